//! `cargo xtask bench --device metax-emu --step-profile`: what one training step asks of the
//! device, counted on the emulated MetaX device ([`burn_metax_backend::emu::EmuCounters`]).
//!
//! The tiny Qwen3 preset trains at FSDP W = 1 and at W = 4 (in-process ranks, rank `r` on
//! emulated device `r`), each configuration in three runs: one warm-up step (kernels compiled,
//! memory pools filled), then `2` and `2 + steps` steps (at W = 4 two more with `--no-prefetch`,
//! for the collective host bytes: see below). A figure per step is the difference of
//! the last two runs' counts over `steps`: steps 3..N of a run, with no boundary between steps to
//! guess. Counts are per rank (per device), averaged over the ranks.
//!
//! Two W = 4 configurations run side by side:
//! - **after** (what `train-qwen3 --device metax-emu` does): streams ordered by need, device
//!   collectives (`--in-process-collectives device`);
//! - **before**: every operation waits for every other stream (`StreamOrdering::AllStreams`),
//!   host collectives (`--in-process-collectives host`, burn-fsdp's `LocalGroup`).
//!
//! Collective host bytes are the data a collective call copies between the rank's device and
//! the host: a wrapper around the rank's process group reads, before and after each call, the
//! bytes the device's server has read or written for the calling thread's stream
//! ([`host_bytes_of_this_thread`]); the server is made to take the thread's earlier work first
//! (a round trip that makes no driver call), so the upload of the call's own input is not
//! counted. FSDP's communication thread runs its jobs on the compute thread's stream (so that
//! the work around a collective needs no wait between streams), where the compute thread's own
//! copies would fall into the window: so this one figure comes from two more runs of the
//! configuration with `--no-prefetch`, whose collectives run in-line on the compute thread and
//! have the stream to themselves for their duration. The collectives are the same ones, in the
//! same order, on the same tensors (the results are bit-identical with and without prefetch).
//!
//! `host ↔ device bytes (all copies)` is every read and write of the step by any stream, for
//! scale: the batch (ids and labels) and the step's one read of its values. The rotary tables
//! are built and uploaded once per model and sequence length (`qwen3_burn::RopeCache`), in the
//! first step, which is not counted.
//!
//! At W = 1 the device's kernel timers run as well (`runtime::set_kernel_timing`: a timing
//! event before and after each launch): `w1_kernel_ms_per_step` is the emulated device's time
//! in kernels, which says little about a GPU (the kernels run on the CPU); what the run shows
//! is that every launch of a training step is timed (`w1_timed_launches_per_step` equals
//! `w1_launches_per_step`). `cargo xtask gpu-bench` sets that time against a step's wall time
//! (the kernel share).

use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};

use anyhow::{Context, Result};
use burn::tensor::Tensor;
use burn_fsdp::comm::{CommError, CommStats, ProcessGroup, ReduceOp, Tag};
use burn_metax_backend::emu::EmuCounters;
use burn_metax_backend::runtime::{
    KernelTime, MetaxEmuPlatform, Platform, StreamOrdering, emu_driver, host_bytes_of_device,
    host_bytes_of_this_thread, set_kernel_timing, set_stream_ordering, take_kernel_time,
};
use burn_metax_backend::{MetaxEmu, MetaxEmuDevice, MetaxEmuRuntime};

use crate::train::{MetricsSink, TrainArgs, setup, train_fsdp_emu};

/// Collective calls and the host bytes copied during them, over all ranks.
#[derive(Debug, Default)]
struct CollectiveCounts {
    calls: AtomicU64,
    host_bytes: AtomicU64,
}

/// A rank's process group that counts its collectives' calls and host copies.
struct Counting {
    inner: Arc<dyn ProcessGroup<MetaxEmu>>,
    device: usize,
    counts: Arc<CollectiveCounts>,
}

impl Counting {
    /// The host ↔ device bytes this thread's stream has copied on the rank's device so far.
    fn host_bytes(&self) -> u64 {
        host_bytes_of_this_thread(MetaxEmuPlatform::NAME, self.device)
    }

    fn counted<T>(&self, call: impl FnOnce() -> T) -> T {
        // The client hands work to the device's server thread without waiting: let it take
        // what this thread queued before the call (e.g. the upload of the call's input), so that
        // only the call's own copies fall in the window. Asking the server for its memory usage
        // is such a round trip, and makes no driver call (a flush could wait for events, which
        // the host-sync counter would see).
        if let Ok(client) = MetaxEmuRuntime::try_client(&MetaxEmuDevice::new(self.device)) {
            let _ = client.memory_usage();
        }
        let before = self.host_bytes();
        let out = call();
        let copied = self.host_bytes().saturating_sub(before);
        self.counts.calls.fetch_add(1, Ordering::Relaxed);
        self.counts.host_bytes.fetch_add(copied, Ordering::Relaxed);
        out
    }
}

