//! `cargo xtask bench`: throughput, bandwidth and memory figures measured side by side in one
//! run.
//!
//! Ends with one `name: value` line per headline figure.

use std::alloc::{GlobalAlloc, Layout, System};
use std::path::PathBuf;
use std::sync::atomic::{AtomicBool, AtomicIsize, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use anyhow::{Context, Result};
use burn::tensor::{Int, Tensor, TensorData};
use burn_fsdp::comm::local::CollectiveTime;
use burn_fsdp::{CollectiveKind, DeviceMesh, Direct, Fsdp, LocalGroup, ProcessGroup, ReduceOp, Tag, launch};
use qwen3_burn::train::{chunked_cross_entropy, cross_entropy, inputs_and_labels, loss_chunk_rows};
use qwen3_burn::{Qwen3, Qwen3Config};

use crate::Backend;
use crate::data::synthetic_batches;
use crate::train::{
    FsdpTrainBackend, LOSS_CHUNK_BYTES, MetricsSink, Setup, TrainArgs, fsdp_config, train_fsdp, train_single,
};

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
    /// Only the scaling figures on equal cores (`fsdp_w1_vs_single`,
    /// `fsdp_w2_scaling_efficiency` and PyTorch's; see `xtask::scaling`).
    #[arg(long, conflicts_with_all = ["quick", "activation_memory_only", "qwen3_06b_memory"])]
    pub scaling_only: bool,
    /// Internal: one single-device run of the scaling model, in a process pinned by `bench`.
    #[arg(long, hide = true)]
    pub scaling_worker: bool,
    /// With `--scaling-worker`: FSDP over this many in-process ranks instead (4 rows per rank),
    /// for profiling one side of a scaling figure (docs/performance.md).
    #[arg(long, hide = true, requires = "scaling_worker")]
    pub world: Option<usize>,
}

// ---------------------------------------------------------------------------------------
// Memory: a counting global allocator, installed by the `xtask` binary (`main.rs`).

static LIVE: AtomicIsize = AtomicIsize::new(0);
static PEAK: AtomicIsize = AtomicIsize::new(0);
static COUNTING: AtomicBool = AtomicBool::new(false);

/// The `xtask` binary's global allocator: `System`, plus process-wide live and peak bytes
/// for the memory figures of `bench` (two relaxed atomics per allocation).
pub struct CountingAlloc;

fn count(delta: isize) {
    let now = LIVE.fetch_add(delta, Ordering::Relaxed) + delta;
    if delta > 0 {
        PEAK.fetch_max(now, Ordering::Relaxed);
    }
}

// SAFETY: every method forwards to `System` with the caller's arguments unchanged, so the
// `GlobalAlloc` contract holds exactly as for `System`; the counters are plain atomics.
unsafe impl GlobalAlloc for CountingAlloc {
    unsafe fn alloc(&self, layout: Layout) -> *mut u8 {
        // SAFETY: same layout as given to us.
        let p = unsafe { System.alloc(layout) };
        if !p.is_null() {
            COUNTING.store(true, Ordering::Relaxed);
            count(layout.size() as isize);
        }
        p
    }
    unsafe fn alloc_zeroed(&self, layout: Layout) -> *mut u8 {
        // SAFETY: same layout as given to us.
        let p = unsafe { System.alloc_zeroed(layout) };
        if !p.is_null() {
            count(layout.size() as isize);
        }
        p
    }
    unsafe fn dealloc(&self, ptr: *mut u8, layout: Layout) {
        // SAFETY: `ptr` was returned by this allocator (so by `System`) with this layout.
        unsafe { System.dealloc(ptr, layout) };
        count(-(layout.size() as isize));
    }
    unsafe fn realloc(&self, ptr: *mut u8, layout: Layout, new_size: usize) -> *mut u8 {
        // SAFETY: forwarded unchanged.
        let p = unsafe { System.realloc(ptr, layout, new_size) };
        if !p.is_null() {
            count(new_size as isize - layout.size() as isize);
        }
        p
    }
}

/// Live bytes now (process-wide), or `None` when [`CountingAlloc`] is not the global allocator.
fn live_bytes() -> Option<isize> {
    COUNTING.load(Ordering::Relaxed).then(|| LIVE.load(Ordering::Relaxed))
}

// ---------------------------------------------------------------------------------------
// Throughput.

