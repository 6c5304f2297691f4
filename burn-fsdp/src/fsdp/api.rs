//! The public API: `Fsdp::wrap(model, &mesh, FsdpConfig)`.

use std::collections::HashMap;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex};

use burn::module::{AutodiffModule, Module, ModuleMapper, ModuleVisitor, Param, ParamId};
use burn::optim::{GradientsParams, LearningRate, Optimizer};
use burn::tensor::backend::{AutodiffBackend, Backend};
use burn::tensor::ops::FloatTensor;
use burn::tensor::{DType, Tensor, TensorData, TensorPrimitive};

use crate::activation::{CheckpointRunner, Checkpointed, add_grads};
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
use crate::optim::{
    TorchAdamW, clip_coefficient, grad_sq_sum, grad_sq_sum_split, scale_grads, standard_layout_grads,
};
use crate::runner::UnitRunner;
use crate::walk::{deferred_shape, describe_float_tensors};

mod eval;
pub use eval::FsdpEvalRunner;

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
    /// Shards every parameter of `model` on dim 0 across the first dimension of `mesh`.
    ///
    /// Every rank calls this with its own replica of the model, built by the rank itself:
    /// ranks must never share tracked tensors. Rank 0's values are the truth: every float
    /// tensor (parameters and buffers) is first broadcast from rank 0 (PyTorch's
    /// `sync_module_states`), so replicas initialised differently — lazy initialisers re-run
    /// by `clone`, per-rank seeds — still start identical. Parameters that do not require grad
    /// (buffers, frozen weights) are not sharded (see [`Fsdp::replicated_tensors`]).
    pub fn wrap(model: M, mesh: &DeviceMesh<B::InnerBackend>, config: FsdpConfig) -> Result<Self, FsdpError> {
        Self::wrap_inner(model, mesh, config, None)
    }

    /// [`wrap`](Self::wrap) for a model whose parameters do not exist yet: each rank creates
    /// only its own shards (PyTorch FSDP2's meta-device initialisation; see [`crate::fsdp::init`]).
    ///
    /// `model` is built with lazy parameters ([`Param::uninitialized`], as Burn's own
    /// `XConfig::init` does), which allocate nothing. For every lazy parameter that `init`
    /// [provides](ShardInit::provides), this rank's rows are asked of `init` and its own
    /// initialiser never runs; no full copy of such a parameter is ever made (nor broadcast:
    /// `init` must give every rank the same tensor, which a checkpoint reader or
    /// [`seeded_normal`](crate::fsdp::init::seeded_normal) does). Other tensors are handled as by
    /// [`wrap`](Self::wrap). A lazy parameter's load/save mappers ([`Param::load_mapper`]) are
    /// not kept: add them after wrapping if needed.
    ///
    /// # Example
    ///
    /// ```
    /// use burn::backend::autodiff::checkpoint::strategy::BalancedCheckpointing;
    /// use burn::backend::{Autodiff, NdArray};
    /// use burn::module::{Module, Param, ParamId};
    /// use burn::tensor::{Shape, Tensor};
    /// use burn_fsdp::init::{InitError, ShardInit, seeded_normal};
    /// use burn_fsdp::{DeviceMesh, Fsdp, FsdpConfig, launch};
    ///
    /// type B = Autodiff<NdArray, BalancedCheckpointing>;
    ///
    /// #[derive(Module, Debug)]
    /// struct Net<B: burn::tensor::backend::Backend> {
    ///     w: Param<Tensor<B, 2>>,
    /// }
    ///
    /// struct Init;
    /// impl ShardInit for Init {
    ///     fn provides(&self, _: &str, _: &[usize]) -> bool {
    ///         true
    ///     }
    ///     fn rows(&self, path: &str, shape: &[usize], rows: std::ops::Range<usize>) -> Result<Vec<f32>, InitError> {
    ///         Ok(seeded_normal(0, path, rows.start * shape[1]..rows.end * shape[1], 0.0, 1.0))
    ///     }
    /// }
    ///
    /// let shards = launch(2, std::time::Duration::from_secs(30), |group| {
    ///     let device = Default::default();
    ///     // A lazy parameter: its initialiser would allocate the whole [1000, 1000] tensor.
    ///     let w = Param::uninitialized(
    ///         ParamId::new(),
    ///         |d, _| Tensor::<B, 2>::zeros([1000, 1000], d).require_grad(),
    ///         device,
    ///         true,
    ///         Shape::new([1000, 1000]),
    ///     );
    ///     let mesh = DeviceMesh::new_1d(group.clone(), device);
    ///     let fsdp = Fsdp::wrap_deferred(Net { w }, &mesh, FsdpConfig::default(), &Init)?;
    ///     Ok::<_, burn_fsdp::FsdpError>(fsdp.module().w.val().into_data().to_vec::<f32>().unwrap())
    /// })
    /// .unwrap();
    /// // Each rank holds its 500 rows, and together they are the seeded tensor.
    /// assert_eq!(shards[0].len(), 500 * 1000);
    /// assert_eq!([&shards[0][..], &shards[1][..]].concat(), seeded_normal(0, "w", 0..1_000_000, 0.0, 1.0));
    /// ```
    pub fn wrap_deferred(
        model: M,
        mesh: &DeviceMesh<B::InnerBackend>,
        config: FsdpConfig,
        init: &dyn ShardInit,
    ) -> Result<Self, FsdpError> {
        Self::wrap_inner(model, mesh, config, Some(init))
    }

    fn wrap_inner(
        model: M,
        mesh: &DeviceMesh<B::InnerBackend>,
        config: FsdpConfig,
        deferred: Option<&dyn ShardInit>,
    ) -> Result<Self, FsdpError> {
        // 1D mesh: FSDP over it. 2D mesh: HSDP, `(replicate, shard)`: parameters are sharded
        // over the inner dimension and replicated over the outer one.
        if mesh.ndim() == 0 || mesh.ndim() > 2 {
            return Err(FsdpError::Config(format!(
                "FSDP takes a 1D mesh (shard) or a 2D mesh (replicate, shard), got {} dimensions {:?}; \
                 for data × tensor parallelism pass the data-parallel sub-mesh (DeviceMesh::submesh)",
                mesh.ndim(),
                mesh.dim_names()
            )));
        }
        let group = mesh.group_at(mesh.ndim() - 1).clone();
        let replicate = (mesh.ndim() == 2).then(|| mesh.group_at(0).clone());
        let (rank, world) = (group.rank(), group.size());
        if config.reshard_after_forward && world > 1 && !B::recomputes() {
            return Err(FsdpError::Config(
                "reshard_after_forward = true needs the backend Autodiff<_, BalancedCheckpointing> \
                 (with NoCheckpointing gathered parameters would silently stay alive); \
                 use that backend or set reshard_after_forward = false"
                    .into(),
            ));
        }
        for (what, dtype) in
            [("param_dtype", config.mp_policy.param_dtype), ("reduce_dtype", config.mp_policy.reduce_dtype)]
        {
            if let Some(dt) = dtype
                && !B::InnerBackend::supports_dtype(mesh.device(), dt)
            {
                return Err(FsdpError::Config(format!(
                    "mixed precision {what} = {dt:?} is not supported by the backend `{}`; \
                     use a backend with {dt:?} (e.g. burn's Flex on CPU, CUDA, MetaX)",
                    B::InnerBackend::name(mesh.device())
                )));
            }
        }
        let model = {
            let mut groups = vec![&group];
            groups.extend(replicate.as_ref());
            crate::fsdp::replicas::from_rank0::<B, M>(model, &groups, deferred)?
        };
        // FSDP2 shards parameters, never buffers: tensors that do not require grad (Burn's
        // `RunningState` buffers such as BatchNorm's running statistics, and frozen parameters)
        // stay whole and replicated on every rank, outside every collective.
        let (described, replicated): (Vec<_>, Vec<_>) = describe_float_tensors::<B, M>(&model, deferred)
            .into_iter()
            .partition(|(.., trainable)| *trainable);
        if described.is_empty() {
            return Err(FsdpError::Config(if replicated.is_empty() {
                "the model has no float parameters to shard".into()
            } else {
                format!(
                    "no parameter of the model requires grad ({} float tensors, e.g. `{}`, are buffers or \
                     frozen): FSDP shards trainable parameters; build the model on an autodiff backend \
                     with trainable parameters (a model loaded or cloned with `no_grad`/`valid()` has none)",
                    replicated.len(),
                    replicated[0].1
                )
            }));
        }
        let replicated: Vec<String> = replicated.into_iter().map(|(_, path, ..)| path).collect();
        let described = described.into_iter().map(|(id, path, shape, _)| (id, path, shape));
        // Group parameters: the root unit (name "") first, then units in visiting order.
        let mut unit_names: Vec<String> = vec![String::new()];
        let mut members: Vec<Vec<ShardedParam>> = vec![Vec::new()];
        let mut param_unit = HashMap::new();
        let marked = match config.units {
            UnitPolicy::Marked => crate::fsdp::scope::discover_units::<B, M>(&model),
            _ => HashMap::new(),
        };
        // Units by key: a marked unit by its number (two marks may share a path), others by name.
        let mut keys: Vec<(Option<usize>, String)> = vec![(None, String::new())];
        for (id, path, shape) in described {
            let key = match marked.get(&id) {
                // A mark on the whole model is the root unit.
                Some((_, name)) if name.is_empty() => (None, String::new()),
                Some((k, name)) => (Some(*k), name.clone()),
                None => (None, config.units.unit_of(&path)),
            };
            let u = match keys.iter().position(|k| *k == key) {
                Some(u) => u,
                None => {
                    let taken = unit_names.contains(&key.1);
                    unit_names.push(if taken { format!("{}#{}", key.1, keys.len()) } else { key.1.clone() });
                    keys.push(key);
                    members.push(Vec::new());
                    unit_names.len() - 1
                }
            };
            param_unit.insert(id, u);
            members[u].push(ShardedParam::new(id, path, shape, world));
        }
        let sync = Arc::new(AtomicBool::new(true));
        let prefetch = (config.prefetch && world > 1)
            .then(|| Prefetcher::<B::InnerBackend>::new(unit_names.len(), &format!("rank{rank}")));
        let units = unit_names
            .into_iter()
            .zip(members)
            .enumerate()
            .map(|(i, (name, params))| {
                let mut offsets = Vec::with_capacity(params.len());
                let mut len = 0;
                for p in &params {
                    offsets.push(len);
                    len += p.shard_numel();
                }
                let reshard = config.reshard_after_forward && (i > 0 || config.reshard_root);
                ParamGroup {
                    comm: Arc::new(UnitComm {
                        group: group.clone(),
                        replicate: replicate.clone(),
                        name: if name.is_empty() { "<root>".to_owned() } else { name.clone() },
                        shard_len: len,
                        sync: sync.clone(),
                        pending: Mutex::new(None),
                        param_dtype: config.mp_policy.param_dtype,
                        reduce_dtype: config.mp_policy.reduce_dtype,
                        index: i,
                        aliases: Mutex::new(Vec::new()),
                    }),
                    name,
                    params,
                    offsets,
                    reshard_after_forward: reshard,
                }
            })
            .collect::<Vec<_>>();
        if let Some(p) = &prefetch {
            p.set_units(&units.iter().map(|u| u.comm.clone()).collect::<Vec<_>>());
        }
        let host = config.offload.enabled.then(|| Arc::new(HostStore::default()));
        let mut sharder = Sharder::<B> {
            units: &units,
            param_unit: &param_unit,
            rank,
            host: host.as_deref(),
            deferred,
            error: None,
            _b: Default::default(),
        };
        let model = model.map(&mut sharder);
        if let Some(e) = sharder.error {
            return Err(e);
        }
        let module = retie::<B, M>(model);
        Ok(Self {
            module,
            units,
            param_unit,
            replicated,
            mesh: mesh.clone(),
            sync,
            stash: Mutex::new(None),
            host,
            config,
            prefetch,
        })
    }

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

    /// Runs a forward pass: all-gathers the root unit, then calls `f` with the gathered root
    /// view and a runner that gathers each further unit when the model runs it.
    ///
    /// At world size 1 (without mixed precision) nothing needs gathering: the model runs on
    /// its parameters directly, so the computation (and its rounding) is exactly that of the
    /// unwrapped model.
    ///
    /// # Panics
    /// When `f` panics: with [`FsdpError::UnitNotRun`]'s message if units had not been run
    /// through the runner by then (the likely cause), else with `f`'s own panic.
    /// [`try_forward`](Self::try_forward) returns the former as an error.
    pub fn forward<O>(&self, f: impl FnOnce(&M, &mut FsdpRunner<'_, B, M>) -> O) -> O {
        match self.try_forward(f) {
            Ok(out) => out,
            Err(e) => panic!("{e}"),
        }
    }

    /// [`forward`](Self::forward), returning [`FsdpError::UnitNotRun`] instead of panicking
    /// when `f` panics before every unit with sharded parameters went through the runner, and
    /// [`FsdpError::UnitsMixed`] when a module run through the runner holds two units.
    /// Other panics of `f` propagate unchanged, among them a failed collective's
    /// [`CollectiveFailure`](crate::CollectiveFailure).
    pub fn try_forward<O>(&self, f: impl FnOnce(&M, &mut FsdpRunner<'_, B, M>) -> O) -> Result<O, FsdpError> {
        self.begin_forward()?;
        // With reduce-scatters on the communication thread, one node that every gather of
        // this forward hangs from collects them when backward ends, whoever runs it.
        let end = match &self.prefetch {
            Some(p) if !self.bypass() => Some(B::fsdp_backward_end(p.clone(), self.mesh.device())),
            _ => None,
        };
        let root = if self.units[0].params.is_empty() || self.bypass() {
            self.module.clone()
        } else {
            self.gather_view(self.module.clone(), 0, None, end.clone(), self.units[0].reshard_after_forward)
        };
        let mut runner = FsdpRunner::new(self, false, end);
        // Blocks the model marks with `FsdpUnit` find this forward through the thread.
        let installed = runner.clone();
        let host: &dyn UnitHost<B> = &installed;
        let guard = scope::install(&host);
        let result = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| f(&root, &mut runner)));
        drop(guard);
        result.map_err(|payload| self.forward_failed(&runner.ran(), payload))
    }

    /// The error of a forward whose closure panicked: [`FsdpError::UnitNotRun`] when units
    /// had not been run through the runner; any other panic (a failed collective's among
    /// them) unwinds on unchanged.
    fn forward_failed(&self, ran: &[bool], payload: Box<dyn std::any::Any + Send>) -> FsdpError {
        if let Some(MixedUnits { first, second }) = payload.downcast_ref::<MixedUnits>() {
            return FsdpError::UnitsMixed { first: first.clone(), second: second.clone() };
        }
        let not_run: Vec<String> = (1..self.units.len())
            .filter(|&u| !ran[u] && !self.units[u].params.is_empty() && !self.bypass())
            .map(|u| format!("`{}`", self.units[u].name))
            .collect();
        // A collective that failed (a peer died or timed out) is not a unit left unrun: it
        // unwinds on to the rank's driver as the error it is.
        if not_run.is_empty() || payload.is::<crate::comm::CollectiveFailure>() {
            std::panic::resume_unwind(payload);
        }
        let cause = crate::comm::panic_message(payload.as_ref());
        FsdpError::UnitNotRun { units: not_run.join(", "), cause }
    }

    /// [`forward`](Self::forward) with block-level activation checkpointing
    /// ([`crate::activation`]): blocks the model runs through
    /// [`UnitRunner::run_recomputable`] keep only their input through forward and run again
    /// (with a fresh all-gather) in [`backward_checkpointed`](Self::backward_checkpointed).
    /// `f` returns the loss. The root unit's gathered parameters are handed to the model as
    /// leaves, so the pieces of the segmented backward share no graph; they stay gathered
    /// until backward ends.
    ///
    /// # Panics
    /// As [`forward`](Self::forward).
    pub fn forward_checkpointed<'s>(
        &'s self,
        f: impl FnOnce(&M, &mut CheckpointRunner<'s, B, FsdpRunner<'s, B, M>>) -> Tensor<B, 1>,
    ) -> Checkpointed<'s, B> {
        if let Err(e) = self.begin_forward() {
            panic!("{e}");
        }
        // The segmented backward's reductions are collected by `backward_checkpointed`.
        let (root, roots) = if self.units[0].params.is_empty() || self.bypass() {
            (self.module.clone(), Vec::new())
        } else {
            let view =
                self.gather_view(self.module.clone(), 0, None, None, self.units[0].reshard_after_forward);
            let mut leaves = RootLeaves { pairs: Vec::new() };
            (view.map(&mut leaves), leaves.pairs)
        };
        let forward = FsdpRunner::new(self, false, None);
        // `FsdpUnit` blocks run once, gathered (not run again in backward: activation
        // checkpointing goes through `UnitRunner::run_recomputable`).
        let installed = forward.clone();
        let mut runner = CheckpointRunner::new(forward, FsdpRunner::new(self, true, None));
        let host: &dyn UnitHost<B> = &installed;
        let guard = scope::install(&host);
        let result = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| f(&root, &mut runner)));
        drop(guard);
        // Every backward ends by locking every autodiff graph of the process, other ranks'
        // included. A rank whose backward blocks in a collective (no communication thread)
        // while holding its graph would wait for a peer stuck in that cleanup: so no rank
        // starts a piece of the segmented backward before all have finished the previous one.
        // (With the communication thread a backward never waits for a collective, except
        // the reduce-scatter of a unit too wide for the gather's direct parents.)
        let blocking = self.prefetch.is_none()
            || self.units.iter().any(|u| u.params.len() > crate::fsdp::op::MAX_DIRECT_PARENTS);
        let between: Option<Box<dyn Fn() + 's>> =
            blocking.then(|| Box::new(move || self.barrier_all("checkpointed-backward")) as _);
        match result {
            Ok(loss) => Checkpointed::new(loss, runner, roots, between),
            Err(payload) => panic!("{}", self.forward_failed(&runner.inner.ran(), payload)),
        }
    }

    /// Starts a forward on the communication thread (prefetch state, shards to prefetch from).
    ///
    /// # Errors
    /// [`FsdpError::GradientsNotCollected`] when the previous backward's reduce-scatters were
    /// never collected.
    fn begin_forward(&self) -> Result<(), FsdpError> {
        match &self.prefetch {
            Some(p) if !self.bypass() => {
                p.begin_forward(self.all_shards()).map_err(|units| FsdpError::GradientsNotCollected { units })
            }
            _ => Ok(()),
        }
    }

    /// [`FsdpError::GradientsNotCollected`] when a backward left reduce-scatters that
    /// nothing collected: `grads` then lack those units' gradients.
    fn refuse_uncollected(&self) -> Result<(), FsdpError> {
        match self.prefetch.as_ref().map(|p| p.uncollected()) {
            Some(units) if units > 0 => Err(FsdpError::GradientsNotCollected { units }),
            _ => Ok(()),
        }
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

    /// Runs the segmented backward of a [`forward_checkpointed`](Self::forward_checkpointed)
    /// and returns the shard gradients, as [`gradients`](Self::gradients) does for
    /// `loss.backward()`.
    pub fn backward_checkpointed(&self, run: Checkpointed<'_, B>) -> GradientsParams
    where
        M: AutodiffModule<B>,
    {
        self.gradients_of(run.backward())
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

    /// Every unit's shard tensors on the inner backend, for the prefetcher (`None` for
    /// offloaded units, whose shards live on the host).
    fn all_shards(&self) -> Vec<Option<Vec<FloatTensor<B::InnerBackend>>>> {
        let shards = collect_shards::<B, M>(&self.module, &self.param_unit, self.units.len());
        self.units
            .iter()
            .zip(&shards)
            .map(|(unit, map)| {
                (self.host.is_none() && !unit.params.is_empty())
                    .then(|| unit_shards::<B, _>(unit, map).into_iter().map(B::inner).collect())
            })
            .collect()
    }

    /// Registers the reduced flat shard gradients of units (from the communication thread)
    /// as the gradients of their parameters' shards.
    fn register_reduced(
        &self,
        grads: &mut GradientsParams,
        reduced: Vec<(usize, Tensor<B::InnerBackend, 1>)>,
    ) {
        if reduced.is_empty() {
            return;
        }
        // A unit run several times in one forward (a shared block, weights tied across
        // units) is reduced once per use: the uses' gradients add up.
        let mut pieces: HashMap<ParamId, Tensor<B::InnerBackend, 1>> = HashMap::new();
        for (u, g) in reduced {
            let unit = &self.units[u];
            for (p, offset) in unit.params.iter().zip(&unit.offsets) {
                let piece = g.clone().narrow(0, *offset, p.shard_numel());
                let sum = match pieces.remove(&p.id) {
                    Some(earlier) => earlier + piece,
                    None => piece,
                };
                pieces.insert(p.id, sum);
            }
        }
        struct Register<'a, I: Backend> {
            pieces: HashMap<ParamId, Tensor<I, 1>>,
            grads: &'a mut GradientsParams,
        }
        impl<B: AutodiffBackend> ModuleVisitor<B> for Register<'_, B::InnerBackend> {
            fn visit_float<const D: usize>(&mut self, param: &Param<Tensor<B, D>>) {
                let Some(piece) = self.pieces.remove(&param.id) else { return };
                let shard = param.val();
                let piece = if piece.dtype() == shard.dtype() { piece } else { piece.cast(shard.dtype()) };
                let mut g: Tensor<B::InnerBackend, D> = crate::downcast::reshape_shared(piece, shard.shape());
                if let Some(earlier) = self.grads.remove::<B::InnerBackend, D>(param.id) {
                    g = g + earlier;
                }
                self.grads.register(param.id, g);
            }
        }
        self.module.visit(&mut Register::<B::InnerBackend> { pieces, grads });
    }

    /// FSDP2's `set_requires_gradient_sync`: with `false`, backward keeps unsharded gradients
    /// locally (no reduce-scatter); the next backward with `true` reduces their sum once.
    pub fn set_requires_gradient_sync(&self, sync: bool) {
        self.sync.store(sync, Ordering::SeqCst);
    }

    /// The shard gradients of a backward pass, keyed by parameter id. Call it after every
    /// backward: while gradient sync is off it returns no gradients (they are accumulated
    /// unsharded, FSDP2 style); after the next synced backward it returns the reduced sum.
    pub fn gradients(&self, grads: B::Gradients) -> GradientsParams
    where
        M: AutodiffModule<B>,
    {
        self.gradients_of(vec![grads])
    }

    /// [`gradients`](Self::gradients) of several backward passes over this forward's graph
    /// (a segmented backward), summed per shard.
    fn gradients_of(&self, all: Vec<B::Gradients>) -> GradientsParams
    where
        M: AutodiffModule<B>,
    {
        let sync = self.sync.load(Ordering::SeqCst);
        // Reduce-scatters still running on the communication thread.
        let reduced = self.prefetch.as_ref().map(|p| p.finish_reductions()).unwrap_or_default();
        if self.host.is_some() {
            // Offload: the gather op's backward already copied the reduced gradients to the
            // host store, where `clip_grad_norm` and `step` find them.
            drop(all);
            return GradientsParams::new();
        }
        let mut current = GradientsParams::new();
        for grads in all {
            add_grads::<B, M>(&self.module, &mut current, GradientsParams::from_grads(grads, &self.module));
        }
        if !self.bypass() {
            // The gather op kept (or reduced) the full gradients itself.
            if !sync {
                return GradientsParams::new();
            }
            self.register_reduced(&mut current, reduced);
            return current;
        }
        let mut stash = self.stash.lock().unwrap_or_else(|p| p.into_inner());
        let total = match stash.take() {
            Some(mut earlier) => {
                add_grads::<B, M>(&self.module, &mut earlier, current);
                earlier
            }
            None => current,
        };
        if sync {
            total
        } else {
            *stash = Some(total);
            GradientsParams::new()
        }
    }

    /// Global L2 norm of all gradients over all ranks (one all-reduce), clipping them to
    /// `max_norm` as `clip_grad_norm_` does (`max_norm` ≤ 0 or infinite only measures).
    pub fn clip_grad_norm(&self, grads: &mut GradientsParams, max_norm: f64) -> Result<f64, FsdpError>
    where
        M: AutodiffModule<B>,
    {
        self.quiesce();
        let local = match &self.host {
            Some(host) => host.grad_sq_sum(),
            None => {
                standard_layout_grads::<B, M>(&self.module, grads);
                grad_sq_sum::<B, M>(&self.module, grads)
            }
        };
        // Over the shard group only: with HSDP every replica holds the same reduced gradients.
        let total = if self.world() == 1 {
            local
        } else {
            let t = Tensor::<B::InnerBackend, 1>::from_data(
                TensorData::new(vec![local as f32], [1]),
                self.mesh.device(),
            );
            self.shard_group()
                .all_reduce(t, ReduceOp::Sum, &Tag::new("clip_grad_norm"))?
                .into_scalar()
                .elem_f64()
        };
        let norm = total.sqrt();
        if max_norm.is_finite() && max_norm > 0.0 {
            let coef = clip_coefficient(norm, max_norm);
            if coef < 1.0 {
                match &self.host {
                    Some(host) => host.scale_grads(coef),
                    None => scale_grads::<B, M>(&self.module, grads, coef),
                }
            }
        }
        Ok(norm)
    }

    /// [`clip_grad_norm`](Self::clip_grad_norm) on a data × tensor parallel mesh, where this
    /// FSDP shards tp-local parameters over the data-parallel group: one all-reduce over dp
    /// of the squared sums of split and of replicated parameters, one over tp of the split
    /// part (replicated parameters have identical gradients on every tp rank and count once).
    pub fn clip_grad_norm_tp(
        &self,
        grads: &mut GradientsParams,
        max_norm: f64,
        tp: &crate::tp::TensorParallel<B::InnerBackend>,
    ) -> Result<f64, FsdpError>
    where
        M: AutodiffModule<B>,
    {
        self.quiesce();
        if self.host.is_some() {
            return Err(FsdpError::Config("CPU offload is not supported with tensor parallelism".into()));
        }
        standard_layout_grads::<B, M>(&self.module, grads);
        let (split, rest) = grad_sq_sum_split::<B, M>(&self.module, grads, |id| tp.is_split(id));
        let device = self.mesh.device();
        let mut sums = Tensor::<B::InnerBackend, 1>::from_data(
            TensorData::new(vec![split as f32, rest as f32], [2]),
            device,
        );
        if self.world() > 1 {
            sums = self.shard_group().all_reduce(sums, ReduceOp::Sum, &Tag::new("clip_grad_norm"))?;
        }
        let v: Vec<f32> = sums.into_data().convert::<f32>().to_vec::<f32>().unwrap_or_default();
        let (mut split, rest) = (v.first().copied().unwrap_or(0.0), v.get(1).copied().unwrap_or(0.0));
        if tp.group().size() > 1 {
            let t = Tensor::<B::InnerBackend, 1>::from_data(TensorData::new(vec![split], [1]), device);
            split = tp
                .group()
                .all_reduce(t, ReduceOp::Sum, &Tag::new("tp:clip_grad_norm"))?
                .into_scalar()
                .elem_f64() as f32;
        }
        let norm = (split as f64 + rest as f64).sqrt();
        if max_norm.is_finite() && max_norm > 0.0 {
            let coef = clip_coefficient(norm, max_norm);
            if coef < 1.0 {
                scale_grads::<B, M>(&self.module, grads, coef);
            }
        }
        Ok(norm)
    }

    /// All-reduces one number over the data-parallel group.
    pub fn all_reduce_scalar(&self, value: f64, op: ReduceOp, tag: &str) -> Result<f64, FsdpError> {
        if self.world() == 1 && self.replicate_group().is_none_or(|g| g.size() == 1) {
            return Ok(value);
        }
        self.quiesce();
        let t = Tensor::<B::InnerBackend, 1>::from_data(
            TensorData::new(vec![value as f32], [1]),
            self.mesh.device(),
        );
        let mut r = self.shard_group().all_reduce(t, op, &Tag::new(tag))?;
        if let Some(rep) = self.replicate_group() {
            r = rep.all_reduce(r, op, &Tag::new(format!("{tag}:replicas")))?;
        }
        Ok(r.into_scalar().elem_f64())
    }

    /// Steps `optim` on the local shards.
    pub fn step(&mut self, optim: &mut TorchAdamW<B::InnerBackend>, grads: GradientsParams)
    where
        M: AutodiffModule<B>,
    {
        if let Some(host) = &self.host {
            // Offload: AdamW runs on the host copies; `optim` contributes its hyper-parameters.
            host.adam_step(optim.config());
            return;
        }
        let module = self.module.clone();
        self.module = retie::<B, M>(optim.step(module, grads));
    }

    /// Burn's [`Optimizer::step`] on the local shards: Adam, AdamW, SGD (with momentum,
    /// Nesterov and weight decay), RmsProp, AdaGrad, Adan — every optimizer of `burn::optim`
    /// whose update is elementwise, so that stepping each rank's rows gives the rows of the
    /// full step. The state (moments, …) is kept per shard, by parameter id, in `optim`. Pass
    /// the learning rate of a Burn [`LrScheduler`](burn::optim::lr_scheduler::LrScheduler)
    /// as `lr` to schedule it.
    ///
    /// [`TorchAdamW`] through [`step`](Self::step) remains the PyTorch-exact AdamW (the one
    /// the fixtures' trajectories are reproduced with, and the only one CPU offload steps).
    ///
    /// # Errors
    /// - [`FsdpError::Config`] with CPU offload (the master shards live in host memory, which
    ///   only [`step`](Self::step) updates), and for Burn's Muon and L-BFGS, whose updates
    ///   depend on the whole parameter (Newton–Schulz orthogonalisation of a matrix, a line
    ///   search over all parameters) and would be silently wrong on row shards.
    ///
    /// Burn's per-parameter gradient clipping (`with_grad_clipping(GradientClippingConfig::Norm)`)
    /// would clip each *shard* by its own norm: clip with [`clip_grad_norm`](Self::clip_grad_norm)
    /// (global norm, over all ranks) instead; clipping by value is elementwise and fine.
    ///
    /// # Example
    /// ```ignore
    /// let mut optim = burn::optim::AdamConfig::new().init();
    /// let mut schedule = CosineAnnealingLrSchedulerConfig::new(1e-3, steps).init()?;
    /// for batch in batches {
    ///     let loss = fsdp.forward(|m, r| m.loss(batch, r));
    ///     let grads = fsdp.gradients(loss.backward());
    ///     fsdp.step_with(&mut optim, schedule.step(), grads)?;
    /// }
    /// ```
    pub fn step_with<O: Optimizer<M, B>>(
        &mut self,
        optim: &mut O,
        lr: LearningRate,
        grads: GradientsParams,
    ) -> Result<(), FsdpError>
    where
        M: AutodiffModule<B>,
    {
        if self.host.is_some() {
            return Err(FsdpError::Config(
                "CPU offload keeps the master shards in host memory, where only burn-fsdp's \
                 TorchAdamW steps them: use `Fsdp::step` with `TorchAdamWConfig`, or turn offload off"
                    .into(),
            ));
        }
        refuse_whole_parameter_optimizer::<O>()?;
        self.refuse_uncollected()?;
        let module = self.module.clone();
        self.module = retie::<B, M>(optim.step(lr, module, grads));
        Ok(())
    }

    /// [`full_parameters`](Self::full_parameters) of a tensor-parallel model: each parameter
    /// also reassembled from its tp slices (every rank of the mesh must call this).
    pub fn full_parameters_tp(
        &self,
        tp: &crate::tp::TensorParallel<B::InnerBackend>,
    ) -> Result<Vec<(String, Vec<usize>, TensorData)>, FsdpError> {
        let device = self.mesh.device().clone();
        self.full_parameters()?
            .into_iter()
            .map(|(name, shape, data)| {
                let v = data.convert::<f32>().to_vec::<f32>().unwrap_or_default();
                let (shape, v) = tp.unsplit(&name, &shape, v, &device)?;
                let n = shape.clone();
                Ok((name, shape, TensorData::new(v, n)))
            })
            .collect()
    }

    /// The host store of an offloaded FSDP (`None` without offload).
    pub fn host_store(&self) -> Option<&HostStore> {
        self.host.as_deref()
    }

    /// Every unsharded parameter as `(path, shape, values)`, gathered from all ranks (every
    /// rank must call this; each gets the full list). For export and checks.
    pub fn full_parameters(&self) -> Result<Vec<(String, Vec<usize>, TensorData)>, FsdpError> {
        self.quiesce();
        let shards = self.shard_values();
        let group = self.shard_group();
        let mut out = Vec::new();
        for unit in &self.units {
            if unit.params.is_empty() {
                continue;
            }
            let values: Vec<f32> =
                unit.params.iter().flat_map(|p| shards.get(&p.id).cloned().unwrap_or_default()).collect();
            let n = values.len();
            let flat =
                Tensor::<B::InnerBackend, 1>::from_data(TensorData::new(values, [n]), self.mesh.device());
            let full = group.all_gather(flat, &Tag::new(format!("{}:export", unit.comm.name)))?;
            let g2 = full.reshape([self.world(), unit.shard_len()]);
            for (p, &off) in unit.params.iter().zip(&unit.offsets) {
                let cols = g2.clone().narrow(1, off, p.shard_numel());
                out.push((p.path.clone(), p.global_shape.clone(), p.unshard_flat(cols).into_data()));
            }
        }
        Ok(out)
    }

    /// At world size 1 without a dtype change nothing needs gathering.
    fn bypass(&self) -> bool {
        self.world() == 1
            && self.replicate_group().is_none_or(|g| g.size() == 1)
            && self.config.mp_policy.param_dtype.is_none()
            && self.host.is_none()
    }

    /// This rank's padded shard of every parameter, flattened to `f32` host values.
    pub(crate) fn shard_values(&self) -> HashMap<ParamId, Vec<f32>> {
        if let Some(host) = &self.host {
            return self
                .units
                .iter()
                .flat_map(|u| u.params.iter())
                .filter_map(|p| host.get(p.id).map(|h| (p.id, h.shard)))
                .collect();
        }
        let shards = collect_shards::<B, M>(&self.module, &self.param_unit, self.units.len());
        shards
            .into_iter()
            .flatten()
            .map(|(id, t)| {
                let t = Tensor::<B, 1>::from_primitive(TensorPrimitive::Float(B::float_reshape(
                    t.clone(),
                    burn::tensor::Shape::new([burn::tensor::TensorMetadata::shape(&t).num_elements()]),
                )));
                (id, t.inner().into_data().convert::<f32>().to_vec::<f32>().unwrap_or_default())
            })
            .collect()
    }

    /// Replaces the sharded module (checkpoint loading).
    pub(crate) fn replace_module(&mut self, f: impl FnOnce(M) -> M) {
        let module = self.module.clone();
        self.module = retie::<B, M>(f(module));
    }

    /// What unit `u`'s gather op talks through: its communicator and the rank's prefetcher.
    fn gather_comm(&self, u: usize) -> GatherComm<B::InnerBackend> {
        GatherComm { unit: self.units[u].comm.clone(), prefetch: self.prefetch.clone() }
    }

    /// The unit of the parameters `ids` of a block run through a runner; `None` for a block
    /// without sharded parameters (only buffers or frozen parameters), which runs as it is.
    /// A block holding two units unwinds with [`MixedUnits`] (the forward returns it as
    /// [`FsdpError::UnitsMixed`]).
    fn unit_of_ids(&self, ids: &[ParamId]) -> Option<usize> {
        let mut units = ids.iter().filter_map(|id| self.param_unit.get(id).copied());
        let first = units.next()?;
        if let Some(other) = units.find(|&u| u != first) {
            // The runner returns a tensor: the forward catches this and returns the error.
            let (first, second) = (self.units[first].name.clone(), self.units[other].name.clone());
            std::panic::panic_any(MixedUnits { first, second });
        }
        Some(first)
    }

    /// A view of `module` with unit `u`'s parameters all-gathered (other parameters untouched).
    fn gather_view<U: Module<B>>(
        &self,
        module: U,
        u: usize,
        anchor: Option<FloatTensor<B>>,
        end: Option<FloatTensor<B>>,
        reshard: bool,
    ) -> U {
        let shards = collect_shards::<B, U>(&module, &self.param_unit, self.units.len());
        let (gathered, group) = self.gather_full(u, &shards[u], anchor, end, reshard);
        let unit = &self.units[u];
        // The root unit's views are the model's `self` in the forward: backward gives them
        // the shards' gradients too.
        let mut views = ParamViews { unit, gathered, group, aliases: (u == 0).then(Vec::new) };
        let view = module.map(&mut views);
        if let Some(aliases) = views.aliases {
            unit.comm.set_aliases(aliases);
        }
        view
    }

    /// All-gathers unit `u` from its `shards` (by id): the gathered buffer and the group of
    /// its parameters' views.
    fn gather_full(
        &self,
        u: usize,
        shards: &HashMap<ParamId, FloatTensor<B>>,
        anchor: Option<FloatTensor<B>>,
        end: Option<FloatTensor<B>>,
        reshard: bool,
    ) -> (FloatTensor<B>, Arc<ViewGroup>) {
        let unit = &self.units[u];
        let full = match &self.host {
            Some(host) => {
                // The op needs a tracked parent; without an input activation, a tiny leaf.
                let anchor = anchor.filter(|a| B::float_is_require_grad(a)).unwrap_or_else(|| {
                    let leaf = Tensor::<B::InnerBackend, 1>::zeros([1], self.mesh.device());
                    Tensor::<B, 1>::from_inner(leaf).require_grad().into_primitive().tensor()
                });
                let ids = Arc::new(unit.params.iter().map(|p| (p.id, p.shard_numel())).collect());
                B::fsdp_all_gather_offloaded(anchor, end, self.gather_comm(u), host.clone(), ids, reshard)
            }
            None => {
                let parts = unit_shards::<B, _>(unit, shards);
                B::fsdp_all_gather(parts, anchor, end, self.gather_comm(u), reshard)
            }
        };
        (full, ViewGroup::new(self.world(), unit.shard_len(), reshard))
    }
}

