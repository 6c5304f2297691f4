//! `bench --qwen3-06b-pace`: the seed's configuration — Qwen3-0.6B, FSDP over W = 4 in-process
//! ranks, 2 × 128 tokens per rank, AdamW, fp32 — against PyTorch FSDP2 (`scripts/headline.py`:
//! 4 gloo processes, one thread each) on the same cores, on the same checkpoint and batches.
//!
//! The two jobs alternate (ours, PyTorch, ours, …; `--rounds` pairs), each a process of its own
//! with the machine to itself: one warm-up step, then `--steps` timed steps. Printed:
//! - `qwen3_06b_fsdp_w4_vs_torch_fsdp2_step_time_ratio`: PyTorch's mean step time over ours
//!   (above 1: ours is faster), the median over rounds;
//! - `qwen3_06b_fsdp_w4_peak_rss_gib`: the peak resident memory of our whole job (the kernel's
//!   `ru_maxrss` of the process), the highest over rounds;
//! - where our step's time goes: from the run itself (`profile.jsonl`: CPU time in user and
//!   kernel mode, page faults, collectives, rank 0's optimizer step) and, for the model's parts
//!   (head and loss, attention, MLP, norms and rope), forward + backward of one rank's shapes
//!   measured apart in this process.
//!
//! Without torch, ours runs on the built-in preset with synthetic batches of the same shapes,
//! and the output says that PyTorch was skipped.

use std::path::Path;
use std::process::{Command, Stdio};
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::time::Duration;

use anyhow::{Context, Result, bail};
use burn::tensor::{Distribution, Int, Tensor};
use qwen3_burn::model::{Qwen3, Rope};
use qwen3_burn::train::{chunked_cross_entropy, loss_chunk_rows};
use qwen3_burn::trainer::LOSS_CHUNK_BYTES;
use qwen3_burn::{Qwen3Config, Qwen3Init};

/// Ranks of the configuration.
const WORLD: usize = 4;
/// Rows per rank per step.
const BATCH: usize = 2;
/// Tokens per row.
const SEQ: usize = 128;
/// AdamW learning rate of both sides (`cargo xtask headline`'s).
const LR: f64 = 3e-4;

/// What one of our runs measured.
#[derive(Debug, Clone)]
struct OurRun {
    /// Mean seconds of the timed steps.
    step_seconds: f64,
    /// Peak resident bytes of the whole job.
    peak_rss_bytes: u64,
    /// `profile.jsonl`'s timed lines.
    profile: Vec<serde_json::Value>,
}

/// What one PyTorch run measured.
#[derive(Debug, Clone, Copy)]
struct TorchRun {
    step_seconds: f64,
    /// The highest sum of the job's processes' resident memory seen (sampled every 0.2 s).
    peak_rss_bytes: u64,
}

