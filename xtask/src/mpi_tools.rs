//! Hidden MPI commands run by the tests and the benchmark under `mpirun`:
//! `xtask mpi-selftest --mode …` and `xtask mpi-bench`.
//!
//! The self-test checks every collective of [`MpiGroup`] against an in-process
//! [`LocalGroup`](burn_fsdp::LocalGroup) of the same size fed the same inputs — they must
//! agree bit for bit — and exercises the failure paths (mismatched collectives, an aborting
//! rank, a stalled rank).

use std::sync::Arc;
use std::time::{Duration, Instant};

use anyhow::{Context, Result, bail};
use burn::tensor::{DType, Tensor, TensorData};
use burn_fsdp::comm::mpi::MpiGroup;
use burn_fsdp::comm::{ProcessGroup, ReduceOp, Tag, check_same_on_all_ranks};
use burn_fsdp::{CommError, launch};

use crate::Backend as NdBackend;

/// The self-test's backend: burn's Flex CPU backend, which has f32, f64 and bf16.
type Backend = burn::backend::Flex<f32>;

fn device() -> burn::tensor::Device<Backend> {
    Default::default()
}

/// Arguments of `mpi-selftest`.
#[derive(Debug, Clone, clap::Args)]
pub struct SelftestArgs {
    /// `collectives`, `mismatch`, `abort` or `stall`.
    #[arg(long, default_value = "collectives")]
    pub mode: String,
    /// Collective timeout in seconds.
    #[arg(long, default_value_t = 30.0)]
    pub timeout: f64,
}

/// Arguments of `mpi-bench`.
#[derive(Debug, Clone, clap::Args)]
pub struct MpiBenchArgs {
    /// Megabytes each rank receives per all-gather (and sends per reduce-scatter).
    #[arg(long, default_value_t = 64)]
    pub mb: usize,
    /// Repetitions per measurement.
    #[arg(long, default_value_t = 5)]
    pub reps: usize,
}

fn input(rank: usize, n: usize, dtype: DType) -> Tensor<Backend, 1> {
    // Values with very different magnitudes, so that the summation order shows in the bits.
    let v: Vec<f32> = (0..n)
        .map(|i| {
            let k = ((rank * 7919 + i * 104_729) % 1000) as f32;
            if (i + rank).is_multiple_of(3) { k * 1.0e5 + 0.123 } else { k * 1.37e-3 - 0.5 }
        })
        .collect();
    let t = Tensor::<Backend, 1>::from_data(TensorData::new(v, [n]), (&device(), DType::F32));
    t.cast(dtype)
}

fn bits(t: Tensor<Backend, 1>) -> Vec<u8> {
    t.into_data().into_bytes().to_vec()
}

/// What each collective returns on every rank, for `size` ranks (computed in-process).
fn expected(size: usize, n: usize, dtype: DType) -> Result<Vec<Vec<Vec<u8>>>> {
    let out = launch(size, Duration::from_secs(30), |g| -> Result<Vec<Vec<u8>>, CommError> {
        run_cases(&*g, n, dtype)
    })
    .map_err(|e| anyhow::anyhow!("in-process reference: {e}"))?;
    Ok(out)
}

/// The battery of collectives, on any group; returns each result's bytes.
fn run_cases(g: &dyn ProcessGroup<Backend>, n: usize, dtype: DType) -> Result<Vec<Vec<u8>>, CommError> {
    let r = g.rank();
    let w = g.size();
    let tag = |s: &str| Tag::new(format!("{s}/{n}/{dtype:?}"));
    let mut out = vec![bits(g.all_gather(input(r, n, dtype), &tag("ag"))?)];
    for op in [ReduceOp::Sum, ReduceOp::Avg, ReduceOp::Max] {
        out.push(bits(g.reduce_scatter(input(r, n * w, dtype), op, &tag("rs"))?));
        out.push(bits(g.all_reduce(input(r, n, dtype), op, &tag("ar"))?));
    }
    out.push(bits(g.broadcast(input(r, n, dtype), w - 1, &tag("bc"))?));
    g.barrier(&tag("barrier"))?;
    Ok(out)
}