trait ElemF64 {
    fn elem_f64(self) -> f64;
}

impl<E: burn::tensor::ElementConversion> ElemF64 for E {
    fn elem_f64(self) -> f64 {
        self.elem::<f64>()
    }
}

/// The shard values (the parameters' own tensors, any rank) of `module`, per unit, by id.
fn collect_shards<B: Backend, M: Module<B>>(
    module: &M,
    param_unit: &HashMap<ParamId, usize>,
    n_units: usize,
) -> Vec<HashMap<ParamId, FloatTensor<B>>> {
    struct Collect<'a, B: Backend> {
        param_unit: &'a HashMap<ParamId, usize>,
        out: Vec<HashMap<ParamId, FloatTensor<B>>>,
    }
    impl<B: Backend> ModuleVisitor<B> for Collect<'_, B> {
        fn visit_float<const D: usize>(&mut self, param: &Param<Tensor<B, D>>) {
            if let Some(&u) = self.param_unit.get(&param.id) {
                self.out[u].insert(param.id, param.val().into_primitive().tensor());
            }
        }
    }
    let mut c = Collect { param_unit, out: (0..n_units).map(|_| HashMap::new()).collect() };
    module.visit(&mut c);
    c.out
}

/// The unit's shards in unit order; a missing one is a bug in how the model runs its units.
fn unit_shards<B: Backend, I: Backend>(
    unit: &ParamGroup<I>,
    shards: &HashMap<ParamId, FloatTensor<B>>,
) -> Vec<FloatTensor<B>> {
    unit.params
        .iter()
        .map(|p| match shards.get(&p.id) {
            Some(t) => t.clone(),
            None => panic!(
                "FSDP unit `{}`: parameter `{}` is not inside the module run for this unit",
                unit.comm.name, p.path
            ),
        })
        .collect()
}

