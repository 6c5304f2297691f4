//! `cargo xtask train-qwen3`: single-device (`--no-fsdp`) or FSDP training of Qwen3.

use std::io::Write;
use std::path::PathBuf;
use std::time::Instant;

use anyhow::{Context, Result, bail};
use burn::module::AutodiffModule;
use burn::optim::{GradientsAccumulator, GradientsParams};
use burn::tensor::backend::Backend as _;
use burn_fsdp::{AdamWConfig, clip_grad_norm};
use qwen3_burn::train::{Batches, cross_entropy, inputs_and_labels};
use qwen3_burn::{Qwen3, Qwen3Config};
use serde::Serialize;

use crate::data::synthetic_batches;
use crate::{TrainBackend, device};

/// Arguments of `train-qwen3`.
#[derive(Debug, Clone, clap::Args)]
pub struct TrainArgs {
    /// HF checkpoint directory to start from; without it a small built-in Qwen3 is used.
    #[arg(long)]
    pub checkpoint: Option<PathBuf>,
    /// Built-in model when no --checkpoint is given: tiny, 0.6b, 1.7b, 4b, 8b.
    #[arg(long, default_value = "tiny")]
    pub preset: String,
    /// Safetensors file with `tokens` [steps, rows, seq+1]; step s trains on tokens[s].
    /// Without it, synthetic data is generated.
    #[arg(long)]
    pub batches: Option<PathBuf>,
    /// Train on one device, without FSDP.
    #[arg(long, conflicts_with = "world_size")]
    pub no_fsdp: bool,
    /// Number of in-process FSDP ranks.
    #[arg(long)]
    pub world_size: Option<usize>,
    /// Free gathered parameters after each unit's forward and re-gather them in backward.
    #[arg(long, default_value_t = true, action = clap::ArgAction::Set)]
    pub reshard_after_forward: bool,
    /// Number of optimizer steps (default: all steps of --batches, or 20).
    #[arg(long)]
    pub steps: Option<usize>,
    /// Rows per rank per step, for synthetic data.
    #[arg(long, default_value_t = 2)]
    pub batch: usize,
    /// Tokens per row, for synthetic data.
    #[arg(long, default_value_t = 64)]
    pub seq: usize,
    /// Seed of the model initialisation and synthetic data.
    #[arg(long, default_value_t = 0)]
    pub seed: u64,
    /// AdamW learning rate.
    #[arg(long, default_value_t = 3e-3)]
    pub lr: f64,
    /// AdamW betas, as `B1,B2`.
    #[arg(long, default_value = "0.9,0.95", value_parser = parse_betas)]
    pub betas: (f64, f64),
    /// AdamW epsilon (added outside the square root).
    #[arg(long, default_value_t = 1e-8)]
    pub eps: f64,
    /// AdamW decoupled weight decay.
    #[arg(long, default_value_t = 0.1)]
    pub weight_decay: f64,
    /// Clip gradients to this global L2 norm (off when absent or 0).
    #[arg(long)]
    pub clip: Option<f64>,
    /// Split each step's rows into this many micro-batches and accumulate.
    #[arg(long, default_value_t = 1)]
    pub grad_accum: usize,
    /// Write one JSON object per step to this file.
    #[arg(long)]
    pub metrics: Option<PathBuf>,
    /// Print nothing but errors.
    #[arg(long)]
    pub quiet: bool,
}

fn parse_betas(s: &str) -> std::result::Result<(f64, f64), String> {
    let parts: Vec<&str> = s.split(',').map(str::trim).collect();
    let [a, b] = parts[..] else {
        return Err(format!("--betas expects two numbers `B1,B2`, got `{s}`"));
    };
    let parse = |x: &str| x.parse::<f64>().map_err(|_| format!("--betas: `{x}` is not a number"));
    let (b1, b2) = (parse(a)?, parse(b)?);
    if !(0.0..1.0).contains(&b1) || !(0.0..1.0).contains(&b2) {
        return Err(format!("--betas must lie in [0, 1), got `{s}`"));
    }
    Ok((b1, b2))
}

