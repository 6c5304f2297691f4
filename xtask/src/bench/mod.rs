//! `cargo xtask bench`: throughput, bandwidth and memory figures measured side by side in one
//! run.
//!
//! Ends with one `name: value` line per headline figure.
//!
//! | file | what |
//! |---|---|
//! | `mod.rs` | the command: which figures, PyTorch side by side, the output |
//! | `throughput.rs` | training and forward tokens/s of one configuration |
//! | `scaling.rs` | the headline: scaling on equal cores, W = 1 overhead, Burn vs PyTorch |
//! | `bandwidth.rs` | collectives against memory copies |
//! | `memory.rs` | memory per rank, activation memory |
//! | `alloc.rs` | the counting global allocator the memory figures read |
//! | `step_profile.rs` | what a training step asks of the (emulated) device: launches, host syncs, stream waits |

mod alloc;
pub(crate) mod bandwidth;
mod memory;
mod pace;
pub mod scaling;
#[cfg(feature = "metax")]
pub mod step_profile;
pub(crate) mod throughput;

use std::path::PathBuf;
use std::time::Duration;

use anyhow::{Context, Result};
use burn_fsdp::CollectiveKind;
use qwen3_burn::Qwen3Config;

use crate::train::CpuBackend;

use bandwidth::{collective_gbps, memcpy_gbps, parallel_memcpy_gbps};
use memory::{activation_memory, memory_figures};
use throughput::{forward_tokens_per_sec, qwen3_50m, train_throughput};

pub use alloc::CountingAlloc;

