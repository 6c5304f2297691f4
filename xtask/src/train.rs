//! `cargo xtask train-qwen3`: single-device (`--no-fsdp`) or FSDP training of Qwen3.

use crate::schedule::{LrSchedule, WarmupDecay};
use std::io::Write;
use std::path::{Path, PathBuf};
use std::sync::Mutex;
use std::time::Instant;

use anyhow::{Context, Result, bail};
use burn::backend::autodiff::checkpoint::strategy::{
    BalancedCheckpointing, CheckpointStrategy, NoCheckpointing,
};
use burn::optim::{GradientsAccumulator, GradientsParams};
use burn::tensor::{DType, ElementConversion, Int, Tensor};
use burn_fsdp::activation::checkpointed;
use burn_fsdp::checkpoint::{CheckpointIndex, INDEX_FILE, read_index};
use burn_fsdp::offload::OffloadPolicy;
use burn_fsdp::tp::TensorParallel;
use burn_fsdp::{
    DeviceMesh, Direct, Fsdp, FsdpBackend, FsdpConfig, LocalGroup, MixedPrecisionPolicy, ReduceOp,
    TorchAdamWConfig, clip_grad_norm, launch,
};
use qwen3_burn::checkpoint::{TensorOut, write_safetensors};
use qwen3_burn::train::{Batches, chunked_cross_entropy, inputs_and_labels, loss_chunk_rows};
use qwen3_burn::{Qwen3, Qwen3Config, Qwen3Init};
use serde::Serialize;

use crate::data::synthetic_batches;
use crate::weights::InitialWeights;
use crate::{Backend, TrainBackend, device};
use burn::backend::Autodiff;
use burn_metax_backend::{MetaxEmu, MetaxEmuDevice};

/// Arguments of `train-qwen3`.
///
/// A flag that the chosen mode would ignore is refused by [`run`], naming it (e.g. `--seq`
/// with `--batches`, `--preset` with `--checkpoint`).
#[derive(Debug, Clone, clap::Args, Serialize)]
pub struct TrainArgs {
    /// HF checkpoint directory to start from; without it a small built-in Qwen3 is used.
    #[arg(long)]
    pub checkpoint: Option<PathBuf>,
    /// Built-in model when no --checkpoint is given: tiny (the default), 0.6b, 1.7b, 4b, 8b.
    /// With --resume it must match the checkpoint's model.
    #[arg(long, conflicts_with = "checkpoint")]
    pub preset: Option<String>,
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
    /// Free gathered parameters after each unit's forward and re-gather them in backward
    /// (`true`, the default, or `false`).
    #[arg(long, action = clap::ArgAction::Set)]
    pub reshard_after_forward: Option<bool>,
    /// Run each FSDP collective on the compute thread when it is needed, instead of
    /// prefetching all-gathers and reducing gradients on a communication thread while
    /// compute goes on (FsdpConfig::prefetch = false). Results are bit-identical either way.
    #[arg(long)]
    pub no_prefetch: bool,
    /// Number of optimizer steps (default: all steps of --batches, else 20).
    #[arg(long)]
    pub steps: Option<usize>,
    /// Text to train on: a `.txt` file, or `.jsonl` with one `{"text": …}` per line;
    /// tokenized with --tokenizer and packed into rows of --seq + 1 tokens, shuffled with
    /// --seed. (Needs a model whose vocabulary covers the tokenizer, e.g. --preset 0.6b or a
    /// Qwen3 checkpoint.)
    #[arg(long, conflicts_with = "batches")]
    pub data: Option<PathBuf>,
    /// `tokenizer.json` for --data (default: $QWEN3_TOKENIZER, else the checkpoint's
    /// `tokenizer.json`, else the Qwen3 tokenizer of the repository's tests/fixtures).
    #[arg(long, requires = "data")]
    pub tokenizer: Option<PathBuf>,
    /// Directory for this run's metrics.jsonl and summary.json (default: runs/<timestamp>).
    #[arg(long)]
    pub out_dir: Option<PathBuf>,
    /// After training, compare with a reference trajectory: `single` (rerun the same model
    /// and data on one device without FSDP) or a JSON file with "losses" (and "grad_norms"),
    /// like the PyTorch fixtures, or a metrics.jsonl.
    #[arg(long)]
    pub compare_to: Option<String>,
    /// Rows per rank per step, for synthetic data and --data (default 2; --batches fixes its
    /// own).
    #[arg(long)]
    pub batch: Option<usize>,
    /// Tokens per row, for synthetic data and --data (default 64; --batches fixes its own).
    #[arg(long)]
    pub seq: Option<usize>,
    /// Seed of the model initialisation (--preset), the synthetic data and the shuffling of
    /// --data (default 0).
    #[arg(long)]
    pub seed: Option<u64>,
    /// AdamW learning rate.
    #[arg(long, default_value_t = 3e-3)]
    pub lr: f64,
    /// Learning-rate schedule after the warmup: `constant`, `cosine` (to 0 at the last
    /// step) or `linear` (to 0 at the last step).
    #[arg(long, value_enum, default_value_t = LrSchedule::Constant)]
    pub lr_schedule: LrSchedule,
    /// Steps of linear warmup from `lr/(N+1)` up to --lr before the schedule.
    #[arg(long, default_value_t = 0)]
    pub warmup: usize,
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
    /// Save sharded checkpoints (every rank its shards and optimizer state, plus an index)
    /// under this directory, as `step-NNNNNN/`.
    #[arg(long)]
    pub save_dir: Option<PathBuf>,
    /// Save every K steps (default: once, at the end). Needs --save-dir.
    #[arg(long, requires = "save_dir")]
    pub save_every: Option<usize>,
    /// Resume from a sharded checkpoint (a `step-NNNNNN/` directory, or a --save-dir holding
    /// several: the latest complete one is used); saved at any world size. Training continues
    /// at the checkpoint's next step index of --batches.
    #[arg(long)]
    pub resume: Option<PathBuf>,
    /// At the end, write the consolidated model as an HF checkpoint (config.json +
    /// model.safetensors) into this directory.
    #[arg(long)]
    pub export: Option<PathBuf>,
    /// CPU offload (FSDP2's CPUOffloadPolicy): shards, gradients and AdamW state live in a
    /// host store; each unit's shard is uploaded for its all-gather, gradients come back after
    /// the reduce-scatter, and the optimizer steps on the host.
    #[arg(long)]
    pub offload: bool,
    /// FSDP2 MixedPrecisionPolicy: `bf16` all-gathers and computes in bf16 and reduces
    /// gradients in fp32, on master fp32 shards (runs on burn's Flex CPU backend, which has
    /// bf16); `fp32` (the default) changes nothing.
    #[arg(long, value_enum, default_value_t = Precision::Fp32)]
    pub mixed_precision: Precision,
    /// Block-level activation checkpointing: `none` (the default) keeps every activation for
    /// backward; `block` keeps only each decoder layer's input and runs the layer again in
    /// backward (PyTorch's `checkpoint_wrapper` per layer; about one more forward of compute).
    #[arg(long, value_enum, default_value_t = ActivationCheckpointing::None)]
    pub activation_checkpointing: ActivationCheckpointing,
    /// Print nothing but errors.
    #[arg(long)]
    pub quiet: bool,
    /// How FSDP ranks are started: `local` (threads of this process); `mpi` (one process
    /// per rank: runs `mpirun -n <world-size>` on this command, or, when already started by an
    /// MPI launcher, acts as one rank; needs xtask built with `--features mpi`); `env` (one
    /// process per rank joined through RANK/WORLD_SIZE/LOCAL_RANK/MASTER_ADDR/MASTER_PORT
    /// over TCP: starts the ranks on this machine when those are unset, else acts as one).
    #[arg(long, value_enum, default_value_t = Launcher::Local)]
    pub launcher: Launcher,
    /// With --launcher mpi: print the exact mpirun command line and exit; with --launcher
    /// env: print each rank's command line (with its environment) and exit.
    #[arg(long)]
    pub dry_run: bool,
    /// The mpirun executable for --launcher mpi (default: $MPIRUN, else `mpirun`).
    #[arg(long)]
    pub mpirun: Option<PathBuf>,
    /// Extra argument for mpirun, repeatable: e.g. `--mpirun-arg=--hostfile --mpirun-arg=hosts`.
    #[arg(long = "mpirun-arg", allow_hyphen_values = true)]
    pub mpirun_args: Vec<String>,
    /// Data × tensor parallelism on a 2D mesh `DPxTP` (e.g. `2x2`): Megatron-style tensor
    /// parallelism over TP ranks (attention heads and MLP features split; embedding and
    /// lm_head replicated), FSDP over the DP ranks of each tensor-parallel slice. DP·TP ranks
    /// in all; the batch is split over DP only.
    #[arg(long, value_parser = parse_mesh, conflicts_with_all = ["hsdp", "no_fsdp"])]
    pub mesh: Option<(usize, usize)>,
    /// Hybrid sharding (FSDP2's HSDP) on a 2D mesh `RxS`: parameters sharded over S ranks and
    /// replicated over R such groups; gradients reduce-scattered within a shard group, then
    /// averaged across replicas. R·S ranks in all.
    #[arg(long, value_parser = parse_mesh, conflicts_with = "no_fsdp")]
    pub hsdp: Option<(usize, usize)>,
    /// Where each rank computes: `cpu` (NdArray, or Flex for bf16); `metax-emu`, the emulated
    /// MetaX device (in-process ranks, one emulated device each, or `--no-fsdp`); or one GPU
    /// per process with device collectives: `metax` (MCCL) or `cuda-proxy` (NCCL; xtask built
    /// with `--features cuda`). GPUs need `--launcher env` (the GPU is `LOCAL_RANK`).
    #[arg(long, value_enum, default_value_t = DeviceKind::Cpu)]
    pub device: DeviceKind,
    /// Collective timeout in seconds: a rank that waits longer for its peers fails with an
    /// error (and so does the job).
    #[arg(long, default_value_t = 120.0)]
    pub timeout: f64,
}