/// Replaces full parameters by this rank's padded shards (fresh leaves).
struct Sharder<'a, B: FsdpBackend> {
    units: &'a [ParamGroup<B::InnerBackend>],
    param_unit: &'a HashMap<ParamId, usize>,
    rank: usize,
    /// With offload, shards go here and the module keeps zero-row placeholders.
    host: Option<&'a HostStore>,
    /// Where the shards of lazy parameters come from ([`Fsdp::wrap_deferred`]).
    deferred: Option<&'a dyn ShardInit>,
    /// The first failure of `deferred`; later parameters are left as they are.
    error: Option<FsdpError>,
    _b: std::marker::PhantomData<B>,
}

impl<B: FsdpBackend> Sharder<'_, B> {
    /// This rank's padded shard of the lazy parameter `p`, from `init`, never building the
    /// full tensor.
    fn deferred_shard<const D: usize>(
        &self,
        init: &dyn ShardInit,
        p: &ShardedParam,
        device: &B::Device,
    ) -> Result<Tensor<B::InnerBackend, D>, FsdpError> {
        let rows = p.rows_of(self.rank);
        let have = rows.len() * p.row_numel();
        let mut values = init
            .rows(&p.path, &p.global_shape, rows)
            .map_err(|error| FsdpError::Init { path: p.path.clone(), error })?;
        if values.len() != have {
            return Err(FsdpError::Init {
                path: p.path.clone(),
                error: format!(
                    "the initialiser gave {} values for rows {:?} of shape {:?}, expected {have}",
                    values.len(),
                    p.rows_of(self.rank),
                    p.global_shape
                )
                .into(),
            });
        }
        values.resize(p.shard_numel(), 0.0);
        let data = burn::tensor::TensorData::new(values, p.shard_shape());
        Ok(Tensor::from_data(data, device))
    }
}

