//! The public API: `Fsdp::wrap(model, &mesh, FsdpConfig)`.

use std::collections::HashMap;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex};

use burn::module::{AutodiffModule, Module, ModuleMapper, ModuleVisitor, Param, ParamId};
use burn::optim::{GradientsParams, LearningRate, Optimizer};
use burn::tensor::backend::{AutodiffBackend, Backend};
use burn::tensor::ops::FloatTensor;
use burn::tensor::{DType, Tensor, TensorData, TensorPrimitive};

use crate::activation_checkpointing::{CheckpointRunner, Checkpointed, add_grads};
use crate::comm::mesh::DeviceMesh;
use crate::comm::{CommError, CommStats, ProcessGroup, ReduceOp, Tag};
use crate::fsdp::collectives::UnitComm;
use crate::fsdp::init::{InitError, ShardInit};
use crate::fsdp::offload::{HostStore, OffloadPolicy};
use crate::fsdp::op::{FsdpBackend, GatherComm};
use crate::fsdp::param::ShardedParam;
use crate::fsdp::param_group::ParamGroup;
use crate::fsdp::prefetch::{Alias, PrefetchStats, Prefetcher};
use crate::fsdp::scope::{self, UnitHost, Views, run_unit};
use crate::fsdp::view::{ParamView, ViewGroup};
use crate::optim::{TorchAdamW, clip_factor, clip_grads_to, grad_sq_sum_tensors, standard_layout_grads};
use crate::runner::UnitRunner;
use crate::walk::deferred_shape;

mod eval;
mod forward;
mod records;
mod state;
mod step;
mod train_step;
mod wrap;

pub use eval::FsdpEvalRunner;
pub use forward::FsdpRunner;
use forward::{collect_shards, unit_shards};
use state::Unsharder;
use step::ElemF64;
pub use train_step::{
    GradientsAndSqSum, StepParts, StepReport, StepValue, catch_collective_failures, take_step,
};

/// Which parameters form a unit (one all-gather, one reduce-scatter).
#[derive(Debug, Clone, PartialEq, Eq, Default)]
pub enum UnitPolicy {
    /// The default: every block the model marks with [`FsdpUnit`](crate::FsdpUnit) is a unit
    /// (the innermost mark, for nested ones); all other parameters form the root unit. A
    /// model that marks nothing is one unit, gathered whole for each forward — any Burn
    /// model, its forward as written.
    #[default]
    Marked,
    /// Every element of a `Vec` of modules is a unit (for Qwen3: `model.layers.N`); all
    /// other parameters form the root unit. The model runs each element through the
    /// [`UnitRunner`] or an [`FsdpUnit`](crate::FsdpUnit), as torchtitan wraps each block.
    VecElements,
    /// One unit per module-path prefix (e.g. `"encoder.blocks.0"`); parameters under no
    /// prefix form the root unit.
    Prefixes(Vec<String>),
}

impl UnitPolicy {
    fn unit_of(&self, path: &str) -> String {
        match self {
            // Resolved from the marks themselves (`scope::discover_units`).
            UnitPolicy::Marked => String::new(),
            UnitPolicy::VecElements => {
                let parts: Vec<&str> = path.split('.').collect();
                // The first numeric segment that is followed by more path is a Vec index.
                match (0..parts.len().saturating_sub(1)).find(|&i| parts[i].parse::<usize>().is_ok()) {
                    Some(i) => parts[..=i].join("."),
                    None => String::new(),
                }
            }
            UnitPolicy::Prefixes(prefixes) => prefixes
                .iter()
                .filter(|p| path == p.as_str() || path.starts_with(&format!("{p}.")))
                .max_by_key(|p| p.len())
                .cloned()
                .unwrap_or_default(),
        }
    }
}

/// FSDP2's `MixedPrecisionPolicy`: master shards stay in their own dtype (fp32); the
/// all-gather and compute run in `param_dtype`, gradients are reduce-scattered in
/// `reduce_dtype`, and each unit's output is cast to `output_dtype`. `None` keeps the dtype.
/// As FSDP2's `cast_forward_inputs`, a unit's floating-point input is cast to `param_dtype`.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub struct MixedPrecisionPolicy {
    /// dtype of all-gathered parameters, of unit inputs and of compute.
    pub param_dtype: Option<DType>,
    /// dtype of the gradient reduce-scatter.
    pub reduce_dtype: Option<DType>,
    /// dtype each unit's output is cast to.
    pub output_dtype: Option<DType>,
}

