//! The per-unit collectives: the all-gather of a unit's flat shard and the reduce-scatter of
//! its flat gradient, with FSDP2's no-sync accumulation.

use std::sync::Arc;
use std::sync::Mutex;
use std::sync::atomic::{AtomicBool, Ordering};

use burn::tensor::backend::Backend;
use burn::tensor::{DType, Tensor};

use crate::comm::{CollectiveFailure, ProcessGroup, ReduceOp, Tag};

/// Why a unit's collective runs: used in tags and messages.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Phase {
    /// All-gather before the unit's forward.
    ForwardGather,
    /// Re-gather in backward of a resharded unit.
    BackwardGather,
    /// Reduce-scatter of the unit's gradient.
    ReduceScatter,
}

impl Phase {
    fn name(self) -> &'static str {
        match self {
            Phase::ForwardGather => "fwd-all-gather",
            Phase::BackwardGather => "bwd-all-gather",
            Phase::ReduceScatter => "reduce-scatter",
        }
    }
}

/// Everything a unit's autodiff op needs to communicate, shared by its forward, its
/// re-gather (retro-forward) and its backward.
pub(crate) struct UnitComm<B: Backend> {
    /// The data-parallel group the unit is sharded over.
    pub(crate) group: Arc<dyn ProcessGroup<B>>,
    /// HSDP: the group of replicas, across which reduced shard gradients are averaged.
    pub(crate) replicate: Option<Arc<dyn ProcessGroup<B>>>,
    /// Unit name (module path), for tags.
    pub(crate) name: String,
    /// Elements of the rank's flat shard.
    pub(crate) shard_len: usize,
    /// `false` while gradient sync is off (accumulation micro-batches).
    pub(crate) sync: Arc<AtomicBool>,
    /// Unsharded gradients accumulated while sync was off.
    pub(crate) pending: Mutex<Option<Tensor<B, 1>>>,
    /// dtype of the all-gather (mixed precision `param_dtype`); `None` keeps the shard's.
    pub(crate) param_dtype: Option<DType>,
    /// dtype of the reduce-scatter (mixed precision `reduce_dtype`); `None` keeps the grad's.
    pub(crate) reduce_dtype: Option<DType>,
    /// The unit's index in its [`Fsdp`](crate::Fsdp) (0 = root).
    pub(crate) index: usize,
    /// The nodes of the views the last forward handed to the model for this unit's parameters,
    /// where backward registers their reduced gradients too (the root unit's only).
    pub(crate) aliases: Mutex<Vec<crate::fsdp::prefetch::Alias>>,
}

impl<B: Backend> std::fmt::Debug for UnitComm<B> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("UnitComm").field("name", &self.name).field("shard_len", &self.shard_len).finish()
    }
}

impl<B: Backend> UnitComm<B> {
    /// Sets the view nodes of this forward ([`UnitComm::aliases`]).
    pub(crate) fn set_aliases(&self, aliases: Vec<crate::fsdp::prefetch::Alias>) {
        match self.aliases.lock() {
            Ok(mut a) => *a = aliases,
            Err(poisoned) => *poisoned.into_inner() = aliases,
        }
    }

    /// Takes the view nodes of the last forward, for its backward.
    pub(crate) fn take_aliases(&self) -> Vec<crate::fsdp::prefetch::Alias> {
        match self.aliases.lock() {
            Ok(mut a) => std::mem::take(&mut *a),
            Err(poisoned) => std::mem::take(&mut *poisoned.into_inner()),
        }
    }

    fn tag(&self, phase: Phase) -> Tag {
        Tag::new(format!("{}:{}", self.name, phase.name()))
    }

    /// All-gathers the flat shard: `[shard_len]` → `[world · shard_len]`.
    ///
    /// Runs inside forward and inside autodiff's backward, neither of which can return an
    /// error: a failed collective unwinds with a [`CollectiveFailure`], and the rank's
    /// launcher turns it into an error (and aborts the group for the other ranks).
    pub fn gather(&self, shard: Tensor<B, 1>, phase: Phase) -> Tensor<B, 1> {
        let shard = match self.param_dtype {
            Some(dt) if shard.dtype() != dt => shard.cast(dt),
            _ => shard,
        };
        match self.group.all_gather(shard, &self.tag(phase)) {
            Ok(full) => full,
            Err(e) => CollectiveFailure::raise(format!("FSDP unit `{}`: {e}", self.name)),
        }
    }

    /// Turns the unit's full gradient into the rank's averaged shard gradient, or keeps it
    /// for later when gradient sync is off (then returns `None`).
    pub fn reduce(&self, full_grad: Tensor<B, 1>) -> Option<Tensor<B, 1>> {
        self.reduce_with(full_grad, self.sync.load(Ordering::SeqCst))
    }

    /// [`reduce`](Self::reduce) with the gradient-sync flag as it was when the backward ran
    /// (the communication thread may run it after the flag changed).
    pub fn reduce_with(&self, full_grad: Tensor<B, 1>, sync: bool) -> Option<Tensor<B, 1>> {
        let mut pending = self.pending.lock().unwrap_or_else(|p| p.into_inner());
        let total = match pending.take() {
            Some(p) => p + full_grad,
            None => full_grad,
        };
        if !sync {
            *pending = Some(total);
            return None;
        }
        drop(pending);
        let grad_dtype = total.dtype();
        let total = match self.reduce_dtype {
            Some(dt) if dt != grad_dtype => total.cast(dt),
            _ => total,
        };
        let reduced = self.group.reduce_scatter(total, ReduceOp::Avg, &self.tag(Phase::ReduceScatter));
        let reduced = match (&self.replicate, reduced) {
            (Some(rep), Ok(g)) if rep.size() > 1 => {
                rep.all_reduce(g, ReduceOp::Avg, &Tag::new(format!("{}:replica-all-reduce", self.name)))
            }
            (_, r) => r,
        };
        match reduced {
            Ok(g) => Some(g),
            Err(e) => CollectiveFailure::raise(format!("FSDP unit `{}`: {e}", self.name)),
        }
    }
}
