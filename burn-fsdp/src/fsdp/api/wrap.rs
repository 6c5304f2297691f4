//! Wrapping: sharding a model's parameters into units (`Fsdp::wrap`, `Fsdp::wrap_deferred`).

use super::*;

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

    pub(super) fn wrap_inner(
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
        // Rank 0's values, each trainable parameter cut to this rank's rows as it is reached
        // (a lazy one materialised then, alone).
        let (model, described) = {
            let mut groups = vec![&group];
            groups.extend(replicate.as_ref());
            crate::fsdp::rank0_broadcast::from_rank0_sharded::<B, M>(model, &groups, (rank, world), deferred)?
        };
        // FSDP2 shards parameters, never buffers: tensors that do not require grad (Burn's
        // `RunningState` buffers such as BatchNorm's running statistics, and frozen parameters)
        // stay whole and replicated on every rank, outside every collective.
        let (described, replicated): (Vec<_>, Vec<_>) =
            described.into_iter().partition(|(.., trainable)| *trainable);
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
        let prefetch = (config.prefetch && world > 1).then(|| {
            Prefetcher::<B::InnerBackend>::new(
                unit_names.len(),
                &format!("rank{rank}"),
                config.max_inflight_reduce_scatters,
            )
        });
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
}
/// Replaces full parameters by this rank's padded shards (fresh leaves).
pub(super) struct Sharder<'a, B: FsdpBackend> {
    pub(super) units: &'a [ParamGroup<B::InnerBackend>],
    pub(super) param_unit: &'a HashMap<ParamId, usize>,
    pub(super) rank: usize,
    /// With offload, shards go here and the module keeps zero-row placeholders.
    pub(super) host: Option<&'a HostStore>,
    /// Where the shards of lazy parameters come from ([`Fsdp::wrap_deferred`]).
    pub(super) deferred: Option<&'a dyn ShardInit>,
    /// The first failure of `deferred`; later parameters are left as they are.
    pub(super) error: Option<FsdpError>,
    pub(super) _b: std::marker::PhantomData<B>,
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
                // Already this rank's rows (`rank0_broadcast`).
                let (_, tensor, mapper) = param.consume();
                let require_grad = tensor.is_require_grad();
                (tensor.inner(), require_grad, mapper)
            }
        };
        let mut t = match self.host {
            Some(host) => {
                let n = shard.shape().num_elements();
                let values = match crate::downcast::f32_values(shard.reshape([n]).into_data(), || {
                    format!("`{}`", p.path)
                }) {
                    Ok(v) => v,
                    Err(e) => {
                        self.error = Some(e);
                        return Param::from_mapped_value(id, Tensor::empty([0; D], &device), mapper);
                    }
                };
                host.insert(id, values);
                let mut empty = p.shard_shape();
                empty[0] = 0;
                Tensor::<B, D>::zeros(burn::tensor::Shape::from(empty), &device)
            }
            // A fresh leaf: the first pass copied the rows out, and deferred rows are new.
            None => Tensor::<B, D>::from_inner(shard),
        };
        if require_grad {
            t = t.require_grad();
        }
        Param::from_mapped_value(id, t, mapper)
    }
}
