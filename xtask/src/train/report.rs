//! What a run reports: the metrics file and the terminal ([`MetricsSink`], the library loop's
//! [`TrainSink`]), the default run directory, and the comparison with a reference trajectory
//! (`--compare-to`).

use std::io::Write;
use std::path::{Path, PathBuf};
use std::sync::Mutex;

use anyhow::{Context, Result, bail};
use burn_fsdp::comm::local::CollectiveTime;
use qwen3_burn::Qwen3Config;
use qwen3_burn::trainer::{StepMetrics, StepTiming, TrainError, TrainSink};
use serde::Serialize;

use super::args::TrainArgs;

/// Where per-step metrics go: the metrics file and the terminal (a progress bar on a
/// terminal, one line per step otherwise). Shared by ranks.
pub struct MetricsSink {
    collectives: Mutex<Option<serde_json::Value>>,
    file: Mutex<Option<std::io::BufWriter<std::fs::File>>>,
    quiet: bool,
    bar: Option<indicatif::ProgressBar>,
    profile: Mutex<Option<Profile>>,
}

/// `profile.jsonl` of a run directory: per step, rank 0's time by phase
/// ([`StepTiming`]) and what the whole process spent since the previous step (CPU time in user
/// and kernel mode, minor page faults, time inside in-process collectives), for `bench
/// --qwen3-06b-pace`'s breakdown.
struct Profile {
    file: std::io::BufWriter<std::fs::File>,
    last: Resources,
}

/// What the process has spent so far.
#[derive(Debug, Clone, Copy)]
pub(crate) struct Resources {
    /// CPU seconds in user mode, all threads.
    pub(crate) user: f64,
    /// CPU seconds in the kernel, all threads.
    pub(crate) system: f64,
    minor_faults: i64,
    collectives: CollectiveTime,
}

impl Resources {
    /// The process's counters now.
    pub(crate) fn now() -> Self {
        // SAFETY: `getrusage` writes one `rusage` into the zeroed struct it is given and
        // reads nothing else; RUSAGE_SELF is always valid.
        let usage = unsafe {
            let mut u: libc::rusage = std::mem::zeroed();
            libc::getrusage(libc::RUSAGE_SELF, &mut u);
            u
        };
        let secs = |t: libc::timeval| t.tv_sec as f64 + t.tv_usec as f64 * 1e-6;
        Self {
            user: secs(usage.ru_utime),
            system: secs(usage.ru_stime),
            minor_faults: usage.ru_minflt,
            collectives: CollectiveTime::now(),
        }
    }
}

/// One line of `profile.jsonl`.
#[derive(Serialize)]
struct ProfileLine {
    #[serde(flatten)]
    timing: StepTiming,
    /// CPU seconds of the whole process (every rank and thread) in user mode since the
    /// previous line.
    process_user_cpu_seconds: f64,
    /// … in the kernel (mostly page faults: fresh memory mapped and zeroed).
    process_system_cpu_seconds: f64,
    /// Minor page faults of the process since the previous line.
    process_minor_faults: i64,
    /// Wall time inside in-process collectives, summed over the ranks (threads).
    collective_seconds: f64,
    /// The part of `collective_seconds` spent waiting for the last rank to arrive.
    collective_wait_seconds: f64,
}

impl MetricsSink {
    /// Opens the metrics file (creating its directory) unless `path` is `None`.
    pub fn new(path: Option<&std::path::Path>, quiet: bool) -> Result<Self> {
        let file = match path {
            Some(p) => {
                if let Some(dir) = p.parent().filter(|d| !d.as_os_str().is_empty()) {
                    std::fs::create_dir_all(dir).with_context(|| format!("creating {}", dir.display()))?;
                }
                let f = std::fs::File::create(p)
                    .with_context(|| format!("creating --metrics {}", p.display()))?;
                Some(std::io::BufWriter::new(f))
            }
            None => None,
        };
        Ok(Self {
            collectives: Mutex::new(None),
            file: Mutex::new(file),
            quiet,
            bar: None,
            profile: Mutex::new(None),
        })
    }

    /// Also writes `profile.jsonl` to `path` (see [`StepTiming`]); its first line counts from
    /// now.
    pub fn with_profile(self, path: &Path) -> Result<Self> {
        let file = std::fs::File::create(path).with_context(|| format!("creating {}", path.display()))?;
        let profile = Profile { file: std::io::BufWriter::new(file), last: Resources::now() };
        *self.profile.lock().unwrap_or_else(|p| p.into_inner()) = Some(profile);
        Ok(self)
    }

    /// Records the collectives of the latest step (per mesh dimension), for `summary.json`.
    pub fn set_collectives(&self, v: serde_json::Value) {
        *self.collectives.lock().unwrap_or_else(|p| p.into_inner()) = Some(v);
    }