impl<B: FsdpBackend> ModuleMapper<B> for Sharder<'_, B> {
    fn map_float<const D: usize>(&mut self, param: Param<Tensor<B, D>>) -> Param<Tensor<B, D>> {
        let Some(&u) = self.param_unit.get(&param.id) else {
            return param;
        };
        let units = self.units;
        let unit = &units[u];
        let Some(i) = unit.index_of(param.id) else {
            return param;
        };
        let p = &unit.params[i];
        let lazy = deferred_shape(self.deferred, &p.path, &param).is_some();
        let (id, device) = (param.id, param.lazy_device());
        let (shard, require_grad, mapper) = match (lazy, self.deferred) {
            (true, Some(init)) => {
                if self.error.is_some() {
                    return param;
                }
                match self.deferred_shard::<D>(init, p, &device) {
                    // The lazy parameter is dropped unread: its initialiser never runs.
                    Ok(shard) => (shard, true, Default::default()),
                    Err(e) => {
                        self.error = Some(e);
                        return param;
                    }
                }
            }
            _ => {
                let (_, tensor, mapper) = param.consume();
                let require_grad = tensor.is_require_grad();
                // Copy the data out so the shard is a fresh leaf sharing nothing with `tensor`'s graph.
                (p.shard_of(tensor.inner(), self.rank), require_grad, mapper)
            }
        };
        let mut t = match self.host {
            Some(host) => {
                let n = shard.shape().num_elements();
                let values =
                    shard.reshape([n]).into_data().convert::<f32>().to_vec::<f32>().unwrap_or_default();
                host.insert(id, values);
                let mut empty = p.shard_shape();
                empty[0] = 0;
                Tensor::<B, D>::zeros(burn::tensor::Shape::from(empty), &device)
            }
            None => Tensor::<B, D>::from_data(shard.into_data(), &device),
        };
        if require_grad {
            t = t.require_grad();
        }
        Param::from_mapped_value(id, t, mapper)
    }
}

