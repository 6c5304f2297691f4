//! One step's model work, for each kind of run: the whole model on one device, or this rank's
//! FSDP-wrapped (and possibly tensor-parallel) model. [`run`](super::run) drives either the
//! same way.

use std::path::Path;
use std::sync::Arc;

use burn::backend::Autodiff;
use burn::backend::autodiff::checkpoint::strategy::CheckpointStrategy;
use burn::optim::{GradientsAccumulator, GradientsParams};
use burn::tensor::backend::Backend;
use burn::tensor::{Int, Tensor};
use burn_fsdp::activation_checkpointing::checkpointed;
use burn_fsdp::optim::{clip_grads_to, grad_sq_sum_device};
use burn_fsdp::prefetch::PrefetchStats;
use burn_fsdp::tp::TensorParallel;
use burn_fsdp::{
    CollectiveKind, CommStats, DeviceMesh, Direct, Fsdp, ProcessGroup, ReduceOp, StepValue, Tag, TorchAdamW,
};

use super::{InitialWeights, Parallelism, RankGroups, Topology, TrainError, TrainOptions};
use crate::Qwen3Config;
use crate::model::Qwen3;
use crate::train::{chunked_cross_entropy, inputs_and_labels};

type Ad<B, C> = Autodiff<B, C>;
/// The model's forward from token ids to final hidden states, run some way.
type HiddenOf<'a, B, C> = dyn FnMut(Tensor<Ad<B, C>, 2, Int>) -> Tensor<Ad<B, C>, 3> + 'a;

/// Where this process's work sits: its global rank, its slice of the data and its device.
pub(super) struct Placement<D> {
    pub rank: usize,
    pub data_rank: usize,
    pub data_world: usize,
    pub device: D,
}

/// The model being trained, on one device or sharded.
pub(super) enum Engine<B: Backend, C: CheckpointStrategy> {
    /// The whole model; gradients of micro-batches add up in `accum`.
    Single { model: Box<Qwen3<Ad<B, C>>>, accum: GradientsAccumulator<Qwen3<Ad<B, C>>> },
    /// This rank's FSDP shards.
    Sharded(Box<Sharded<B, C>>),
}

pub(super) struct Sharded<B: Backend, C: CheckpointStrategy> {
    fsdp: Fsdp<Ad<B, C>, Qwen3<Ad<B, C>>>,
    tp: Option<std::sync::Arc<TensorParallel<B>>>,
    topology: Topology,
    outer: Arc<dyn ProcessGroup<B>>,
    inner: Option<Arc<dyn ProcessGroup<B>>>,
    gate: Option<Arc<dyn ProcessGroup<B>>>,
    /// The gradients of the step's micro-batches (FSDP adds them up itself).
    grads: Option<GradientsParams>,
}

/// The communication counters at the start of a step.
pub(super) struct Snapshot {
    outer: CommStats,
    inner: Option<CommStats>,
    prefetch: PrefetchStats,
}

impl<B: Backend, C: CheckpointStrategy> Engine<B, C> {
    /// Builds the model where `parallelism` says: whole on one device, or (sharded) only this
    /// rank's shards — created directly from `weights`, no full copy, except under tensor
    /// parallelism, which splits whole parameters first.
    pub fn new(
        parallelism: Parallelism<B>,
        config: &Qwen3Config,
        weights: &InitialWeights,
        options: &TrainOptions,
    ) -> Result<(Self, Placement<B::Device>), TrainError> {
        let RankGroups { topology, rank, outer, inner, gate, device } = match parallelism {
            Parallelism::Single(device) => {
                let model = Box::new(weights.model::<Ad<B, C>>(config, &device)?);
                let placement = Placement { rank: 0, data_rank: 0, data_world: 1, device };
                return Ok((Self::Single { model, accum: GradientsAccumulator::new() }, placement));
            }
            Parallelism::Sharded(groups) => groups,
        };
        let mut tp = None;
        let fsdp = match (topology, &inner) {
            (Topology::DpTp { .. }, Some(tp_group)) => {
                let replica = weights.model::<Ad<B, C>>(config, &device)?;
                let (m, plan) =
                    TensorParallel::apply(replica, tp_group.clone(), crate::parallelize::tp_plan(config))?;
                let plan = std::sync::Arc::new(plan);
                tp = Some(plan.clone());
                let mesh = DeviceMesh::new_1d(outer.clone(), device.clone()).with_tensor_parallel(plan);
                Fsdp::wrap(m, &mesh, options.fsdp.clone())?
            }
            (topology, inner) => {
                let mesh = match (topology, inner) {
                    (Topology::Hsdp { .. }, Some(shard)) => DeviceMesh::new_2d(
                        ("replicate", outer.clone()),
                        ("shard", shard.clone()),
                        device.clone(),
                    ),
                    _ => DeviceMesh::new_1d(outer.clone(), device.clone()),
                };
                let skeleton = weights.skeleton::<Ad<B, C>>(config, &device);
                Fsdp::wrap_deferred(skeleton, &mesh, options.fsdp.clone(), weights.shards())?
            }
        };
        let placement = Placement {
            rank,
            data_rank: topology.data_rank(rank),
            data_world: topology.data_world(),
            device,
        };
        let sharded = Sharded { fsdp, tp, topology, outer, inner, gate, grads: None };
        Ok((Self::Sharded(Box::new(sharded)), placement))
    }