    /// The collectives of the latest step, if recorded.
    pub fn collectives(&self) -> Option<serde_json::Value> {
        self.collectives.lock().unwrap_or_else(|p| p.into_inner()).clone()
    }

    /// Shows a progress bar of `steps` steps when stdout is a terminal (and not quiet).
    pub fn with_progress(mut self, steps: usize) -> Self {
        use std::io::IsTerminal;
        if !self.quiet && std::io::stdout().is_terminal() {
            let bar = indicatif::ProgressBar::new(steps as u64);
            let style = indicatif::ProgressStyle::with_template(
                "{bar:30.cyan/blue} step {pos}/{len}  {msg}  [{elapsed_precise} < {eta_precise}]",
            )
            .unwrap_or_else(|_| indicatif::ProgressStyle::default_bar());
            bar.set_style(style);
            self.bar = Some(bar);
        }
        self
    }

    /// Records one step.
    pub fn emit(&self, m: &StepMetrics) -> Result<()> {
        let mut file = self.file.lock().map_err(|_| anyhow::anyhow!("metrics file lock poisoned"))?;
        if let Some(w) = file.as_mut() {
            writeln!(w, "{}", serde_json::to_string(m)?)?;
            w.flush()?;
        }
        match (&self.bar, self.quiet) {
            (Some(bar), _) => {
                bar.set_message(format!(
                    "loss {:.4}  grad_norm {:.3}  {:.0} tok/s",
                    m.loss, m.grad_norm, m.tokens_per_sec
                ));
                bar.inc(1);
            }
            (None, false) => println!(
                "step {:>4}  loss {:.6}  grad_norm {:.6}  lr {:.3e}  {:.0} tok/s",
                m.step, m.loss, m.grad_norm, m.lr, m.tokens_per_sec
            ),
            (None, true) => {}
        }
        Ok(())
    }

    /// Closes the progress bar.
    pub fn finish(&self) {
        if let Some(bar) = &self.bar {
            bar.finish();
        }
    }
}

impl TrainSink for MetricsSink {
    fn step(&self, metrics: &StepMetrics) -> std::result::Result<(), TrainError> {
        self.emit(metrics).map_err(|e| TrainError::Sink(format!("{e:#}")))
    }

    fn collectives(&self, per_step: serde_json::Value) {
        self.set_collectives(per_step);
    }

    fn step_timing(&self, timing: &StepTiming) {
        let mut guard = self.profile.lock().unwrap_or_else(|p| p.into_inner());
        let Some(profile) = guard.as_mut() else { return };
        let now = Resources::now();
        let spent = now.collectives.since(&profile.last.collectives);
        let line = ProfileLine {
            timing: *timing,
            process_user_cpu_seconds: now.user - profile.last.user,
            process_system_cpu_seconds: now.system - profile.last.system,
            process_minor_faults: now.minor_faults - profile.last.minor_faults,
            collective_seconds: spent.total.iter().map(|d| d.as_secs_f64()).sum(),
            collective_wait_seconds: spent.waiting.iter().map(|d| d.as_secs_f64()).sum(),
        };
        profile.last = now;
        // A profile that cannot be written is not worth failing the run for: say so once
        // and stop writing it.
        let written = serde_json::to_string(&line)
            .map_err(std::io::Error::other)
            .and_then(|text| writeln!(profile.file, "{text}"))
            .and_then(|()| profile.file.flush());
        if let Err(e) = written {
            eprintln!("profile.jsonl: {e}; not written further");
            *guard = None;
        }
    }

    fn checkpoint_saved(&self, dir: &Path) {
        if !self.quiet {
            println!("saved sharded checkpoint {}", dir.display());
        }
    }

    fn exported(&self, dir: &Path) {
        if !self.quiet {
            println!("exported HF checkpoint {}", dir.display());
        }
    }
}

/// `runs/<UTC timestamp>`, the default --out-dir.
pub fn default_run_dir() -> PathBuf {
    let secs =
        std::time::SystemTime::now().duration_since(std::time::UNIX_EPOCH).map(|d| d.as_secs()).unwrap_or(0);
    let (days, rem) = (secs / 86_400, secs % 86_400);
    // Civil date from days since 1970-01-01 (Howard Hinnant's algorithm).
    let z = days as i64 + 719_468;
    let era = z.div_euclid(146_097);
    let doe = z - era * 146_097;
    let yoe = (doe - doe / 1460 + doe / 36_524 - doe / 146_096) / 365;
    let doy = doe - (365 * yoe + yoe / 4 - yoe / 100);
    let mp = (5 * doy + 2) / 153;
    let d = doy - (153 * mp + 2) / 5 + 1;
    let m = if mp < 10 { mp + 3 } else { mp - 9 };
    let y = yoe + era * 400 + i64::from(m <= 2);
    let name = format!("{y:04}{m:02}{d:02}-{:02}{:02}{:02}", rem / 3600, rem % 3600 / 60, rem % 60);
    let mut dir = PathBuf::from("runs").join(&name);
    let mut k = 1;
    while dir.exists() {
        dir = PathBuf::from("runs").join(format!("{name}-{k}"));
        k += 1;
    }
    dir
}