/// Runs the benchmark: `rounds` alternations of ours and PyTorch's (`torch`: the interpreter,
/// or why it cannot be used), `timed` steps each after a warm-up step, in `dir` (which keeps
/// the checkpoint and batches for the next run).
pub(super) fn figures(
    dir: &Path,
    rounds: usize,
    timed: usize,
    torch: std::result::Result<&Path, &str>,
) -> Result<Vec<(String, f64)>> {
    if timed < 3 {
        bail!("--steps {timed}: the pace benchmark times at least 3 steps after the warm-up");
    }
    if rounds == 0 {
        bail!("--rounds 0: at least one round");
    }
    let steps = timed + 1;
    std::fs::create_dir_all(dir).with_context(|| format!("--pace-dir {}", dir.display()))?;
    let config = Qwen3Config::qwen3_0_6b();
    match torch {
        Ok(python) => ensure_checkpoint(python, dir, &config, steps)?,
        Err(why) => println!("PyTorch FSDP2 skipped: {why}"),
    }
    println!(
        "[qwen3_06b pace] {} parameters, W = {WORLD}, {BATCH} × {SEQ} tokens per rank, AdamW lr {LR}: \
         1 warm-up + {timed} timed steps per run, {rounds} round(s) of ours then PyTorch FSDP2",
        config.num_params()
    );
    let mut ours = Vec::with_capacity(rounds);
    let mut theirs = Vec::with_capacity(rounds);
    for round in 0..rounds {
        let run = our_run(dir, round, steps, torch.is_ok())?;
        println!(
            "  round {round}: ours {:.1} s per step, peak RSS {:.2} GiB",
            run.step_seconds,
            gib(run.peak_rss_bytes)
        );
        ours.push(run);
        if let Ok(python) = torch {
            let run = torch_run(python, dir, round)?;
            println!(
                "  round {round}: PyTorch FSDP2 {:.1} s per step, peak RSS of its 4 processes {:.2} GiB",
                run.step_seconds,
                gib(run.peak_rss_bytes)
            );
            theirs.push(run);
        }
    }
    let our_step = median(ours.iter().map(|r| r.step_seconds).collect());
    let peak = ours.iter().map(|r| r.peak_rss_bytes).max().unwrap_or(0);
    let mut figures = vec![
        ("qwen3_06b_fsdp_w4_step_seconds".to_owned(), our_step),
        ("qwen3_06b_fsdp_w4_peak_rss_gib".to_owned(), gib(peak)),
    ];
    if !theirs.is_empty() {
        let ratios: Vec<f64> =
            ours.iter().zip(&theirs).map(|(o, t)| t.step_seconds / o.step_seconds).collect();
        println!(
            "  PyTorch's step time over ours, per round: {}",
            ratios.iter().map(|r| format!("{r:.3}")).collect::<Vec<_>>().join(", ")
        );
        figures.push((
            "qwen3_06b_torch_fsdp2_w4_step_seconds".to_owned(),
            median(theirs.iter().map(|r| r.step_seconds).collect()),
        ));
        figures.push((
            "qwen3_06b_torch_fsdp2_w4_peak_rss_gib".to_owned(),
            gib(theirs.iter().map(|r| r.peak_rss_bytes).max().unwrap_or(0)),
        ));
        figures.push(("qwen3_06b_fsdp_w4_vs_torch_fsdp2_step_time_ratio".to_owned(), median(ratios)));
    }
    let parts = model_parts(&config)?;
    figures.extend(breakdown(&ours, &parts));
    Ok(figures)
}

fn gib(bytes: u64) -> f64 {
    bytes as f64 / (1u64 << 30) as f64
}

fn median(mut v: Vec<f64>) -> f64 {
    v.sort_by(f64::total_cmp);
    match v.len() {
        0 => f64::NAN,
        n if n % 2 == 1 => v[n / 2],
        n => (v[n / 2 - 1] + v[n / 2]) / 2.0,
    }
}

/// Makes (once) the random checkpoint and the batches both sides train on, with
/// `scripts/headline.py init`; an existing set of other shapes is made again.
fn ensure_checkpoint(python: &Path, dir: &Path, config: &Qwen3Config, steps: usize) -> Result<()> {
    let train = dir.join("train.json");
    let fits = std::fs::read_to_string(&train)
        .ok()
        .and_then(|t| serde_json::from_str::<serde_json::Value>(&t).ok())
        .is_some_and(|t| {
            let n = |k: &str| t.get(k).and_then(|v| v.as_u64());
            n("world") == Some(WORLD as u64)
                && n("batch") == Some(BATCH as u64)
                && n("seq") == Some(SEQ as u64)
                && n("steps") == Some(steps as u64)
                && t.get("lr").and_then(|v| v.as_f64()) == Some(LR)
        });
    let have = |f: &str| dir.join(f).is_file();
    if fits && have("model.safetensors") && have("batches.safetensors") && have("config.json") {
        return Ok(());
    }
    println!(
        "making the random Qwen3-0.6B checkpoint and {steps} steps of batches with PyTorch in {}…",
        dir.display()
    );
    config.save(dir)?;
    let script = crate::headline::find_script()?;
    let (world, batch, seq, n, lr) =
        (WORLD.to_string(), BATCH.to_string(), SEQ.to_string(), steps.to_string(), LR.to_string());
    let status = Command::new(python)
        .arg(&script)
        .arg("init")
        .arg(dir)
        .args([
            "--world", &world, "--batch", &batch, "--seq", &seq, "--steps", &n, "--lr", &lr, "--seed", "0",
        ])
        .status()
        .with_context(|| format!("running {}", python.display()))?;
    if !status.success() {
        bail!("{} init failed ({status}); its output is above", script.display());
    }
    Ok(())
}

