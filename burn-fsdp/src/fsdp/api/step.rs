//! Gradients, clipping and the optimizer step on the shards.

use super::*;

impl<B: FsdpBackend, M: Module<B>> Fsdp<B, M> {
    /// [`FsdpError::GradientsNotCollected`] when a backward left reduce-scatters that
    /// nothing collected: `grads` then lack those units' gradients.
    pub(super) fn refuse_uncollected(&self) -> Result<(), FsdpError> {
        match self.prefetch.as_ref().map(|p| p.uncollected()) {
            Some(units) if units > 0 => Err(FsdpError::GradientsNotCollected { units }),
            _ => Ok(()),
        }
    }

    /// Registers the reduced flat shard gradients of units (from the communication thread)
    /// as the gradients of their parameters' shards.
    pub(super) fn register_reduced(
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
    pub(super) fn gradients_of(&self, all: Vec<B::Gradients>) -> GradientsParams
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
    /// `max_norm` as `clip_grad_norm_` does (`max_norm` ≤ 0 or infinite only measures). On a
    /// mesh carrying tensor parallelism ([`DeviceMesh::with_tensor_parallel`]) the norm is that
    /// of the whole model, over dp and tp.
    pub fn clip_grad_norm(&self, grads: &mut GradientsParams, max_norm: f64) -> Result<f64, FsdpError>
    where
        M: AutodiffModule<B>,
    {
        let norm = match self.grad_sq_sum(grads)? {
            StepValue::Pending(t) => {
                super::train_step::read_values(vec![t], "the squared gradient norm")?.into_iter().sum::<f64>()
            }
            StepValue::Read(v) => v,
        }
        .sqrt();
        self.clip_grads(grads, norm, max_norm)?;
        Ok(norm)
    }

    /// The global squared L2 norm `Σ g²` of all gradients over all ranks, as
    /// [`clip_grad_norm`](Self::clip_grad_norm) measures it, left on the device where it can
    /// be (a one-element `f32` tensor after one all-reduce over the shard group): read it
    /// together with the step's other values ([`take_step`]). With CPU offload it is summed on
    /// the host; on a tensor-parallel mesh it is two values on the device (see
    /// [`StepValue::Pending`]), after one all-reduce over dp and one over tp, with no read.
    pub fn grad_sq_sum(&self, grads: &mut GradientsParams) -> Result<StepValue<B::InnerBackend>, FsdpError>
    where
        M: AutodiffModule<B>,
    {
        if let Some(tp) = self.mesh.tensor_parallel() {
            return self.grad_sq_sum_tp(grads, tp).map(StepValue::Pending);
        }
        self.quiesce();
        let device = self.mesh.device();
        let local = match &self.host {
            Some(host) => {
                let local = host.grad_sq_sum();
                if self.world() == 1 {
                    return Ok(StepValue::Read(local));
                }
                Tensor::<B::InnerBackend, 1>::from_data(TensorData::new(vec![local as f32], [1]), device)
            }
            None => {
                standard_layout_grads::<B, M>(&self.module, grads);
                match grad_sq_sum_tensors::<B, M>(&self.module, grads, |_| true) {
                    [Some(t), _] => t,
                    _ => Tensor::zeros([1], device),
                }
            }
        };
        // Over the shard group only: with HSDP every replica holds the same reduced gradients.
        if self.world() == 1 {
            return Ok(StepValue::Pending(local));
        }
        let local = local.cast(DType::F32);
        Ok(StepValue::Pending(self.shard_group().all_reduce(
            local,
            ReduceOp::Sum,
            &Tag::new("clip_grad_norm"),
        )?))
    }

    /// Scales every gradient by `torch.nn.utils.clip_grad_norm_`'s coefficient for a global
    /// norm `norm` and a bound `max_norm` (≤ 0 or infinite: no change), as
    /// [`clip_grad_norm`](Self::clip_grad_norm) does after measuring.
    pub fn clip_grads(&self, grads: &mut GradientsParams, norm: f64, max_norm: f64) -> Result<(), FsdpError>
    where
        M: AutodiffModule<B>,
    {
        match (clip_factor(norm, max_norm), &self.host) {
            (Some(coef), Some(host)) => host.scale_grads(coef),
            (Some(_), None) => clip_grads_to::<B, M>(&self.module, grads, norm, max_norm),
            (None, _) => {}
        }
        Ok(())
    }

    /// [`grad_sq_sum`](Self::grad_sq_sum) on a data × tensor parallel mesh, where this
    /// FSDP shards tp-local parameters over the data-parallel group: one all-reduce over dp
    /// of the squared sums of split and of replicated parameters, one over tp of the split
    /// part (replicated parameters have identical gradients on every tp rank and count once).
    fn grad_sq_sum_tp(
        &self,
        grads: &mut GradientsParams,
        tp: &crate::tp::TensorParallel<B::InnerBackend>,
    ) -> Result<Tensor<B::InnerBackend, 1>, FsdpError>
    where
        M: AutodiffModule<B>,
    {
        self.quiesce();
        if self.host.is_some() {
            return Err(FsdpError::Config("CPU offload is not supported with tensor parallelism".into()));
        }
        standard_layout_grads::<B, M>(&self.module, grads);
        let device = self.mesh.device();
        // Each part in f32, as the host's `as f32` of the part's value (exact from f32 and
        // bf16 gradients, the same rounding from f64).
        let part = |t: Option<Tensor<B::InnerBackend, 1>>| match t {
            Some(t) if t.dtype() == DType::F32 => t,
            Some(t) => t.cast(DType::F32),
            None => Tensor::zeros([1], (device, DType::F32)),
        };
        let [split, rest] = grad_sq_sum_tensors::<B, M>(&self.module, grads, |id| tp.is_split(id));
        let mut sums = Tensor::cat(vec![part(split), part(rest)], 0);
        if self.world() > 1 {
            sums = self.shard_group().all_reduce(sums, ReduceOp::Sum, &Tag::new("clip_grad_norm"))?;
        }
        if tp.group().size() > 1 {
            let split = sums.clone().slice(0..1);
            let split = tp.group().all_reduce(split, ReduceOp::Sum, &Tag::new("tp:clip_grad_norm"))?;
            sums = Tensor::cat(vec![split, sums.slice(1..2)], 0);
        }
        // [split, rest]: the caller adds them in f64 (`StepValue::Pending`).
        Ok(sums)
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
}
pub(super) trait ElemF64 {
    fn elem_f64(self) -> f64;
}
impl<E: burn::tensor::ElementConversion> ElemF64 for E {
    fn elem_f64(self) -> f64 {
        self.elem::<f64>()
    }
}