/// A reference trajectory for `--compare-to`.
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct Comparison {
    /// What was compared with.
    pub reference: String,
    /// Reference losses per step (aligned with ours).
    pub losses: Vec<f64>,
    /// Reference grad norms per step, when known.
    pub grad_norms: Vec<f64>,
    /// Reference mean tokens/s, when known.
    pub tokens_per_sec: Option<f64>,
    /// Largest |ours − ref| / |ref| over the losses.
    pub worst_loss_rel_diff: f64,
    /// Largest relative difference of the grad norms (NaN when the reference has none).
    pub worst_grad_norm_rel_diff: f64,
    /// Our mean tokens/s over the reference's.
    pub throughput_ratio: Option<f64>,
}

pub(super) fn mean_tps(m: &[StepMetrics]) -> f64 {
    m.iter().map(|m| m.tokens_per_sec).sum::<f64>() / m.len().max(1) as f64
}

fn worst_rel(a: &[f64], b: &[f64]) -> f64 {
    if b.is_empty() {
        return f64::NAN;
    }
    a.iter().zip(b).map(|(x, y)| (x - y).abs() / y.abs().max(f64::MIN_POSITIVE)).fold(0.0, f64::max)
}

/// Reads a reference trajectory file: PyTorch-fixture JSON (`losses`, `grad_norms`) or a
/// metrics JSONL written by this command.
pub fn read_reference(path: &std::path::Path) -> Result<(Vec<f64>, Vec<f64>, Option<f64>)> {
    let text = std::fs::read_to_string(path).with_context(|| format!("--compare-to {}", path.display()))?;
    if let Ok(v) = serde_json::from_str::<serde_json::Value>(&text)
        && let Some(l) = v.get("losses").and_then(|l| l.as_array())
    {
        let nums = |a: Option<&Vec<serde_json::Value>>| {
            a.map(|a| a.iter().filter_map(|x| x.as_f64()).collect()).unwrap_or_default()
        };
        return Ok((nums(Some(l)), nums(v.get("grad_norms").and_then(|g| g.as_array())), None));
    }
    let mut losses = Vec::new();
    let mut norms = Vec::new();
    let mut tps = Vec::new();
    for (i, line) in text.lines().enumerate().filter(|(_, l)| !l.trim().is_empty()) {
        let v: serde_json::Value = serde_json::from_str(line).with_context(|| {
            format!(
                "--compare-to {}: line {} is neither JSON with \"losses\" nor a metrics line",
                path.display(),
                i + 1
            )
        })?;
        let get = |k: &str| v.get(k).and_then(|x| x.as_f64());
        let Some(l) = get("loss") else {
            bail!("--compare-to {}: line {} has no \"loss\"", path.display(), i + 1);
        };
        losses.push(l);
        norms.extend(get("grad_norm"));
        tps.extend(get("tokens_per_sec"));
    }
    let tps = (!tps.is_empty()).then(|| tps.iter().sum::<f64>() / tps.len() as f64);
    Ok((losses, norms, tps))
}

/// Builds the comparison of `ours` with a reference trajectory.
pub fn compare(
    reference: String,
    ours: &[StepMetrics],
    losses: Vec<f64>,
    norms: Vec<f64>,
    tps: Option<f64>,
) -> Comparison {
    let first = ours.first().map_or(0, |m| m.step);
    let pick = |v: &[f64]| v.iter().skip(first).take(ours.len()).copied().collect::<Vec<f64>>();
    let (losses, grad_norms) = (pick(&losses), pick(&norms));
    let our_losses: Vec<f64> = ours.iter().map(|m| m.loss).collect();
    let our_norms: Vec<f64> = ours.iter().map(|m| m.grad_norm).collect();
    Comparison {
        reference,
        worst_loss_rel_diff: worst_rel(&our_losses[..losses.len().min(our_losses.len())], &losses),
        worst_grad_norm_rel_diff: worst_rel(&our_norms[..grad_norms.len().min(our_norms.len())], &grad_norms),
        throughput_ratio: tps.map(|t| mean_tps(ours) / t),
        tokens_per_sec: tps,
        losses,
        grad_norms,
    }
}

