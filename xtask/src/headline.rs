//! `cargo xtask headline`: the seed's reference run at real size, repeatable by anyone.
//!
//! Qwen3-0.6B (random, reproducible), W = 4, batch 2 per rank, seq 128, 20 AdamW steps:
//! PyTorch FSDP2 (gloo, 4 processes, `scripts/headline.py`) against this project's FSDP at
//! W = 4 in-process ranks and its single-device run (`--no-fsdp`), on the same checkpoint and
//! batches, then the per-step comparison. Each stage's output is kept in `--dir`
//! (`torch_fsdp4.json`, `burn_fsdp.json`, `burn_single.json`, their wall times in
//! `timings.json`), and a stage whose output exists is not run again (delete the file to redo
//! it). `--only STAGE` runs one stage and stops, so the three (~40, ~70 and ~50 minutes on a
//! 2-core machine) can run in separate sittings; the report is printed once all three exist.

use std::path::{Path, PathBuf};
use std::process::Command;
use std::time::Instant;

use anyhow::{Context, Result, bail};
use clap::Args;
use qwen3_burn::Qwen3Config;

use crate::train::{TrainArgs, read_reference};

/// Flags of `cargo xtask headline`.
#[derive(Args, Debug, Clone)]
pub struct HeadlineArgs {
    /// Working directory: checkpoint, batches, every run's metrics and the report.
    #[arg(long, default_value = "runs/headline")]
    pub dir: PathBuf,
    /// Model preset (`0.6b` is the headline; `tiny` checks the pipeline in seconds).
    #[arg(long, default_value = "0.6b")]
    pub preset: String,
    /// Ranks of both FSDP runs.
    #[arg(long, default_value_t = 4)]
    pub world_size: usize,
    /// Rows per rank per step.
    #[arg(long, default_value_t = 2)]
    pub batch: usize,
    /// Tokens per row.
    #[arg(long, default_value_t = 128)]
    pub seq: usize,
    /// Training steps.
    #[arg(long, default_value_t = 20)]
    pub steps: usize,
    /// AdamW learning rate (betas 0.9/0.95, eps 1e-8, weight decay 0.1 on both sides).
    #[arg(long, default_value_t = 3e-4)]
    pub lr: f64,
    /// Seed of the PyTorch initialisation and the batches.
    #[arg(long, default_value_t = 0)]
    pub seed: u64,
    /// Python with torch, transformers and safetensors (for the checkpoint and FSDP2).
    #[arg(long, default_value = "python3")]
    pub python: String,
    /// Do not run PyTorch: use `--dir`'s checkpoint and batches as they are and compare with
    /// `torch_fsdp4.json` only if it is there.
    #[arg(long)]
    pub skip_torch: bool,
    /// Run only this stage (and the checkpoint, if it is missing), then print the report if
    /// every stage's output is there.
    #[arg(long, value_enum)]
    pub only: Option<Stage>,
}

/// A stage of the headline run, named by the file it writes in `--dir`.
#[derive(Debug, Clone, Copy, PartialEq, Eq, clap::ValueEnum)]
pub enum Stage {
    /// PyTorch FSDP2, `torch_fsdp4.json`.
    Torch,
    /// This project's FSDP at `--world-size` in-process ranks, `burn_fsdp.json`.
    Fsdp,
    /// This project's single device (`--no-fsdp`), `burn_single.json`.
    Single,
}

impl Stage {
    fn file(self) -> &'static str {
        match self {
            Stage::Torch => "torch_fsdp4.json",
            Stage::Fsdp => "burn_fsdp.json",
            Stage::Single => "burn_single.json",
        }
    }

    fn runs(self, only: Option<Stage>) -> bool {
        only.is_none_or(|o| o == self)
    }
}

