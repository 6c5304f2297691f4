//! The training loop: the same steps for one device and for every rank of a sharded job.

use std::cell::Cell;
use std::ops::Range;
use std::panic::{AssertUnwindSafe, catch_unwind, resume_unwind};
use std::path::Path;
use std::time::Instant;

use burn::backend::autodiff::checkpoint::strategy::{
    BalancedCheckpointing, CheckpointStrategy, NoCheckpointing,
};
use burn::optim::GradientsParams;
use burn::tensor::backend::Backend;
use burn::tensor::{Tensor, TensorData};
use burn_fsdp::{ReduceOp, StepParts, StepReport, StepValue, take_step};

use super::engine::{Engine, Placement};
use super::{
    InitialWeights, LOSS_CHUNK_BYTES, Parallelism, StepMetrics, StepTiming, TrainError, TrainOptions,
    TrainSink,
};
use crate::checkpoint::{TensorOut, WEIGHTS_FILE, write_hf_checkpoint};
use crate::train::{Batches, loss_chunk_rows};
use crate::{Qwen3Config, Qwen3Error};

/// Trains Qwen3 `config` from `weights` on `batches` as `options` say, on one device or as one
/// rank of a sharded job ([`Parallelism`]); returns the metrics of the steps run (each also
/// given to `sink` on rank 0).
///
/// Every step is [`burn_fsdp::take_step`] — the generic step any model's loop can take, also
/// behind [`burn_fsdp::Fsdp::train_step`] — over this model: each data-parallel rank takes its
/// rows of the step's global batch (data rank
/// `d` of `D`: rows `d·R/D ..`), in [`TrainOptions::grad_accum`] micro-batches; forward and
/// backward through the chunked loss ([`chunked_cross_entropy`](crate::train::chunked_cross_entropy));
/// the global gradient norm, clipped; the loss averaged over the data-parallel ranks; the
/// AdamW step at the schedule's learning rate. Training stops after the first step whose loss
/// or gradient norm is not finite, before its update (its metrics name the lowest rank whose
/// loss was not finite). Sharded checkpoints are saved as [`TrainOptions::save`] says; with
/// [`TrainOptions::export`] the model is written as an HF checkpoint at the end.
///
/// A sharded rank trains on `Autodiff<B, BalancedCheckpointing>` when its backward has
/// parameters to re-gather ([`TrainOptions::regathers`]), else on `Autodiff<B>`; one device
/// always on `Autodiff<B>`. A collective that fails inside forward or backward (a peer died,
/// timed out or failed) comes back as [`TrainError::Collective`] naming the step.
///
/// # Errors
/// Options that do not fit the batches or the parallelism ([`TrainError::Invalid`]), weights
/// that do not fit the config, failed collectives, checkpoints that cannot be read or written,
/// and a sink that fails.
pub fn train<B: Backend>(
    parallelism: Parallelism<B>,
    config: &Qwen3Config,
    weights: &InitialWeights,
    batches: &Batches,
    options: &TrainOptions,
    sink: &dyn TrainSink,
) -> Result<Vec<StepMetrics>, TrainError> {
    check(&parallelism, batches, options)?;
    let shard_world = match &parallelism {
        Parallelism::Single(_) => {
            let at = Cell::new(None);
            return steps::<B, NoCheckpointing>(parallelism, config, weights, batches, options, sink, &at);
        }
        Parallelism::Sharded(groups) => groups.topology.shard_world(),
    };
    burn_fsdp::comm::quiet_collective_panics();
    let at = Cell::new(None);
    let run = || match options.regathers(shard_world) {
        true => steps::<B, BalancedCheckpointing>(parallelism, config, weights, batches, options, sink, &at),
        false => steps::<B, NoCheckpointing>(parallelism, config, weights, batches, options, sink, &at),
    };
    match catch_unwind(AssertUnwindSafe(run)) {
        Ok(r) => r,
        Err(p) if p.is::<burn_fsdp::CollectiveFailure>() => Err(TrainError::Collective {
            step: at.get(),
            message: burn_fsdp::comm::panic_message(p.as_ref()),
        }),
        Err(p) => resume_unwind(p),
    }
}

