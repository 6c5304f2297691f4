//! The forward pass: gathering units as the model runs them (`Fsdp::forward`, the runner, the
//! checkpointed forward).

use super::*;

impl<B: FsdpBackend, M: Module<B>> Fsdp<B, M> {
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
    pub(super) fn forward_failed(&self, ran: &[bool], payload: Box<dyn std::any::Any + Send>) -> FsdpError {
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
    /// ([`crate::activation_checkpointing`]): blocks the model runs through
    /// [`UnitRunner::run_recomputable`] keep only their input through forward and run again
    /// (with a fresh all-gather) in [`backward_checkpointed`](Self::backward_checkpointed).
    /// `f` returns the loss. The root unit's gathered parameters are handed to the model as
    /// leaves, so the pieces of the segmented backward share no graph; they stay gathered
    /// until backward ends.
    ///
    /// # Panics
    /// As [`forward`](Self::forward), and when the previous backward's gradients were never
    /// collected; [`try_forward_checkpointed`](Self::try_forward_checkpointed) returns these as
    /// errors.
    pub fn forward_checkpointed<'s>(
        &'s self,
        f: impl FnOnce(&M, &mut CheckpointRunner<'s, B, FsdpRunner<'s, B, M>>) -> Tensor<B, 1>,
    ) -> Checkpointed<'s, B> {
        match self.try_forward_checkpointed(f) {
            Ok(run) => run,
            Err(e) => panic!("{e}"),
        }
    }

    /// [`forward_checkpointed`](Self::forward_checkpointed), returning an error where it
    /// panics: [`FsdpError::GradientsNotCollected`] when the previous backward's
    /// reduce-scatters were never collected, [`FsdpError::UnitNotRun`] and
    /// [`FsdpError::UnitsMixed`] as [`try_forward`](Self::try_forward) does. Other panics of
    /// `f` propagate unchanged, among them a failed collective's
    /// [`CollectiveFailure`](crate::CollectiveFailure).
    pub fn try_forward_checkpointed<'s>(
        &'s self,
        f: impl FnOnce(&M, &mut CheckpointRunner<'s, B, FsdpRunner<'s, B, M>>) -> Tensor<B, 1>,
    ) -> Result<Checkpointed<'s, B>, FsdpError> {
        self.begin_forward()?;
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
            Ok(loss) => Ok(Checkpointed::new(loss, runner, roots, between)),
            Err(payload) => Err(self.forward_failed(&runner.inner.ran(), payload)),
        }
    }

    /// Starts a forward on the communication thread (prefetch state, shards to prefetch from).
    ///
    /// # Errors
    /// [`FsdpError::GradientsNotCollected`] when the previous backward's reduce-scatters were
    /// never collected.
    pub(super) fn begin_forward(&self) -> Result<(), FsdpError> {
        match &self.prefetch {
            Some(p) if !self.bypass() => {
                p.begin_forward(self.all_shards()).map_err(|units| FsdpError::GradientsNotCollected { units })
            }
            _ => Ok(()),
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

    /// Every unit's shard tensors on the inner backend, for the prefetcher (`None` for
    /// offloaded units, whose shards live on the host).
    pub(super) fn all_shards(&self) -> Vec<Option<Vec<FloatTensor<B::InnerBackend>>>> {
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

    /// What unit `u`'s gather op talks through: its communicator and the rank's prefetcher.
    pub(super) fn gather_comm(&self, u: usize) -> GatherComm<B::InnerBackend> {
        GatherComm { unit: self.units[u].comm.clone(), prefetch: self.prefetch.clone() }
    }

    /// The unit of the parameters `ids` of a block run through a runner; `None` for a block
    /// without sharded parameters (only buffers or frozen parameters), which runs as it is.
    /// A block holding two units unwinds with [`MixedUnits`] (the forward returns it as
    /// [`FsdpError::UnitsMixed`]).
    pub(super) fn unit_of_ids(&self, ids: &[ParamId]) -> Option<usize> {
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
    pub(super) fn gather_view<U: Module<B>>(
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
    pub(super) fn gather_full(
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
/// The shard values (the parameters' own tensors, any rank) of `module`, per unit, by id.
pub(super) fn collect_shards<B: Backend, M: Module<B>>(
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
pub(super) fn unit_shards<B: Backend, I: Backend>(
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
/// Replaces the shards of one unit's parameters by their views of the gathered buffer
/// (training forward: [`FsdpBackend::fsdp_param_view`]).
pub(super) struct ParamViews<'a, B: FsdpBackend> {
    pub(super) unit: &'a ParamGroup<B::InnerBackend>,
    pub(super) gathered: FloatTensor<B>,
    pub(super) group: Arc<ViewGroup>,
    /// The views' nodes, when they are kept as aliases of the shards ([`Alias`]).
    pub(super) aliases: Option<Vec<Alias>>,
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
    /// Runs blocks again in a checkpointed backward ([`crate::activation_checkpointing`]).
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
pub(super) struct RootLeaves<B: Backend> {
    pub(super) pairs: Vec<(FloatTensor<B>, FloatTensor<B>)>,
}
impl<B: AutodiffBackend> ModuleMapper<B> for RootLeaves<B> {
    fn map_float<const D: usize>(&mut self, param: Param<Tensor<B, D>>) -> Param<Tensor<B, D>> {
        let (id, original, mapper) = param.consume();
        let leaf = original.clone().detach().require_grad();
        self.pairs.push((leaf.clone().into_primitive().tensor(), original.into_primitive().tensor()));
        Param::from_mapped_value(id, leaf, mapper)
    }
}