/// Options of [`Fsdp::wrap`] (FSDP2 names).
#[derive(Debug, Clone, PartialEq)]
pub struct FsdpConfig {
    /// Free gathered parameters after each unit's forward and re-gather them in backward
    /// (needs `Autodiff<_, BalancedCheckpointing>`). `false` keeps them until backward (ZeRO-2).
    pub reshard_after_forward: bool,
    /// Whether the root unit reshards too (FSDP2 does not reshard the root by default).
    pub reshard_root: bool,
    /// How parameters are grouped into units.
    pub units: UnitPolicy,
    /// Mixed precision.
    pub mp_policy: MixedPrecisionPolicy,
    /// CPU offload of shards, gradients and optimizer state.
    pub offload: OffloadPolicy,
    /// Overlap communication with compute (FSDP2's default forward and backward prefetch of
    /// one unit, and reduce-scatters that run while backward continues): every collective of
    /// the rank runs on a communication thread ([`crate::fsdp::prefetch`]). `false` runs each
    /// collective on the compute thread when it is needed.
    pub prefetch: bool,
    /// With `prefetch`, at most this many reduce-scatters in flight on the communication
    /// thread; a backward that would issue one more first waits for the oldest. Each holds its
    /// unit's full gradient until it has run, so this bounds communication memory whatever
    /// the number of units. Default 2: the previous unit's reduce-scatter runs while the next
    /// is issued, as FSDP2 waits on the previous one.
    pub max_inflight_reduce_scatters: usize,
}

impl Default for FsdpConfig {
    fn default() -> Self {
        Self {
            reshard_after_forward: true,
            reshard_root: false,
            units: UnitPolicy::default(),
            mp_policy: MixedPrecisionPolicy::default(),
            offload: OffloadPolicy::default(),
            prefetch: true,
            max_inflight_reduce_scatters: 2,
        }
    }
}

/// Errors of FSDP's own operations.
#[derive(Debug, thiserror::Error)]
pub enum FsdpError {
    /// The configuration cannot work with this model or backend.
    #[error("FSDP config: {0}")]
    Config(String),
    /// A collective failed.
    #[error(transparent)]
    Comm(#[from] CommError),
    /// The forward failed while units had not been run through the runner: their parameters
    /// were still this rank's shards (the usual cause: a block called directly instead of
    /// through [`UnitRunner::run`]).
    #[error(
        "FSDP forward failed while unit(s) {units} had not been run through the runner: their parameters \
         are this rank's shards, not whole tensors. Call each unit through the runner, e.g. \
         `x = runner.run(&self.layers[i], x, |layer, x| layer.forward(x))`. The failure: {cause}"
    )]
    UnitNotRun {
        /// The units not run before the failure, quoted and comma-separated.
        units: String,
        /// The panic message of the forward.
        cause: String,
    },
    /// A module run through the runner holds parameters of two units: a unit is gathered and
    /// reduced as one, so each must run on its own.
    #[error(
        "FSDP: a module run through the runner holds parameters of units `{first}` and `{second}`; \
         run each unit through the runner on its own (e.g. each element of the Vec of blocks), or make \
         them one unit with `UnitPolicy::Prefixes`"
    )]
    UnitsMixed {
        /// One unit of the module.
        first: String,
        /// Another unit of the same module.
        second: String,
    },
    /// A forward began while reduce-scatters of the previous backward had not been collected:
    /// a backward pass ran outside the forward's own graph (e.g. of a
    /// [`forward_checkpointed`](Fsdp::forward_checkpointed) loss without
    /// [`backward_checkpointed`](Fsdp::backward_checkpointed)), so its shard gradients never
    /// reached the optimizer.
    #[error(
        "FSDP: {units} reduce-scatter(s) of the previous backward were never collected, so that step's \
         shard gradients were lost; take the gradients of a `forward_checkpointed` loss with \
         `Fsdp::backward_checkpointed`, and those of a `forward` loss with `Fsdp::gradients(loss.backward())` \
         or Burn's `GradientsParams::from_grads(loss.backward(), fsdp.module())`"
    )]
    GradientsNotCollected {
        /// How many reduce-scatters were left.
        units: usize,
    },
    /// A collective failed inside a forward or backward (a peer died, timed out or failed),
    /// where it unwinds as a [`CollectiveFailure`](crate::CollectiveFailure):
    /// [`Fsdp::train_step`] and [`catch_collective_failures`] return it as this error.
    #[error("a collective failed inside the forward or backward: {0}")]
    Collective(String),
    /// A tensor's values could not be read as `f32` (a dtype Burn cannot convert).
    #[error("the values of {what} cannot be read as f32: {reason}")]
    Values {
        /// The parameter (its module path) or other tensor.
        what: String,
        /// The dtype and Burn's error.
        reason: String,
    },
    /// A record checkpoint ([`Fsdp::save_records`], [`Fsdp::load_records`], the Learner's) could
    /// not be written or read: `path` names the file or directory.
    #[error("FSDP checkpoint {}: {reason}", path.display())]
    Checkpoint {
        /// The file or directory.
        path: std::path::PathBuf,
        /// What went wrong.
        reason: String,
    },
    /// A [`ShardInit`] could not give a parameter's rows ([`Fsdp::wrap_deferred`]).
    #[error("deferred initialisation of `{path}`: {error}")]
    Init {
        /// The parameter's module path.
        path: String,
        /// What the initialiser said.
        error: InitError,
    },
}