impl TrainArgs {
    /// Default arguments (the README's main job), as `clap` would parse an empty command line.
    pub fn defaults() -> Self {
        match Self::parse_from_args(&["train-qwen3"]) {
            Ok(args) => args,
            Err(e) => unreachable!("the defaults parse: {e}"),
        }
    }

    /// The AdamW hyper-parameters.
    pub fn adamw(&self) -> AdamWConfig {
        AdamWConfig { lr: self.lr, betas: self.betas, eps: self.eps, weight_decay: self.weight_decay }
    }

    /// World size: 1 for `--no-fsdp`, else `--world-size` (default 4).
    pub fn world(&self) -> usize {
        if self.no_fsdp { 1 } else { self.world_size.unwrap_or(4) }
    }
}

/// One line of the metrics file.
#[derive(Debug, Clone, Copy, PartialEq, Serialize)]
pub struct StepMetrics {
    /// Step index (into `--batches`).
    pub step: usize,
    /// Mean token cross-entropy over the global batch, before the update.
    pub loss: f64,
    /// Global gradient L2 norm before clipping.
    pub grad_norm: f64,
    /// Tokens of the global batch divided by the step's wall time.
    pub tokens_per_sec: f64,
}

/// The model and data a run starts from.
pub struct Setup {
    /// Model config.
    pub config: Qwen3Config,
    /// Initial model.
    pub model: Qwen3<TrainBackend>,
    /// Token batches.
    pub batches: Batches,
    /// Number of steps to run.
    pub steps: usize,
}

/// Loads (or builds) the model and data, validating every flag against them.
pub fn setup(args: &TrainArgs) -> Result<Setup> {
    let device = device();
    let world = args.world();
    if world == 0 {
        bail!("--world-size must be at least 1");
    }
    if args.grad_accum == 0 {
        bail!("--grad-accum must be at least 1");
    }
    if !(args.lr.is_finite() && args.lr >= 0.0) {
        bail!("--lr must be a non-negative number, got {}", args.lr);
    }
    if !(args.eps.is_finite() && args.eps > 0.0) {
        bail!("--eps must be positive, got {}", args.eps);
    }
    if let Some(c) = args.clip
        && (c.is_nan() || c < 0.0)
    {
        bail!("--clip must be non-negative, got {c}");
    }
    let (model, config) = match &args.checkpoint {
        Some(dir) => Qwen3::<TrainBackend>::load(dir, &device)?,
        None => {
            let config = Qwen3Config::preset(&args.preset).with_context(|| {
                format!("--preset `{}` is unknown (tiny, 0.6b, 1.7b, 4b, 8b)", args.preset)
            })?;
            TrainBackend::seed(&device, args.seed);
            (config.init::<TrainBackend>(&device), config)
        }
    };
    let batches = match &args.batches {
        Some(path) => {
            let b = Batches::load(path)?;
            if b.min_token() < 0 || b.max_token() as usize >= config.vocab_size {
                bail!(
                    "{}: `tokens` holds ids {}..={}, outside the model's vocabulary 0..{}",
                    path.display(),
                    b.min_token(),
                    b.max_token(),
                    config.vocab_size
                );
            }
            b
        }
        None => {
            if args.batch == 0 || args.seq == 0 {
                bail!("--batch and --seq must be at least 1");
            }
            synthetic_batches(
                args.steps.unwrap_or(20),
                world * args.batch,
                args.seq,
                config.vocab_size,
                args.seed,
            )
        }
    };
    let steps = args.steps.unwrap_or(batches.steps);
    if steps > batches.steps {
        bail!("--steps {steps} exceeds the {} steps of the batches file", batches.steps);
    }
    if !batches.rows.is_multiple_of(world) {
        bail!("the global batch has {} rows, which --world-size {world} does not divide", batches.rows);
    }
    if !(batches.rows / world).is_multiple_of(args.grad_accum) {
        bail!(
            "each rank has {} rows per step, which --grad-accum {} does not divide",
            batches.rows / world,
            args.grad_accum
        );
    }
    Ok(Setup { config, model, batches, steps })
}