    /// Forward and backward of one micro-batch of token rows `[rows, seq + 1]`, the
    /// `index`-th of `micro`; returns its loss (divided by `micro`, as its gradients) as a
    /// one-element tensor, not read (the step reads its values once, [`burn_fsdp::take_step`]).
    pub fn micro_batch(
        &mut self,
        tokens: Tensor<Ad<B, C>, 2, Int>,
        index: usize,
        micro: usize,
        chunk: usize,
        activation_checkpointing: bool,
    ) -> Result<Tensor<B, 1>, TrainError> {
        let (inputs, labels) = inputs_and_labels(tokens);
        let scale = micro as f64;
        match self {
            Self::Single { model, accum } => {
                let loss_of = |runner: &mut HiddenOf<'_, B, C>| {
                    chunked_cross_entropy(runner(inputs), model.head_weight(), labels, chunk)
                        .div_scalar(scale)
                };
                let (loss, grads) = if activation_checkpointing {
                    let run = checkpointed(|runner| loss_of(&mut |ids| model.hidden_with(ids, runner)));
                    (run.loss().inner(), run.gradients(&**model))
                } else {
                    let loss = loss_of(&mut |ids| model.hidden_with(ids, &mut Direct));
                    let value = loss.clone().inner();
                    (value, GradientsParams::from_grads(loss.backward(), &**model))
                };
                accum.accumulate(&**model, grads);
                Ok(loss)
            }
            Self::Sharded(s) => {
                let Sharded { fsdp, tp, gate, grads, .. } = &mut **s;
                fsdp.set_requires_gradient_sync(index + 1 == micro);
                let loss_of = |model: &Qwen3<Ad<B, C>>, hidden: Tensor<Ad<B, C>, 3>| {
                    chunked_cross_entropy(hidden, model.head_weight(), labels, chunk).div_scalar(scale)
                };
                let backward_gate = || match &gate {
                    Some(gate) => gate.barrier(&Tag::new("backward-gate")),
                    None => Ok(()),
                };
                let (loss, step_grads) = match (activation_checkpointing, &tp) {
                    // Tensor-parallel layers run collectives inside them and are not recomputed.
                    (true, None) => {
                        let run = fsdp.forward_checkpointed(|model, runner| {
                            loss_of(model, model.hidden_with(inputs, runner))
                        });
                        let loss = run.loss().inner();
                        backward_gate()?;
                        (loss, fsdp.backward_checkpointed(run))
                    }
                    (_, tp) => {
                        let loss = fsdp.forward(|model, runner| {
                            let hidden = match tp {
                                Some(tp) => model.hidden_hooked(inputs, runner, &tp.hooks()),
                                None => model.hidden_with(inputs, runner),
                            };
                            loss_of(model, hidden)
                        });
                        let value = loss.clone().inner();
                        backward_gate()?;
                        (value, fsdp.gradients(loss.backward()))
                    }
                };
                *grads = Some(step_grads);
                Ok(loss)
            }
        }
    }

    /// The step's gradients (all micro-batches') and their global `Σ g²`, left on the device
    /// where it can be ([`StepValue`]).
    pub fn gradients(&mut self) -> Result<(GradientsParams, StepValue<B>), TrainError> {
        match self {
            Self::Single { model, accum } => {
                let mut grads = std::mem::replace(accum, GradientsAccumulator::new()).grads();
                let sq_sum = match grad_sq_sum_device(&**model, &mut grads) {
                    Some(t) => StepValue::Pending(t),
                    None => StepValue::Read(0.0),
                };
                Ok((grads, sq_sum))
            }
            Self::Sharded(s) => {
                let mut grads =
                    s.grads.take().ok_or_else(|| TrainError::Invalid("no micro-batch ran".into()))?;
                if let Some(tp) = &s.tp {
                    tp.reduce_partial_grads::<Ad<B, C>, _>(s.fsdp.module(), &mut grads)?;
                }
                let sq_sum = s.fsdp.grad_sq_sum(&mut grads)?;
                Ok((grads, sq_sum))
            }
        }
    }

    /// Scales `grads` to the global L2 norm `max_norm`, their norm being `norm`.
    pub fn clip(&self, grads: &mut GradientsParams, norm: f64, max_norm: f64) -> Result<(), TrainError> {
        match self {
            Self::Single { model, .. } => {
                clip_grads_to(&**model, grads, norm, max_norm);
                Ok(())
            }
            Self::Sharded(s) => Ok(s.fsdp.clip_grads(grads, norm, max_norm)?),
        }
    }

    /// `values` reduced over the data-parallel ranks, on the device; `None` on one device.
    pub fn all_reduce(
        &self,
        values: Tensor<B, 1>,
        op: ReduceOp,
        tag: &str,
    ) -> Result<Option<Tensor<B, 1>>, TrainError> {
        match self {
            Self::Single { .. } => Ok(None),
            Self::Sharded(s) => Ok(s.fsdp.all_reduce_data_parallel(values, op, tag)?),
        }
    }

    /// The optimizer step.
    pub fn step(self, optim: &mut TorchAdamW<B>, grads: GradientsParams) -> Self {
        match self {
            Self::Single { model, accum } => {
                Self::Single { model: Box::new(optim.step(*model, grads)), accum }
            }
            Self::Sharded(mut s) => {
                s.fsdp.step(optim, grads);
                Self::Sharded(s)
            }
        }
    }

    /// The communication counters now (`None` on one device).
    pub fn snapshot(&self) -> Option<Snapshot> {
        match self {
            Self::Single { .. } => None,
            Self::Sharded(s) => Some(Snapshot {
                outer: s.outer.stats(),
                inner: s.inner.as_ref().map(|g| g.stats()),
                prefetch: s.fsdp.prefetch_stats().unwrap_or_default(),
            }),
        }
    }

    /// The collectives issued since `then`, per mesh dimension (calls per kind, and under
    /// `bytes` the bytes this rank contributed per kind), and what overlap did (FSDP's
    /// communication thread), as JSON.
    pub fn collectives_since(&self, then: &Snapshot) -> Option<serde_json::Value> {
        let Self::Sharded(s) = self else { return None };
        let counts = |now: CommStats, then: CommStats| {
            let d = now.since(&then);
            let mut m = serde_json::Map::new();
            let mut bytes = serde_json::Map::new();
            for k in CollectiveKind::ALL {
                m.insert(k.name().to_owned(), d.calls(k).into());
                bytes.insert(k.name().to_owned(), d.bytes(k).into());
            }
            // The bytes this rank contributed, per kind (`CommStats::bytes`).
            m.insert("bytes".to_owned(), serde_json::Value::Object(bytes));
            serde_json::Value::Object(m)
        };
        let names = match s.topology {
            Topology::Flat(_) => ("dp", ""),
            Topology::DpTp { .. } => ("dp", "tp"),
            Topology::Hsdp { .. } => ("replicate", "shard"),
        };
        let mut m = serde_json::Map::new();
        m.insert(names.0.to_owned(), counts(s.outer.stats(), then.outer));
        if let (Some(g), Some(b)) = (&s.inner, then.inner) {
            m.insert(names.1.to_owned(), counts(g.stats(), b));
        }
        if let Some(now) = s.fsdp.prefetch_stats() {
            let was = &then.prefetch;
            let overlap = serde_json::json!({
                "forward_gathers_prefetched": now.forward_prefetched - was.forward_prefetched,
                "forward_gathers_exposed": now.forward_on_demand - was.forward_on_demand,
                "backward_gathers_prefetched": now.backward_prefetched - was.backward_prefetched,
                "backward_gathers_exposed": now.backward_on_demand - was.backward_on_demand,
                "async_reduce_scatters": now.async_reduce_scatters - was.async_reduce_scatters,
                "wait_seconds": (now.wait_nanos - was.wait_nanos) as f64 * 1e-9,
            });
            m.insert("overlap".into(), overlap);
        }
        Some(serde_json::Value::Object(m))
    }

    /// Loads the sharded checkpoint `dir` into the model and `optim`; returns its step.
    pub fn resume(
        &mut self,
        dir: &Path,
        optim: &mut TorchAdamW<B>,
        model_config: &serde_json::Value,
    ) -> Result<usize, TrainError> {
        match self {
            Self::Single { .. } => Err(sharded_only("resuming")),
            Self::Sharded(s) => Ok(s.fsdp.load_sharded(dir, optim, model_config)?.step as usize),
        }
    }

    /// Saves a sharded checkpoint of `steps_done` steps into `dir` (every rank its part).
    pub fn save(
        &self,
        dir: &Path,
        optim: &TorchAdamW<B>,
        steps_done: usize,
        model_config: &serde_json::Value,
    ) -> Result<(), TrainError> {
        let Self::Sharded(s) = self else { return Err(sharded_only("saving sharded checkpoints")) };
        Ok(s.fsdp.save_sharded(dir, optim, steps_done as u64, model_config)?)
    }

    /// Writes the whole model as an HF checkpoint into `dir` (every rank gathers; rank 0
    /// writes, when `write`).
    pub fn export(&self, config: &Qwen3Config, dir: &Path, write: bool) -> Result<(), TrainError> {
        match self {
            Self::Single { model, .. } => Ok(model.save(config, dir)?),
            Self::Sharded(s) => {
                let params = s.fsdp.full_parameters()?;
                if write {
                    super::run::export_hf(config, params, dir)?;
                }
                Ok(())
            }
        }
    }
}

fn sharded_only(what: &str) -> TrainError {
    TrainError::Invalid(format!(
        "{what} uses sharded FSDP checkpoints: train with Parallelism::Sharded (one rank is fine)"
    ))
}
