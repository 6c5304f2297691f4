//! The all-gather as a differentiable Burn op.
//!
//! Forward concatenates a unit's parameter shards and all-gathers them; backward
//! reduce-scatters the gradient of the gathered buffer and hands each parameter shard its
//! slice, so each unit's gradient is reduced as soon as its backward ends. With `recompute`
//! the op is registered as memory-bound with a retro-forward that re-gathers: under
//! `Autodiff<_, BalancedCheckpointing>` the gathered buffer is then freed after forward and
//! re-gathered when backward needs it (FSDP2's `reshard_after_forward`). Without it the op is
//! compute-bound and the gathered buffer lives until backward (ZeRO-2).
//!
//! The parameter shards are the op's direct parents: they are leaves that live anyway, so
//! keeping them for the re-gather costs nothing (a concatenated copy would cost one more
//! shard per unit until backward). Units with more than [`MAX_DIRECT_PARENTS`] parameters
//! fall back to one concatenated parent, which is kept.
//!
//! The optional `anchor` — the unit's input activation — is one more, gradient-free parent.
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
use burn::tensor::{DType, Shape, Tensor, TensorMetadata, TensorPrimitive};

use crate::collectives::{Phase, UnitComm};

/// Units with at most this many parameters (plus the anchor) gather without keeping a
/// concatenated copy of their shards.
pub const MAX_DIRECT_PARENTS: usize = 31;

/// Backends on which FSDP can run: an autodiff backend with the differentiable all-gather.
pub trait FsdpBackend: AutodiffBackend {
    /// All-gathers the concatenation of the flattened `shards` through `unit`
    /// (`[Σ nᵢ]` → `[world · Σ nᵢ]`), differentiably with respect to every shard.
    fn fsdp_all_gather(
        shards: Vec<FloatTensor<Self>>,
        anchor: Option<FloatTensor<Self>>,
        unit: Arc<UnitComm<Self::InnerBackend>>,
        recompute: bool,
    ) -> FloatTensor<Self>;

    /// Whether a memory-bound op is recomputed in backward (true for
    /// `Autodiff<_, BalancedCheckpointing>`), which `reshard_after_forward` relies on.
    fn recomputes() -> bool;
}

fn wrap<B: Backend>(t: B::FloatTensorPrimitive) -> Tensor<B, 1> {
    let n = t.shape().num_elements();
    Tensor::<B, 1>::from_primitive(TensorPrimitive::Float(B::float_reshape(t, Shape::new([n]))))
}

fn flat_concat<B: Backend>(pieces: Vec<B::FloatTensorPrimitive>) -> Tensor<B, 1> {
    let mut pieces: Vec<Tensor<B, 1>> = pieces.into_iter().map(wrap::<B>).collect();
    if pieces.len() == 1 { pieces.remove(0) } else { Tensor::cat(pieces, 0) }
}

/// How the gradient of the flat shard is handed back.
#[derive(Debug, Clone)]
enum Parents {
    /// Parents `0..n` are the parameter shards with these shapes and dtypes.
    Direct(Vec<(Shape, DType)>),
    /// Parent 0 is the concatenated flat shard.
    Flat,
}

#[derive(Debug)]
struct GatherBackward<B: Backend> {
    unit: Arc<UnitComm<B>>,
    parents: Parents,
}

impl<B: Backend, const N: usize> Backward<B, N> for GatherBackward<B> {
    type State = ();

    fn backward(self, ops: Ops<Self::State, N>, grads: &mut Gradients, _checkpointer: &mut Checkpointer) {
        let grad = wrap::<B>(grads.consume::<B>(&ops.node));
        let device = grad.device();
        // Reduce even when no shard needs a gradient: every rank must issue the collective.
        let reduced = self.unit.reduce(grad);
        match self.parents {
            Parents::Flat => {
                let g = reduced.unwrap_or_else(|| Tensor::zeros([self.unit.shard_len], &device));
                if let Some(node) = &ops.parents[0] {
                    grads.register::<B>(node.id, g.into_primitive().tensor());
                }
            }
            Parents::Direct(shapes) => {
                // Without sync the full gradient was kept for later; the shards get nothing
                // now (leaves need no gradient to be registered).
                let Some(g) = reduced else { return };
                let mut offset = 0;
                for (i, (shape, dtype)) in shapes.into_iter().enumerate() {
                    let n = shape.num_elements();
                    if let Some(node) = &ops.parents[i] {
                        let piece = g.clone().narrow(0, offset, n);
                        let piece = if piece.dtype() == dtype { piece } else { piece.cast(dtype) };
                        let piece = B::float_reshape(piece.into_primitive().tensor(), shape);
                        grads.register::<B>(node.id, piece);
                    }
                    offset += n;
                }
            }
        }
    }
}

