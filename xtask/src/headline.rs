//! `cargo xtask headline`: the seed's reference run at real size, repeatable by anyone.
//!
//! Qwen3-0.6B (random, reproducible), W = 4, batch 2 per rank, seq 128, 20 AdamW steps:
//! PyTorch FSDP2 (gloo, 4 processes, `scripts/headline.py`) against this project's FSDP at
//! W = 4 in-process ranks and its single-device run (`--no-fsdp`), on the same checkpoint and
//! batches, then the per-step comparison. Each stage's output is kept in `--dir`, and a
//! stage whose output exists is not run again (delete the file to redo it).

use std::path::{Path, PathBuf};
use std::process::Command;
use std::time::Instant;

use anyhow::{Context, Result, bail};
use clap::Args;
use qwen3_burn::Qwen3Config;

use crate::train::{StepMetrics, TrainArgs, read_reference};

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
}

/// Runs the stages that have not run yet and prints the comparison. Returns the worst relative
/// loss differences (against PyTorch FSDP2 when it ran, and against our single device).
pub fn run(args: &HeadlineArgs) -> Result<Report> {
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
    let torch_json = dir.join("torch_fsdp4.json");
    let mut torch_secs = None;
    if !args.skip_torch && !torch_json.is_file() {
        println!("headline: PyTorch FSDP2, {} processes (gloo)…", args.world_size);
        let start = Instant::now();
        let launcher = ["-m", "torch.distributed.run", "--nproc-per-node", &args.world_size.to_string()];
        python(args, &script, &launcher, dir, &["fsdp", "--out", "torch_fsdp4"])?;
        torch_secs = Some(start.elapsed().as_secs_f64());
    }
    let ours = |name: &str, mode: &[&str]| -> Result<(Vec<StepMetrics>, f64)> {
        let out = dir.join(name);
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
        Ok((metrics, start.elapsed().as_secs_f64()))
    };
    println!("headline: this project, FSDP over {} in-process ranks…", args.world_size);
    let (fsdp, fsdp_secs) = ours("burn_fsdp", &["--world-size", &args.world_size.to_string()])?;
    println!("headline: this project, one device (--no-fsdp)…");
    let (single, single_secs) = ours("burn_single", &["--no-fsdp"])?;
    let torch = if torch_json.is_file() { Some(read_reference(&torch_json)?) } else { None };
    let report = Report::new(&fsdp, &single, torch.as_ref().map(|(l, n, _)| (l.as_slice(), n.as_slice())));
    let trained = Qwen3Config::from_file(dir.join("config.json"))?;
    let text = report.render(args, &trained, [torch_secs, Some(fsdp_secs), Some(single_secs)]);
    println!("{text}");
    std::fs::write(dir.join("report.txt"), &text)
        .with_context(|| format!("{}", dir.join("report.txt").display()))?;
    Ok(report)
}

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
    fn new(fsdp: &[StepMetrics], single: &[StepMetrics], torch: Option<(&[f64], &[f64])>) -> Self {
        let rows: Vec<([f64; 3], [f64; 3])> = fsdp
            .iter()
            .zip(single)
            .enumerate()
            .map(|(i, (f, s))| {
                let (tl, tn) = torch.map_or((f64::NAN, f64::NAN), |(l, n)| {
                    (l.get(i).copied().unwrap_or(f64::NAN), n.get(i).copied().unwrap_or(f64::NAN))
                });
                ([f.loss, s.loss, tl], [f.grad_norm, s.grad_norm, tn])
            })
            .collect();
        let worst = |k: usize| rows.iter().map(|(l, _)| rel(l[0], l[k])).fold(0.0, f64::max);
        let vs_torch = torch.map(|(l, _)| if l.len() < rows.len() { f64::INFINITY } else { worst(2) });
        Self { vs_single: worst(1), vs_torch, rows }
    }

    fn render(&self, args: &HeadlineArgs, config: &Qwen3Config, secs: [Option<f64>; 3]) -> String {
        let mut s = format!(
            "Qwen3 of {} parameters ({} layers, hidden {}, vocab {}), {} in {}, W = {}, {} steps, AdamW lr {}\n\
             step   burn FSDP loss   burn single loss   torch FSDP2 loss   | burn FSDP grad norm   torch grad norm\n",
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
        let t = |x: Option<f64>| x.map_or("-".to_owned(), |x| format!("{x:.0} s"));
        s += &format!(
            "wall time: PyTorch FSDP2 {} (this invocation), burn FSDP {}, burn single {}\n",
            t(secs[0]),
            t(secs[1]),
            t(secs[2])
        );
        s
    }
}

fn python(args: &HeadlineArgs, script: &Path, launcher: &[&str], dir: &Path, rest: &[&str]) -> Result<()> {
    let mut cmd = Command::new(&args.python);
    cmd.args(launcher).arg(script).arg(rest[0]).arg(dir).args(&rest[1..]);
    // Four PyTorch processes of Qwen3-0.6B need ~20 GB; glibc's per-thread arenas (gloo's
    // threads) fragment that into more than a 24 GB machine has. Two arenas and trimming keep
    // the peak at ~19 GB (measured).
    cmd.env("MALLOC_ARENA_MAX", "2").env("MALLOC_TRIM_THRESHOLD_", "0");
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
fn find_script() -> Result<PathBuf> {
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