/// What a runner unwinds with when a module it runs holds parameters of two units; the forward
/// that catches it returns [`FsdpError::UnitsMixed`].
#[derive(Debug)]
pub(crate) struct MixedUnits {
    first: String,
    second: String,
}

/// Makes every occurrence of a parameter id hold the tensor of its first occurrence.
///
/// A module cloned into several places of a model (weights tied across layers or units)
/// keeps one `ParamId`, but mappers — sharding, optimizer steps, checkpoint loading — visit
/// each occurrence separately and return separate tensors: separate autodiff leaves, of which
/// only one would receive the summed gradient and be updated. Re-tying after each of them
/// keeps one leaf per id, as one device keeps one tensor.
pub(crate) fn retie<B: Backend, M: Module<B>>(module: M) -> M {
    struct Retie(HashMap<ParamId, Box<dyn std::any::Any>>);
    impl<B: Backend> ModuleMapper<B> for Retie {
        fn map_float<const D: usize>(&mut self, param: Param<Tensor<B, D>>) -> Param<Tensor<B, D>> {
            let (id, tensor, mapper) = param.consume();
            if let Some(first) = self.0.get(&id).and_then(|t| t.downcast_ref::<Tensor<B, D>>()) {
                return Param::from_mapped_value(id, first.clone(), mapper);
            }
            self.0.insert(id, Box::new(tensor.clone()));
            Param::from_mapped_value(id, tensor, mapper)
        }
    }
    module.map(&mut Retie(HashMap::new()))
}

/// Refuses Burn optimizers whose update of a parameter depends on the whole parameter (or on
/// all of them), which would be silently wrong on dim-0 shards.
fn refuse_whole_parameter_optimizer<O>() -> Result<(), FsdpError> {
    let name = std::any::type_name::<O>();
    for (module, what) in [
        ("::muon::", "Muon orthogonalises each whole weight matrix (Newton–Schulz)"),
        ("::lbfgs::", "L-BFGS takes inner products over all parameters"),
    ] {
        if name.contains(module) {
            return Err(FsdpError::Config(format!(
                "{what}, which row shards cannot do: `Fsdp::step_with` takes optimizers whose \
                 update is elementwise (Adam, AdamW, SGD, RmsProp, AdaGrad, Adan); got {name}"
            )));
        }
    }
    Ok(())
}

