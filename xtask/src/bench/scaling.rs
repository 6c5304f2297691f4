//! Scaling figures of `cargo xtask bench`, measured on equal resources (issue #19):
//!
//! - `fsdp_w1_vs_single`: FSDP over one rank against single-device training (`--no-fsdp`),
//!   both with the process pinned to the same one core, alternated (A B A B);
//! - `fsdp_w2_scaling_efficiency`: FSDP over two in-process ranks with the process pinned to
//!   two cores, against two independent single-device runs at the same time, each a process
//!   pinned to one of those cores (perfect data parallelism: no communication), alternated
//!   (A B A B);
//! - the same two figures for PyTorch FSDP2 (gloo, one process and one thread per rank, each
//!   pinned to its core) when PyTorch is present, and Burn against PyTorch tokens/s per core.
//!
//! Every run, Burn's and PyTorch's, is a fresh process (`bench --scaling-worker`,
//! `torch_bench.py`) pinned by this one: no run inherits another's heap or threads.
//!
//! The model is the ~29M-parameter Qwen3 of issue #19 (hidden 512, 8 layers, vocab 8192),
//! 4 rows × 128 tokens per rank and step; Burn's side runs on `bench --cpu-backend` (Flex by
//! default, as `train-qwen3`), every one of its runs on the same backend.

use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};

use anyhow::{Context, Result, bail, ensure};
use qwen3_burn::Qwen3Config;

use super::throughput::{qwen3_50m, train_throughput};
use crate::train::CpuBackend;

/// Rows per rank and step.
pub const ROWS: usize = 4;
/// Tokens per row.
pub const SEQ: usize = 128;

/// The ~29M-parameter Qwen3 of the scaling figures: the 50M benchmark model with 8 layers.
pub fn qwen3_29m() -> Qwen3Config {
    Qwen3Config { num_hidden_layers: 8, ..qwen3_50m() }
}

/// Pins the calling thread (and every thread or process it creates afterwards) to `cores`.
pub fn pin_current_thread(cores: &[usize]) -> Result<()> {
    // SAFETY: `cpu_set_t` is plain old data, for which all-zero bytes are the empty set.
    let mut set: libc::cpu_set_t = unsafe { std::mem::zeroed() };
    for &core in cores {
        ensure!(core < libc::CPU_SETSIZE as usize, "core {core} is beyond CPU_SETSIZE");
        // SAFETY: `core` is below CPU_SETSIZE (checked above), so the bit is inside `set`.
        unsafe { libc::CPU_SET(core, &mut set) };
    }
    // SAFETY: `set` is a valid, initialised `cpu_set_t` that outlives the call, and its size
    // is passed with it; pid 0 means the calling thread.
    let rc = unsafe { libc::sched_setaffinity(0, std::mem::size_of::<libc::cpu_set_t>(), &set) };
    if rc != 0 {
        bail!("sched_setaffinity({cores:?}): {}", std::io::Error::last_os_error());
    }
    Ok(())
}

/// The cores this thread may run on.
pub fn allowed_cores() -> Result<Vec<usize>> {
    // SAFETY: as in `pin_current_thread`: an all-zero `cpu_set_t` is valid.
    let mut set: libc::cpu_set_t = unsafe { std::mem::zeroed() };
    // SAFETY: `set` is valid for writes of its own size, passed with it; pid 0 = this thread.
    let rc = unsafe { libc::sched_getaffinity(0, std::mem::size_of::<libc::cpu_set_t>(), &mut set) };
    if rc != 0 {
        bail!("sched_getaffinity: {}", std::io::Error::last_os_error());
    }
    // SAFETY: `set` was filled by the kernel and `core` stays below CPU_SETSIZE.
    Ok((0..libc::CPU_SETSIZE as usize).filter(|&c| unsafe { libc::CPU_ISSET(c, &set) }).collect())
}

/// `bench --scaling-worker`: one single-device run of the scaling model (FSDP over `world`
/// in-process ranks if given), as a process of its own (pinned by its parent or by
/// `taskset`); prints `tokens_per_sec: X`.
pub fn worker(steps: usize, world: Option<usize>, backend: CpuBackend) -> Result<()> {
    let backend = ["--cpu-backend", backend.name()];
    let t = train_throughput(&qwen3_29m(), world, ROWS * world.unwrap_or(1), SEQ, steps, &backend)?;
    println!("tokens_per_sec: {}", t.tokens_per_sec);
    Ok(())
}