#[derive(Debug)]
struct RetroGather<B: Backend> {
    sources: Vec<NodeId>,
    unit: Arc<UnitComm<B>>,
}

impl<B: Backend> RetroForward for RetroGather<B> {
    fn forward(&self, states: &mut BackwardStates, out_node: NodeId) {
        let pieces = self.sources.iter().map(|id| states.get_state::<B::FloatTensorPrimitive>(id)).collect();
        let full = self.unit.gather(flat_concat::<B>(pieces), Phase::BackwardGather);
        states.save(out_node, full.into_primitive().tensor());
    }
}

fn register<B: Backend, C: CheckpointStrategy, const N: usize>(
    parents: &[&FloatTensor<Autodiff<B, C>>],
    n_sources: usize,
    kind: Parents,
    unit: Arc<UnitComm<B>>,
    recompute: bool,
    output: B::FloatTensorPrimitive,
) -> FloatTensor<Autodiff<B, C>> {
    let parents: [&FloatTensor<Autodiff<B, C>>; N] = match parents.try_into() {
        Ok(p) => p,
        Err(_) => unreachable!("dispatched on the parent count"),
    };
    let nodes = parents.map(|p| p.node.clone());
    let sources = parents[..n_sources].iter().map(|p| p.node.id).collect();
    let prep = GatherBackward { unit: unit.clone(), parents: kind }.prepare::<C>(nodes);
    let ops = if recompute {
        prep.memory_bound().retro_forward(RetroGather { sources, unit }).parents(parents).stateful()
    } else {
        prep.compute_bound().stateful()
    };
    match ops {
        OpsKind::Tracked(prep) => prep.finish((), output),
        OpsKind::UnTracked(prep) => prep.finish(output),
    }
}

macro_rules! dispatch {
    ($n:expr, $args:tt, [$($k:literal)*]) => {
        match $n {
            $($k => dispatch!(@call $k, $args),)*
            other => unreachable!("{other} parents exceed MAX_DIRECT_PARENTS + 1"),
        }
    };
    (@call $k:literal, ($($arg:expr),*)) => {
        register::<B, C, $k>($($arg),*)
    };
}

impl<B: Backend, C: CheckpointStrategy> FsdpBackend for Autodiff<B, C> {
    fn fsdp_all_gather(
        shards: Vec<FloatTensor<Self>>,
        anchor: Option<FloatTensor<Self>>,
        unit: Arc<UnitComm<B>>,
        recompute: bool,
    ) -> FloatTensor<Self> {
        let flat = flat_concat::<B>(shards.iter().map(|s| s.primitive.clone()).collect());
        let output = unit.gather(flat, Phase::ForwardGather).into_primitive().tensor();
        let anchor = anchor.filter(|a| a.is_tracked());
        let (sources, kind) = if shards.len() <= MAX_DIRECT_PARENTS {
            let shapes = shards.iter().map(|s| (s.primitive.shape(), s.primitive.dtype())).collect();
            (shards, Parents::Direct(shapes))
        } else {
            // Too many parents for the dispatch below: concatenate with Burn's own op (whose
            // output the re-gather then keeps until backward).
            let flat: Vec<Tensor<Self, 1>> = shards.into_iter().map(wrap::<Self>).collect();
            (vec![Tensor::cat(flat, 0).into_primitive().tensor()], Parents::Flat)
        };
        let n_sources = sources.len();
        let mut parents: Vec<&FloatTensor<Self>> = sources.iter().collect();
        parents.extend(anchor.as_ref());
        dispatch!(
            parents.len(),
            (&parents, n_sources, kind, unit, recompute, output),
            [1 2 3 4 5 6 7 8 9 10 11 12 13 14 15 16 17 18 19 20 21 22 23 24 25 26 27 28 29 30 31 32]
        )
    }

    fn recomputes() -> bool {
        crate::fsdp::is_balanced::<C>()
    }
}