/// Arguments of `bench`.
#[derive(Debug, Clone, clap::Args)]
pub struct BenchArgs {
    /// Only the small model (skips the ~50M-parameter Qwen3, which takes minutes on 2 cores).
    #[arg(long)]
    pub quick: bool,
    /// Training steps timed per configuration (after one warm-up step).
    #[arg(long, default_value_t = 4)]
    pub steps: usize,
    /// Python interpreter with `torch` and `transformers` for the PyTorch side by side
    /// (default: `$PYTHON`, else `python3`).
    #[arg(long)]
    pub python: Option<PathBuf>,
    /// Only the activation-memory figures (one 2048-token sequence through 2 layers of
    /// Qwen3-0.6B with and without the chunked loss and activation checkpointing).
    #[arg(long, conflicts_with = "quick")]
    pub activation_memory_only: bool,
    /// Only the memory of the full Qwen3-0.6B (28 layers, 596M parameters) trained with FSDP
    /// over 4 in-process ranks for 2 steps of 2 × 128 tokens per rank (the headline's shapes):
    /// live bytes per rank between steps and at peak against 16Ψ/W, and the process's peak.
    /// Takes about 4 minutes and 21 GB of memory on a 2-core machine.
    #[arg(long, conflicts_with_all = ["quick", "activation_memory_only"])]
    pub qwen3_06b_memory: bool,
    /// Only the seed's configuration against PyTorch FSDP2 on the same cores: Qwen3-0.6B,
    /// W = 4 in-process ranks, 2 × 128 tokens per rank, AdamW, on one checkpoint and batches
    /// made by `scripts/headline.py` (with `--python`'s torch). Our run and PyTorch's (4 gloo
    /// processes, one thread each) alternate, `--rounds` times, each with one warm-up step and
    /// `--steps` timed steps (at least 3). Prints
    /// `qwen3_06b_fsdp_w4_vs_torch_fsdp2_step_time_ratio` (PyTorch's step time over ours),
    /// `qwen3_06b_fsdp_w4_peak_rss_gib` and where our step's time goes. Without torch, ours
    /// alone. About 25 minutes a round on a 2-core machine, 23 GB of memory.
    #[arg(long, conflicts_with_all = ["quick", "activation_memory_only", "qwen3_06b_memory"])]
    pub qwen3_06b_pace: bool,
    /// With `--qwen3-06b-pace`: rounds of ours then PyTorch's.
    #[arg(long, default_value_t = 1, requires = "qwen3_06b_pace")]
    pub rounds: usize,
    /// With `--qwen3-06b-pace`: the checkpoint, batches and every run's output (kept, so a
    /// later run reuses the checkpoint).
    #[arg(long, default_value = "runs/qwen3-06b-pace", requires = "qwen3_06b_pace")]
    pub pace_dir: PathBuf,
    /// Only the scaling figures on equal cores (`fsdp_w1_vs_single`,
    /// `fsdp_w2_scaling_efficiency` and PyTorch's; see `xtask::bench::scaling`).
    #[arg(long, conflicts_with_all = ["quick", "activation_memory_only", "qwen3_06b_memory", "qwen3_06b_pace"])]
    pub scaling_only: bool,
    /// The CPU backend the scaling figures train on (`train-qwen3 --cpu-backend`).
    #[arg(long, value_enum, default_value_t = CpuBackend::DEFAULT)]
    pub cpu_backend: CpuBackend,
    /// Only the step profile of `--device` (`metax-emu`: xtask built with `--features metax`):
    /// the tiny preset trained at FSDP W = 1 and W = 4 on emulated MetaX devices, and per
    /// training step and rank (steps 3..N, `--steps` of them) the kernel launches, blocking host
    /// waits, cross-stream waits and the bytes collectives copy through the host — before
    /// (every stream waits for every other, host collectives) and after (ordering by need,
    /// device collectives). Prints `w1_launches_per_step`, `w4_launches_per_step`,
    /// `w1_host_syncs_per_step`, `w4_host_syncs_per_step`, `w4_collective_host_bytes_per_step`
    /// and `w4_cross_stream_waits_per_collective`. About 2 minutes.
    #[arg(long, requires = "device", conflicts_with_all = ["quick", "activation_memory_only", "qwen3_06b_memory", "qwen3_06b_pace", "scaling_only"])]
    pub step_profile: bool,
    /// The device of `--step-profile`: `metax-emu`.
    #[arg(long, value_enum)]
    pub device: Option<crate::train::DeviceKind>,
    /// Internal: one single-device run of the scaling model, in a process pinned by `bench`.
    #[arg(long, hide = true)]
    pub scaling_worker: bool,
    /// With `--scaling-worker`: FSDP over this many in-process ranks instead (4 rows per rank),
    /// for profiling one side of a scaling figure (docs/performance.md).
    #[arg(long, hide = true, requires = "scaling_worker")]
    pub world: Option<usize>,
}

// ---------------------------------------------------------------------------------------
// PyTorch side by side.

/// What `xtask/bench/torch_bench.py` reports.
#[derive(Debug, serde::Deserialize)]
struct TorchFigures {
    torch_version: String,
    threads: usize,
    attn_implementation: Option<String>,
    params: usize,
    forward_tokens_per_sec: f64,
    train_step_tokens_per_sec: f64,
}

/// `--step-profile` on `--device`.
fn step_profile_figures(args: &BenchArgs) -> Result<Vec<(String, f64)>> {
    match args.device {
        #[cfg(feature = "metax")]
        Some(crate::train::DeviceKind::MetaxEmu) => step_profile::figures(args.steps),
        #[cfg(not(feature = "metax"))]
        Some(crate::train::DeviceKind::MetaxEmu) => {
            anyhow::bail!(
                "--device metax-emu needs xtask built with `--features metax` (`cargo xtask-metax bench …`)"
            )
        }
        Some(other) => anyhow::bail!(
            "--step-profile counts what the emulated MetaX device is asked to do: use --device metax-emu, not {}",
            other.name()
        ),
        None => anyhow::bail!("--step-profile needs --device metax-emu"),
    }
}

/// The interpreter to use: `--python`, else `$PYTHON`, else `python3`.
fn python(args: &BenchArgs) -> PathBuf {
    args.python
        .clone()
        .or_else(|| std::env::var_os("PYTHON").map(PathBuf::from))
        .unwrap_or_else(|| PathBuf::from("python3"))
}