/// Starts `command` with its output captured.
fn spawn(mut command: Command) -> Result<Child> {
    command
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .with_context(|| format!("starting {command:?}"))
}

/// Starts `command` pinned to `core` (the child inherits the affinity set just before).
fn spawn_pinned(command: Command, core: usize) -> Result<Child> {
    pinned(&[core], || spawn(command))
}

/// Waits for `child` and reads the `key: value` line it printed last.
fn read_figure(child: Child, key: &str) -> Result<f64> {
    let out = child.wait_with_output()?;
    let stdout = String::from_utf8_lossy(&out.stdout);
    ensure!(
        out.status.success(),
        "a scaling worker failed ({}): {}",
        out.status,
        String::from_utf8_lossy(&out.stderr).trim()
    );
    // A `key: value` line (the Burn worker) or a JSON object with `key` (torch_bench.py).
    let json = |l: &str| serde_json::from_str::<serde_json::Value>(l).ok().and_then(|v| v[key].as_f64());
    stdout
        .lines()
        .rev()
        .find_map(|l| match l.strip_prefix(key) {
            Some(v) => v.trim_start_matches(':').trim().parse().ok(),
            None => json(l.trim()),
        })
        .with_context(|| format!("no `{key}:` line in a worker's output: {stdout}"))
}

/// Runs `f` with this thread pinned to `cores`, then restores its affinity.
fn pinned<T>(cores: &[usize], f: impl FnOnce() -> Result<T>) -> Result<T> {
    let restore = allowed_cores()?;
    pin_current_thread(cores)?;
    let out = f();
    pin_current_thread(&restore)?;
    out
}

/// Runs `a` then `b`, twice (A B A B), and returns the mean of each: the machine's speed
/// drifts by several percent from one run to the next, and alternating spreads that drift over
/// both sides.
fn alternated(mut a: impl FnMut() -> Result<f64>, mut b: impl FnMut() -> Result<f64>) -> Result<(f64, f64)> {
    let (mut sum_a, mut sum_b) = (0.0, 0.0);
    for _ in 0..2 {
        sum_a += a()?;
        sum_b += b()?;
    }
    Ok((sum_a / 2.0, sum_b / 2.0))
}

/// The PyTorch side: `torch_bench.py` in its scaling modes.
struct Torch<'a> {
    python: &'a Path,
    config_dir: &'a Path,
    steps: usize,
}

impl Torch<'_> {
    fn command(&self, extra: &[&str]) -> Command {
        let script = PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("bench").join("torch_bench.py");
        let mut c = Command::new(self.python);
        c.arg(script)
            .arg("--config")
            .arg(self.config_dir.join("config.json"))
            .args(["--batch", &ROWS.to_string(), "--seq", &SEQ.to_string()])
            .args(["--steps", &self.steps.to_string(), "--threads", "1", "--train-only"])
            .args(extra);
        c
    }
}