/// `--activation-checkpointing` values.
#[derive(Debug, Clone, Copy, PartialEq, Eq, clap::ValueEnum, Serialize)]
#[serde(rename_all = "kebab-case")]
pub enum ActivationCheckpointing {
    /// Keep every activation for backward.
    None,
    /// Keep each decoder layer's input only; run the layer again in backward.
    Block,
}

/// `--launcher` values.
#[derive(Debug, Clone, Copy, PartialEq, Eq, clap::ValueEnum, Serialize)]
#[serde(rename_all = "kebab-case")]
pub enum Launcher {
    /// In-process ranks (threads).
    Local,
    /// One process per rank, started by mpirun.
    Mpi,
    /// One process per rank, joined through torchrun-style environment variables over TCP.
    Env,
}

/// This process's place in a multi-process job.
enum Job {
    Mpi(crate::launch::MpiRank),
    Env(crate::env_launch::EnvJob),
}

impl Job {
    fn rank(&self) -> usize {
        match self {
            Job::Mpi(m) => m.rank(),
            Job::Env(e) => e.rank(),
        }
    }

    fn size(&self) -> usize {
        match self {
            Job::Mpi(m) => m.size(),
            Job::Env(e) => e.size(),
        }
    }

    fn abort(&self, reason: &str) {
        match self {
            Job::Mpi(m) => m.abort(reason),
            Job::Env(e) => e.abort(reason),
        }
    }

    fn check_consistent(&self, args: &TrainArgs, setup: &Setup) -> Result<()> {
        match self {
            Job::Mpi(m) => m.check_consistent(args, setup),
            Job::Env(e) => e.check_consistent(args, setup),
        }
    }

    fn train(
        &self,
        args: &TrainArgs,
        setup: Setup,
        sink: &MetricsSink,
        precision: Precision,
    ) -> Result<Vec<StepMetrics>> {
        match self {
            Job::Mpi(m) => m.train(args, setup, sink, precision),
            Job::Env(e) => e.train(args, setup, sink, precision),
        }
    }

    fn how(&self) -> &'static str {
        match self {
            Job::Mpi(_) => "MPI processes",
            Job::Env(_) => "processes (env launcher, TCP)",
        }
    }
}

/// `--device` values.
#[derive(Debug, Clone, Copy, PartialEq, Eq, clap::ValueEnum, Serialize)]
#[serde(rename_all = "kebab-case")]
pub enum DeviceKind {
    /// The CPU (host-buffer collectives of the launcher).
    Cpu,
    /// A MetaX GPU per process, MCCL collectives on device buffers.
    Metax,
    /// An NVIDIA GPU per process through the MetaX runtime's CUDA proxy, NCCL collectives.
    CudaProxy,
    /// The emulated MetaX device (the MetaX backend's kernels compiled by the host C++ compiler
    /// and run on the CPU at wave size 64): each in-process rank on its own emulated device,
    /// host collectives. Needs g++ or clang++ (`scripts/setup.sh`).
    MetaxEmu,
}

impl DeviceKind {
    /// The flag value.
    pub fn name(self) -> &'static str {
        match self {
            DeviceKind::Cpu => "cpu",
            DeviceKind::Metax => "metax",
            DeviceKind::CudaProxy => "cuda-proxy",
            DeviceKind::MetaxEmu => "metax-emu",
        }
    }
}

/// `--mixed-precision` values.
#[derive(Debug, Clone, Copy, PartialEq, Eq, clap::ValueEnum, Serialize)]
#[serde(rename_all = "kebab-case")]
pub enum Precision {
    /// Everything in fp32.
    Fp32,
    /// bf16 parameters and compute, fp32 gradient reduction and master weights.
    Bf16,
}

fn parse_mesh(s: &str) -> std::result::Result<(usize, usize), String> {
    let parts: Vec<&str> = s.split(['x', 'X', '×']).map(str::trim).collect();
    let [a, b] = parts[..] else {
        return Err(format!("expected two sizes `AxB` (e.g. `2x2`), got `{s}`"));
    };
    let parse = |x: &str| match x.parse::<usize>() {
        Ok(n) if n > 0 => Ok(n),
        _ => Err(format!("`{x}` in `{s}` is not a positive integer")),
    };
    Ok((parse(a)?, parse(b)?))
}

/// How the ranks of a run are arranged.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Topology {
    /// FSDP over all ranks (`--world-size`).
    Flat(usize),
    /// `--mesh DPxTP`.
    DpTp {
        /// Data-parallel degree.
        dp: usize,
        /// Tensor-parallel degree.
        tp: usize,
    },
    /// `--hsdp RxS`.
    Hsdp {
        /// Replica groups.
        replicate: usize,
        /// Ranks per shard group.
        shard: usize,
    },
}

impl Topology {
    /// Sizes of the mesh's `(outer, inner)` dimensions (`(1, W)` when flat).
    pub fn dims(self) -> (usize, usize) {
        match self {
            Topology::Flat(w) => (1, w),
            Topology::DpTp { dp, tp } => (dp, tp),
            Topology::Hsdp { replicate, shard } => (replicate, shard),
        }
    }

    /// All ranks.
    pub fn world(self) -> usize {
        let (a, b) = self.dims();
        a * b
    }

    /// Ranks each FSDP unit is sharded over: the world when flat, `dp` for `--mesh` (FSDP runs
    /// over the data-parallel dimension), `shard` for `--hsdp`.
    pub fn shard_world(self) -> usize {
        match self {
            Topology::Flat(w) => w,
            Topology::DpTp { dp, .. } => dp,
            Topology::Hsdp { shard, .. } => shard,
        }
    }

    /// Ranks that see different data (the batch is split across them).
    pub fn data_world(self) -> usize {
        match self {
            Topology::DpTp { dp, .. } => dp,
            other => other.world(),
        }
    }