/// A module whose parameters are sharded across the ranks of a mesh (PyTorch FSDP2's
/// `fully_shard`, applied per unit).
///
/// Between steps only shards live. [`forward`](Fsdp::forward) all-gathers the root unit and
/// hands the model a [`UnitRunner`] that gathers each further unit just before it runs; the
/// gathers are differentiable and reduce-scatter gradients in backward.
///
/// # Example
///
/// ```
/// use burn::backend::{Autodiff, NdArray};
/// use burn::backend::autodiff::checkpoint::strategy::BalancedCheckpointing;
/// use burn::module::{Initializer, Module};
/// use burn::nn::{Linear, LinearConfig};
/// use burn::tensor::{Tensor, backend::Backend};
/// use burn_fsdp::{TorchAdamWConfig, DeviceMesh, Fsdp, FsdpConfig, UnitRunner, launch};
///
/// type B = Autodiff<NdArray, BalancedCheckpointing>;
///
/// #[derive(Module, Debug)]
/// struct Mlp<B: Backend> {
///     layers: Vec<Linear<B>>,
/// }
///
/// impl<B: Backend> Mlp<B> {
///     fn forward_with(&self, mut x: Tensor<B, 2>, runner: &mut impl UnitRunner<B>) -> Tensor<B, 2> {
///         for layer in &self.layers {
///             x = runner.run(layer, x, |l, x| l.forward(x));
///         }
///         x
///     }
/// }
///
/// fn build(device: &burn::tensor::Device<B>) -> Mlp<B> {
///     let linear = LinearConfig::new(8, 8).with_initializer(Initializer::Constant { value: 0.1 });
///     Mlp { layers: (0..3).map(|_| linear.init(device)).collect() }
/// }
/// let losses = launch(2, std::time::Duration::from_secs(30), |group| {
///     let device = Default::default();
///     // Every rank builds its own copy of the same model (never share tracked tensors).
///     let model = build(&device);
///     let mesh = DeviceMesh::new_1d(group, device);
///     let mut fsdp = Fsdp::wrap(model, &mesh, FsdpConfig::default())?;
///     let mut adam = TorchAdamWConfig::default().init();
///     let x = Tensor::<B, 2>::ones([4, 8], &device);
///     let loss = fsdp.forward(|m, r| m.forward_with(x, r)).powf_scalar(2.0).mean();
///     let grads = fsdp.gradients(loss.backward());
///     fsdp.step(&mut adam, grads);
///     Ok::<_, burn_fsdp::FsdpError>(loss.into_scalar())
/// })
/// .unwrap();
/// assert_eq!(losses[0], losses[1]);
/// ```
pub struct Fsdp<B: FsdpBackend, M: Module<B>> {
    module: M,
    units: Vec<ParamGroup<B::InnerBackend>>,
    param_unit: HashMap<ParamId, usize>,
    /// Paths of the float tensors left whole on every rank: buffers and frozen parameters.
    replicated: Vec<String>,
    mesh: DeviceMesh<B::InnerBackend>,
    sync: Arc<AtomicBool>,
    /// Gradients kept while sync is off, at world size 1 (where no gather op runs).
    stash: Mutex<Option<GradientsParams>>,
    /// Host copies of the shards, gradients and optimizer state, with offload.
    host: Option<Arc<HostStore>>,
    config: FsdpConfig,
    /// The communication thread and prefetch state (world > 1 with `config.prefetch`).
    prefetch: Option<Arc<Prefetcher<B::InnerBackend>>>,
}

impl<B: FsdpBackend, M: Module<B>> std::fmt::Debug for Fsdp<B, M> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Fsdp")
            .field("units", &self.units.iter().map(|u| u.name.as_str()).collect::<Vec<_>>())
            .field("rank", &self.rank())
            .field("world", &self.world())
            .field("config", &self.config)
            .finish()
    }
}

impl<B: FsdpBackend, M: Module<B>> Fsdp<B, M> {
    /// The sharded module (parameters are local shards).
    pub fn module(&self) -> &M {
        &self.module
    }

    /// Consumes the wrapper, returning the sharded module.
    pub fn into_module(self) -> M {
        self.module
    }

    /// The units, root first.
    pub fn units(&self) -> &[ParamGroup<B::InnerBackend>] {
        &self.units
    }

    /// Module paths of the float tensors that are not sharded: those that do not require grad
    /// — buffers (`RunningState`, e.g. BatchNorm's running statistics) and frozen parameters.
    /// They stay whole on every rank, take part in no collective and get no gradient, as
    /// buffers do under PyTorch FSDP2; each rank updates its own buffers in its forward.
    pub fn replicated_tensors(&self) -> &[String] {
        &self.replicated
    }

    /// The configuration.
    pub fn config(&self) -> &FsdpConfig {
        &self.config
    }

    /// The mesh.
    pub fn mesh(&self) -> &DeviceMesh<B::InnerBackend> {
        &self.mesh
    }