/// Throughput of one training configuration.
pub(crate) struct Throughput {
    /// Tokens per second of the timed steps (the first, warm-up step is excluded).
    pub(crate) tokens_per_sec: f64,
    /// Wall time of all steps, warm-up included.
    total_secs: f64,
    /// Collective time over the same steps (all ranks summed).
    collectives: CollectiveTime,
    /// FSDP with overlap: the share of rank 0's last step spent waiting for communication
    /// results (the exposed communication).
    exposed_wait: Option<f64>,
}

pub(crate) fn train_throughput(
    config: &Qwen3Config,
    world: Option<usize>,
    rows: usize,
    seq: usize,
    steps: usize,
    extra: &[&str],
) -> Result<Throughput> {
    let model = crate::weights::InitialWeights::Seeded(qwen3_burn::Qwen3Init::new(0));
    let batches = synthetic_batches(steps + 1, rows, seq, config.vocab_size, 0);
    let argv: Vec<String> = match world {
        None => vec!["train-qwen3".into(), "--no-fsdp".into(), "--quiet".into()],
        Some(w) => vec!["train-qwen3".into(), "--world-size".into(), w.to_string(), "--quiet".into()],
    };
    let mut argv: Vec<&str> = argv.iter().map(String::as_str).collect();
    argv.extend(extra);
    let args = TrainArgs::parse_from_args(&argv)?;
    let sink = MetricsSink::new(None, true)?;
    let setup = Setup { config: config.clone(), model, batches, steps: steps + 1, resume: None };
    let before = CollectiveTime::now();
    let metrics = match world {
        None => train_single(&args, setup, &sink)?,
        Some(_) => train_fsdp::<Backend>(&args, setup, &sink)?,
    };
    let collectives = CollectiveTime::now().since(&before);
    let exposed_wait = sink
        .collectives()
        .and_then(|c| c["overlap"]["wait_seconds"].as_f64())
        .zip(metrics.last())
        .map(|(wait, last)| wait * last.tokens_per_sec / (rows * seq) as f64);
    // Harmonic mean over the timed steps = total tokens / total time.
    let tokens = (rows * seq) as f64;
    let secs: f64 = metrics.iter().skip(1).map(|m| tokens / m.tokens_per_sec).sum();
    let total_secs: f64 = metrics.iter().map(|m| tokens / m.tokens_per_sec).sum();
    Ok(Throughput { tokens_per_sec: tokens * steps as f64 / secs, total_secs, collectives, exposed_wait })
}

/// Tokens per second of the single-device forward (logits of `rows × seq` tokens, no autodiff),
/// over `steps` timed forwards after one warm-up.
fn forward_tokens_per_sec(config: &Qwen3Config, rows: usize, seq: usize, steps: usize) -> f64 {
    let device = crate::device();
    let model = config.init::<Backend>(&device);
    let batches = synthetic_batches(1, rows, seq, config.vocab_size, 0);
    let (inputs, _) = inputs_and_labels(batches.rows::<Backend>(0, 0..rows, &device));
    let run = |ids: Tensor<Backend, 2, Int>| std::hint::black_box(model.forward(ids).into_data());
    run(inputs.clone());
    let start = Instant::now();
    for _ in 0..steps {
        run(inputs.clone());
    }
    (rows * seq * steps) as f64 / start.elapsed().as_secs_f64()
}

/// The ~50M-parameter Qwen3 of the benchmark (48.3M: 14 layers of width 512, vocab 8192).
pub fn qwen3_50m() -> Qwen3Config {
    Qwen3Config {
        vocab_size: 8192,
        hidden_size: 512,
        intermediate_size: 1536,
        num_hidden_layers: 14,
        num_attention_heads: 8,
        num_key_value_heads: 4,
        head_dim: 64,
        max_position_embeddings: 1024,
        rms_norm_eps: 1e-6,
        rope_theta: 1e6,
        tie_word_embeddings: true,
    }
}

// ---------------------------------------------------------------------------------------
// Collectives.

/// Seconds for `reps` copies of `bytes` between two warm buffers on this thread.
pub(crate) fn timed_copies(bytes: usize, reps: usize) -> f64 {
    let src = vec![1.0f32; bytes / 4];
    let mut dst = vec![0.0f32; bytes / 4];
    dst.copy_from_slice(&src);
    let start = Instant::now();
    for i in 0..reps {
        dst.copy_from_slice(&src);
        std::hint::black_box(&dst[i % dst.len()]);
    }
    start.elapsed().as_secs_f64()
}