/// Runs the stages that have not run yet (only `--only`'s, when given) and prints the
/// comparison. Returns it — the worst relative loss differences against PyTorch FSDP2 (when its
/// output is there) and against our single device — or `None` when `--only` left a stage of
/// ours unrun.
pub fn run(args: &HeadlineArgs) -> Result<Option<Report>> {
    let dir = &args.dir;
    std::fs::create_dir_all(dir).with_context(|| format!("--dir {}", dir.display()))?;
    let config = Qwen3Config::preset(&args.preset).with_context(|| {
        format!("--preset {}: not a Qwen3 preset (tiny, 0.6b, 1.7b, 4b, 8b)", args.preset)
    })?;
    let script = find_script()?;
    let has = |name: &str| dir.join(name).is_file();
    if !(has("model.safetensors") && has("batches.safetensors")) {
        if args.skip_torch {
            bail!("--skip-torch: {} has no model.safetensors and batches.safetensors", dir.display());
        }
        config.save(dir)?;
        let world = args.world_size.to_string();
        let (batch, seq, steps) = (args.batch.to_string(), args.seq.to_string(), args.steps.to_string());
        let (lr, seed) = (args.lr.to_string(), args.seed.to_string());
        println!("headline: making the random {} checkpoint and batches with PyTorch…", args.preset);
        let a = [
            "init", "--world", &world, "--batch", &batch, "--seq", &seq, "--steps", &steps, "--lr", &lr,
            "--seed", &seed,
        ];
        python(args, &script, &[], dir, &a)?;
    }
    let mut timings = Timings::read(dir)?;
    if !args.skip_torch && Stage::Torch.runs(args.only) && !has(Stage::Torch.file()) {
        println!("headline: PyTorch FSDP2, {} processes (gloo)…", args.world_size);
        let start = Instant::now();
        let launcher = ["-m", "torch.distributed.run", "--nproc-per-node", &args.world_size.to_string()];
        python(args, &script, &launcher, dir, &["fsdp", "--out", "torch_fsdp4"])?;
        timings.record(dir, Stage::Torch, start.elapsed().as_secs_f64())?;
    }
    let ours = |stage: Stage, mode: &[&str], timings: &mut Timings| -> Result<()> {
        let out = dir.join(stage.file().trim_end_matches(".json"));
        let checkpoint = dir.display().to_string();
        let batches = dir.join("batches.safetensors").display().to_string();
        let (lr, out_dir) = (args.lr.to_string(), out.display().to_string());
        let mut argv = vec![
            "train-qwen3",
            "--checkpoint",
            &checkpoint,
            "--batches",
            &batches,
            "--lr",
            &lr,
            "--betas",
            "0.9,0.95",
            "--eps",
            "1e-8",
            "--weight-decay",
            "0.1",
            "--out-dir",
            &out_dir,
            "--quiet",
        ];
        argv.extend(mode);
        let start = Instant::now();
        let metrics = crate::train::run(&TrainArgs::parse_from_args(&argv)?)?;
        let secs = start.elapsed().as_secs_f64();
        let json = serde_json::json!({
            "losses": metrics.iter().map(|m| m.loss).collect::<Vec<_>>(),
            "grad_norms": metrics.iter().map(|m| m.grad_norm).collect::<Vec<_>>(),
        });
        write_atomically(&dir.join(stage.file()), &serde_json::to_string_pretty(&json)?)?;
        timings.record(dir, stage, secs)
    };
    if Stage::Fsdp.runs(args.only) && !has(Stage::Fsdp.file()) {
        println!("headline: this project, FSDP over {} in-process ranks…", args.world_size);
        ours(Stage::Fsdp, &["--world-size", &args.world_size.to_string()], &mut timings)?;
    }
    if Stage::Single.runs(args.only) && !has(Stage::Single.file()) {
        println!("headline: this project, one device (--no-fsdp)…");
        ours(Stage::Single, &["--no-fsdp"], &mut timings)?;
    }
    let missing: Vec<&str> =
        [Stage::Fsdp, Stage::Single].iter().map(|s| s.file()).filter(|f| !has(f)).collect();
    if !missing.is_empty() {
        println!("headline: {} not there yet; run the other stages to get the report", missing.join(", "));
        return Ok(None);
    }
    let read = |stage: Stage| read_reference(&dir.join(stage.file())).map(|(l, n, _)| (l, n));
    let (fsdp, single) = (read(Stage::Fsdp)?, read(Stage::Single)?);
    let torch = if has(Stage::Torch.file()) { Some(read(Stage::Torch)?) } else { None };
    let report = Report::new(&fsdp, &single, torch.as_ref());
    let trained = Qwen3Config::from_file(dir.join("config.json"))?;
    let text = report.render(args, &trained, &timings);
    println!("{text}");
    write_atomically(&dir.join("report.txt"), &text)?;
    Ok(Some(report))
}