    /// Which slice of the batch rank `rank` (global, row-major) trains on.
    pub fn data_rank(self, rank: usize) -> usize {
        match self {
            Topology::DpTp { tp, .. } => rank / tp,
            _ => rank,
        }
    }
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
    /// `--seed`, 0 when not given.
    pub fn seed(&self) -> u64 {
        self.seed.unwrap_or(0)
    }

    /// `--batch` and `--seq` (2 and 64 when not given), each at least 1.
    pub fn batch_and_seq(&self) -> Result<(usize, usize)> {
        let (batch, seq) = (self.batch.unwrap_or(2), self.seq.unwrap_or(64));
        if batch == 0 || seq == 0 {
            bail!("--batch and --seq must be at least 1");
        }
        Ok((batch, seq))
    }

    /// The learning-rate schedule of a run of `steps` steps (--lr, --lr-schedule, --warmup).
    pub fn lr_schedule(&self, steps: usize) -> WarmupDecay {
        WarmupDecay::new(self.lr_schedule, self.lr, self.warmup, steps)
    }

    /// The AdamW hyper-parameters.
    pub fn adamw(&self) -> TorchAdamWConfig {
        TorchAdamWConfig { lr: self.lr, betas: self.betas, eps: self.eps, weight_decay: self.weight_decay }
    }

    /// The rank layout: `--mesh`, `--hsdp`, else FSDP over `--world-size` (default 4; 1 for
    /// `--no-fsdp`).
    pub fn topology(&self) -> Topology {
        match (self.mesh, self.hsdp) {
            (Some((dp, tp)), _) => Topology::DpTp { dp, tp },
            (None, Some((replicate, shard))) => Topology::Hsdp { replicate, shard },
            (None, None) => Topology::Flat(if self.no_fsdp { 1 } else { self.world_size.unwrap_or(4) }),
        }
    }

    /// Number of ranks (processes or threads).
    pub fn world(&self) -> usize {
        self.topology().world()
    }