/// Replaces the shards of one unit's parameters by their values cut out of the flat gathered
/// buffer, without autodiff (`forward_valid`, on the inner backend).
struct Unsharder<'a, I: Backend> {
    unit: &'a ParamGroup<I>,
    gathered: FloatTensor<I>,
    world: usize,
}

impl<I: Backend> ModuleMapper<I> for Unsharder<'_, I> {
    fn map_float<const D: usize>(&mut self, param: Param<Tensor<I, D>>) -> Param<Tensor<I, D>> {
        let (id, tensor, mapper) = param.consume();
        let Some(i) = self.unit.index_of(id) else {
            return Param::from_mapped_value(id, tensor, mapper);
        };
        let view = ParamView::of(&self.unit.params[i], self.unit.offsets[i]);
        let full = view.cut::<I>(self.gathered.clone(), self.world, self.unit.shard_len());
        Param::from_mapped_value(id, Tensor::from_primitive(TensorPrimitive::Float(full)), mapper)
    }
}

/// Replaces the shards of one unit's parameters by their views of the gathered buffer
/// (training forward: [`FsdpBackend::fsdp_param_view`]).
struct ParamViews<'a, B: FsdpBackend> {
    unit: &'a ParamGroup<B::InnerBackend>,
    gathered: FloatTensor<B>,
    group: Arc<ViewGroup>,
    /// The views' nodes, when they are kept as aliases of the shards ([`Alias`]).
    aliases: Option<Vec<Alias>>,
}