/// Runs `child` to its end; returns whether it succeeded and its peak resident bytes (the
/// kernel's `ru_maxrss` of the process).
fn wait_with_peak(child: std::process::Child) -> Result<(bool, u64)> {
    let pid = child.id() as libc::pid_t;
    let mut status: libc::c_int = 0;
    // SAFETY: `usage` is a zeroed `rusage` that `wait4` fills; `pid` is our own child, not
    // waited for before (`child` is dropped without waiting: dropping a `Child` neither waits
    // nor kills).
    let (ret, usage) = unsafe {
        let mut usage: libc::rusage = std::mem::zeroed();
        let ret = libc::wait4(pid, &mut status, 0, &mut usage);
        (ret, usage)
    };
    drop(child);
    if ret != pid {
        bail!("waiting for process {pid}: {}", std::io::Error::last_os_error());
    }
    let ok = libc::WIFEXITED(status) && libc::WEXITSTATUS(status) == 0;
    Ok((ok, usage.ru_maxrss.max(0) as u64 * 1024))
}

/// One of our runs: `train-qwen3` at W = 4 in a process of its own.
fn our_run(dir: &Path, round: usize, steps: usize, checkpoint: bool) -> Result<OurRun> {
    let out = dir.join(format!("ours-r{round}"));
    let exe = std::env::current_exe().context("the xtask binary's path")?;
    let mut cmd = Command::new(exe);
    cmd.args(["train-qwen3", "--world-size", &WORLD.to_string(), "--steps", &steps.to_string()]);
    cmd.args(["--lr", &LR.to_string(), "--betas", "0.9,0.95", "--eps", "1e-8", "--weight-decay", "0.1"]);
    if checkpoint {
        cmd.arg("--checkpoint").arg(dir).arg("--batches").arg(dir.join("batches.safetensors"));
    } else {
        cmd.args(["--preset", "0.6b", "--batch", &BATCH.to_string(), "--seq", &SEQ.to_string()]);
    }
    cmd.arg("--out-dir").arg(&out).arg("--quiet").stdin(Stdio::null());
    let child = cmd.spawn().context("starting our training run")?;
    let (ok, peak) = wait_with_peak(child)?;
    if !ok {
        bail!(
            "our run (train-qwen3 --world-size {WORLD}, --out-dir {}) failed; its output is above",
            out.display()
        );
    }
    let lines = |name: &str| -> Result<Vec<serde_json::Value>> {
        let path = out.join(name);
        let text = std::fs::read_to_string(&path).with_context(|| format!("{}", path.display()))?;
        text.lines()
            .map(|l| serde_json::from_str(l).with_context(|| format!("{}: not JSON lines", path.display())))
            .collect()
    };
    let tokens = (WORLD * BATCH * SEQ) as f64;
    let metrics = lines("metrics.jsonl")?;
    let timed: Vec<f64> = metrics
        .iter()
        .skip(1)
        .map(|m| tokens / m.get("tokens_per_sec").and_then(|v| v.as_f64()).unwrap_or(f64::NAN))
        .collect();
    if timed.len() + 1 != steps {
        bail!("{}: {} steps recorded, {steps} expected", out.join("metrics.jsonl").display(), metrics.len());
    }
    let profile = lines("profile.jsonl")?.into_iter().skip(1).collect();
    Ok(OurRun { step_seconds: timed.iter().sum::<f64>() / timed.len() as f64, peak_rss_bytes: peak, profile })
}

/// Resident bytes of `root` and every process below it.
fn tree_rss_bytes(root: u32) -> u64 {
    let Ok(entries) = std::fs::read_dir("/proc") else { return 0 };
    let mut parent = std::collections::HashMap::new();
    let mut rss = std::collections::HashMap::new();
    // SAFETY: sysconf only reads a configuration value.
    let page = unsafe { libc::sysconf(libc::_SC_PAGESIZE) }.max(1) as u64;
    for e in entries.flatten() {
        let Some(pid) = e.file_name().to_str().and_then(|s| s.parse::<u32>().ok()) else { continue };
        let Ok(stat) = std::fs::read_to_string(e.path().join("stat")) else { continue };
        // `pid (comm) state ppid …`: the command may hold spaces, so read after the last ')'.
        let Some(ppid) = stat.rsplit_once(')').and_then(|(_, rest)| rest.split_whitespace().nth(1)) else {
            continue;
        };
        let Ok(statm) = std::fs::read_to_string(e.path().join("statm")) else { continue };
        let resident = statm.split_whitespace().nth(1).and_then(|v| v.parse::<u64>().ok()).unwrap_or(0);
        parent.insert(pid, ppid.parse::<u32>().unwrap_or(0));
        rss.insert(pid, resident * page);
    }
    let below = |mut pid: u32| {
        while pid > 1 {
            if pid == root {
                return true;
            }
            pid = parent.get(&pid).copied().unwrap_or(0);
        }
        false
    };
    rss.iter().filter(|(pid, _)| below(**pid)).map(|(_, b)| b).sum()
}