/// Runs the self-test as one MPI rank; prints `ok …` lines, errors on any difference.
pub fn selftest(args: &SelftestArgs) -> Result<()> {
    let timeout = Duration::from_secs_f64(args.timeout);
    let group = MpiGroup::world(timeout).map_err(|e| anyhow::anyhow!("{e}"))?;
    let (rank, size) = (group.rank(), group.size());
    let g: &dyn ProcessGroup<Backend> = &*group;
    match args.mode.as_str() {
        "collectives" => {
            for dtype in [DType::F32, DType::BF16, DType::F64] {
                for n in [1, 7, 4099] {
                    let want = expected(size, n, dtype)?;
                    let got = run_cases(g, n, dtype).map_err(|e| anyhow::anyhow!("{e}"))?;
                    if got != want[rank] {
                        bail!(
                            "rank {rank}: MPI results differ from the in-process group for n={n} {dtype:?}"
                        );
                    }
                    println!("ok rank {rank}: {dtype:?} n={n} matches LocalGroup bit for bit");
                }
            }
            // Sub-groups: even and odd ranks.
            let sub = group.split((rank % 2) as u32, rank as u32).map_err(|e| anyhow::anyhow!("{e}"))?;
            let s: &dyn ProcessGroup<Backend> = &*sub;
            let want = expected(sub.size(), 5, DType::F32)?;
            let got = run_cases(s, 5, DType::F32).map_err(|e| anyhow::anyhow!("{e}"))?;
            if got != want[sub.rank()] {
                bail!("rank {rank}: sub-group results differ from the in-process group");
            }
            println!("ok rank {rank}: split sub-group {} of {} matches", sub.rank(), sub.size());
            check_same_on_all_ranks(g, "digest", 0xdead_beef_0123_4567, &device())
                .map_err(|e| anyhow::anyhow!("{e}"))?;
            match check_same_on_all_ranks(g, "digest", rank as u64 / 2, &device()) {
                Err(e) if size > 2 && e.to_string().contains("rank 2 was started with different digest") => {}
                Ok(()) if size <= 2 => {}
                other => bail!("rank {rank}: digest check: unexpected {other:?}"),
            }
            println!("ok rank {rank}: digest check");
            Ok(())
        }
        "mismatch" => {
            let tag = if rank == 1 { "layers.1" } else { "layers.0" };
            match g.all_gather(input(rank, 3, DType::F32), &Tag::new(tag)) {
                Err(e @ CommError::Mismatch { .. }) => {
                    println!("ok rank {rank}: expected error: {e}");
                    Ok(())
                }
                other => bail!("rank {rank}: expected a mismatch error, got {:?}", other.map(|_| ())),
            }
        }
        "abort" => {
            if rank == 1 {
                g.abort("rank 1 injected a failure");
                println!("ok rank {rank}: aborted");
                std::thread::sleep(Duration::from_secs(2));
                std::process::exit(3);
            }
            let start = Instant::now();
            match g.all_gather(input(rank, 3, DType::F32), &Tag::new("step")) {
                Err(e @ CommError::PeerFailed { .. }) if e.to_string().contains("injected") => {
                    println!("ok rank {rank}: expected error after {:?}: {e}", start.elapsed());
                    std::thread::sleep(Duration::from_secs(1));
                    std::process::exit(2);
                }
                other => bail!("rank {rank}: expected PeerFailed, got {:?}", other.map(|_| ())),
            }
        }
        "stall" => {
            if rank == 1 {
                std::thread::sleep(timeout * 10);
                std::process::exit(3);
            }
            let start = Instant::now();
            match g.all_gather(input(rank, 3, DType::F32), &Tag::new("step")) {
                Err(e @ CommError::Stalled { .. }) => {
                    println!("ok rank {rank}: expected error after {:?}: {e}", start.elapsed());
                    std::thread::sleep(Duration::from_secs(1));
                    std::process::exit(2);
                }
                other => bail!("rank {rank}: expected Stalled, got {:?}", other.map(|_| ())),
            }
        }
        other => bail!("--mode `{other}` is unknown (collectives, mismatch, abort, stall)"),
    }
}