impl<B: FsdpBackend> ModuleMapper<B> for ParamViews<'_, B> {
    fn map_float<const D: usize>(&mut self, param: Param<Tensor<B, D>>) -> Param<Tensor<B, D>> {
        let (id, tensor, mapper) = param.consume();
        let Some(i) = self.unit.index_of(id) else {
            return Param::from_mapped_value(id, tensor, mapper);
        };
        let view = ParamView::of(&self.unit.params[i], self.unit.offsets[i]);
        let full = B::fsdp_param_view(&self.gathered, view, &self.group);
        if let Some(aliases) = &mut self.aliases
            && B::is_tracked(&full)
        {
            let shard = tensor.shape();
            aliases.push((B::autodiff_node(&full), self.unit.offsets[i], shard, tensor.dtype()));
        }
        Param::from_mapped_value(id, Tensor::from_primitive(TensorPrimitive::Float(full)), mapper)
    }
}

/// The [`UnitRunner`] of an [`Fsdp`] forward: gathers each unit just before it runs.
pub struct FsdpRunner<'a, B: FsdpBackend, M: Module<B>> {
    fsdp: &'a Fsdp<B, M>,
    /// Which units went through [`UnitRunner::run`] (or [`FsdpUnit::run`](crate::FsdpUnit::run))
    /// in this forward; shared with the runner installed for the forward's thread.
    ran: Arc<Mutex<Vec<bool>>>,
    /// Runs blocks again in a checkpointed backward ([`crate::activation`]).
    rerun: bool,
    /// The node that collects this forward's reduce-scatters in backward
    /// ([`FsdpBackend::fsdp_backward_end`]).
    end: Option<FloatTensor<B>>,
}

