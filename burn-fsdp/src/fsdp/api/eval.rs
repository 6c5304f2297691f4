//! Evaluation: Burn's `valid()` mode on the sharded model.
//!
//! In Burn a model evaluates on the inner (non-autodiff) backend: `model.valid()`, where
//! BatchNorm normalises with its running statistics and dropout is off. [`Fsdp::forward_valid`]
//! does the same with the shards: it runs the model's `InnerModule`, all-gathering the root unit
//! first and each further unit when the model runs it (no autodiff graph, no resharding state to
//! keep: each gathered unit is dropped when its block returns).

use burn::module::{AutodiffModule, Module};
use burn::tensor::Tensor;

use super::{Fsdp, FsdpError, Unsharder, collect_shards, unit_shards};
use crate::fsdp::collectives::Phase;
use crate::fsdp::op::FsdpBackend;
use crate::runner::UnitRunner;

impl<B: FsdpBackend, M: AutodiffModule<B>> Fsdp<B, M> {
    /// Runs `f` on the model in evaluation mode (Burn's `valid()`: the inner backend, no
    /// autodiff; BatchNorm uses its running statistics), with the root unit all-gathered and
    /// a runner that gathers each further unit when the model runs it. Every rank must call
    /// it (the gathers are collectives).
    ///
    /// # Errors
    /// [`FsdpError::Config`] with CPU offload (the shards are in host memory; evaluate on
    /// [`full_parameters`](Self::full_parameters) instead).
    ///
    /// # Example
    /// ```ignore
    /// let logits = fsdp.forward_valid(|model, runner| model.forward_with(ids, runner))?;
    /// ```
    pub fn forward_valid<O>(
        &self,
        f: impl FnOnce(&M::InnerModule, &mut FsdpEvalRunner<'_, B, M>) -> O,
    ) -> Result<O, FsdpError> {
        if self.host.is_some() {
            return Err(FsdpError::Config(
                "forward_valid with CPU offload: the shards live in host memory; evaluate a model \
                 built from `Fsdp::full_parameters` instead"
                    .into(),
            ));
        }
        // Nothing of the training step may still be in flight on the communication thread.
        self.quiesce();
        let inner = self.module.valid();
        let root = if self.units[0].params.is_empty() || self.bypass() {
            inner
        } else {
            self.gather_valid(inner, 0)
        };
        let mut runner = FsdpEvalRunner { fsdp: self };
        let result = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| f(&root, &mut runner)));
        result.map_err(|payload| match payload.downcast::<super::MixedUnits>() {
            Ok(m) => FsdpError::UnitsMixed { first: m.first, second: m.second },
            Err(payload) => std::panic::resume_unwind(payload),
        })
    }

    /// `module` (on the inner backend) with unit `u`'s parameters all-gathered.
    fn gather_valid<U: Module<B::InnerBackend>>(&self, module: U, u: usize) -> U {
        let unit = &self.units[u];
        let shards = collect_shards::<B::InnerBackend, U>(&module, &self.param_unit, self.units.len());
        let pieces = unit_shards::<B::InnerBackend, _>(unit, &shards[u]);
        let flat = crate::fsdp::prefetch::flat::<B::InnerBackend>(pieces);
        let gathered = unit.comm.gather(flat, Phase::ForwardGather).into_primitive().tensor();
        module.map(&mut Unsharder { unit, gathered, world: self.world() })
    }
}

/// The [`UnitRunner`] of [`Fsdp::forward_valid`]: gathers each unit (on the inner backend)
/// just before it runs.
pub struct FsdpEvalRunner<'a, B: FsdpBackend, M: AutodiffModule<B>> {
    fsdp: &'a Fsdp<B, M>,
}

impl<B: FsdpBackend, M: AutodiffModule<B>> std::fmt::Debug for FsdpEvalRunner<'_, B, M> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("FsdpEvalRunner").finish_non_exhaustive()
    }
}

impl<B: FsdpBackend, M: AutodiffModule<B>> UnitRunner<B::InnerBackend> for FsdpEvalRunner<'_, B, M> {
    fn run<U: Module<B::InnerBackend>, const D: usize>(
        &mut self,
        unit: &U,
        x: Tensor<B::InnerBackend, D>,
        f: impl FnOnce(&U, Tensor<B::InnerBackend, D>) -> Tensor<B::InnerBackend, D>,
    ) -> Tensor<B::InnerBackend, D> {
        let fsdp = self.fsdp;
        if fsdp.bypass() {
            return f(unit, x);
        }
        let Some(u) = fsdp.unit_of_module::<B::InnerBackend, U>(unit) else { return f(unit, x) };
        let view = fsdp.gather_valid(unit.clone(), u);
        let x = match fsdp.config.mp_policy.param_dtype {
            Some(dt) if x.dtype() != dt => x.cast(dt),
            _ => x,
        };
        let y = f(&view, x);
        match fsdp.config.mp_policy.output_dtype {
            Some(dt) if y.dtype() != dt => y.cast(dt),
            _ => y,
        }
    }
}
