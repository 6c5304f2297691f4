//! The all-gather as a differentiable Burn op.
//!
//! Forward all-gathers a unit's flat shard; backward reduce-scatters the gradient of the
//! gathered tensor onto the shard, so each unit's gradient is reduced as soon as its backward
//! ends. With `recompute` the op is registered as memory-bound with a retro-forward that
//! re-gathers: under `Autodiff<_, BalancedCheckpointing>` the gathered tensor is then freed
//! after forward and re-gathered when backward needs it (FSDP2's `reshard_after_forward`).
//! Without it the op is compute-bound and the gathered tensor lives until backward (ZeRO-2).
//!
//! The optional `anchor` — the unit's input activation — is a second, gradient-free parent.
//! Burn runs backward steps by graph depth; anchoring the gather at the unit's input makes
//! its backward (the reduce-scatter) run right after the unit's own backward instead of at
//! the very end, so full-size gradients do not pile up.

use std::sync::Arc;

use burn::backend::Autodiff;
use burn::backend::autodiff::NodeId;
use burn::backend::autodiff::checkpoint::base::Checkpointer;
use burn::backend::autodiff::checkpoint::retro_forward::RetroForward;
use burn::backend::autodiff::checkpoint::state::BackwardStates;
use burn::backend::autodiff::checkpoint::strategy::CheckpointStrategy;
use burn::backend::autodiff::grads::Gradients;
use burn::backend::autodiff::ops::{Backward, Ops, OpsKind};
use burn::tensor::backend::{AutodiffBackend, Backend};
use burn::tensor::ops::FloatTensor;
use burn::tensor::{Tensor, TensorPrimitive};

use crate::collectives::{Phase, UnitComm};

/// Backends on which FSDP can run: an autodiff backend with the differentiable all-gather.
pub trait FsdpBackend: AutodiffBackend {
    /// All-gathers `shard` (`[n]` → `[world·n]`) through `unit`, differentiably.
    fn fsdp_all_gather(
        shard: FloatTensor<Self>,
        anchor: Option<FloatTensor<Self>>,
        unit: Arc<UnitComm<Self::InnerBackend>>,
        recompute: bool,
    ) -> FloatTensor<Self>;

    /// Whether a memory-bound op is recomputed in backward (true for
    /// `Autodiff<_, BalancedCheckpointing>`), which `reshard_after_forward` relies on.
    fn recomputes() -> bool;
}

fn wrap<B: Backend>(t: B::FloatTensorPrimitive) -> Tensor<B, 1> {
    Tensor::from_primitive(TensorPrimitive::Float(t))
}

#[derive(Debug)]
struct GatherBackward<B: Backend> {
    unit: Arc<UnitComm<B>>,
}

impl<B: Backend, const N: usize> Backward<B, N> for GatherBackward<B> {
    type State = ();

    fn backward(self, ops: Ops<Self::State, N>, grads: &mut Gradients, _checkpointer: &mut Checkpointer) {
        let grad = wrap::<B>(grads.consume::<B>(&ops.node));
        let (device, dtype) = (grad.device(), grad.dtype());
        // Reduce even when the shard needs no gradient: every rank must issue the collective.
        let shard_grad = self.unit.reduce(grad).unwrap_or_else(|| {
            // Gradient sync is off: the full gradient was kept for the next synced backward.
            // The ops below the gather still expect a gradient, so they get zeros.
            Tensor::<B, 1>::zeros([self.unit.shard_len], &device).cast(dtype)
        });
        if let Some(node) = &ops.parents[0] {
            grads.register::<B>(node.id, shard_grad.into_primitive().tensor());
        }
    }
}

#[derive(Debug)]
struct RetroGather<B: Backend> {
    shard_id: NodeId,
    unit: Arc<UnitComm<B>>,
}

impl<B: Backend> RetroForward for RetroGather<B> {
    fn forward(&self, states: &mut BackwardStates, out_node: NodeId) {
        let shard = states.get_state::<B::FloatTensorPrimitive>(&self.shard_id);
        let full = self.unit.gather(wrap::<B>(shard), Phase::BackwardGather);
        states.save(out_node, full.into_primitive().tensor());
    }
}

fn finish<B: Backend, C: CheckpointStrategy, const N: usize>(
    parents: [&FloatTensor<Autodiff<B, C>>; N],
    unit: Arc<UnitComm<B>>,
    recompute: bool,
    output: B::FloatTensorPrimitive,
) -> FloatTensor<Autodiff<B, C>> {
    let nodes = parents.map(|p| p.node.clone());
    let shard_id = parents[0].node.id;
    let prep = GatherBackward { unit: unit.clone() }.prepare::<C>(nodes);
    let kind = if recompute {
        prep.memory_bound().retro_forward(RetroGather { shard_id, unit }).parents(parents).stateful()
    } else {
        prep.compute_bound().stateful()
    };
    match kind {
        OpsKind::Tracked(prep) => prep.finish((), output),
        OpsKind::UnTracked(prep) => prep.finish(output),
    }
}

impl<B: Backend, C: CheckpointStrategy> FsdpBackend for Autodiff<B, C> {
    fn recomputes() -> bool {
        crate::fsdp::is_balanced::<C>()
    }

    fn fsdp_all_gather(
        shard: FloatTensor<Self>,
        anchor: Option<FloatTensor<Self>>,
        unit: Arc<UnitComm<B>>,
        recompute: bool,
    ) -> FloatTensor<Self> {
        let full = unit.gather(wrap::<B>(shard.primitive.clone()), Phase::ForwardGather);
        let output = full.into_primitive().tensor();
        match anchor.filter(|a| a.is_tracked()) {
            Some(anchor) => finish::<B, C, 2>([&shard, &anchor], unit, recompute, output),
            None => finish::<B, C, 1>([&shard], unit, recompute, output),
        }
    }
}