    /// This rank in the data-parallel group.
    pub fn rank(&self) -> usize {
        self.shard_group().rank()
    }

    /// Size of the data-parallel group.
    pub fn world(&self) -> usize {
        self.shard_group().size()
    }

    /// Collective counters of this rank's data-parallel group.
    pub fn comm_stats(&self) -> CommStats {
        self.shard_group().stats()
    }

    /// The group parameters are sharded over (the mesh's last dimension).
    pub fn shard_group(&self) -> &Arc<dyn ProcessGroup<B::InnerBackend>> {
        self.mesh.group_at(self.mesh.ndim() - 1)
    }

    /// With HSDP (a 2D mesh), the group over which shards are replicated.
    pub fn replicate_group(&self) -> Option<&Arc<dyn ProcessGroup<B::InnerBackend>>> {
        (self.mesh.ndim() == 2).then(|| self.mesh.group_at(0))
    }

    /// This rank's index among the replicas (0 without HSDP).
    pub fn replicate_rank(&self) -> usize {
        self.replicate_group().map_or(0, |g| g.rank())
    }

    /// A barrier of every rank of the mesh (the shard group, then the replicate group: once
    /// both returned, every rank has arrived); a failure unwinds as a
    /// [`CollectiveFailure`](crate::CollectiveFailure).
    pub(crate) fn barrier_all(&self, name: &str) {
        self.quiesce();
        let tag = Tag::new(name);
        let groups = std::iter::once(self.shard_group()).chain(self.replicate_group());
        for group in groups {
            if let Err(e) = group.barrier(&tag) {
                crate::comm::CollectiveFailure::raise(format!("{name}: {e}"));
            }
        }
    }

    /// What the overlap of communication with compute achieved on this rank (see
    /// [`crate::fsdp::prefetch`]); `None` when it is off (`prefetch: false`, or world size 1).
    pub fn prefetch_stats(&self) -> Option<PrefetchStats> {
        self.prefetch.as_ref().map(|p| p.stats())
    }

    /// Waits until this rank's communication thread is idle. FSDP's own methods call it
    /// before issuing collectives from the compute thread; call it before using the FSDP
    /// process group directly while a forward or backward may have left work queued.
    pub fn quiesce(&self) {
        if let Some(p) = &self.prefetch {
            p.quiesce();
        }
    }

    /// `values` reduced elementwise over the data-parallel ranks (the shard group, then the
    /// replicas under HSDP), on the device: nothing is read. `None` on a single rank.
    ///
    /// # Errors
    /// A failed collective.
    pub fn all_reduce_data_parallel(
        &self,
        values: Tensor<B::InnerBackend, 1>,
        op: ReduceOp,
        tag: &str,
    ) -> Result<Option<Tensor<B::InnerBackend, 1>>, FsdpError> {
        if self.single_data_parallel_rank() {
            return Ok(None);
        }
        self.quiesce();
        let mut r = self.shard_group().all_reduce(values, op, &Tag::new(tag))?;
        if let Some(rep) = self.replicate_group() {
            r = rep.all_reduce(r, op, &Tag::new(format!("{tag}:replicas")))?;
        }
        Ok(Some(r))
    }

    /// All-reduces one number over the data-parallel group
    /// ([`all_reduce_data_parallel`](Self::all_reduce_data_parallel) of it as `f32`, read).
    pub fn all_reduce_scalar(&self, value: f64, op: ReduceOp, tag: &str) -> Result<f64, FsdpError> {
        if self.single_data_parallel_rank() {
            return Ok(value);
        }
        let t = Tensor::<B::InnerBackend, 1>::from_data(
            TensorData::new(vec![value as f32], [1]),
            self.mesh.device(),
        );
        Ok(match self.all_reduce_data_parallel(t, op, tag)? {
            Some(r) => r.into_scalar().elem_f64(),
            None => value,
        })
    }

    /// Whether this rank is the only data-parallel rank (no shard peer, no replica).
    fn single_data_parallel_rank(&self) -> bool {
        self.world() == 1 && self.replicate_group().is_none_or(|g| g.size() == 1)
    }

    /// At world size 1 without a dtype change nothing needs gathering.
    fn bypass(&self) -> bool {
        self.single_data_parallel_rank() && self.config.mp_policy.param_dtype.is_none() && self.host.is_none()
    }
}