/// The scaling figures (see the module docs); `python` is the interpreter with PyTorch, or
/// why there is none (its figures are then printed as skipped, with that reason).
pub fn figures(steps: usize, backend: CpuBackend, python: Result<&Path, &str>) -> Result<Vec<(String, f64)>> {
    let config = qwen3_29m();
    let cores = allowed_cores()?;
    println!(
        "[scaling] Qwen3 of {} parameters (hidden 512, 8 layers, vocab 8192), {ROWS} × {SEQ} tokens per rank, \
         {steps} timed steps, burn's {} backend; cores {cores:?}",
        config.num_params(),
        backend.name()
    );
    let backend = ["--cpu-backend", backend.name()];
    let mut figures = Vec::new();
    let core0 = *cores.first().context("sched_getaffinity allowed no core")?;

    // Every Burn run is a fresh process (as every PyTorch run is), pinned by its parent.
    let exe = std::env::current_exe()?;
    let worker = |world: Option<usize>| {
        let mut c = Command::new(&exe);
        c.args(["bench", "--scaling-worker", "--steps", &steps.to_string()]).args(backend);
        if let Some(w) = world {
            c.args(["--world", &w.to_string()]);
        }
        c
    };
    let figure = |child: Result<Child>| read_figure(child?, "tokens_per_sec");

    // FSDP at W = 1 against --no-fsdp, on one core, alternated.
    let on_core0 = |world| figure(spawn_pinned(worker(world), core0));
    let (single, w1) = alternated(|| on_core0(None), || on_core0(Some(1)))?;
    println!(
        "  one core: single device {single:.1} tokens/s, FSDP W=1 {w1:.1} tokens/s (mean of two alternated runs each)"
    );
    figures.push(("fsdp_w1_vs_single".into(), w1 / single));

    // FSDP at W = 2 on two cores against two independent single-device processes.
    let two = cores.len() >= 2;
    if two {
        let pair = [cores[0], cores[1]];
        let (independent, w2) = alternated(
            || {
                let children = [spawn_pinned(worker(None), pair[0])?, spawn_pinned(worker(None), pair[1])?];
                children.into_iter().map(|c| read_figure(c, "tokens_per_sec")).sum()
            },
            || figure(pinned(&pair, || spawn(worker(Some(2))))),
        )?;
        println!(
            "  two cores: two independent single-device processes, one per core, {independent:.1} tokens/s in sum; \
             FSDP W=2 {w2:.1} tokens/s (means of two alternated runs each)"
        );
        figures.push(("fsdp_w2_scaling_efficiency".into(), w2 / independent));
    } else {
        println!("fsdp_w2_scaling_efficiency: skipped (one core available)");
    }

    match python {
        Err(why) => {
            for f in [
                "torch_fsdp_w1_vs_single",
                "torch_fsdp_w2_scaling_efficiency",
                "burn_vs_torch_tokens_per_sec_per_core",
            ] {
                println!("{f}: skipped ({why})");
            }
        }
        Ok(python) => {
            // The model's config.json for the PyTorch workers; removed when the figures are done.
            let dir = tempfile::Builder::new().prefix("xtask-scaling-").tempdir()?;
            config.save(dir.path())?;
            let torch = Torch { python, config_dir: dir.path(), steps };
            let key = "train_step_tokens_per_sec";
            let run = |extra: &[&str], core: usize| spawn_pinned(torch.command(extra), core);
            let (t_single, t_w1) = alternated(
                || read_figure(run(&[], core0)?, key),
                || read_figure(run(&["--fsdp-world", "1"], core0)?, key),
            )?;
            println!(
                "  [pytorch] one core: single device {t_single:.1} tokens/s, FSDP2 W=1 {t_w1:.1} tokens/s"
            );
            figures.push(("torch_fsdp_w1_vs_single".into(), t_w1 / t_single));
            // Burn against PyTorch on the same core, alternated with each other.
            let (burn, torch_single) = alternated(|| on_core0(None), || read_figure(run(&[], core0)?, key))?;
            println!(
                "  one core: Burn single device {burn:.1} tokens/s, PyTorch single device {torch_single:.1} tokens/s \
                 (alternated)"
            );
            figures.push(("burn_vs_torch_tokens_per_sec_per_core".into(), burn / torch_single));
            if two {
                let children = [run(&[], cores[0])?, run(&[], cores[1])?];
                let independent: f64 =
                    children.into_iter().map(|c| read_figure(c, key)).sum::<Result<f64>>()?;
                // The FSDP2 processes pin themselves, rank r to the r-th allowed core.
                let w2 = pinned(&[cores[0], cores[1]], || {
                    read_figure(spawn(torch.command(&["--fsdp-world", "2"]))?, key)
                })?;
                println!(
                    "  [pytorch] two cores: two independent single-device processes {independent:.1} tokens/s in sum; \
                     FSDP2 W=2 (gloo) {w2:.1} tokens/s"
                );
                figures.push(("torch_fsdp_w2_scaling_efficiency".into(), w2 / independent));
            }
            let _ = std::fs::remove_dir_all(&dir);
        }
    }
    Ok(figures)
}