impl ProcessGroup<MetaxEmu> for Counting {
    fn rank(&self) -> usize {
        self.inner.rank()
    }

    fn size(&self) -> usize {
        self.inner.size()
    }

    fn stats(&self) -> CommStats {
        self.inner.stats()
    }

    fn all_gather(&self, input: Tensor<MetaxEmu, 1>, tag: &Tag) -> Result<Tensor<MetaxEmu, 1>, CommError> {
        self.counted(|| self.inner.all_gather(input, tag))
    }

    fn reduce_scatter(
        &self,
        input: Tensor<MetaxEmu, 1>,
        op: ReduceOp,
        tag: &Tag,
    ) -> Result<Tensor<MetaxEmu, 1>, CommError> {
        self.counted(|| self.inner.reduce_scatter(input, op, tag))
    }

    fn all_reduce(
        &self,
        input: Tensor<MetaxEmu, 1>,
        op: ReduceOp,
        tag: &Tag,
    ) -> Result<Tensor<MetaxEmu, 1>, CommError> {
        self.counted(|| self.inner.all_reduce(input, op, tag))
    }

    fn broadcast(
        &self,
        input: Tensor<MetaxEmu, 1>,
        root: usize,
        tag: &Tag,
    ) -> Result<Tensor<MetaxEmu, 1>, CommError> {
        self.counted(|| self.inner.broadcast(input, root, tag))
    }

    fn barrier(&self, tag: &Tag) -> Result<(), CommError> {
        self.counted(|| self.inner.barrier(tag))
    }

    fn abort(&self, reason: &str) {
        self.inner.abort(reason)
    }
}

/// What one run did, summed over its ranks.
#[derive(Debug, Clone, Copy, Default)]
struct Totals {
    device: EmuCounters,
    collectives: u64,
    collective_host_bytes: u64,
    host_bytes: u64,
    /// The devices' kernel timers (configurations with `kernel_timers` only).
    kernels: KernelTime,
}

/// One configuration: world size, stream-ordering rule and collectives.
struct Config {
    world: usize,
    ordering: StreamOrdering,
    collectives: &'static str,
    /// Whether the devices' kernel timers run (`runtime::set_kernel_timing`).
    kernel_timers: bool,
}

/// Whether a run overlaps communication with compute (FSDP's communication thread).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Overlap {
    /// The default: prefetched all-gathers, reduce-scatters on the communication thread.
    On,
    /// `--no-prefetch`: every collective in-line on the compute thread.
    Off,
}

/// Trains `steps` steps of the tiny preset in `config` and returns the counts.
fn run(config: &Config, steps: usize, overlap: Overlap) -> Result<Totals> {
    for device in 0..config.world {
        set_stream_ordering(MetaxEmuPlatform::NAME, device, config.ordering);
    }
    let (world, steps) = (config.world.to_string(), steps.to_string());
    let mut argv = vec![
        "train-qwen3",
        "--device",
        "metax-emu",
        "--world-size",
        &world,
        "--steps",
        &steps,
        "--in-process-collectives",
        config.collectives,
        "--quiet",
    ];
    if overlap == Overlap::Off {
        argv.push("--no-prefetch");
    }
    let args = TrainArgs::parse_from_args(&argv)?;
    let setup = setup(&args)?;
    let driver = emu_driver().context("the emulated device (scripts/setup.sh installs g++)")?;
    let read = || (0..config.world).fold(EmuCounters::default(), |sum, d| sum.plus(&driver.counters(d)));
    let counts = Arc::new(CollectiveCounts::default());
    let sink = MetricsSink::new(None, true)?;
    let host_bytes =
        || (0..config.world).map(|d| host_bytes_of_device(MetaxEmuPlatform::NAME, d)).sum::<u64>();
    for device in 0..config.world {
        set_kernel_timing(MetaxEmuPlatform::NAME, device, config.kernel_timers);
    }
    let before = read();
    let host_before = host_bytes();
    let wrap = |group: Arc<dyn ProcessGroup<MetaxEmu>>, device: MetaxEmuDevice| {
        Arc::new(Counting { inner: group, device: device.index, counts: counts.clone() })
            as Arc<dyn ProcessGroup<MetaxEmu>>
    };
    train_fsdp_emu(&args, setup, &sink, &wrap)?;
    let device = read().since(&before);
    // After the counters are read: waiting for the timers is a host sync of its own.
    let mut kernels = KernelTime::default();
    for d in 0..config.world {
        set_kernel_timing(MetaxEmuPlatform::NAME, d, false);
        kernels = kernels.plus(&take_kernel_time(MetaxEmuPlatform::NAME, d).context("the kernel timers")?);
    }
    Ok(Totals {
        device,
        collectives: counts.calls.load(Ordering::Relaxed),
        collective_host_bytes: counts.host_bytes.load(Ordering::Relaxed),
        host_bytes: host_bytes().saturating_sub(host_before),
        kernels,
    })
}