/// Refuses options that do not fit the batches or the parallelism.
fn check<B: Backend>(
    parallelism: &Parallelism<B>,
    batches: &Batches,
    options: &TrainOptions,
) -> Result<(), TrainError> {
    let invalid = |msg: String| Err(TrainError::Invalid(msg));
    let data_world = match parallelism {
        Parallelism::Single(_) => {
            let mp = options.fsdp.mp_policy.param_dtype.is_some();
            if options.fsdp.offload.enabled || mp {
                return invalid(
                    "offload and mixed precision are FSDP policies: train with Parallelism::Sharded (one rank is fine)"
                        .into(),
                );
            }
            1
        }
        Parallelism::Sharded(g) => g.topology.data_world(),
    };
    if options.grad_accum == 0 {
        return invalid("grad_accum must be at least 1".into());
    }
    if options.steps > batches.steps {
        return invalid(format!("{} steps asked for, but the batches hold {}", options.steps, batches.steps));
    }
    if !batches.rows.is_multiple_of(data_world) {
        return invalid(format!(
            "the global batch has {} rows, which the {data_world} data-parallel ranks do not divide",
            batches.rows
        ));
    }
    if !(batches.rows / data_world).is_multiple_of(options.grad_accum) {
        return invalid(format!(
            "each rank has {} rows per step, which {} micro-batches do not divide",
            batches.rows / data_world,
            options.grad_accum
        ));
    }
    Ok(())
}

/// [`train`]'s loop on `Autodiff<B, C>`; `at` is the step under way.
fn steps<B: Backend, C: CheckpointStrategy>(
    parallelism: Parallelism<B>,
    config: &Qwen3Config,
    weights: &InitialWeights,
    batches: &Batches,
    options: &TrainOptions,
    sink: &dyn TrainSink,
    at: &Cell<Option<usize>>,
) -> Result<Vec<StepMetrics>, TrainError> {
    let model_config = serde_json::to_value(config)
        .map_err(|e| TrainError::Invalid(format!("the model config cannot be written as JSON: {e}")))?;
    let (mut engine, place) = Engine::<B, C>::new(parallelism, config, weights, options)?;
    // This rank's parameters are made: the checkpoint's pages it read need not stay resident
    // through the run (an in-process rank still reading its rows maps them again).
    weights.release_pages();
    let Placement { rank, data_rank, data_world, device } = place;
    let mut optim = options.optimizer.init::<B>();
    let first_step = match &options.resume {
        Some(dir) => engine.resume(dir, &mut optim, &model_config)?,
        None => 0,
    };
    let (steps, micro) = (options.steps, options.grad_accum);
    let rows_per_rank = batches.rows / data_world;
    let chunk = loss_chunk_rows(config.vocab_size, LOSS_CHUNK_BYTES);
    let mut out = Vec::with_capacity(steps);
    for step in first_step..steps {
        at.set(Some(step));
        let start = Instant::now();
        let lr = (options.lr)(step);
        optim.set_lr(lr);
        let before = engine.snapshot();
        let first_row = data_rank * rows_per_rank;
        let mut parts = StepOf {
            engine: &mut engine,
            batches,
            step,
            rows: first_row..first_row + rows_per_rank,
            data: (data_rank, data_world),
            device: &device,
            chunk,
            activation_checkpointing: options.activation_checkpointing,
            update: None,
        };
        let report = take_step(&mut parts, micro, options.clip);
        let forward_backward = start.elapsed();
        if let Some(grads) = parts.update {
            engine = engine.step(&mut optim, grads);
        }
        let seconds = start.elapsed().as_secs_f64();
        let StepReport { loss, grad_norm, stepped: finite, nonfinite_rank } = report?;
        let metrics = StepMetrics {
            step,
            loss,
            grad_norm,
            lr,
            tokens_per_sec: (batches.rows * (batches.width - 1)) as f64 / seconds.max(1e-9),
            nonfinite_rank,
        };
        if rank == 0 {
            sink.step(&metrics)?;
            let forward_backward_seconds = forward_backward.as_secs_f64();
            sink.step_timing(&StepTiming {
                step,
                seconds,
                forward_backward_seconds,
                optimizer_seconds: seconds - forward_backward_seconds,
            });
            if let Some(c) = before.as_ref().and_then(|b| engine.collectives_since(b)) {
                sink.collectives(c);
            }
        }
        out.push(metrics);
        if !finite {
            break;
        }
        if let Some(save) = &options.save {
            let done = step + 1;
            if save.every.map_or(done == steps, |k| done.is_multiple_of(k) || done == steps) {
                let dir = save.dir.join(format!("step-{done:06}"));
                engine.save(&dir, &optim, done, &model_config)?;
                if rank == 0 {
                    sink.checkpoint_saved(&dir);
                }
            }
        }
    }
    if let Some(dir) = &options.export {
        engine.export(config, dir, rank == 0)?;
        if rank == 0 {
            sink.exported(dir);
        }
    }
    Ok(out)
}