/// One PyTorch FSDP2 run: `torchrun --nproc-per-node 4 scripts/headline.py fsdp`.
fn torch_run(python: &Path, dir: &Path, round: usize) -> Result<TorchRun> {
    let name = format!("torch-r{round}");
    let script = crate::headline::find_script()?;
    let child = Command::new(python)
        .args(["-m", "torch.distributed.run", "--nproc-per-node", &WORLD.to_string()])
        .arg(&script)
        .arg("fsdp")
        .arg(dir)
        .args(["--out", &name])
        .envs(crate::headline::TORCH_MALLOC_ENV)
        .env("OMP_NUM_THREADS", "1")
        .stdin(Stdio::null())
        .stdout(Stdio::null())
        .spawn()
        .with_context(|| format!("running {} -m torch.distributed.run", python.display()))?;
    let root = child.id();
    let peak = Arc::new(AtomicU64::new(0));
    let done = Arc::new(AtomicBool::new(false));
    let sampler = {
        let (peak, done) = (peak.clone(), done.clone());
        std::thread::spawn(move || {
            while !done.load(Ordering::Relaxed) {
                peak.fetch_max(tree_rss_bytes(root), Ordering::Relaxed);
                std::thread::sleep(Duration::from_millis(200));
            }
        })
    };
    let waited = wait_with_peak(child);
    done.store(true, Ordering::Relaxed);
    let _ = sampler.join();
    let (ok, _) = waited?;
    if !ok {
        bail!("PyTorch FSDP2 ({} fsdp) failed; its errors are above", script.display());
    }
    let path = dir.join(format!("{name}.json"));
    let text = std::fs::read_to_string(&path).with_context(|| format!("{}", path.display()))?;
    let v: serde_json::Value = serde_json::from_str(&text).with_context(|| format!("{}", path.display()))?;
    let secs: Vec<f64> = v
        .get("step_seconds")
        .and_then(|s| s.as_array())
        .map(|a| a.iter().filter_map(|x| x.as_f64()).collect())
        .unwrap_or_default();
    if secs.len() < 2 {
        bail!("{}: no timed steps in step_seconds", path.display());
    }
    let timed = &secs[1..];
    Ok(TorchRun {
        step_seconds: timed.iter().sum::<f64>() / timed.len() as f64,
        peak_rss_bytes: peak.load(Ordering::Relaxed),
    })
}

/// CPU seconds (user + kernel) of this whole process so far.
fn process_cpu_seconds() -> f64 {
    let r = crate::train::report::Resources::now();
    r.user + r.system
}

/// CPU seconds of one call of `f`, the mean of `reps` calls after one untimed call.
fn cpu_seconds_of(reps: usize, mut f: impl FnMut()) -> f64 {
    f();
    let start = process_cpu_seconds();
    for _ in 0..reps {
        f();
    }
    (process_cpu_seconds() - start) / reps as f64
}

/// CPU seconds per step of the model's parts, for all `WORLD` ranks: one rank's forward +
/// backward at the run's shapes measured apart in this process (Flex, as the run).
#[derive(Debug, Clone, Copy)]
struct ModelParts {
    head_and_loss: f64,
    attention: f64,
    mlp: f64,
    norms_and_rope: f64,
}