    /// The collective timeout (`--timeout`).
    pub fn collective_timeout(&self) -> Result<std::time::Duration> {
        if !(self.timeout.is_finite() && self.timeout > 0.0) {
            bail!("--timeout must be a positive number of seconds, got {}", self.timeout);
        }
        Ok(std::time::Duration::from_secs_f64(self.timeout))
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
    /// Learning rate of this step's update.
    pub lr: f64,
    /// Tokens of the global batch divided by the step's wall time.
    pub tokens_per_sec: f64,
    /// The lowest (data-parallel) rank whose own loss was not finite, if any. Training stops
    /// at the first step whose loss or gradient norm is not finite, before its update.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub nonfinite_rank: Option<usize>,
}

impl StepMetrics {
    /// Whether the loss and the gradient norm are finite numbers.
    pub fn is_finite(&self) -> bool {
        self.loss.is_finite() && self.grad_norm.is_finite()
    }
}

/// The model and data a run starts from.
#[derive(Clone)]
pub struct Setup {
    /// Model config.
    pub config: Qwen3Config,
    /// The initial weights: a single device builds the model from them, each FSDP rank only
    /// its shards.
    pub model: InitialWeights,
    /// Token batches.
    pub batches: Batches,
    /// Number of steps to run.
    pub steps: usize,
    /// Checkpoint to resume from.
    pub resume: Option<PathBuf>,
}

/// Loads (or builds) the model and data, validating every flag against them.
pub fn setup(args: &TrainArgs) -> Result<Setup> {
    let topology = args.topology();
    if topology.world() == 0 {
        bail!("--world-size must be at least 1");
    }
    if let (Some(w), Topology::DpTp { .. } | Topology::Hsdp { .. }) = (args.world_size, topology)
        && w != topology.world()
    {
        bail!("--world-size {w} disagrees with the mesh, which has {} ranks", topology.world());
    }
    if topology != Topology::Flat(topology.world()) && args.offload {
        bail!("--offload is not supported with --mesh or --hsdp");
    }
    // The batch is split across the ranks that see different data.
    let world = topology.data_world();
    if args.grad_accum == 0 {
        bail!("--grad-accum must be at least 1");
    }
    if args.no_fsdp && args.offload {
        bail!("--offload is an FSDP policy; use --world-size N (1 is fine) instead of --no-fsdp");
    }
    if args.no_fsdp && (args.save_dir.is_some() || args.resume.is_some()) {
        bail!(
            "--save-dir and --resume use sharded FSDP checkpoints; use --world-size N (1 is fine) instead of --no-fsdp"
        );
    }
    refuse_ignored_flags(args)?;
    if args.save_every == Some(0) {
        bail!("--save-every must be at least 1");
    }
    let resume = match &args.resume {
        Some(dir) => Some(resolve_checkpoint(dir)?),
        None => None,
    };
    if args.no_fsdp && args.mixed_precision != Precision::Fp32 {
        bail!(
            "--mixed-precision bf16 is an FSDP policy; use --world-size N (1 is fine) instead of --no-fsdp"
        );
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
    // The model's config first: every check of the flags and the data runs before any weight
    // is read or initialised (a 0.6B model takes a while).
    let config = match (&args.checkpoint, &resume) {
        (Some(dir), _) => Qwen3Config::from_file(dir.join("config.json"))?,
        // Resuming without --checkpoint: the model is the checkpoint's.
        (None, Some((dir, index))) => resume_config(dir, index)?,
        (None, None) => preset_config(args)?,
    };
    // --checkpoint or --preset with --resume: the model they name must be the checkpoint's.
    if let Some((dir, index)) = &resume
        && (args.checkpoint.is_some() || args.preset.is_some())
    {
        let (flag, given) = match (&args.checkpoint, &args.preset) {
            (Some(c), _) => (format!("--checkpoint {}", c.display()), config.clone()),
            (None, p) => (format!("--preset {}", p.as_deref().unwrap_or("tiny")), preset_config(args)?),
        };
        let differ = config_differences(&given, &resume_config(dir, index)?);
        if !differ.is_empty() {
            bail!(
                "{flag} is another model than the one saved in --resume {} (given vs saved: {}); \
                 omit it to resume the checkpoint's model",
                dir.display(),
                differ.join(", ")
            );
        }
    }
    let batches = match (&args.batches, &args.data) {
        (None, Some(path)) => {
            let tok_path = crate::tokenizer::resolve(args.tokenizer.as_deref(), args.checkpoint.as_deref())?;
            let tokenizer = qwen3_burn::tokenizer::Tokenizer::from_file(&tok_path)?;
            let docs = crate::data::text::read_documents(path)?;
            let eos = tokenizer.token_id("<|endoftext|>");
            let (batch, seq) = args.batch_and_seq()?;
            let what = format!("--data {}", path.display());
            let steps = args.steps.unwrap_or(DEFAULT_STEPS);
            let layout = crate::data::text::Layout { seq, steps, rows: world * batch, seed: args.seed() };
            let b = crate::data::text::pack(&docs, &tokenizer, eos, layout, &what)?;
            if b.max_token() as usize >= config.vocab_size {
                bail!(
                    "{what}: --tokenizer {} produces token ids up to {}, but the model's vocabulary has {} entries; \
                     use a model that covers the tokenizer (e.g. --preset 0.6b, or a Qwen3 --checkpoint)",
                    tok_path.display(),
                    b.max_token(),
                    config.vocab_size
                );
            }
            b
        }
        (Some(path), _) => {
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
        (None, None) => {
            let (batch, seq) = args.batch_and_seq()?;
            synthetic_batches(
                args.steps.unwrap_or(DEFAULT_STEPS),
                world * batch,
                seq,
                config.vocab_size,
                args.seed(),
            )
        }
    };
    let steps = args.steps.unwrap_or(batches.steps);
    if let Some((dir, index)) = &resume
        && index.step as usize >= steps
    {
        bail!(
            "--resume {}: the checkpoint is at step {}, nothing left to run with --steps {steps}",
            dir.display(),
            index.step
        );
    }
    if steps > batches.steps {
        bail!("--steps {steps} exceeds the {} steps of the batches file", batches.steps);
    }
    if !batches.rows.is_multiple_of(world) {
        bail!(
            "the global batch has {} rows, which the {world} data-parallel ranks (--world-size, --mesh DP, --hsdp R·S) do not divide",
            batches.rows
        );
    }
    if let Topology::DpTp { dp, tp } = topology {
        qwen3_burn::parallelize::check_tp(&config, tp)
            .map_err(|e| anyhow::anyhow!("--mesh {dp}x{tp}: {e}"))?;
    }
    if !(batches.rows / world).is_multiple_of(args.grad_accum) {
        bail!(
            "each rank has {} rows per step, which --grad-accum {} does not divide",
            batches.rows / world,
            args.grad_accum
        );
    }
    let model = match (&args.checkpoint, &resume) {
        (Some(dir), _) => InitialWeights::checkpoint(&config, dir)?,
        // Resuming: the weights come from the checkpoint when training starts.
        (None, Some(_)) => InitialWeights::Seeded(Qwen3Init::new(0)),
        (None, None) => InitialWeights::Seeded(Qwen3Init::new(args.seed())),
    };
    Ok(Setup { config, model, batches, steps, resume: resume.map(|(dir, _)| dir) })
}

/// Refuses flags that the chosen mode would ignore, naming them.
fn refuse_ignored_flags(args: &TrainArgs) -> Result<()> {
    let mut ignored: Vec<(&str, &str)> = Vec::new();
    if args.batches.is_some() {
        let why = "--batches fixes the rows and length of every step";
        if args.batch.is_some() {
            ignored.push(("--batch", why));
        }
        if args.seq.is_some() {
            ignored.push(("--seq", why));
        }
        if args.seed.is_some() && (args.checkpoint.is_some() || args.resume.is_some()) {
            ignored.push((
                "--seed",
                "the weights come from a checkpoint and the data from --batches: nothing is random",
            ));
        }
    }
    if args.no_fsdp {
        let why = "it is an FSDP setting and --no-fsdp trains without FSDP";
        if args.no_prefetch {
            ignored.push(("--no-prefetch", why));
        }
        if args.reshard_after_forward.is_some() {
            ignored.push(("--reshard-after-forward", why));
        }
    }
    if args.activation_checkpointing == ActivationCheckpointing::Block
        && args.mesh.is_some_and(|(_, tp)| tp > 1)
    {
        ignored.push((
            "--activation-checkpointing block",
            "tensor-parallel layers run collectives inside them and are not recomputed",
        ));
    }
    if args.launcher != Launcher::Mpi {
        let why = "it is for --launcher mpi";
        if args.mpirun.is_some() {
            ignored.push(("--mpirun", why));
        }
        if !args.mpirun_args.is_empty() {
            ignored.push(("--mpirun-arg", why));
        }
    }
    match ignored.first() {
        None => Ok(()),
        Some((flag, why)) => bail!("{flag} would be ignored: {why}; leave it out"),
    }
}

/// The model of a `--resume` checkpoint (its index's `model_config`).
fn resume_config(dir: &Path, index: &CheckpointIndex) -> Result<Qwen3Config> {
    serde_json::from_value(index.model_config.clone())
        .with_context(|| format!("{}: model_config is not a Qwen3 config", dir.join(INDEX_FILE).display()))
}

/// The model of `--preset` (tiny when not given).
fn preset_config(args: &TrainArgs) -> Result<Qwen3Config> {
    let name = args.preset.as_deref().unwrap_or("tiny");
    Qwen3Config::preset(name)
        .with_context(|| format!("--preset `{name}` is unknown (tiny, 0.6b, 1.7b, 4b, 8b)"))
}

/// The fields in which two model configs differ, as `name given vs saved`.
fn config_differences(given: &Qwen3Config, saved: &Qwen3Config) -> Vec<String> {
    let (a, b) =
        (serde_json::to_value(given).unwrap_or_default(), serde_json::to_value(saved).unwrap_or_default());
    let (Some(a), Some(b)) = (a.as_object(), b.as_object()) else {
        return vec!["the configs cannot be compared".to_owned()];
    };
    let mut keys: Vec<&String> = a.keys().chain(b.keys()).collect();
    keys.sort();
    keys.dedup();
    keys.into_iter()
        .filter(|k| a.get(*k) != b.get(*k))
        .map(|k| {
            let show = |v: Option<&serde_json::Value>| v.map_or("absent".to_owned(), |v| v.to_string());
            format!("{k} {} vs {}", show(a.get(k)), show(b.get(k)))
        })
        .collect()
}

/// A `--resume` argument: the checkpoint directory itself, or a directory of `step-*/`
/// checkpoints (the latest complete one).
pub fn resolve_checkpoint(dir: &std::path::Path) -> Result<(PathBuf, CheckpointIndex)> {
    if dir.join(INDEX_FILE).is_file() {
        return Ok((dir.to_path_buf(), read_index(dir)?));
    }
    let mut candidates: Vec<PathBuf> = std::fs::read_dir(dir)
        .with_context(|| format!("--resume {}: not a checkpoint directory", dir.display()))?
        .filter_map(|e| e.ok().map(|e| e.path()))
        .filter(|p| {
            p.file_name().is_some_and(|n| n.to_string_lossy().starts_with("step-"))
                && p.join(INDEX_FILE).is_file()
        })
        .collect();
    candidates.sort();
    match candidates.pop() {
        Some(latest) => {
            let index = read_index(&latest)?;
            Ok((latest, index))
        }
        None => bail!(
            "--resume {}: holds neither {INDEX_FILE} nor any complete step-*/ checkpoint",
            dir.display()
        ),
    }
}

/// Where per-step metrics go: the metrics file and the terminal (a progress bar on a
/// terminal, one line per step otherwise). Shared by ranks.
pub struct MetricsSink {
    collectives: Mutex<Option<serde_json::Value>>,
    file: Mutex<Option<std::io::BufWriter<std::fs::File>>>,
    quiet: bool,
    bar: Option<indicatif::ProgressBar>,
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
        Ok(Self { collectives: Mutex::new(None), file: Mutex::new(file), quiet, bar: None })
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

fn mean_tps(m: &[StepMetrics]) -> f64 {
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

/// Runs training as the flags say and returns the per-step metrics (also written to
/// `--metrics`, or `metrics.jsonl` in `--out-dir`, with a `summary.json` beside it).
pub fn run(args: &TrainArgs) -> Result<Vec<StepMetrics>> {
    if args.compare_to.as_deref() == Some("single") && args.resume.is_some() {
        bail!(
            "--compare-to single reruns from step 0 and cannot follow --resume; compare with a file instead"
        );
    }
    args.collective_timeout()?;
    if args.dry_run && args.launcher == Launcher::Local {
        bail!("--dry-run prints the command lines of --launcher mpi or env; add one of them");
    }
    if matches!(args.device, DeviceKind::Metax | DeviceKind::CudaProxy)
        && (args.launcher != Launcher::Env || args.no_fsdp)
    {
        bail!(
            "--device {} runs one FSDP rank per GPU process with device collectives: use --launcher env \
             (RANK/WORLD_SIZE/LOCAL_RANK/MASTER_ADDR; the GPU is LOCAL_RANK)",
            args.device.name()
        );
    }
    if args.device == DeviceKind::MetaxEmu {
        check_emu_devices(args)?;
    }
    // Under a launcher this process is one rank: join the job first, so that the world
    // size comes from it and only rank 0 writes files and prints.
    let mpi = match args.launcher {
        Launcher::Mpi => Some(Job::Mpi(crate::launch::MpiRank::join(args)?)),
        Launcher::Env => Some(Job::Env(crate::env_launch::EnvJob::join(args)?)),
        Launcher::Local => None,
    };
    let owned;
    let args = match &mpi {
        Some(m) if args.world_size.is_none() => {
            owned = TrainArgs { world_size: Some(m.size()), ..args.clone() };
            &owned
        }
        _ => args,
    };
    let is_main = mpi.as_ref().is_none_or(|m| m.rank() == 0);
    let setup = match setup(args) {
        Ok(s) => s,
        Err(e) => {
            if let Some(m) = &mpi {
                m.abort(&format!("{e:#}"));
            }
            return Err(e);
        }
    };
    if let Some(m) = &mpi {
        m.check_consistent(args, &setup)?;
    }
    let out_dir = args.out_dir.clone().unwrap_or_else(default_run_dir);
    if is_main {
        std::fs::create_dir_all(&out_dir)
            .with_context(|| format!("creating --out-dir {}", out_dir.display()))?;
    }
    let metrics_path = args.metrics.clone().unwrap_or_else(|| out_dir.join("metrics.jsonl"));
    let sink = if is_main {
        MetricsSink::new(Some(&metrics_path), args.quiet)?.with_progress(setup.steps)
    } else {
        MetricsSink::new(None, true)?
    };
    let reference_setup = (args.compare_to.as_deref() == Some("single")).then(|| setup.clone());
    let (params, layers, world, steps) =
        (setup.config.num_params(), setup.config.num_hidden_layers, args.world(), setup.steps);
    let mode = if args.no_fsdp {
        "single device (no FSDP)".to_owned()
    } else {
        let how = mpi.as_ref().map(Job::how).unwrap_or("in-process ranks");
        match args.topology() {
            Topology::Flat(_) => format!("FSDP over {world} {how}"),
            Topology::DpTp { dp, tp } => {
                format!("FSDP (dp = {dp}) × tensor parallel (tp = {tp}), {world} {how}")
            }
            Topology::Hsdp { replicate, shard } => {
                format!("HSDP ({replicate} replicas × {shard}-way sharding), {world} {how}")
            }
        }
    };
    // The policies that change the numbers or where state lives, named in the summary and plot.
    let policies: Vec<&str> = [
        (args.mixed_precision == Precision::Bf16).then_some("bf16 mixed precision"),
        args.offload.then_some("CPU offload"),
        (args.device != DeviceKind::Cpu).then_some(args.device.name()),
    ]
    .into_iter()
    .flatten()
    .collect();
    let mode = if policies.is_empty() { mode } else { format!("{mode}, {}", policies.join(", ")) };
    if !args.quiet && is_main {
        println!(
            "train-qwen3: {params} params, {layers} layers, {mode}, {steps} steps of {} rows × {} tokens → {}",
            setup.batches.rows,
            setup.batches.width - 1,
            out_dir.display()
        );
    }
    let config = setup.config.clone();
    let metrics = match (args.no_fsdp, args.mixed_precision, &mpi) {
        (true, _, _) => train_single(args, setup, &sink)?,
        (false, precision, Some(m)) => m.train(args, setup, &sink, precision)?,
        (false, _, None) if args.device == DeviceKind::MetaxEmu => {
            train_fsdp_on::<MetaxEmu>(args, setup, &sink, MetaxEmuDevice::new)?
        }
        (false, Precision::Fp32, None) => train_fsdp::<Backend>(args, setup, &sink)?,
        // NdArray has no bf16; burn's Flex CPU backend does.
        (false, Precision::Bf16, None) => train_fsdp::<burn::backend::Flex<f32>>(args, setup, &sink)?,
    };
    sink.finish();
    if !is_main {
        if let Some(m) = metrics.iter().find(|m| !m.is_finite()) {
            bail!(
                "step {}: non-finite loss or gradient norm; training stopped (rank 0 writes the summary)",
                m.step
            );
        }
        return Ok(metrics);
    }
    // The first non-finite step (training stopped there): no comparison, and the error below
    // once summary.json and the plot of what ran are written.
    let stopped = metrics.iter().find(|m| !m.is_finite()).map(|m| {
        let what = match (m.loss.is_finite(), m.grad_norm.is_finite()) {
            (false, _) => format!("loss {}", m.loss),
            (true, _) => format!("gradient norm {}", m.grad_norm),
        };
        let rank = match m.nonfinite_rank {
            Some(r) if !args.no_fsdp => format!(" (first on rank {r})"),
            _ => String::new(),
        };
        format!(
            "step {}: {what}{rank}; training stopped before this step's update (check the learning rate, \
             the data and the checkpoint's weights)",
            m.step
        )
    });
    let reference_setup = if stopped.is_some() { None } else { reference_setup };
    let comparison = match (args.compare_to.as_deref().filter(|_| stopped.is_none()), reference_setup) {
        (Some("single"), Some(reference)) => {
            if !args.quiet {
                println!("compare-to single: rerunning the same model and data on one device without FSDP…");
            }
            let quiet_sink = MetricsSink::new(None, true)?;
            let single = train_single(args, reference, &quiet_sink)?;
            let l = single.iter().map(|m| m.loss).collect();
            let n = single.iter().map(|m| m.grad_norm).collect();
            Some(compare("single device (no FSDP)".into(), &metrics, l, n, Some(mean_tps(&single))))
        }
        (Some(file), _) => {
            let path = PathBuf::from(file);
            let (l, n, tps) = read_reference(&path)?;
            Some(compare(path.display().to_string(), &metrics, l, n, tps))
        }
        (None, _) => None,
    };
    let png = out_dir.join("loss.png");
    let finite: Vec<(f64, f64)> =
        metrics.iter().filter(|m| m.loss.is_finite()).map(|m| (m.step as f64, m.loss)).collect();
    let has_plot = !finite.is_empty();
    let mut series = vec![("this run".to_owned(), finite)];
    if let Some(c) = &comparison {
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
        "mean_tokens_per_sec": mean_tps(&metrics),
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
            mean_tps(&metrics),
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
        println!("  {:<22} {:.0}", "mean tokens/s", mean_tps(&metrics));
        if let Some(c) = &comparison {
            print_comparison(first, last, c);
        }
    }
    Ok(metrics)
}

fn print_comparison(first: &StepMetrics, last: &StepMetrics, c: &Comparison) {
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

/// Bytes of one `[rows, vocab]` f32 piece of the chunked loss: the full-vocabulary logits of
/// a batch never exist at once, only pieces of about this size.
pub const LOSS_CHUNK_BYTES: usize = 64 << 20;

/// Steps of the synthetic default run when `--steps` is not given.
pub const DEFAULT_STEPS: usize = 20;

/// `--device metax-emu`: one emulated device per in-process rank (or device 0 for `--no-fsdp`);
/// the flags must fit the emulated devices, and the emulator must be usable (a C++ compiler).
fn check_emu_devices(args: &TrainArgs) -> Result<()> {
    if args.launcher != Launcher::Local {
        bail!(
            "--device metax-emu runs in-process ranks, one emulated device each: drop --launcher {}",
            if args.launcher == Launcher::Mpi { "mpi" } else { "env" }
        );
    }
    let driver = burn_metax_backend::runtime::emu_driver()
        .map_err(|e| anyhow::anyhow!("--device metax-emu: the emulated MetaX device is unavailable: {e}"))?;
    let have = driver.config().devices.len();
    let need = if args.no_fsdp { 1 } else { args.world() };
    if need > have {
        bail!(
            "--device metax-emu: {need} ranks need {need} emulated devices, but there are {have} \
             (set METAX_EMU_DEVICES={need})"
        );
    }
    Ok(())
}

/// Single-device training: the reference every FSDP run is compared with. On the CPU (NdArray),
/// or on emulated MetaX device 0 with `--device metax-emu`.
pub fn train_single(args: &TrainArgs, setup: Setup, sink: &MetricsSink) -> Result<Vec<StepMetrics>> {
    match args.device {
        DeviceKind::MetaxEmu => {
            train_single_on::<Autodiff<MetaxEmu>>(args, setup, sink, &MetaxEmuDevice::new(0))
        }
        _ => train_single_on::<TrainBackend>(args, setup, sink, &device()),
    }
}

/// Single-device training on any autodiff backend and device.
pub fn train_single_on<AB: FsdpBackend + qwen3_burn::train::LossBackend>(
    args: &TrainArgs,
    setup: Setup,
    sink: &MetricsSink,
    device: &AB::Device,
) -> Result<Vec<StepMetrics>> {
    let device = device.clone();
    let Setup { config, model, batches, steps, .. } = setup;
    let mut model = model.model::<AB>(&config, &device)?;
    let mut optim = args.adamw().init();
    let schedule = args.lr_schedule(steps);
    let micro = args.grad_accum;
    let rows_per_micro = batches.rows / micro;
    let mut out = Vec::with_capacity(steps);
    for step in 0..steps {
        let start = Instant::now();
        let lr = schedule.lr_at(step);
        optim.set_lr(lr);
        let mut accum = GradientsAccumulator::<Qwen3<AB>>::new();
        let mut loss_sum = 0.0;
        for m in 0..micro {
            let tokens = batches.rows::<AB>(step, m * rows_per_micro..(m + 1) * rows_per_micro, &device);
            let (inputs, labels) = inputs_and_labels(tokens);
            let chunk = loss_chunk_rows(config.vocab_size, LOSS_CHUNK_BYTES);
            let loss_of = |runner: &mut dyn FnMut(Tensor<AB, 2, Int>) -> Tensor<AB, 3>| {
                chunked_cross_entropy(runner(inputs), model.head_weight(), labels, chunk)
                    .div_scalar(micro as f64)
            };
            let grads = match args.activation_checkpointing {
                ActivationCheckpointing::None => {
                    let loss = loss_of(&mut |ids| model.hidden_with(ids, &mut Direct));
                    loss_sum += loss.clone().into_scalar().elem::<f64>();
                    GradientsParams::from_grads(loss.backward(), &model)
                }
                ActivationCheckpointing::Block => {
                    let run = checkpointed(|runner| loss_of(&mut |ids| model.hidden_with(ids, runner)));
                    loss_sum += run.loss().into_scalar().elem::<f64>();
                    run.gradients(&model)
                }
            };
            accum.accumulate(&model, grads);
        }
        let mut grads = accum.grads();
        let grad_norm = clip_grad_norm(&model, &mut grads, args.clip.unwrap_or(0.0));
        let finite = loss_sum.is_finite() && grad_norm.is_finite();
        if finite {
            model = optim.step(model, grads);
        }
        let metrics = StepMetrics {
            step,
            loss: loss_sum,
            grad_norm,
            lr,
            tokens_per_sec: (batches.rows * (batches.width - 1)) as f64
                / start.elapsed().as_secs_f64().max(1e-9),
            nonfinite_rank: (!loss_sum.is_finite()).then_some(0),
        };
        sink.emit(&metrics)?;
        out.push(metrics);
        if !finite {
            break;
        }
    }
    Ok(out)
}

/// The autodiff backend of FSDP training when backward re-gathers ([`regathers`]): balanced
/// checkpointing, so that resharded parameters are re-gathered in backward.
pub type FsdpTrainBackend<B> = burn::backend::Autodiff<B, BalancedCheckpointing>;

/// Whether an FSDP rank's backward has anything to re-gather, i.e. whether it needs
/// [`FsdpTrainBackend`]'s balanced checkpointing. Nothing does when every unit's shard is the
/// whole parameter (one rank per shard group) or units stay gathered (`reshard_after_forward`
/// off), without offload (whose shards live on the host) or block checkpointing (which
/// re-runs blocks); then the rank trains on `Autodiff<B>` without recomputation — balanced
/// checkpointing would also recompute every memory-bound op of the model in backward, which
/// costs ~4 % of a step here (docs/performance.md). Both give the same values.
pub fn regathers(args: &TrainArgs, shard_world: usize) -> bool {
    let resharded = args.reshard_after_forward.unwrap_or(true) && shard_world > 1;
    resharded || args.offload || args.activation_checkpointing != ActivationCheckpointing::None
}

/// This rank's handles on its mesh: for a flat run the world group only; for `--mesh` the
/// `(dp, tp)` groups, for `--hsdp` the `(replicate, shard)` groups.
pub struct RankGroups<B: burn::tensor::backend::Backend> {
    /// The layout.
    pub topology: Topology,
    /// This rank's global index (row-major over the mesh).
    pub rank: usize,
    /// Flat: the world group. 2D: the outer dimension's group (dp or replicate).
    pub outer: std::sync::Arc<dyn burn_fsdp::ProcessGroup<B>>,
    /// 2D: the inner dimension's group (tp or shard).
    pub inner: Option<std::sync::Arc<dyn burn_fsdp::ProcessGroup<B>>>,
    /// In-process 2D meshes: the world group, for a barrier before each backward. Burn's
    /// autodiff cleans up after a backward by locking every graph of the process, so a rank
    /// thread that finished its backward waits for the other threads' backwards; without the
    /// barrier, ranks that sync only through sub-groups can drift a micro-batch apart and
    /// deadlock on that lock (one process per rank, as with MPI, needs no gate).
    pub gate: Option<std::sync::Arc<dyn burn_fsdp::ProcessGroup<B>>>,
    /// The device this rank computes on.
    pub device: B::Device,
}

/// A process rank's mesh groups from its world group: the world itself for a flat run, else
/// (`--mesh`/`--hsdp`) its row and column of the mesh split from the world with `split(color,
/// key)` (`MPI_Comm_split` semantics; row-major: rank = outer · inner_size + inner).
pub fn split_mesh<B, G>(
    args: &TrainArgs,
    rank: usize,
    world: std::sync::Arc<G>,
    split: impl Fn(&G, u32, u32) -> std::result::Result<std::sync::Arc<G>, burn_fsdp::CommError>,
) -> Result<RankGroups<B>>
where
    B: burn::tensor::backend::Backend,
    G: burn_fsdp::ProcessGroup<B> + 'static,
{
    let topology = args.topology();
    let (outer, inner): (std::sync::Arc<dyn burn_fsdp::ProcessGroup<B>>, _) = match topology {
        Topology::Flat(_) => (world, None),
        _ => {
            let (_, i) = topology.dims();
            let (a, b) = (rank / i, rank % i);
            let err = |e: burn_fsdp::CommError| anyhow::anyhow!("splitting the job into the mesh: {e}");
            let inner: std::sync::Arc<dyn burn_fsdp::ProcessGroup<B>> =
                split(&world, a as u32, b as u32).map_err(err)?;
            (split(&world, b as u32, a as u32).map_err(err)?, Some(inner))
        }
    };
    Ok(RankGroups { topology, rank, outer, inner, gate: None, device: Default::default() })
}

/// One process rank's CPU training: its mesh groups split from `world` ([`split_mesh`]), on
/// NdArray (fp32) or Flex (bf16 mixed precision).
pub fn cpu_rank<G>(
    args: &TrainArgs,
    setup: &Setup,
    sink: &MetricsSink,
    precision: Precision,
    rank: usize,
    world: std::sync::Arc<G>,
    split: impl Fn(&G, u32, u32) -> std::result::Result<std::sync::Arc<G>, burn_fsdp::CommError>,
) -> Result<Vec<StepMetrics>>
where
    G: burn_fsdp::ProcessGroup<Backend> + burn_fsdp::ProcessGroup<burn::backend::Flex<f32>> + 'static,
{
    match precision {
        Precision::Fp32 => split_mesh::<Backend, G>(args, rank, world, split)
            .and_then(|g| fsdp_rank::<Backend>(args, setup, g, sink)),
        Precision::Bf16 => split_mesh::<burn::backend::Flex<f32>, G>(args, rank, world, split)
            .and_then(|g| fsdp_rank::<burn::backend::Flex<f32>>(args, setup, g, sink)),
    }
}

/// FSDP training over in-process ranks (threads), `--world-size` of them or the ranks of
/// `--mesh`/`--hsdp`; each rank trains on its slice of every step's batch, all on the backend's
/// default device.
pub fn train_fsdp<B: burn::tensor::backend::Backend>(
    args: &TrainArgs,
    setup: Setup,
    sink: &MetricsSink,
) -> Result<Vec<StepMetrics>> {
    train_fsdp_on::<B>(args, setup, sink, |_| Default::default())
}

/// [`train_fsdp`] with rank `r` on device `device_of(r)` (e.g. one emulated MetaX device per
/// rank).
pub fn train_fsdp_on<B: burn::tensor::backend::Backend>(
    args: &TrainArgs,
    setup: Setup,
    sink: &MetricsSink,
    device_of: impl Fn(usize) -> B::Device + Sync,
) -> Result<Vec<StepMetrics>> {
    use std::panic::{AssertUnwindSafe, catch_unwind, resume_unwind};
    let topology = args.topology();
    let timeout = args.collective_timeout()?;
    let results = match topology {
        Topology::Flat(world) => launch(world, timeout, |group| {
            let rank = group.rank();
            fsdp_rank::<B>(
                args,
                &setup,
                RankGroups { topology, rank, outer: group, inner: None, gate: None, device: device_of(rank) },
                sink,
            )
        }),
        _ => {
            let (o, i) = topology.dims();
            // One inner group per outer index (rows of the mesh), one outer group per inner
            // index (columns).
            let rows: Vec<_> = (0..o).map(|_| LocalGroup::new_group(i, timeout)).collect();
            let cols: Vec<_> = (0..i).map(|_| LocalGroup::new_group(o, timeout)).collect();
            launch(topology.world(), timeout, |group| {
                let rank = group.rank();
                let (a, b) = (rank / i, rank % i);
                let (outer, inner) = (cols[b][a].clone(), rows[a][b].clone());
                let groups = RankGroups::<B> {
                    topology,
                    rank,
                    outer: outer.clone(),
                    inner: Some(inner.clone()),
                    gate: Some(group.clone()),
                    device: device_of(rank),
                };
                // A failing rank aborts its mesh groups too, so that no peer waits for it.
                let fail = |why: &str| {
                    outer.fail(why);
                    inner.fail(why);
                };
                match catch_unwind(AssertUnwindSafe(|| fsdp_rank::<B>(args, &setup, groups, sink))) {
                    Ok(Ok(v)) => Ok(v),
                    Ok(Err(e)) => {
                        fail(&format!("rank {rank}: {e:#}"));
                        Err(e)
                    }
                    Err(p) => {
                        fail(&format!("rank {rank} panicked"));
                        resume_unwind(p)
                    }
                }
            })
        }
    }
    .map_err(|e| anyhow::anyhow!("{e}"))?;
    results.into_iter().next().context("no rank ran")
}

/// The FSDP policy the flags ask for.
pub fn fsdp_config(args: &TrainArgs) -> FsdpConfig {
    let mp_policy = match args.mixed_precision {
        Precision::Fp32 => MixedPrecisionPolicy::default(),
        Precision::Bf16 => MixedPrecisionPolicy {
            param_dtype: Some(DType::BF16),
            reduce_dtype: Some(DType::F32),
            output_dtype: None,
        },
    };
    FsdpConfig {
        reshard_after_forward: args.reshard_after_forward.unwrap_or(true),
        mp_policy,
        offload: OffloadPolicy { enabled: args.offload },
        prefetch: !args.no_prefetch,
        units: qwen3_burn::parallelize::fsdp_units(),
        ..FsdpConfig::default()
    }
}

/// One FSDP rank's training loop (any process groups: in-process threads or MPI processes).
/// Data rank `d` trains on rows `d·rows/data_world ..` of every step; rank 0 emits the
/// metrics and records the collectives of the last step.
///
/// A collective that fails inside forward or backward (a peer died, timed out or failed)
/// unwinds with a [`burn_fsdp::CollectiveFailure`]; it comes back here as an error naming
/// the step, e.g. `step 7: FSDP unit `model.layers.0`: all_gather … aborted: rank 2 failed: …`.
pub fn fsdp_rank<B: burn::tensor::backend::Backend>(
    args: &TrainArgs,
    setup: &Setup,
    groups: RankGroups<B>,
    sink: &MetricsSink,
) -> Result<Vec<StepMetrics>> {
    use std::panic::{AssertUnwindSafe, catch_unwind, resume_unwind};
    burn_fsdp::comm::quiet_collective_panics();
    let at = std::cell::Cell::new(None);
    let run = || match regathers(args, groups.topology.shard_world()) {
        true => fsdp_rank_steps::<B, BalancedCheckpointing>(args, setup, groups, sink, &at),
        false => fsdp_rank_steps::<B, NoCheckpointing>(args, setup, groups, sink, &at),
    };
    match catch_unwind(AssertUnwindSafe(run)) {
        Ok(r) => r,
        Err(p) if p.is::<burn_fsdp::CollectiveFailure>() => {
            let what = burn_fsdp::comm::panic_message(p.as_ref());
            Err(match at.get() {
                Some(step) => anyhow::anyhow!("step {step}: {what}"),
                None => anyhow::anyhow!("setting up: {what}"),
            })
        }
        Err(p) => resume_unwind(p),
    }
}

/// [`fsdp_rank`]'s body on `Autodiff<B, C>` (see [`regathers`]); `at` is the step under way.
fn fsdp_rank_steps<B: burn::tensor::backend::Backend, C: CheckpointStrategy>(
    args: &TrainArgs,
    setup: &Setup,
    groups: RankGroups<B>,
    sink: &MetricsSink,
    at: &std::cell::Cell<Option<usize>>,
) -> Result<Vec<StepMetrics>> {
    type Ad<B, C> = burn::backend::Autodiff<B, C>;
    let RankGroups { topology, rank, outer, inner, gate, device } = groups;
    let Setup { config, model, batches, steps, resume } = setup;
    let steps = *steps;
    let model_config = serde_json::to_value(config)?;
    let (data_rank, data_world) = (topology.data_rank(rank), topology.data_world());
    let rows_per_rank = batches.rows / data_world;
    let micro = args.grad_accum;
    let rows_per_micro = rows_per_rank / micro;
    let mut tp = None;
    let mut fsdp = match (topology, &inner) {
        // Tensor parallelism splits whole parameters first: this rank builds the model, then
        // keeps its TP slices and FSDP shards of them.
        (Topology::DpTp { .. }, Some(tp_group)) => {
            let replica = model.model::<Ad<B, C>>(config, &device)?;
            let (m, plan) =
                TensorParallel::apply(replica, tp_group.clone(), qwen3_burn::parallelize::tp_plan(config))?;
            tp = Some(plan);
            Fsdp::wrap(m, &DeviceMesh::new_1d(outer.clone(), device.clone()), fsdp_config(args))?
        }
        // Otherwise the rank creates only its own shards (no full copy of any parameter).
        (topology, inner) => {
            let mesh = match (topology, inner) {
                (Topology::Hsdp { .. }, Some(shard)) => {
                    DeviceMesh::new_2d(("replicate", outer.clone()), ("shard", shard.clone()), device.clone())
                }
                _ => DeviceMesh::new_1d(outer.clone(), device.clone()),
            };
            let skeleton = model.skeleton::<Ad<B, C>>(config, &device);
            Fsdp::wrap_deferred(skeleton, &mesh, fsdp_config(args), model.shards())?
        }
    };
    let mut optim = args.adamw().init();
    let first_step = match resume {
        Some(dir) => fsdp.load_sharded_with(dir, &mut optim, &model_config, tp.as_ref())?.step as usize,
        None => 0,
    };
    let schedule = args.lr_schedule(steps);
    let mut out = Vec::with_capacity(steps);
    for step in first_step..steps {
        at.set(Some(step));
        let start = Instant::now();
        let lr = schedule.lr_at(step);
        optim.set_lr(lr);
        let before = (outer.stats(), inner.as_ref().map(|g| g.stats()));
        let prefetch_before = fsdp.prefetch_stats().unwrap_or_default();
        let mut loss_sum = 0.0;
        let mut grads = None;
        for m in 0..micro {
            fsdp.set_requires_gradient_sync(m + 1 == micro);
            let first_row = data_rank * rows_per_rank + m * rows_per_micro;
            let tokens = batches.rows::<Ad<B, C>>(step, first_row..first_row + rows_per_micro, &device);
            let (inputs, labels) = inputs_and_labels(tokens);
            let chunk = loss_chunk_rows(config.vocab_size, LOSS_CHUNK_BYTES);
            let loss_of = |model: &Qwen3<Ad<B, C>>, hidden: Tensor<Ad<B, C>, 3>| {
                chunked_cross_entropy(hidden, model.head_weight(), labels, chunk).div_scalar(micro as f64)
            };
            let backward_gate = || match &gate {
                Some(gate) => gate.barrier(&burn_fsdp::Tag::new("backward-gate")),
                None => Ok(()),
            };
            grads = Some(match (args.activation_checkpointing, &tp) {
                (ActivationCheckpointing::Block, None) => {
                    let run = fsdp.forward_checkpointed(|model, runner| {
                        loss_of(model, model.hidden_with(inputs, runner))
                    });
                    loss_sum += run.loss().into_scalar().elem::<f64>();
                    backward_gate()?;
                    fsdp.backward_checkpointed(run)
                }
                (_, tp) => {
                    let loss = fsdp.forward(|model, runner| {
                        let hidden = match tp {
                            Some(tp) => model.hidden_hooked(inputs, runner, &tp.hooks()),
                            None => model.hidden_with(inputs, runner),
                        };
                        loss_of(model, hidden)
                    });
                    loss_sum += loss.clone().into_scalar().elem::<f64>();
                    backward_gate()?;
                    fsdp.gradients(loss.backward())
                }
            });
        }
        let mut grads = grads.context("no micro-batch ran")?;
        let grad_norm = match &tp {
            Some(tp) => {
                tp.reduce_partial_grads::<Ad<B, C>, _>(fsdp.module(), &mut grads)?;
                fsdp.clip_grad_norm_tp(&mut grads, args.clip.unwrap_or(0.0), tp)?
            }
            None => fsdp.clip_grad_norm(&mut grads, args.clip.unwrap_or(0.0))?,
        };
        let loss = fsdp.all_reduce_scalar(loss_sum, ReduceOp::Avg, "loss")?;
        // The loss and the norm are global: every rank takes the same branch.
        let finite = loss.is_finite() && grad_norm.is_finite();
        let nonfinite_rank = if finite {
            fsdp.step(&mut optim, grads);
            None
        } else {
            // The lowest data-parallel rank whose own loss was not finite, as
            // world - max(world - r) (0 from ranks whose loss was finite).
            let mine = if loss_sum.is_finite() { 0.0 } else { (data_world - data_rank) as f64 };
            let max = fsdp.all_reduce_scalar(mine, ReduceOp::Max, "nonfinite-rank")?;
            (max > 0.0).then(|| data_world - max.round() as usize)
        };
        let metrics = StepMetrics {
            step,
            loss,
            grad_norm,
            lr,
            tokens_per_sec: (batches.rows * (batches.width - 1)) as f64
                / start.elapsed().as_secs_f64().max(1e-9),
            nonfinite_rank,
        };
        if rank == 0 {
            sink.emit(&metrics)?;
            let mut c = collectives_json(topology, &before, &outer, inner.as_ref());
            if let (Some(now), Some(obj)) = (fsdp.prefetch_stats(), c.as_object_mut()) {
                obj.insert("overlap".into(), overlap_json(&now, &prefetch_before));
            }
            sink.set_collectives(c);
        }
        out.push(metrics);
        if !finite {
            break;
        }
        if let Some(save_dir) = &args.save_dir {
            let done = step + 1;
            if args.save_every.map_or(done == steps, |k| done % k == 0 || done == steps) {
                let dir = save_dir.join(format!("step-{done:06}"));
                match &tp {
                    Some(tp) => fsdp.save_sharded_tp(&dir, &optim, done as u64, &model_config, tp)?,
                    None => fsdp.save_sharded(&dir, &optim, done as u64, &model_config)?,
                }
                if rank == 0 && !args.quiet {
                    println!("saved sharded checkpoint {}", dir.display());
                }
            }
        }
    }
    if let Some(dir) = &args.export {
        let params = match &tp {
            Some(tp) => fsdp.full_parameters_tp(tp)?,
            None => fsdp.full_parameters()?,
        };
        if rank == 0 {
            export_hf(config, params, dir)?;
            if !args.quiet {
                println!("exported HF checkpoint {}", dir.display());
            }
        }
    }
    Ok(out)
}

/// What overlap did in one step (FSDP's communication thread), as JSON for `summary.json`:
/// gathers that were prefetched vs issued on demand (exposed), asynchronous reduce-scatters,
/// and the seconds the compute thread waited for communication.
fn overlap_json(
    now: &burn_fsdp::prefetch::PrefetchStats,
    then: &burn_fsdp::prefetch::PrefetchStats,
) -> serde_json::Value {
    serde_json::json!({
        "forward_gathers_prefetched": now.forward_prefetched - then.forward_prefetched,
        "forward_gathers_exposed": now.forward_on_demand - then.forward_on_demand,
        "backward_gathers_prefetched": now.backward_prefetched - then.backward_prefetched,
        "backward_gathers_exposed": now.backward_on_demand - then.backward_on_demand,
        "async_reduce_scatters": now.async_reduce_scatters - then.async_reduce_scatters,
        "wait_seconds": (now.wait_nanos - then.wait_nanos) as f64 * 1e-9,
    })
}

/// Collectives issued by one step, per mesh dimension, as JSON for `summary.json`.
fn collectives_json<B: burn::tensor::backend::Backend>(
    topology: Topology,
    before: &(burn_fsdp::CommStats, Option<burn_fsdp::CommStats>),
    outer: &std::sync::Arc<dyn burn_fsdp::ProcessGroup<B>>,
    inner: Option<&std::sync::Arc<dyn burn_fsdp::ProcessGroup<B>>>,
) -> serde_json::Value {
    let counts = |now: burn_fsdp::CommStats, then: burn_fsdp::CommStats| {
        let d = now.since(&then);
        let mut m = serde_json::Map::new();
        for k in burn_fsdp::CollectiveKind::ALL {
            m.insert(k.name().to_owned(), d.calls(k).into());
        }
        serde_json::Value::Object(m)
    };
    let names = match topology {
        Topology::Flat(_) => ("dp", ""),
        Topology::DpTp { .. } => ("dp", "tp"),
        Topology::Hsdp { .. } => ("replicate", "shard"),
    };
    let mut m = serde_json::Map::new();
    m.insert(names.0.to_owned(), counts(outer.stats(), before.0));
    if let (Some(g), Some(b)) = (inner, before.1) {
        m.insert(names.1.to_owned(), counts(g.stats(), b));
    }
    serde_json::Value::Object(m)
}

/// Writes full parameters as an HF checkpoint (`config.json` + `model.safetensors`).
pub fn export_hf(
    config: &Qwen3Config,
    params: Vec<(String, Vec<usize>, burn::tensor::TensorData)>,
    dir: &std::path::Path,
) -> Result<()> {
    let tensors = params
        .into_iter()
        .map(|(name, shape, data)| {
            let v = data.convert::<f32>().to_vec::<f32>().map_err(|e| anyhow::anyhow!("{name}: {e:?}"))?;
            Ok((name, TensorOut::F32(shape, v)))
        })
        .collect::<Result<Vec<_>>>()?;
    std::fs::create_dir_all(dir).with_context(|| format!("creating {}", dir.display()))?;
    let meta = std::collections::HashMap::from([("format".to_owned(), "pt".to_owned())]);
    write_safetensors(dir.join(qwen3_burn::checkpoint::WEIGHTS_FILE), tensors, Some(meta))?;
    config.save(dir)?;
    Ok(())
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