/// Why PyTorch cannot be used, or `None` when `import torch, transformers` works.
fn torch_missing(python: &PathBuf) -> Option<String> {
    match std::process::Command::new(python).args(["-c", "import torch, transformers"]).output() {
        Ok(o) if o.status.success() => None,
        Ok(o) => Some(format!(
            "`{} -c 'import torch, transformers'` failed: {}",
            python.display(),
            String::from_utf8_lossy(&o.stderr).lines().last().unwrap_or("").trim()
        )),
        Err(e) => Some(format!("cannot run `{}`: {e}", python.display())),
    }
}

/// Runs the PyTorch benchmark on `config` (written to a temporary `config.json`).
fn torch_figures(
    python: &PathBuf,
    config: &Qwen3Config,
    rows: usize,
    seq: usize,
    steps: usize,
) -> Result<TorchFigures> {
    let script = PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("bench").join("torch_bench.py");
    let dir = std::env::temp_dir().join(format!("xtask-bench-{}", std::process::id()));
    std::fs::create_dir_all(&dir)?;
    config.save(&dir)?;
    let out = std::process::Command::new(python)
        .arg(&script)
        .arg("--config")
        .arg(dir.join("config.json"))
        .args(["--batch", &rows.to_string(), "--seq", &seq.to_string(), "--steps", &steps.to_string()])
        // Burn's NdArray backend runs its kernels on one thread (no `multi-threads` feature).
        .args(["--threads", "1"])
        .output()
        .with_context(|| format!("running {}", script.display()))?;
    let _ = std::fs::remove_dir_all(&dir);
    anyhow::ensure!(
        out.status.success(),
        "{} failed: {}",
        script.display(),
        String::from_utf8_lossy(&out.stderr).trim()
    );
    let stdout = String::from_utf8_lossy(&out.stdout);
    let line = stdout.lines().rev().find(|l| l.trim_start().starts_with('{')).context("no JSON output")?;
    Ok(serde_json::from_str(line)?)
}

// ---------------------------------------------------------------------------------------