/// Seconds each stage took when it ran (`timings.json` in `--dir`).
#[derive(Debug, Default)]
struct Timings(serde_json::Map<String, serde_json::Value>);

impl Timings {
    fn read(dir: &Path) -> Result<Self> {
        let path = dir.join("timings.json");
        if !path.is_file() {
            return Ok(Self::default());
        }
        let text = std::fs::read_to_string(&path).with_context(|| format!("{}", path.display()))?;
        let map = serde_json::from_str(&text)
            .with_context(|| format!("{}: not a JSON object of seconds per stage", path.display()))?;
        Ok(Self(map))
    }

    fn record(&mut self, dir: &Path, stage: Stage, secs: f64) -> Result<()> {
        self.0.insert(stage.file().to_owned(), serde_json::json!(secs));
        write_atomically(&dir.join("timings.json"), &serde_json::to_string_pretty(&self.0)?)
    }

    fn get(&self, stage: Stage) -> Option<f64> {
        self.0.get(stage.file()).and_then(|v| v.as_f64())
    }
}

/// Writes `path` through a temporary file and a rename, so a killed run never leaves a stage's
/// output half-written (a stage whose file exists is not run again).
fn write_atomically(path: &Path, text: &str) -> Result<()> {
    let tmp = path.with_extension("tmp");
    std::fs::write(&tmp, text).with_context(|| format!("writing {}", tmp.display()))?;
    std::fs::rename(&tmp, path).with_context(|| format!("renaming {} to {}", tmp.display(), path.display()))
}

/// Per step losses and grad norms of one run.
type Trajectory = (Vec<f64>, Vec<f64>);

/// The per-step comparison.
#[derive(Debug, Clone)]
pub struct Report {
    /// Per step: (ours FSDP loss, ours single loss, PyTorch FSDP2 loss) and the grad norms.
    pub rows: Vec<([f64; 3], [f64; 3])>,
    /// Worst relative loss difference of our FSDP run against PyTorch FSDP2 (when it ran).
    pub vs_torch: Option<f64>,
    /// Worst relative loss difference of our FSDP run against our single device.
    pub vs_single: f64,
}

fn rel(a: f64, b: f64) -> f64 {
    (a - b).abs() / b.abs().max(1e-12)
}

impl Report {
    /// Rows of (losses, grad norms) per run: ours FSDP, ours single device, PyTorch FSDP2.
    fn new(fsdp: &Trajectory, single: &Trajectory, torch: Option<&Trajectory>) -> Self {
        let at = |v: &[f64], i: usize| v.get(i).copied().unwrap_or(f64::NAN);
        let rows: Vec<([f64; 3], [f64; 3])> = (0..fsdp.0.len())
            .map(|i| {
                let (tl, tn) = torch.map_or((f64::NAN, f64::NAN), |(l, n)| (at(l, i), at(n, i)));
                ([fsdp.0[i], at(&single.0, i), tl], [at(&fsdp.1, i), at(&single.1, i), tn])
            })
            .collect();
        // A missing or non-finite value is the worst difference there is (NaN would be skipped
        // by max).
        let worst = |k: usize| {
            rows.iter()
                .map(|(l, _)| rel(l[0], l[k]))
                .fold(0.0, |w, d| if d.is_nan() { f64::INFINITY } else { w.max(d) })
        };
        let vs_torch = torch.map(|_| worst(2));
        Self { vs_single: worst(1), vs_torch, rows }
    }

