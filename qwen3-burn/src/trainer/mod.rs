//! One training loop for Qwen3 — single device, FSDP, HSDP, FSDP × tensor parallelism and CPU
//! offload — as a library: `cargo xtask train-qwen3` only parses flags and calls it.
//!
//! The loop ([`train`]) takes the model's config and initial weights ([`InitialWeights`]),
//! the token batches ([`Batches`]), the optimizer and schedule ([`TrainOptions`]) and where
//! this process stands ([`Parallelism`]): one device without FSDP, or one rank of a mesh
//! ([`RankGroups`]: in-process threads, MPI or TCP processes, GPU communicators). Single-device
//! training is the no-FSDP, one-rank case of the same loop, not a second copy of it. What a
//! run reports goes through a [`TrainSink`] (metrics, progress, the collectives of each step,
//! checkpoints written); sharded checkpoints and the HF export are [`TrainOptions`] fields.
//!
//! The parallelism is applied from outside the model, as torchtitan does: the units and the
//! tensor-parallel plan come from [`crate::parallelize`], and [`crate::model`] knows nothing of
//! them.
//!
//! | file | what |
//! |---|---|
//! | `mod.rs` | options, metrics, the sink, errors |
//! | `weights.rs` | where the initial weights come from ([`InitialWeights`]) |
//! | `mesh.rs` | rank layouts ([`Topology`], [`RankGroups`]) and in-process ranks ([`train_in_process`]) |
//! | `engine.rs` | one step's model work: the single-device model or the FSDP-wrapped one |
//! | `run.rs` | the loop ([`train`]) |
//!
//! # Example
//!
//! Two steps of the tiny Qwen3 fixture, on one device and with FSDP over two in-process ranks:
//!
//! ```
//! use burn::backend::NdArray;
//! use qwen3_burn::Qwen3Config;
//! use qwen3_burn::train::Batches;
//! use qwen3_burn::trainer::{
//!     InitialWeights, NoSink, Parallelism, Topology, TrainOptions, train, train_in_process,
//! };
//!
//! # fn main() -> Result<(), Box<dyn std::error::Error>> {
//! let dir = std::path::Path::new("../tests/fixtures/qwen3-tiny-a");
//! let config = Qwen3Config::from_file(dir.join("config.json"))?;
//! let weights = InitialWeights::checkpoint(&config, dir)?;
//! let batches = Batches::load(dir.join("batches.safetensors"))?;
//! let options = TrainOptions::new(2);
//!
//! let single = train::<NdArray>(Parallelism::Single(Default::default()), &config, &weights, &batches, &options, &NoSink)?;
//! let fsdp = train_in_process::<NdArray>(Topology::Flat(2), &config, &weights, &batches, &options, &NoSink, |_| {
//!     Default::default()
//! })?;
//! assert_eq!(single.len(), 2);
//! assert!((single[1].loss - fsdp[1].loss).abs() < 1e-5 * single[1].loss);
//! # Ok(())
//! # }
//! ```

mod engine;
mod mesh;
mod run;
mod weights;

use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::time::Duration;

use burn_fsdp::checkpoint::CheckpointError;
use burn_fsdp::comm::local::RankError;
use burn_fsdp::tp::TpError;
use burn_fsdp::{CommError, FsdpConfig, FsdpError, TorchAdamWConfig};
use serde::Serialize;

pub use crate::train::Batches;
pub use mesh::{RankGroups, Topology, split_mesh, train_in_process};
pub use run::{export_hf, train};
pub use weights::InitialWeights;

use crate::Qwen3Error;

/// Bytes of one `[rows, vocab]` f32 piece of the chunked loss: the full-vocabulary logits of a
/// batch never exist at once, only pieces of about this size
/// ([`loss_chunk_rows`](crate::train::loss_chunk_rows)).
pub const LOSS_CHUNK_BYTES: usize = 64 << 20;

/// Where this process stands in a run.
pub enum Parallelism<B: burn::tensor::backend::Backend> {
    /// One device, no FSDP: the reference every sharded run is compared with.
    Single(B::Device),
    /// One rank of a mesh: FSDP over its shard group (flat, HSDP), or FSDP over data-parallel
    /// ranks of tensor-parallel slices.
    Sharded(RankGroups<B>),
}

/// A learning rate per step (0-based), e.g. a warmup-then-decay schedule.
pub type LrFn = Arc<dyn Fn(usize) -> f64 + Send + Sync>;

/// What [`train`] runs: steps, micro-batches, the optimizer and its schedule, FSDP's policy,
/// checkpoints.
#[derive(Clone)]
pub struct TrainOptions {
    /// Train steps `0..steps` (from the checkpoint's step when resuming) of the batches.
    pub steps: usize,
    /// Micro-batches per step: each rank's rows of a step are split into this many, whose
    /// gradients add up (without gradient sync until the last, as FSDP2's
    /// `set_requires_gradient_sync(False)`).
    pub grad_accum: usize,
    /// Clip gradients to this global L2 norm (`None` or 0: only measure it).
    pub clip: Option<f64>,
    /// Keep only each decoder layer's input through forward and run the layer again in
    /// backward (block activation checkpointing).
    pub activation_checkpointing: bool,
    /// AdamW (PyTorch's update; `lr` is replaced by [`lr`](Self::lr) each step).
    pub optimizer: TorchAdamWConfig,
    /// The learning rate of each step.
    pub lr: LrFn,
    /// FSDP's policy (sharded runs only): reshard after forward, mixed precision, offload,
    /// prefetch, units ([`crate::parallelize::fsdp_units`] by default).
    pub fsdp: FsdpConfig,
    /// Resume from this sharded checkpoint directory (sharded runs only).
    pub resume: Option<PathBuf>,
    /// Save sharded checkpoints (sharded runs only).
    pub save: Option<SavePolicy>,
    /// After training, write the model as an HF checkpoint (`config.json` +
    /// `model.safetensors`) into this directory (rank 0 writes; every rank gathers).
    pub export: Option<PathBuf>,
    /// How long a rank of [`train_in_process`] waits for its peers in a collective before it
    /// fails (and the job with it). Process groups made elsewhere carry their own.
    pub timeout: Duration,
}

