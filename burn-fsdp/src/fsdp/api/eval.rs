//! Evaluation: Burn's `valid()` mode on the sharded model.
//!
//! In Burn a model evaluates on the inner (non-autodiff) backend: `model.valid()`, where
//! BatchNorm normalises with its running statistics and dropout is off. [`Fsdp::forward_valid`]
//! does the same with the shards: it runs the model's `InnerModule`, all-gathering the root unit
//! first and each further unit when the model runs it (no autodiff graph, no resharding state to
//! keep: each gathered unit is dropped when its block returns).

use burn::module::{AutodiffModule, Module};
use burn::tensor::Tensor;

use std::collections::HashMap;

use burn::module::ParamId;
use burn::tensor::ops::FloatTensor;

use super::{Fsdp, FsdpError, MixedPrecisionPolicy, Unsharder, collect_shards, unit_shards};
use crate::fsdp::collectives::Phase;
use crate::fsdp::op::FsdpBackend;
use crate::fsdp::scope::{self, UnitHost, Views, run_unit};
use crate::fsdp::view::ParamView;
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
        let installed = FsdpEvalRunner { fsdp: self };
        let host: &dyn UnitHost<B::InnerBackend> = &installed;
        let guard = scope::install(&host);
        let result = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| f(&root, &mut runner)));
        drop(guard);
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

impl<B: FsdpBackend, M: AutodiffModule<B>> UnitHost<B::InnerBackend> for FsdpEvalRunner<'_, B, M> {
    fn enter(&self, ids: &[ParamId]) -> Option<usize> {
        if self.fsdp.bypass() {
            return None;
        }
        self.fsdp.unit_of_ids(ids).filter(|&u| u != 0)
    }

    fn gather(
        &self,
        u: usize,
        shards: &HashMap<ParamId, FloatTensor<B::InnerBackend>>,
        _anchor: FloatTensor<B::InnerBackend>,
    ) -> Views<'_, B::InnerBackend> {
        let fsdp = self.fsdp;
        let unit = &fsdp.units[u];
        let pieces = unit_shards::<B::InnerBackend, _>(unit, shards);
        let flat = crate::fsdp::prefetch::flat::<B::InnerBackend>(pieces);
        let gathered = unit.comm.gather(flat, Phase::ForwardGather).into_primitive().tensor();
        let world = fsdp.world();
        Box::new(move |id| {
            let i = unit.index_of(id)?;
            let view = ParamView::of(&unit.params[i], unit.offsets[i]);
            Some(view.cut::<B::InnerBackend>(gathered.clone(), world, unit.shard_len()))
        })
    }

    fn policy(&self) -> MixedPrecisionPolicy {
        self.fsdp.config.mp_policy
    }
}

impl<B: FsdpBackend, M: AutodiffModule<B>> UnitRunner<B::InnerBackend> for FsdpEvalRunner<'_, B, M> {
    fn run<U: Module<B::InnerBackend>, const D: usize>(
        &mut self,
        unit: &U,
        x: Tensor<B::InnerBackend, D>,
        f: impl FnOnce(&U, Tensor<B::InnerBackend, D>) -> Tensor<B::InnerBackend, D>,
    ) -> Tensor<B::InnerBackend, D> {
        run_unit(&*self, unit, x, f)
    }
}