impl<'a, B: FsdpBackend, M: Module<B>> FsdpRunner<'a, B, M> {
    fn new(fsdp: &'a Fsdp<B, M>, rerun: bool, end: Option<FloatTensor<B>>) -> Self {
        Self { fsdp, ran: Arc::new(Mutex::new(vec![false; fsdp.units.len()])), rerun, end }
    }

    fn ran(&self) -> Vec<bool> {
        self.ran.lock().map(|r| r.clone()).unwrap_or_else(|p| p.into_inner().clone())
    }
}

impl<B: FsdpBackend, M: Module<B>> Clone for FsdpRunner<'_, B, M> {
    fn clone(&self) -> Self {
        Self { fsdp: self.fsdp, ran: self.ran.clone(), rerun: self.rerun, end: self.end.clone() }
    }
}

impl<B: FsdpBackend, M: Module<B>> std::fmt::Debug for FsdpRunner<'_, B, M> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("FsdpRunner").field("rerun", &self.rerun).finish_non_exhaustive()
    }
}

impl<B: FsdpBackend, M: Module<B>> UnitHost<B> for FsdpRunner<'_, B, M> {
    fn enter(&self, ids: &[ParamId]) -> Option<usize> {
        if self.fsdp.bypass() {
            return None;
        }
        // The root unit is gathered for the whole forward already.
        let u = self.fsdp.unit_of_ids(ids).filter(|&u| u != 0)?;
        match self.ran.lock() {
            Ok(mut ran) => ran[u] = true,
            Err(poisoned) => poisoned.into_inner()[u] = true,
        }
        Some(u)
    }

    fn gather(
        &self,
        u: usize,
        shards: &HashMap<ParamId, FloatTensor<B>>,
        anchor: FloatTensor<B>,
    ) -> Views<'_, B> {
        // A block run again by activation checkpointing keeps its gathered parameters for its
        // own backward, which follows at once: no reshard, no re-gather.
        let reshard = self.fsdp.units[u].reshard_after_forward && !self.rerun;
        let (gathered, group) = self.fsdp.gather_full(u, shards, Some(anchor), self.end.clone(), reshard);
        let unit = &self.fsdp.units[u];
        Box::new(move |id| {
            let i = unit.index_of(id)?;
            Some(B::fsdp_param_view(&gathered, ParamView::of(&unit.params[i], unit.offsets[i]), &group))
        })
    }

    fn policy(&self) -> MixedPrecisionPolicy {
        self.fsdp.config.mp_policy
    }
}

impl<B: FsdpBackend, M: Module<B>> UnitRunner<B> for FsdpRunner<'_, B, M> {
    fn run<U: Module<B>, const D: usize>(
        &mut self,
        unit: &U,
        x: Tensor<B, D>,
        f: impl FnOnce(&U, Tensor<B, D>) -> Tensor<B, D>,
    ) -> Tensor<B, D> {
        run_unit(&*self, unit, x, f)
    }
}

/// Maps the gathered root view's parameters to leaves holding the same values, remembering
/// `(leaf, original)` pairs ([`Fsdp::forward_checkpointed`]).
struct RootLeaves<B: Backend> {
    pairs: Vec<(FloatTensor<B>, FloatTensor<B>)>,
}

impl<B: AutodiffBackend> ModuleMapper<B> for RootLeaves<B> {
    fn map_float<const D: usize>(&mut self, param: Param<Tensor<B, D>>) -> Param<Tensor<B, D>> {
        let (id, original, mapper) = param.consume();
        let leaf = original.clone().detach().require_grad();
        self.pairs.push((leaf.clone().into_primitive().tensor(), original.into_primitive().tensor()));
        Param::from_mapped_value(id, leaf, mapper)
    }
}