/// Measures MPI all-gather and reduce-scatter bandwidth on this job against `memcpy` of the
/// same bytes, and prints `name: value` lines on rank 0.
pub fn bench(args: &MpiBenchArgs) -> Result<()> {
    let group = MpiGroup::world(Duration::from_secs(300)).map_err(|e| anyhow::anyhow!("{e}"))?;
    let g: &dyn ProcessGroup<NdBackend> = &*group;
    let (rank, w) = (group.rank(), group.size());
    let bytes = args.mb << 20;
    let n_out = bytes / 4;
    let n_shard = n_out / w;
    let reps = args.reps.max(1);
    let device = crate::device();
    let shard = Tensor::<NdBackend, 1>::ones([n_shard], &device);
    let full = Tensor::<NdBackend, 1>::ones([n_shard * w], &device);
    // Warm up (allocations, MPI connections).
    g.all_gather(shard.clone(), &Tag::new("warm")).map_err(|e| anyhow::anyhow!("{e}"))?;
    g.barrier(&Tag::new("b0")).map_err(|e| anyhow::anyhow!("{e}"))?;
    let start = Instant::now();
    for i in 0..reps {
        let out =
            g.all_gather(shard.clone(), &Tag::new(format!("ag{i}"))).map_err(|e| anyhow::anyhow!("{e}"))?;
        std::hint::black_box(out);
    }
    let ag = start.elapsed().as_secs_f64() / reps as f64;
    g.barrier(&Tag::new("b1")).map_err(|e| anyhow::anyhow!("{e}"))?;
    let start = Instant::now();
    for i in 0..reps {
        let out = g
            .reduce_scatter(full.clone(), ReduceOp::Sum, &Tag::new(format!("rs{i}")))
            .map_err(|e| anyhow::anyhow!("{e}"))?;
        std::hint::black_box(out);
    }
    let rs = start.elapsed().as_secs_f64() / reps as f64;
    // memcpy of the same number of bytes, in this process, while the others do the same.
    g.barrier(&Tag::new("b2")).map_err(|e| anyhow::anyhow!("{e}"))?;
    let mc = crate::bench::bandwidth::timed_copies(n_shard * w * 4, reps) / reps as f64;
    let gbps = |s: f64| (n_shard * w * 4) as f64 / s / 1e9;
    let times = Tensor::<NdBackend, 1>::from_floats([ag as f32, rs as f32, mc as f32], &device);
    let worst = g
        .all_reduce(times, ReduceOp::Max, &Tag::new("times"))
        .map_err(|e| anyhow::anyhow!("{e}"))?
        .into_data()
        .to_vec::<f32>()
        .map_err(|e| anyhow::anyhow!("{e:?}"))?;
    let (ag, rs, mc) = (worst[0] as f64, worst[1] as f64, worst[2] as f64);
    if rank == 0 {
        println!("mpi: {w} processes, {} MiB per rank per collective, {reps} reps (slowest rank)", args.mb);
        println!("mpi_allgather_gbps: {:.3}", gbps(ag));
        println!("mpi_reducescatter_gbps: {:.3}", gbps(rs));
        println!("memcpy_gbps: {:.3}", gbps(mc));
        println!("mpi_allgather_vs_memcpy_bandwidth_ratio: {:.3}", mc / ag);
        println!("mpi_reducescatter_vs_memcpy_bandwidth_ratio: {:.3}", mc / rs);
    }
    drop(Arc::clone(&group));
    Ok(())
}

/// Runs `xtask mpi-bench` under mpirun with `world` processes and returns its output lines
/// (or a `skipped` line when MPI is not usable here).
pub fn bench_lines(world: usize, mb: usize) -> Vec<String> {
    let skip = |why: String| vec![format!("mpi_allgather_vs_memcpy_bandwidth_ratio: skipped ({why})")];
    let exe = match std::env::current_exe() {
        Ok(e) => e,
        Err(e) => return skip(format!("no xtask binary: {e}")),
    };
    let mut line = crate::launch::mpirun_prefix(None, world);
    line.push(exe.to_string_lossy().into_owned());
    line.extend(["mpi-bench".to_owned(), "--mb".to_owned(), mb.to_string()]);
    match std::process::Command::new(&line[0]).args(&line[1..]).output().context("running mpirun") {
        Ok(o) if o.status.success() => {
            String::from_utf8_lossy(&o.stdout).lines().map(str::to_owned).collect()
        }
        Ok(o) => skip(format!("mpirun failed: {}", String::from_utf8_lossy(&o.stderr).trim())),
        Err(e) => skip(format!("{e:#}")),
    }
}