/// Per step and per rank, from a run of 2 steps and one of `2 + steps`.
struct PerStep {
    launches: f64,
    host_syncs: f64,
    background_waits: f64,
    cross_stream_waits: f64,
    collectives: f64,
    collective_host_bytes: f64,
    host_bytes: f64,
    /// Launches the kernel timers timed (0 without them).
    timed_launches: f64,
    /// Device time in kernels, in ms.
    kernel_ms: f64,
}

fn per_step(config: &Config, steps: usize) -> Result<PerStep> {
    run(config, 1, Overlap::On)?;
    let short = run(config, 2, Overlap::On)?;
    let long = run(config, 2 + steps, Overlap::On)?;
    let d = long.device.since(&short.device);
    let per = |n: u64| n as f64 / (steps * config.world) as f64;
    // The collectives' own copies, counted where nothing else runs on the calling thread's
    // stream meanwhile (see the module docs).
    let (short_inline, long_inline) = match config.world {
        1 => (short, long),
        _ => (run(config, 2, Overlap::Off)?, run(config, 2 + steps, Overlap::Off)?),
    };
    Ok(PerStep {
        launches: per(d.launches),
        host_syncs: per(d.host_syncs),
        background_waits: per(d.background_waits),
        cross_stream_waits: per(d.cross_stream_waits),
        collectives: per(long.collectives.saturating_sub(short.collectives)),
        collective_host_bytes: per(long_inline
            .collective_host_bytes
            .saturating_sub(short_inline.collective_host_bytes)),
        host_bytes: per(long.host_bytes.saturating_sub(short.host_bytes)),
        timed_launches: per(long.kernels.launches.saturating_sub(short.kernels.launches)),
        kernel_ms: (long.kernels.busy_ms - short.kernels.busy_ms) / (steps * config.world) as f64,
    })
}

/// The figures, as `name: value` pairs.
pub fn figures(steps: usize) -> Result<Vec<(String, f64)>> {
    let steps = steps.max(1);
    let config =
        |world, ordering, collectives, kernel_timers| Config { world, ordering, collectives, kernel_timers };
    let w1 = per_step(&config(1, StreamOrdering::ByNeed, "device", true), steps)?;
    let after = per_step(&config(4, StreamOrdering::ByNeed, "device", false), steps)?;
    let before = per_step(&config(4, StreamOrdering::AllStreams, "host", false), steps)?;
    for device in 0..4 {
        set_stream_ordering(MetaxEmuPlatform::NAME, device, StreamOrdering::ByNeed);
    }
    let waits_per_collective =
        |p: &PerStep| if p.collectives > 0.0 { p.cross_stream_waits / p.collectives } else { 0.0 };
    println!(
        "step profile on the emulated MetaX device: tiny preset, {steps} steps counted per configuration"
    );
    println!(
        "| per step and rank | W = 1 | W = 4 before (all streams, host collectives) | W = 4 after (by need, device collectives) |"
    );
    println!("|---|---|---|---|");
    let row = |name: &str, f: &dyn Fn(&PerStep) -> f64| {
        println!("| {name} | {:.1} | {:.1} | {:.1} |", f(&w1), f(&before), f(&after));
    };
    row("kernel launches", &|p| p.launches);
    row("host syncs", &|p| p.host_syncs);
    row("background waits (no stream or issuing thread stalls)", &|p| p.background_waits);
    row("cross-stream waits", &|p| p.cross_stream_waits);
    row("collectives", &|p| p.collectives);
    row("collective host bytes", &|p| p.collective_host_bytes);
    row("host ↔ device bytes (all copies)", &|p| p.host_bytes);
    row("cross-stream waits per collective", &waits_per_collective);
    Ok(vec![
        ("w1_launches_per_step".into(), w1.launches),
        ("w4_launches_per_step".into(), after.launches),
        ("w1_host_syncs_per_step".into(), w1.host_syncs),
        ("w4_host_syncs_per_step".into(), after.host_syncs),
        ("w1_background_waits_per_step".into(), w1.background_waits),
        ("w4_background_waits_per_step".into(), after.background_waits),
        ("w4_collective_host_bytes_per_step".into(), after.collective_host_bytes),
        ("w1_host_bytes_per_step".into(), w1.host_bytes),
        ("w4_host_bytes_per_step".into(), after.host_bytes),
        ("w4_cross_stream_waits_per_collective".into(), waits_per_collective(&after)),
        ("w4_before_host_syncs_per_step".into(), before.host_syncs),
        ("w4_before_collective_host_bytes_per_step".into(), before.collective_host_bytes),
        ("w4_before_cross_stream_waits_per_collective".into(), waits_per_collective(&before)),
        ("w1_timed_launches_per_step".into(), w1.timed_launches),
        ("w1_kernel_ms_per_step".into(), w1.kernel_ms),
    ])
}