/// GB/s of a plain memory copy of `bytes` (warm buffers, one thread).
fn memcpy_gbps(bytes: usize, reps: usize) -> f64 {
    (bytes * reps) as f64 / timed_copies(bytes, reps) / 1e9
}

/// GB/s per thread of `threads` threads each copying `bytes` at the same time (warm buffers):
/// the copy an ideal in-process all-gather with one output per rank has to make.
fn parallel_memcpy_gbps(threads: usize, bytes: usize, reps: usize) -> f64 {
    let secs = std::thread::scope(|s| {
        let handles: Vec<_> = (0..threads).map(|_| s.spawn(move || timed_copies(bytes, reps))).collect();
        handles.into_iter().map(|h| h.join().unwrap_or(f64::NAN)).fold(0.0f64, f64::max)
    });
    (bytes * reps) as f64 / secs / 1e9
}

/// GB/s of in-process all-gather and reduce-scatter over `world` ranks, counted as the bytes
/// each rank receives into its output (all-gather) or reads from its input (reduce-scatter),
/// over the slowest rank's time. One untimed warm-up call of each first.
fn collective_gbps(world: usize, bytes_per_rank: usize, reps: usize) -> Result<(f64, f64)> {
    let n = bytes_per_rank / 4;
    let times = launch(world, Duration::from_secs(120), |group: Arc<LocalGroup>| {
        let device = crate::device();
        let shard = Tensor::<Backend, 1>::from_data(TensorData::new(vec![1.0f32; n], [n]), &device);
        let full =
            Tensor::<Backend, 1>::from_data(TensorData::new(vec![1.0f32; n * world], [n * world]), &device);
        let tag = Tag::new("bench");
        let ag = |g: &LocalGroup| ProcessGroup::<Backend>::all_gather(g, shard.clone(), &tag);
        let rs =
            |g: &LocalGroup| ProcessGroup::<Backend>::reduce_scatter(g, full.clone(), ReduceOp::Avg, &tag);
        std::hint::black_box(ag(&group)?);
        ProcessGroup::<Backend>::barrier(&*group, &tag)?;
        let start = Instant::now();
        for _ in 0..reps {
            std::hint::black_box(ag(&group)?);
        }
        let ag_secs = start.elapsed().as_secs_f64();
        std::hint::black_box(rs(&group)?);
        ProcessGroup::<Backend>::barrier(&*group, &tag)?;
        let start = Instant::now();
        for _ in 0..reps {
            std::hint::black_box(rs(&group)?);
        }
        Ok::<_, burn_fsdp::CommError>((ag_secs, start.elapsed().as_secs_f64()))
    })
    .map_err(|e| anyhow::anyhow!("{e}"))?;
    let (ag, rs) = times.iter().fold((0.0f64, 0.0f64), |acc, t| (acc.0.max(t.0), acc.1.max(t.1)));
    let moved = (bytes_per_rank * world * reps) as f64;
    Ok((moved / ag / 1e9, moved / rs / 1e9))
}

// ---------------------------------------------------------------------------------------
// Memory per rank.

/// Per-rank memory of FSDP training at one world size (bytes).
struct RankMemory {
    /// 16 bytes × the rank's shard elements (fp32 parameters, gradients, AdamW m and v), from
    /// the FSDP units' shard lengths (padding included).
    model_16psi: usize,
    /// Live bytes between steps (after the optimizer step), process-wide above the baseline,
    /// divided by the world size.
    between_steps: isize,
    /// Peak live bytes during the steps, process-wide above the baseline, / world size.
    peak: isize,
}