fn model_parts(config: &Qwen3Config) -> Result<ModelParts> {
    type Ad = burn::backend::Autodiff<burn::backend::Flex<f32>>;
    let device = Default::default();
    let one = Qwen3Config { num_hidden_layers: 1, ..config.clone() };
    let model = Qwen3::<Ad>::new_seeded(&one, Qwen3Init::new(0), &device);
    let layer = &model.model.layers[0];
    let (d, hd) = (config.hidden_size, config.head_dim);
    let (heads, kv) = (config.num_attention_heads, config.num_key_value_heads);
    let rope = Rope::<Ad>::new(hd, config.rope_theta, 0, SEQ, &device);
    let x =
        || Tensor::<Ad, 3>::random([BATCH, SEQ, d], Distribution::Normal(0.0, 1.0), &device).require_grad();
    let x4 = |n: usize| {
        Tensor::<Ad, 4>::random([BATCH, SEQ, n, hd], Distribution::Normal(0.0, 1.0), &device).require_grad()
    };
    let reps = 2;
    let layers = config.num_hidden_layers as f64;
    let attention_all = cpu_seconds_of(reps, || {
        let _ = layer.self_attn.forward(x(), &rope, None).sum().backward();
    });
    let mlp = cpu_seconds_of(reps, || {
        let _ = layer.mlp.forward(x()).sum().backward();
    });
    let qk_norm_rope = cpu_seconds_of(reps, || {
        let q = rope.apply(layer.self_attn.q_norm.forward(x4(heads)));
        let k = rope.apply(layer.self_attn.k_norm.forward(x4(kv)));
        let _ = (q.sum() + k.sum()).backward();
    });
    let layer_norm = cpu_seconds_of(reps, || {
        let _ = layer.input_layernorm.forward(x()).sum().backward();
    });
    let vocab = config.vocab_size;
    let chunk = loss_chunk_rows(vocab, LOSS_CHUNK_BYTES);
    let ids =
        || Tensor::<Ad, 2, Int>::random([BATCH, SEQ], Distribution::Uniform(0.0, vocab as f64), &device);
    let head_and_loss = cpu_seconds_of(reps, || {
        let hidden = model.model.embed_tokens.forward(ids()) + x();
        let hidden = model.model.norm.forward(hidden);
        let _ = chunked_cross_entropy(hidden, model.head_weight(), ids(), chunk).backward();
    });
    // The final norm ran inside `head_and_loss`: count it with the norms.
    let w = WORLD as f64;
    Ok(ModelParts {
        head_and_loss: w * (head_and_loss - layer_norm),
        attention: w * layers * (attention_all - qk_norm_rope).max(0.0),
        mlp: w * layers * mlp,
        norms_and_rope: w * (layers * (qk_norm_rope + 2.0 * layer_norm) + layer_norm),
    })
}