/// Runs every benchmark and prints the headline figures.
pub fn run(args: &BenchArgs) -> Result<Vec<(String, f64)>> {
    if args.activation_memory_only {
        let figures = activation_memory()?;
        print_figures(&figures);
        return Ok(figures);
    }
    if args.scaling_worker {
        scaling::worker(args.steps, args.world, args.cpu_backend)?;
        return Ok(Vec::new());
    }
    if args.step_profile {
        let figures = step_profile_figures(args)?;
        print_figures(&figures);
        return Ok(figures);
    }
    if args.qwen3_06b_memory {
        let figures = memory_figures("qwen3_06b", &Qwen3Config::qwen3_0_6b(), &[4], 8, 128)?;
        print_figures(&figures);
        return Ok(figures);
    }
    let python = python(args);
    let missing = torch_missing(&python);
    let torch = match &missing {
        None => Ok(python.as_path()),
        Some(why) => Err(why.as_str()),
    };
    if args.qwen3_06b_pace {
        let figures = pace::figures(&args.pace_dir, args.rounds, args.steps, torch)?;
        print_figures(&figures);
        return Ok(figures);
    }
    if args.scaling_only {
        let figures = scaling::figures(args.steps, args.cpu_backend, torch)?;
        print_figures(&figures);
        return Ok(figures);
    }
    let mut figures: Vec<(String, f64)> = Vec::new();
    let tiny = Qwen3Config::from_json_str(
        r#"{"vocab_size": 256, "hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 2,
            "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 16, "rms_norm_eps": 1e-6,
            "rope_theta": 1000000.0, "tie_word_embeddings": true}"#,
        "<qwen3-tiny-a shapes>".as_ref(),
    )?;
    let mut models = vec![("qwen3_tiny_a", tiny, 8, 32)];
    if !args.quick {
        models.push(("qwen3_50m", qwen3_50m(), 8, 128));
    }
    let mut torch_headline: Option<Vec<(String, f64)>> = None;
    for (name, config, rows, seq) in &models {
        let (rows, seq) = (*rows, *seq);
        println!(
            "[{name}] {} parameters, global batch {rows} × {seq} tokens, {} timed steps",
            config.num_params(),
            args.steps
        );
        let single = train_throughput(config, None, rows, seq, args.steps, &[])?;
        let fsdp = train_throughput(config, Some(4), rows, seq, args.steps, &[])?;
        let inline = train_throughput(config, Some(4), rows, seq, args.steps, &["--no-prefetch"])?;
        println!(
            "  single device: {:.0} tokens/s; FSDP W=4 (in-process): {:.0} tokens/s with overlap \
             (prefetch + reduce-scatter on a communication thread), {:.0} tokens/s without",
            single.tokens_per_sec, fsdp.tokens_per_sec, inline.tokens_per_sec
        );
        figures.push((
            format!("{name}_fsdp_w4_overlap_vs_inline_tokens_per_sec_ratio"),
            fsdp.tokens_per_sec / inline.tokens_per_sec,
        ));
        // Per rank: the ranks run at once, so each rank's share of the wall time.
        let c = &fsdp.collectives;
        let per_rank = |d: Duration| d.as_secs_f64() / 4.0;
        let (ag, rs) = (CollectiveKind::AllGather.index(), CollectiveKind::ReduceScatter.index());
        let total: f64 = c.total.iter().map(|d| per_rank(*d)).sum();
        let waiting: f64 = c.waiting.iter().map(|d| per_rank(*d)).sum();
        println!(
            "  FSDP W=4 time per rank inside collectives (with overlap: on the communication thread, alongside compute): {:.1}% of the run ({:.2} s of {:.2} s over {} steps: \
             all-gather {:.2} s, reduce-scatter {:.2} s, other {:.2} s; of the total {:.2} s waiting for peers)",
            100.0 * total / fsdp.total_secs,
            total,
            fsdp.total_secs,
            args.steps + 1,
            per_rank(c.total[ag]),
            per_rank(c.total[rs]),
            total - per_rank(c.total[ag]) - per_rank(c.total[rs]),
            waiting,
        );
        figures.push((
            format!("{name}_fsdp_w4_2cores_vs_single_1core_tokens_per_sec_ratio"),
            fsdp.tokens_per_sec / single.tokens_per_sec,
        ));
        figures.push((format!("{name}_fsdp_w4_collective_time_fraction"), total / fsdp.total_secs));
        if let Some(w) = fsdp.exposed_wait {
            println!(
                "  FSDP W=4 with overlap: rank 0 waited for communication results {:.1}% of its last step \
                 (the exposed part; collectives themselves run on the communication thread)",
                100.0 * w
            );
            figures.push((format!("{name}_fsdp_w4_exposed_comm_wait_fraction"), w));
        }

        let burn_fwd = forward_tokens_per_sec(config, rows, seq, args.steps);
        match &missing {
            Some(why) => println!("  [pytorch] skipped: {why}"),
            None => {
                let t = torch_figures(&python, config, rows, seq, args.steps)?;
                println!(
                    "  [pytorch {} on {} thread(s), attention {}, {} parameters] forward {:.0} tokens/s \
                     (Burn {burn_fwd:.0}); training step {:.0} tokens/s (Burn {:.0})",
                    t.torch_version,
                    t.threads,
                    t.attn_implementation.as_deref().unwrap_or("?"),
                    t.params,
                    t.forward_tokens_per_sec,
                    t.train_step_tokens_per_sec,
                    single.tokens_per_sec
                );
                torch_headline = Some(vec![
                    ("torch_forward_tokens_per_sec".into(), t.forward_tokens_per_sec),
                    ("burn_forward_tokens_per_sec".into(), burn_fwd),
                    ("burn_vs_torch_forward_ratio".into(), burn_fwd / t.forward_tokens_per_sec),
                    ("torch_train_step_tokens_per_sec".into(), t.train_step_tokens_per_sec),
                    ("burn_train_step_tokens_per_sec".into(), single.tokens_per_sec),
                    (
                        "burn_vs_torch_train_step_ratio".into(),
                        single.tokens_per_sec / t.train_step_tokens_per_sec,
                    ),
                ]);
            }
        }
    }

    // Collectives: 4 ranks × 16 MiB (the headline) and × 4 MiB (a 50M-model layer unit is
    // 12.6 MB gathered, so 4 MiB per rank is the realistic size).
    let mut collective_figures = Vec::new();
    for (label, bytes, reps) in [("", 16usize << 20, 10), ("_4x4mib", 4 << 20, 40)] {
        let memcpy = memcpy_gbps(bytes * 4, 2 * reps);
        let parallel = parallel_memcpy_gbps(4, bytes * 4, reps);
        let (ag, rs) = collective_gbps(4, bytes, reps)?;
        println!(
            "[collectives] 4 ranks × {} MiB: all-gather {ag:.2} GB/s, reduce-scatter {rs:.2} GB/s per rank; \
             memcpy of {} MiB {memcpy:.2} GB/s on one thread, {parallel:.2} GB/s per thread with 4 threads copying at once",
            bytes >> 20,
            (4 * bytes) >> 20,
        );
        collective_figures.push((format!("allgather_vs_memcpy_bandwidth_ratio{label}"), ag / memcpy));
        collective_figures.push((format!("reducescatter_vs_memcpy_bandwidth_ratio{label}"), rs / memcpy));
        collective_figures
            .push((format!("allgather_vs_parallel_memcpy_bandwidth_ratio{label}"), ag / parallel));
    }
    figures.extend(collective_figures);

    // MPI collectives on 4 local processes vs memcpy (issue #5), when built with MPI.
    #[cfg(feature = "mpi")]
    for line in crate::mpi_tools::bench_lines(4, 16) {
        let parsed =
            line.split_once(": ").and_then(|(k, v)| v.trim().parse::<f64>().ok().map(|v| (k.to_owned(), v)));
        match parsed {
            Some((k, v)) if k.ends_with("_ratio") => figures.push((k, v)),
            _ => println!("[mpi] {line}"),
        }
    }
    #[cfg(not(feature = "mpi"))]
    println!(
        "[mpi] skipped: xtask built without MPI; `cargo xtask-mpi bench` measures MPI all-gather/reduce-scatter \
         on 4 local processes"
    );

    // Memory per rank at W = 1, 2, 4 on the larger model.
    let (name, config, rows, seq) = models.last().context("no model")?;
    figures.extend(memory_figures(name, config, &[1, 2, 4], *rows, *seq)?);

    if !args.quick {
        figures.extend(activation_memory()?);
    }
    // The headline: scaling on equal cores (two processes, or one process on two cores).
    figures.extend(scaling::figures(args.steps, args.cpu_backend, torch)?);

    match (torch_headline, &missing) {
        (Some(t), _) => figures.extend(t),
        (None, Some(why)) => {
            println!("[pytorch] {why}");
            for f in ["forward", "train_step"] {
                println!(
                    "burn_vs_torch_{f}_ratio: skipped (PyTorch not found: pip install torch transformers; \
                     see docs/performance.md)"
                );
            }
        }
        (None, None) => {}
    }
    // The headline figures last: scaling on equal cores and Burn against PyTorch.
    let headline = ["fsdp_w2_scaling_efficiency", "fsdp_w1_vs_single", "burn_vs_torch_train_step_ratio"];
    figures.sort_by_key(|(n, _)| headline.iter().position(|h| h == n));
    print_figures(&figures);
    Ok(figures)
}

/// One `name: value` line per figure.
fn print_figures(figures: &[(String, f64)]) {
    for (name, value) in figures {
        if value.abs() >= 100.0 {
            println!("{name}: {value:.0}");
        } else {
            println!("{name}: {value:.3}");
        }
    }
}