/// Trains `steps` steps of FSDP over `world` in-process ranks (global batch `rows × seq`) and
/// reads the counting allocator. The baseline is taken before the ranks start (it holds the
/// initial weights and the batches, which every rank reads); the peak is reset once every rank
/// has wrapped its model, so that the full replicas built before sharding are not counted.
fn rank_memory(
    config: &Qwen3Config,
    world: usize,
    rows: usize,
    seq: usize,
    steps: usize,
) -> Result<RankMemory> {
    type Ad = FsdpTrainBackend<Backend>;
    let device = crate::device();
    let init = qwen3_burn::Qwen3Init::new(0);
    let batches = synthetic_batches(steps, rows, seq, config.vocab_size, 0);
    let args = TrainArgs::parse_from_args(&["train-qwen3", "--world-size", &world.to_string(), "--quiet"])?;
    let baseline = live_bytes().context("the counting allocator is not installed")?;
    let between = Mutex::new(0isize);
    let peak = Mutex::new(0isize);
    let chunk = loss_chunk_rows(config.vocab_size, LOSS_CHUNK_BYTES);
    let shard_elems = launch(world, Duration::from_secs(600), |group: Arc<LocalGroup>| {
        let rank = group.rank();
        let rows_per_rank = rows / world;
        // Each rank creates only its shards: nothing of the full model is ever resident.
        let skeleton = Qwen3::<Ad>::new_seeded(config, init, &device);
        let mesh = DeviceMesh::new_1d(group.clone(), device);
        let mut fsdp = Fsdp::wrap_deferred(skeleton, &mesh, fsdp_config(&args), &init)?;
        let mut optim = args.adamw().init();
        let shard_elems: usize = fsdp.units().iter().map(|u| u.shard_len()).sum();
        let sync = |name: &str| ProcessGroup::<Backend>::barrier(&*group, &Tag::new(name));
        sync("wrapped")?;
        if rank == 0 {
            PEAK.store(LIVE.load(Ordering::Relaxed), Ordering::Relaxed);
        }
        sync("measure")?;
        for step in 0..steps {
            let tokens = batches.rows::<Ad>(step, rank * rows_per_rank..(rank + 1) * rows_per_rank, &device);
            let (inputs, labels) = inputs_and_labels(tokens);
            let loss = fsdp.forward(|m, r| {
                let hidden = m.hidden_with(inputs, r);
                chunked_cross_entropy(hidden, m.head_weight(), labels, chunk)
            });
            let grads = fsdp.gradients(loss.backward());
            fsdp.step(&mut optim, grads);
            sync("stepped")?;
            if rank == 0 {
                *between.lock().unwrap_or_else(|p| p.into_inner()) = LIVE.load(Ordering::Relaxed);
                *peak.lock().unwrap_or_else(|p| p.into_inner()) = PEAK.load(Ordering::Relaxed);
            }
            sync("read")?;
        }
        Ok::<_, anyhow::Error>(shard_elems)
    })
    .map_err(|e| anyhow::anyhow!("{e}"))?;
    let per_rank = |b: isize| (b - baseline) / world as isize;
    let between = *between.lock().unwrap_or_else(|p| p.into_inner());
    let peak = *peak.lock().unwrap_or_else(|p| p.into_inner());
    Ok(RankMemory {
        model_16psi: 16 * shard_elems[0],
        between_steps: per_rank(between),
        peak: per_rank(peak),
    })
}

/// Per-rank memory of FSDP training (2 steps of a global batch `rows × seq`) at each world
/// size, as ratios to 16Ψ/W, and the process's peak in GiB at the largest world size.
fn memory_figures(
    name: &str,
    config: &Qwen3Config,
    worlds: &[usize],
    rows: usize,
    seq: usize,
) -> Result<Vec<(String, f64)>> {
    let mut figures = Vec::new();
    if live_bytes().is_none() {
        println!(
            "[memory] skipped: the counting allocator is not installed (run through the `xtask` binary)"
        );
        return Ok(figures);
    }
    let gib = |b: f64| b / f64::from(1 << 30);
    let mib = |b: f64| b / f64::from(1 << 20);
    for &world in worlds {
        let m = rank_memory(config, world, rows, seq, 2)?;
        println!(
            "[memory {name}] W={world}: 16Ψ/W (params + grads + AdamW m, v; from the shard sizes) {:.1} MiB; \
             measured per rank: between steps {:.1} MiB, peak during a step {:.1} MiB; \
             all ranks at peak {:.2} GiB (16Ψ = {:.2} GiB)",
            mib(m.model_16psi as f64),
            mib(m.between_steps as f64),
            mib(m.peak as f64),
            gib((m.peak * world as isize) as f64),
            gib((m.model_16psi * world) as f64),
        );
        figures.push((
            format!("{name}_w{world}_rank_peak_vs_16psi_over_w"),
            m.peak as f64 / m.model_16psi as f64,
        ));
        figures.push((
            format!("{name}_w{world}_rank_between_steps_vs_16psi_over_w"),
            m.between_steps as f64 / m.model_16psi as f64,
        ));
        if Some(&world) == worlds.last() {
            figures
                .push((format!("{name}_w{world}_process_peak_gib"), gib((m.peak * world as isize) as f64)));
        }
    }
    Ok(figures)
}