    fn render(&self, args: &HeadlineArgs, config: &Qwen3Config, timings: &Timings) -> String {
        let mut s = format!(
            "Qwen3 of {} parameters ({} layers, hidden {}, vocab {}), {} in {}, W = {}, {} steps, AdamW lr {}\n",
            config.num_params(),
            config.num_hidden_layers,
            config.hidden_size,
            config.vocab_size,
            args.dir.join("batches.safetensors").display(),
            args.dir.display(),
            args.world_size,
            self.rows.len(),
            args.lr
        );
        // The checkpoint and batches compared (written by `scripts/headline.py init`).
        if let Ok(text) = std::fs::read_to_string(args.dir.join("sha256.json"))
            && let Ok(map) = serde_json::from_str::<serde_json::Map<String, serde_json::Value>>(&text)
        {
            for (file, sha) in &map {
                s += &format!("SHA-256 {file}: {}\n", sha.as_str().unwrap_or("?"));
            }
        }
        s += "step   burn FSDP loss   burn single loss   torch FSDP2 loss   | burn FSDP grad norm   torch grad norm\n";
        for (i, (l, n)) in self.rows.iter().enumerate() {
            s += &format!(
                "{i:4}   {:14.8}   {:16.8}   {:16.8}   | {:19.6}   {:15.6}\n",
                l[0], l[1], l[2], n[0], n[2]
            );
        }
        s += &format!(
            "worst relative loss difference, burn FSDP vs burn single device: {:.3e}\n",
            self.vs_single
        );
        match self.vs_torch {
            Some(v) => s += &format!("worst relative loss difference, burn FSDP vs PyTorch FSDP2: {v:.3e}\n"),
            None => s += "PyTorch FSDP2: not run (--skip-torch and no torch_fsdp4.json)\n",
        }
        let t = |stage: Stage| timings.get(stage).map_or("-".to_owned(), |x| format!("{x:.0} s"));
        s += &format!(
            "wall time: PyTorch FSDP2 {}, burn FSDP {}, burn single {} (each when its stage ran)\n",
            t(Stage::Torch),
            t(Stage::Fsdp),
            t(Stage::Single)
        );
        s
    }
}

/// glibc settings for the PyTorch processes (headline and `bench --qwen3-06b-pace`): four
/// PyTorch processes of Qwen3-0.6B need ~20 GB; glibc's per-thread arenas (gloo's threads)
/// fragment that into more than a 24 GB machine has. Two arenas and trimming keep the peak at
/// ~19 GB (measured).
pub(crate) const TORCH_MALLOC_ENV: [(&str, &str); 2] =
    [("MALLOC_ARENA_MAX", "2"), ("MALLOC_TRIM_THRESHOLD_", "0")];

fn python(args: &HeadlineArgs, script: &Path, launcher: &[&str], dir: &Path, rest: &[&str]) -> Result<()> {
    let mut cmd = Command::new(&args.python);
    cmd.args(launcher).arg(script).arg(rest[0]).arg(dir).args(&rest[1..]);
    cmd.envs(TORCH_MALLOC_ENV);
    let status = cmd.status().with_context(|| {
        format!(
            "--python {}: cannot run it (install Python 3 with torch, transformers and safetensors)",
            args.python
        )
    })?;
    if !status.success() {
        bail!("{} failed ({status}); its output is above", script.display());
    }
    Ok(())
}

/// `scripts/headline.py` of this repository, found from the current directory or the binary
/// upwards.
pub(crate) fn find_script() -> Result<PathBuf> {
    let rel = Path::new("scripts").join("headline.py");
    let starts = [std::env::current_dir().ok(), std::env::current_exe().ok()];
    for start in starts.iter().flatten() {
        for dir in start.ancestors() {
            if dir.join(&rel).is_file() {
                return Ok(dir.join(&rel));
            }
        }
    }
    bail!(
        "scripts/headline.py not found above the current directory or the xtask binary: run from the repository"
    )
}