pub(super) fn print_comparison(first: &StepMetrics, last: &StepMetrics, c: &Comparison) {
    println!("compared with {}:", c.reference);
    println!("  {:<12} {:>12} {:>12}", "", "this run", "reference");
    let (rf, rl) =
        (c.losses.first().copied().unwrap_or(f64::NAN), c.losses.last().copied().unwrap_or(f64::NAN));
    println!("  {:<12} {:>12.6} {:>12.6}", "first loss", first.loss, rf);
    println!("  {:<12} {:>12.6} {:>12.6}", "last loss", last.loss, rl);
    println!("  worst relative loss difference: {:.3e}", c.worst_loss_rel_diff);
    if !c.worst_grad_norm_rel_diff.is_nan() {
        println!("  worst relative grad-norm difference: {:.3e}", c.worst_grad_norm_rel_diff);
    }
    match c.throughput_ratio {
        Some(r) => println!("  throughput ratio (this run / reference): {r:.3}"),
        None => println!("  throughput ratio: n/a (the reference has no tokens/s)"),
    }
}

/// What a finished run is, for its summary.
pub(super) struct Finished<'a> {
    pub args: &'a TrainArgs,
    pub out_dir: &'a Path,
    pub metrics_path: &'a Path,
    /// How it ran (single device, FSDP over N ranks, …, with its policies).
    pub mode: &'a str,
    pub params: usize,
    pub world: usize,
    pub config: &'a Qwen3Config,
    pub sink: &'a MetricsSink,
}

/// Rank 0's end of a run: the loss plot (with the reference's), `summary.json` and the closing
/// lines; the error of a run `stopped` at a non-finite step, once those are written.
pub(super) fn write_summary(
    run: &Finished<'_>,
    metrics: &[StepMetrics],
    stopped: Option<String>,
    comparison: Option<&Comparison>,
) -> Result<()> {
    let Finished { args, out_dir, metrics_path, mode, params, world, config, sink } = *run;
    let png = out_dir.join("loss.png");
    let finite: Vec<(f64, f64)> =
        metrics.iter().filter(|m| m.loss.is_finite()).map(|m| (m.step as f64, m.loss)).collect();
    let has_plot = !finite.is_empty();
    let mut series = vec![("this run".to_owned(), finite)];
    if let Some(c) = comparison {
        let first = metrics.first().map_or(0, |m| m.step);
        series.push((
            format!(
                "reference: {}",
                Path::new(&c.reference)
                    .file_name()
                    .map_or(c.reference.clone(), |n| n.to_string_lossy().into_owned())
            ),
            c.losses.iter().enumerate().map(|(i, l)| ((first + i) as f64, *l)).collect(),
        ));
    }
    if has_plot {
        crate::plot::loss_png(&png, &format!("train-qwen3: {mode}"), &series)?;
    }
    let summary = serde_json::json!({
        "mode": mode,
        "world_size": world,
        "params": params,
        "steps": metrics.len(),
        "first_step": metrics.first().map(|m| m.step),
        "first_loss": metrics.first().map(|m| m.loss),
        "last_loss": metrics.last().map(|m| m.loss),
        "mean_tokens_per_sec": mean_tps(metrics),
        "model_config": config,
        "metrics": metrics_path,
        "loss_plot": has_plot.then_some(&png),
        "stopped": stopped,
        "comparison": comparison,
        "collectives_per_step": sink.collectives(),
    });
    let summary_path = out_dir.join("summary.json");
    std::fs::write(&summary_path, serde_json::to_string_pretty(&summary)?)
        .with_context(|| format!("writing {}", summary_path.display()))?;
    if let Some(why) = stopped {
        bail!("{why}; what ran is in {} and {}", metrics_path.display(), summary_path.display());
    }
    if !args.quiet
        && let (Some(first), Some(last)) = (metrics.first(), metrics.last())
    {
        println!(
            "done: {} steps, loss {:.4} → {:.4}, mean {:.0} tokens/s; {}, {} and {}",
            metrics.len(),
            first.loss,
            last.loss,
            mean_tps(metrics),
            metrics_path.display(),
            png.display(),
            summary_path.display()
        );
        let best = metrics.iter().map(|m| m.loss).fold(f64::INFINITY, f64::min);
        println!("  {:<22} {}", "mode", mode);
        println!("  {:<22} {}", "parameters", params);
        println!("  {:<22} {} → {}", "steps", first.step, last.step);
        println!("  {:<22} {:.6} → {:.6} (best {best:.6})", "loss", first.loss, last.loss);
        println!("  {:<22} {:.6} → {:.6}", "grad norm", first.grad_norm, last.grad_norm);
        println!("  {:<22} {:.0}", "mean tokens/s", mean_tps(metrics));
        if let Some(c) = comparison {
            print_comparison(first, last, c);
        }
    }
    Ok(())
}