/// One step's parts for [`take_step`]: the engine and this rank's rows of the step's global
/// batch. The update is left to the loop (the optimizer takes the engine by value): `apply`
/// keeps the gradients in `update`, the last thing `take_step` does when it steps.
struct StepOf<'a, B: Backend, C: CheckpointStrategy> {
    engine: &'a mut Engine<B, C>,
    batches: &'a Batches,
    step: usize,
    /// This rank's rows of the step, split evenly into the micro-batches.
    rows: Range<usize>,
    /// `(data-parallel rank, data-parallel world)`.
    data: (usize, usize),
    device: &'a B::Device,
    chunk: usize,
    activation_checkpointing: bool,
    /// The gradients to step with, once `take_step` decided to.
    update: Option<GradientsParams>,
}

impl<B: Backend, C: CheckpointStrategy> StepParts for StepOf<'_, B, C> {
    type Gradients = GradientsParams;
    type Error = TrainError;
    type Backend = B;

    fn micro_batch(&mut self, index: usize, count: usize) -> Result<Tensor<B, 1>, TrainError> {
        let per_micro = self.rows.len() / count;
        let first = self.rows.start + index * per_micro;
        let tokens = self.batches.rows(self.step, first..first + per_micro, self.device);
        self.engine.micro_batch(tokens, index, count, self.chunk, self.activation_checkpointing)
    }

    fn gradients(&mut self) -> Result<(GradientsParams, StepValue<B>), TrainError> {
        self.engine.gradients()
    }

    fn clip(&mut self, grads: &mut GradientsParams, norm: f64, max_norm: f64) -> Result<(), TrainError> {
        self.engine.clip(grads, norm, max_norm)
    }

    fn all_reduce(
        &self,
        values: Tensor<B, 1>,
        op: ReduceOp,
        tag: &str,
    ) -> Result<Option<Tensor<B, 1>>, TrainError> {
        self.engine.all_reduce(values, op, tag)
    }

    fn data_parallel(&self) -> (usize, usize) {
        self.data
    }

    fn apply(&mut self, grads: GradientsParams) -> Result<(), TrainError> {
        self.update = Some(grads);
        Ok(())
    }
}

/// Writes full parameters `(HF name, shape, values)` (e.g. FSDP's
/// [`full_parameters`](burn_fsdp::Fsdp::full_parameters)) as an HF checkpoint:
/// `config.json` + `model.safetensors` (f32) in `dir`, each file written atomically
/// ([`write_hf_checkpoint`]).
pub fn export_hf(
    config: &Qwen3Config,
    params: Vec<(String, Vec<usize>, TensorData)>,
    dir: &Path,
) -> Result<(), Qwen3Error> {
    let file = dir.join(WEIGHTS_FILE);
    let tensors = params
        .into_iter()
        .map(|(name, shape, data)| {
            let v = data
                .convert::<f32>()
                .to_vec::<f32>()
                .map_err(|e| Qwen3Error::Safetensors { path: file.clone(), msg: format!("{name}: {e:?}") })?;
            Ok((name, TensorOut::F32(shape, v)))
        })
        .collect::<Result<Vec<_>, Qwen3Error>>()?;
    write_hf_checkpoint(config, tensors, dir)
}