impl TrainOptions {
    /// `steps` steps of AdamW with PyTorch's defaults at a constant learning rate, one
    /// micro-batch per step, no clipping, FSDP's default policy over Qwen3's decoder layers.
    pub fn new(steps: usize) -> Self {
        let optimizer = TorchAdamWConfig::default();
        let lr = optimizer.lr;
        Self {
            steps,
            grad_accum: 1,
            clip: None,
            activation_checkpointing: false,
            optimizer,
            lr: Arc::new(move |_| lr),
            fsdp: FsdpConfig { units: crate::parallelize::fsdp_units(), ..FsdpConfig::default() },
            resume: None,
            save: None,
            export: None,
            timeout: Duration::from_secs(300),
        }
    }

    /// Whether an FSDP rank's backward has anything to re-gather, i.e. whether it needs
    /// `Autodiff<B, BalancedCheckpointing>`. Nothing does when every unit's shard is the
    /// whole parameter (one rank per shard group) or units stay gathered
    /// (`reshard_after_forward` off), without offload (whose shards live on the host) or block
    /// checkpointing (which re-runs blocks); then the rank trains on `Autodiff<B>` without
    /// recomputation — balanced checkpointing would also recompute every memory-bound op of
    /// the model in backward (~4 % of a step on a CPU). Both give the same values.
    pub fn regathers(&self, shard_world: usize) -> bool {
        let resharded = self.fsdp.reshard_after_forward && shard_world > 1;
        resharded || self.fsdp.offload.enabled || self.activation_checkpointing
    }
}

/// When to save sharded checkpoints ([`TrainOptions::save`]).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct SavePolicy {
    /// Checkpoints go to `dir/step-NNNNNN/` (the number of steps done).
    pub dir: PathBuf,
    /// Every this many steps, and after the last; `None`: after the last step only.
    pub every: Option<usize>,
}

/// One step's figures.
#[derive(Debug, Clone, Copy, PartialEq, Serialize)]
pub struct StepMetrics {
    /// Step index (into the batches).
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

/// Where a run reports to: rank 0 calls it (the single device is rank 0). Shared by the
/// in-process ranks of a job, hence `Sync`. Every method but [`step`](Self::step) does nothing
/// by default.
pub trait TrainSink: Sync {
    /// One step done (metrics, progress).
    fn step(&self, metrics: &StepMetrics) -> Result<(), TrainError>;
    /// The collectives the step issued, per mesh dimension, and what overlap did (FSDP).
    fn collectives(&self, per_step: serde_json::Value) {
        let _ = per_step;
    }
    /// Where rank 0's time of the step went (called after [`step`](Self::step)).
    fn step_timing(&self, timing: &StepTiming) {
        let _ = timing;
    }
    /// A sharded checkpoint was written to `dir`.
    fn checkpoint_saved(&self, dir: &Path) {
        let _ = dir;
    }
    /// The HF checkpoint was written to `dir`.
    fn exported(&self, dir: &Path) {
        let _ = dir;
    }
}

/// Rank 0's wall time of one step, by phase ([`TrainSink::step_timing`]).
#[derive(Debug, Clone, Copy, PartialEq, Serialize)]
pub struct StepTiming {
    /// Step index (into the batches).
    pub step: usize,
    /// The whole step, as in [`StepMetrics::tokens_per_sec`].
    pub seconds: f64,
    /// Forward, loss and backward of every micro-batch, the gradient norm and clipping (and
    /// FSDP's collectives that were not overlapped).
    pub forward_backward_seconds: f64,
    /// The optimizer step (on this rank's shards under FSDP).
    pub optimizer_seconds: f64,
}

/// A sink that keeps nothing (the metrics are still [`train`]'s result).
#[derive(Debug, Clone, Copy, Default)]
pub struct NoSink;

impl TrainSink for NoSink {
    fn step(&self, _: &StepMetrics) -> Result<(), TrainError> {
        Ok(())
    }
}

/// Why training failed.
#[derive(Debug, thiserror::Error)]
pub enum TrainError {
    /// The model, its weights or a file.
    #[error(transparent)]
    Model(#[from] Qwen3Error),
    /// FSDP (wrapping, clipping, the optimizer step, gathering for export).
    #[error(transparent)]
    Fsdp(#[from] FsdpError),
    /// A sharded checkpoint.
    #[error(transparent)]
    Checkpoint(#[from] CheckpointError),
    /// Tensor parallelism.
    #[error(transparent)]
    TensorParallel(#[from] TpError),
    /// A collective of the loop itself (the backward gate, tensor-parallel reductions).
    #[error(transparent)]
    Comm(#[from] CommError),
    /// An in-process rank failed ([`train_in_process`]).
    #[error(transparent)]
    Rank(#[from] RankError),
    /// A collective failed inside forward or backward of step `step` (`None`: while setting
    /// up): a peer died, timed out or failed.
    #[error("{}: {message}", step.map_or("setting up".to_owned(), |s| format!("step {s}")))]
    Collective {
        /// The step under way.
        step: Option<usize>,
        /// The collective's failure.
        message: String,
    },
    /// The options do not fit the run.
    #[error("{0}")]
    Invalid(String),
    /// The sink failed (e.g. writing the metrics file).
    #[error("{0}")]
    Sink(String),
}
