//! The flags of `train-qwen3` ([`TrainArgs`]) and their values.

use std::path::PathBuf;

use anyhow::{Result, bail};
use burn_fsdp::TorchAdamWConfig;
use qwen3_burn::trainer::Topology;
use serde::Serialize;

use crate::schedule::{LrSchedule, WarmupDecay};

/// Arguments of `train-qwen3`.
///
/// A flag that the chosen mode would ignore is refused by [`run`](super::run), naming it (e.g. `--seq`
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
    /// Directory for this run's metrics.jsonl, summary.json and profile.jsonl (where each step's
    /// time went) (default: runs/<timestamp>).
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
    /// Where each rank computes: `cpu` (burn's Flex or NdArray: `--cpu-backend`); `metax-emu`, the emulated
    /// MetaX device (in-process ranks, one emulated device each, or `--no-fsdp`); or one GPU
    /// per process with device collectives: `metax` (MCCL) or `cuda-proxy` (NCCL; xtask built
    /// with `--features cuda`), under `--launcher env` (the GPU is `LOCAL_RANK`). `cuda-proxy`
    /// also runs in this process on GPU 0 (`--no-fsdp`, or in-process ranks sharing it with
    /// host collectives; xtask built with `--features cuda-proxy`). `cuda` is Burn's own CUDA
    /// backend (burn-cuda) in this process: `--no-fsdp` on GPU 0, or in-process ranks spread
    /// over the visible GPUs, host collectives (xtask built with `--features burn-cuda`).
    #[arg(long, value_enum, default_value_t = DeviceKind::Cpu)]
    pub device: DeviceKind,
    /// The Burn backend of `--device cpu` in fp32: `flex` (burn's Flex: matrix products by the
    /// `gemm` crate, with AVX-512 kernels where the CPU has them; the fastest measured, and
    /// deterministic run to run) or `ndarray` (burn's NdArray, the reference configuration of
    /// the parity tests). bf16 mixed precision always runs on Flex (NdArray has no bf16).
    #[arg(long, value_enum, default_value_t = CpuBackend::DEFAULT)]
    pub cpu_backend: CpuBackend,
    /// How in-process ranks on emulated MetaX devices (`--device metax-emu`, flat FSDP)
    /// communicate: `device` (the default: collectives run on the devices' streams, device
    /// memory to device memory, and no byte goes through the host) or `host` (burn-fsdp's
    /// `LocalGroup`: each collective reads its input to the host and writes the result back).
    /// `--mesh`/`--hsdp` always use `host`.
    #[arg(long, value_enum, default_value_t = InProcessCollectives::Device)]
    pub in_process_collectives: InProcessCollectives,
    /// Collective timeout in seconds: a rank that waits longer for its peers fails with an
    /// error (and so does the job). Meaningless on one device: refused with `--no-fsdp`.
    #[arg(long, default_value_t = 120.0, conflicts_with = "no_fsdp")]
    pub timeout: f64,
}

/// `--in-process-collectives` values.
#[derive(Debug, Clone, Copy, PartialEq, Eq, clap::ValueEnum, Serialize)]
#[serde(rename_all = "kebab-case")]
pub enum InProcessCollectives {
    /// On the devices' streams (emulated MetaX devices).
    Device,
    /// Through host memory (burn-fsdp's `LocalGroup`).
    Host,
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

/// `--device` values.
#[derive(Debug, Clone, Copy, PartialEq, Eq, clap::ValueEnum, Serialize)]
#[serde(rename_all = "kebab-case")]
pub enum DeviceKind {
    /// The CPU (host-buffer collectives of the launcher).
    Cpu,
    /// A MetaX GPU per process, MCCL collectives on device buffers.
    Metax,
    /// An NVIDIA GPU through the MetaX runtime's CUDA proxy: one per process with NCCL
    /// collectives (`--launcher env`), or GPU 0 shared by in-process ranks (host collectives).
    CudaProxy,
    /// Burn's own CUDA backend (burn-cuda's `Cuda`: CubeCL's CUDA runtime, fusion, autotune) in
    /// this process: GPU 0 alone, or in-process ranks spread over the visible GPUs with host
    /// collectives.
    Cuda,
    /// The emulated MetaX device (the MetaX backend's kernels compiled by the host C++ compiler
    /// and run on the CPU at wave size 64): each in-process rank on its own emulated device,
    /// device collectives (`--in-process-collectives`). Needs g++ or clang++ (`scripts/setup.sh`).
    MetaxEmu,
}

impl DeviceKind {
    /// The flag value.
    pub fn name(self) -> &'static str {
        match self {
            DeviceKind::Cpu => "cpu",
            DeviceKind::Metax => "metax",
            DeviceKind::CudaProxy => "cuda-proxy",
            DeviceKind::Cuda => "cuda",
            DeviceKind::MetaxEmu => "metax-emu",
        }
    }
}

/// `--cpu-backend` values.
#[derive(Debug, Clone, Copy, PartialEq, Eq, clap::ValueEnum, Serialize)]
#[serde(rename_all = "kebab-case")]
pub enum CpuBackend {
    /// burn's NdArray (`matrixmultiply` products).
    #[value(name = "ndarray")]
    NdArray,
    /// burn's Flex (`gemm` products, SIMD element-wise kernels).
    Flex,
}

impl CpuBackend {
    /// `train-qwen3`'s default (and `bench`'s).
    pub const DEFAULT: CpuBackend = CpuBackend::Flex;

    /// The backend that trains at `precision`: this one in fp32, Flex in bf16 (NdArray has
    /// no bf16).
    pub fn at(self, precision: Precision) -> CpuBackend {
        match precision {
            Precision::Fp32 => self,
            Precision::Bf16 => CpuBackend::Flex,
        }
    }

    /// The flag value.
    pub fn name(self) -> &'static str {
        match self {
            CpuBackend::NdArray => "ndarray",
            CpuBackend::Flex => "flex",
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

pub(crate) fn parse_mesh(s: &str) -> std::result::Result<(usize, usize), String> {
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