/// Prints where our step's time went and returns its figures.
fn breakdown(ours: &[OurRun], parts: &ModelParts) -> Vec<(String, f64)> {
    let lines: Vec<&serde_json::Value> = ours.iter().flat_map(|r| &r.profile).collect();
    let mean = |key: &str| {
        let v: Vec<f64> = lines.iter().filter_map(|l| l.get(key).and_then(|x| x.as_f64())).collect();
        if v.is_empty() { f64::NAN } else { v.iter().sum::<f64>() / v.len() as f64 }
    };
    let wall = mean("seconds");
    let (user, system) = (mean("process_user_cpu_seconds"), mean("process_system_cpu_seconds"));
    let cpu = user + system;
    let cores = std::thread::available_parallelism().map_or(1, |n| n.get()) as f64;
    // The optimizer runs on every rank at once: rank 0's wall time, on all cores.
    let optimizer = mean("optimizer_seconds") * cores.min(WORLD as f64);
    // Time inside collectives minus waiting for peers: copies and host reductions.
    let collectives = (mean("collective_seconds") - mean("collective_wait_seconds")).max(0.0);
    let known = [
        (
            "head and loss (with the embedding)",
            parts.head_and_loss,
            "forward + backward measured apart, × 4 ranks",
        ),
        (
            "attention (projections, scores, softmax)",
            parts.attention,
            "measured apart, × 28 layers × 4 ranks",
        ),
        ("MLP", parts.mlp, "measured apart, × 28 layers × 4 ranks"),
        ("norms and rope", parts.norms_and_rope, "measured apart, × 4 ranks"),
        ("optimizer (AdamW on the shards)", optimizer, "rank 0's wall time × cores"),
        (
            "collectives (copies, host reductions)",
            collectives,
            "time inside, less waiting, summed over ranks",
        ),
        ("allocation (kernel: page faults, zeroing)", system, "the process's kernel CPU time"),
    ];
    let rest = cpu - known.iter().map(|k| k.1).sum::<f64>();
    println!(
        "our step, mean of the timed steps: {wall:.1} s wall, {cpu:.1} CPU-s on {cores} cores ({user:.1} user, \
         {system:.1} kernel; {:.2} M minor page faults)",
        mean("process_minor_faults") / 1e6
    );
    println!("  {:<44} {:>9} {:>7}  how measured", "part", "CPU-s", "share");
    let mut figures = Vec::new();
    let slug = |name: &str| name.split(" (").next().unwrap_or(name).replace(' ', "_");
    for (name, secs, how) in known.iter().copied().chain([(
        "other (FSDP views, recomputation, copies, contention)",
        rest,
        "the rest of the process's CPU time",
    )]) {
        println!("  {name:<44} {secs:>9.1} {:>6.1}%  {how}", 100.0 * secs / cpu);
        figures.push((format!("qwen3_06b_fsdp_w4_step_cpu_share_{}", slug(name)), secs / cpu));
    }
    figures
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn median_of_odd_and_even_counts() {
        assert_eq!(median(vec![3.0, 1.0, 2.0]), 2.0);
        assert_eq!(median(vec![4.0, 1.0, 3.0, 2.0]), 2.5);
        assert!(median(Vec::new()).is_nan());
    }

    #[test]
    fn fewer_than_three_timed_steps_or_no_round_is_refused_before_anything_runs() {
        let dir = std::env::temp_dir().join(format!("pace-refused-{}", std::process::id()));
        let e = figures(&dir, 1, 2, Err("no torch here")).unwrap_err().to_string();
        assert!(e.contains("--steps 2") && e.contains("at least 3"), "{e}");
        let e = figures(&dir, 0, 3, Err("no torch here")).unwrap_err().to_string();
        assert!(e.contains("--rounds 0"), "{e}");
        assert!(!dir.exists(), "nothing is made before the arguments are checked");
    }

    #[test]
    fn a_child_s_peak_memory_and_exit_status_are_read() {
        // `dd` reads 64 MiB of zeros into one buffer: its peak is at least that, and the
        // parent's own size does not count.
        let mut dd = Command::new("dd");
        dd.args(["if=/dev/zero", "of=/dev/null", "bs=64M", "count=1"]).stderr(Stdio::null());
        let (ok, peak) = wait_with_peak(dd.spawn().expect("dd(1)")).expect("waited");
        assert!(ok);
        assert!(peak >= 64 << 20, "peak {peak}");
        assert!(peak < 1 << 30, "peak {peak}: the parent's memory is not the child's");
        let (ok, _) = wait_with_peak(Command::new("false").spawn().expect("false(1)")).expect("waited");
        assert!(!ok, "a failing child is reported as failed");
    }

    #[test]
    fn the_resident_memory_of_a_process_tree_counts_its_children() {
        let me = std::process::id();
        let alone = tree_rss_bytes(me);
        assert!(alone > 0, "this process has resident memory");
        let mut child = Command::new("sleep").arg("5").spawn().expect("sleep(1)");
        std::thread::sleep(Duration::from_millis(100));
        let with_child = tree_rss_bytes(me);
        let of_child = tree_rss_bytes(child.id());
        let _ = child.kill();
        let _ = child.wait();
        assert!(of_child > 0);
        assert!(with_child >= of_child, "{with_child} < {of_child}");
    }

    #[test]
    fn the_breakdown_shares_add_up_to_the_process_s_cpu_time() {
        let line = serde_json::json!({
            "seconds": 100.0, "forward_backward_seconds": 90.0, "optimizer_seconds": 10.0,
            "process_user_cpu_seconds": 150.0, "process_system_cpu_seconds": 50.0,
            "process_minor_faults": 1000, "collective_seconds": 12.0, "collective_wait_seconds": 2.0,
        });
        let run = OurRun { step_seconds: 100.0, peak_rss_bytes: 1 << 30, profile: vec![line.clone(), line] };
        let parts = ModelParts { head_and_loss: 20.0, attention: 30.0, mlp: 40.0, norms_and_rope: 5.0 };
        let figures = breakdown(&[run], &parts);
        let share = |name: &str| {
            figures
                .iter()
                .find(|(n, _)| n == &format!("qwen3_06b_fsdp_w4_step_cpu_share_{name}"))
                .map(|f| f.1)
        };
        assert_eq!(share("MLP"), Some(40.0 / 200.0));
        assert_eq!(share("allocation"), Some(50.0 / 200.0));
        assert_eq!(share("collectives"), Some(10.0 / 200.0));
        let total: f64 = figures.iter().map(|f| f.1).sum();
        assert!((total - 1.0).abs() < 1e-12, "{total}");
    }
}