/// Activation memory of one long sequence at Qwen3-0.6B width (2 of its layers), with the
/// loss over full-vocabulary logits, in chunks, and in chunks with block checkpointing.
fn activation_memory() -> Result<Vec<(String, f64)>> {
    let mut figures = Vec::new();
    if live_bytes().is_none() {
        println!(
            "[activation memory] skipped: the counting allocator is not installed (run through the `xtask` binary)"
        );
        return Ok(figures);
    }
    let mut config = Qwen3Config::qwen3_0_6b();
    config.num_hidden_layers = 2;
    let seq = 2048;
    let mib = |b: isize| b as f64 / f64::from(1 << 20);
    let mut peaks = Vec::new();
    for paths in [
        ActivationPaths::FullLogits,
        ActivationPaths::ChunkedLoss,
        ActivationPaths::ChunkedLossAndCheckpointing,
    ] {
        let peak = activation_peak(&config, seq, paths)?;
        println!("[activation memory] {paths:?}: peak {:.0} MiB above the model", mib(peak));
        peaks.push(peak);
    }
    let [full, chunked, ac] = peaks[..] else { anyhow::bail!("three measurements expected") };
    println!(
        "[activation memory] Qwen3-0.6B width, 2 layers ({} parameters; their gradients {:.0} MiB), one {seq}-token \
         sequence, forward + backward on one device, peak above the model: {:.0} MiB with the loss over \
         full-vocabulary logits, {:.0} MiB with the chunked loss (pieces of {} MiB), {:.0} MiB with the chunked \
         loss and block activation checkpointing",
        config.num_params(),
        mib(4 * config.num_params() as isize),
        mib(full),
        mib(chunked),
        LOSS_CHUNK_BYTES >> 20,
        mib(ac),
    );
    figures.push((
        "qwen3_06b_2layer_seq2048_chunked_loss_vs_full_logits_peak_ratio".into(),
        chunked as f64 / full as f64,
    ));
    figures.push((
        "qwen3_06b_2layer_seq2048_chunked_loss_and_checkpointing_vs_full_logits_peak_ratio".into(),
        ac as f64 / full as f64,
    ));
    Ok(figures)
}

/// Which activation-memory paths [`activation_peak`] uses.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum ActivationPaths {
    /// Loss over the full-vocabulary logits (`cross_entropy`).
    FullLogits,
    /// `chunked_cross_entropy`.
    ChunkedLoss,
    /// `chunked_cross_entropy` and block activation checkpointing.
    ChunkedLossAndCheckpointing,
}

/// Peak live bytes above the model (built eagerly before measuring) of one forward and
/// backward of one `seq`-token sequence through `config` on one device. The gradients
/// themselves (4Ψ bytes) are part of every peak.
fn activation_peak(config: &Qwen3Config, seq: usize, paths: ActivationPaths) -> Result<isize> {
    type Ad = burn::backend::Autodiff<Backend>;
    let device = crate::device();
    let model = config.init::<Ad>(&device);
    let tokens = synthetic_batches(1, 1, seq, config.vocab_size, 0).rows::<Ad>(0, 0..1, &device);
    let (inputs, labels) = inputs_and_labels(tokens);
    let chunk = loss_chunk_rows(config.vocab_size, LOSS_CHUNK_BYTES);
    let baseline = live_bytes().context("the counting allocator is not installed")?;
    PEAK.store(baseline, Ordering::Relaxed);
    match paths {
        ActivationPaths::FullLogits => drop(cross_entropy(model.forward(inputs), labels).backward()),
        ActivationPaths::ChunkedLoss => {
            let hidden = model.hidden_with(inputs, &mut Direct);
            drop(chunked_cross_entropy(hidden, model.head_weight(), labels, chunk).backward())
        }
        ActivationPaths::ChunkedLossAndCheckpointing => {
            let run = burn_fsdp::activation::checkpointed(|r| {
                chunked_cross_entropy(model.hidden_with(inputs, r), model.head_weight(), labels, chunk)
            });
            drop(run.backward())
        }
    }
    Ok(PEAK.load(Ordering::Relaxed) - baseline)
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
        crate::scaling::worker(args.steps, args.world)?;
        return Ok(Vec::new());
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
    if args.scaling_only {
        let figures = crate::scaling::figures(args.steps, torch)?;
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
    figures.extend(crate::scaling::figures(args.steps, torch)?);

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