/// Runs training as the flags say and returns the per-step metrics (also written to
/// `--metrics`).
pub fn run(args: &TrainArgs) -> Result<Vec<StepMetrics>> {
    let setup = setup(args)?;
    let mut sink = match &args.metrics {
        Some(p) => {
            if let Some(dir) = p.parent().filter(|d| !d.as_os_str().is_empty()) {
                std::fs::create_dir_all(dir).with_context(|| format!("creating {}", dir.display()))?;
            }
            Some(std::io::BufWriter::new(
                std::fs::File::create(p).with_context(|| format!("creating --metrics {}", p.display()))?,
            ))
        }
        None => None,
    };
    if !args.quiet {
        println!(
            "train-qwen3: {} params, {} layers, world size {}, {} steps of {} rows × {} tokens",
            setup.config.num_params(),
            setup.config.num_hidden_layers,
            args.world(),
            setup.steps,
            setup.batches.rows,
            setup.batches.width - 1
        );
    }
    let mut on_step = |m: StepMetrics| -> Result<()> {
        if let Some(w) = sink.as_mut() {
            writeln!(w, "{}", serde_json::to_string(&m)?)?;
            w.flush()?;
        }
        if !args.quiet {
            println!(
                "step {:>4}  loss {:.6}  grad_norm {:.6}  {:.0} tok/s",
                m.step, m.loss, m.grad_norm, m.tokens_per_sec
            );
        }
        Ok(())
    };
    if args.world() == 1 && args.no_fsdp {
        train_single(args, setup, &mut on_step)
    } else {
        bail!("FSDP training (--world-size) is not available yet; use --no-fsdp")
    }
}

/// Single-device training: the reference every FSDP run is compared with.
pub fn train_single(
    args: &TrainArgs,
    setup: Setup,
    on_step: &mut dyn FnMut(StepMetrics) -> Result<()>,
) -> Result<Vec<StepMetrics>> {
    let device = device();
    let Setup { mut model, batches, steps, .. } = setup;
    let mut optim = args.adamw().init();
    let micro = args.grad_accum;
    let rows_per_micro = batches.rows / micro;
    let mut out = Vec::with_capacity(steps);
    for step in 0..steps {
        let start = Instant::now();
        let mut accum = GradientsAccumulator::<Qwen3<TrainBackend>>::new();
        let mut loss_sum = 0.0;
        for m in 0..micro {
            let tokens =
                batches.rows::<TrainBackend>(step, m * rows_per_micro..(m + 1) * rows_per_micro, &device);
            let (inputs, labels) = inputs_and_labels(tokens);
            let loss = cross_entropy(model.forward(inputs), labels).div_scalar(micro as f64);
            loss_sum += loss.clone().into_scalar() as f64;
            let grads = GradientsParams::from_grads(loss.backward(), &model);
            accum.accumulate(&model, grads);
        }
        let mut grads = accum.grads();
        let grad_norm = clip_grad_norm(&model, &mut grads, args.clip.unwrap_or(0.0));
        model = optim.step(model, grads);
        let secs = start.elapsed().as_secs_f64();
        let metrics = StepMetrics {
            step,
            loss: loss_sum,
            grad_norm,
            tokens_per_sec: (batches.rows * (batches.width - 1)) as f64 / secs.max(1e-9),
        };
        on_step(metrics)?;
        out.push(metrics);
    }
    let _ = model.valid();
    Ok(out)
}

impl TrainArgs {
    /// Parses a command line (`argv[0]` is the command name), as the binary does.
    pub fn parse_from_args(argv: &[&str]) -> std::result::Result<Self, clap::Error> {
        use clap::Parser;
        #[derive(Parser)]
        struct Wrap {
            #[command(flatten)]
            args: TrainArgs,
        }
        Wrap::try_parse_from(argv).map(|w| w.args)
    }
}
