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
//! The optional `anchor` — the unit's input activation — is one more, gradient-free parent,
//! and so is the optional `end` ([`FsdpBackend::fsdp_backward_end`]), which collects the
//! reduce-scatters of the communication thread when backward ends.
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

use crate::fsdp::collectives::{Phase, UnitComm};
use crate::fsdp::offload::HostStore;
use crate::fsdp::prefetch::{Deliver, Prefetcher, ShardTarget, Targets, register_aliases, register_pieces};
use crate::fsdp::view::{ParamView, ViewGroup};
use burn::module::ParamId;

/// Units with at most this many parameters (plus the anchor) gather without keeping a
/// concatenated copy of their shards.
pub const MAX_DIRECT_PARENTS: usize = 31;

/// What a unit's differentiable gather talks through: the unit's communicator and, when
/// overlap is on, the rank's communication thread ([`Prefetcher`]), which then runs the
/// gathers and reduce-scatters; without it they run inline.
#[derive(Debug, Clone)]
pub(crate) struct GatherComm<B: Backend> {
    /// The unit's collectives.
    pub(crate) unit: Arc<UnitComm<B>>,
    /// The rank's overlap machinery, `None` for inline collectives.
    pub(crate) prefetch: Option<Arc<Prefetcher<B>>>,
}

impl<B: Backend> GatherComm<B> {
    /// The forward all-gather of the flat shard that `shard` makes (prefetched when it can be).
    fn forward_gather(&self, shard: impl FnOnce() -> Tensor<B, 1>) -> Tensor<B, 1> {
        match &self.prefetch {
            Some(p) => p.forward_gather(self.unit.index, &self.unit, shard),
            None => self.unit.gather(shard(), Phase::ForwardGather),
        }
    }
}

/// Backends on which FSDP can run: an autodiff backend with the differentiable all-gather.
// Sealed: the hooks below take crate-private types (the prefetcher, the host store, the
// views), so no other crate can implement this trait or call its methods; it is public
// as the bound users name (`B: FsdpBackend`), implemented here for every `Autodiff<_, _>`.
#[allow(private_interfaces)]
pub trait FsdpBackend: AutodiffBackend {
    #[doc(hidden)]
    /// All-gathers the concatenation of the flattened `shards` through `comm`
    /// (`[Σ nᵢ]` → `[world · Σ nᵢ]`), differentiably with respect to every shard.
    fn fsdp_all_gather(
        shards: Vec<FloatTensor<Self>>,
        anchor: Option<FloatTensor<Self>>,
        end: Option<FloatTensor<Self>>,
        comm: GatherComm<Self::InnerBackend>,
        recompute: bool,
    ) -> FloatTensor<Self>;

    #[doc(hidden)]
    /// The end of a forward's backward pass: a tracked `[1]` tensor whose node, made a parent
    /// of every gather of the forward (the `end` argument of the gathers), runs after all of
    /// them in backward (its depth is 1, theirs at least 2) and collects the reduce-scatters
    /// that `prefetch`'s communication thread ran meanwhile into the pass's gradients. Burn's
    /// `loss.backward()` then returns with every shard's reduced gradient registered.
    fn fsdp_backward_end(
        prefetch: Arc<Prefetcher<Self::InnerBackend>>,
        device: &burn::tensor::Device<Self::InnerBackend>,
    ) -> FloatTensor<Self>;

    #[doc(hidden)]
    /// The same all-gather for an offloaded unit: the flat shard is uploaded from `host`
    /// (the concatenation of `ids`' shards, with their lengths) right before the gather and
    /// again for a re-gather; backward copies the reduced shard gradient back into `host`.
    /// `anchor` must be tracked (the unit's input activation, or any tracked leaf).
    fn fsdp_all_gather_offloaded(
        anchor: FloatTensor<Self>,
        end: Option<FloatTensor<Self>>,
        comm: GatherComm<Self::InnerBackend>,
        host: Arc<HostStore>,
        ids: Arc<Vec<(ParamId, usize)>>,
        recompute: bool,
    ) -> FloatTensor<Self>;

    #[doc(hidden)]
    /// Parameter `view` cut out of a unit's gathered buffer (`[world · unit_len]`, the output
    /// of [`fsdp_all_gather`](Self::fsdp_all_gather)), differentiably: the backward of all
    /// views of one `group` adds into a single gradient buffer ([`crate::fsdp::view`]).
    fn fsdp_param_view(
        gathered: &FloatTensor<Self>,
        view: ParamView,
        group: &Arc<ViewGroup>,
    ) -> FloatTensor<Self>;

    #[doc(hidden)]
    /// Whether a memory-bound op is recomputed in backward (true for
    /// `Autodiff<_, BalancedCheckpointing>`), which `reshard_after_forward` relies on.
    fn recomputes() -> bool;

    #[doc(hidden)]
    /// The autodiff node of `tensor` (identifies it across clones).
    fn autodiff_node(tensor: &FloatTensor<Self>) -> NodeId;

    #[doc(hidden)]
    /// Whether `tensor` is part of a graph that backward can walk (a leaf requiring
    /// gradients, or computed from one).
    fn is_tracked(tensor: &FloatTensor<Self>) -> bool;
}

fn wrap<B: Backend>(t: B::FloatTensorPrimitive) -> Tensor<B, 1> {
    // A reshape copies on some backends (NdArray), even to the same shape.
    let t = if t.shape().num_dims() == 1 {
        t
    } else {
        let n = t.shape().num_elements();
        B::float_reshape(t, Shape::new([n]))
    };
    Tensor::<B, 1>::from_primitive(TensorPrimitive::Float(t))
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
    /// The shards live in a host store; the gradient is copied back there.
    Host(Arc<HostStore>, Arc<Vec<(ParamId, usize)>>),
}

#[derive(Debug)]
struct GatherBackward<B: Backend> {
    comm: GatherComm<B>,
    parents: Parents,
}

impl<B: Backend, const N: usize> Backward<B, N> for GatherBackward<B> {
    type State = ();

    fn backward(self, ops: Ops<Self::State, N>, grads: &mut Gradients, _checkpointer: &mut Checkpointer) {
        let grad = wrap::<B>(grads.consume::<B>(&ops.node));
        let shards = match &self.parents {
            Parents::Direct(shapes) => {
                shard_targets(ops.parents.iter().map(|p| p.as_ref().map(|n| n.id)), shapes)
            }
            _ => Vec::new(),
        };
        let aliases = self.comm.unit.take_aliases();
        let targets = Targets { shards, aliases };
        // The flat fallback's parent is Burn's own concatenation, whose backward needs its
        // gradient registered now: it waits for its reduce-scatter (still on the
        // communication thread, to keep every rank's collectives in one order).
        let flat_parent = matches!(self.parents, Parents::Flat);
        if let Some(prefetch) = self.comm.prefetch.as_ref().filter(|_| !flat_parent) {
            // Reduce on the communication thread while backward goes on: the shards' gradients
            // are registered on their nodes by the backward's last step (`BackwardEnd`) or by
            // `Fsdp::gradients`; offloaded ones go straight to the host.
            let deliver: Option<Deliver<B>> = match self.parents {
                Parents::Host(host, ids) => Some(Box::new(move |g| host.accumulate_grad(&ids, g))),
                _ => None,
            };
            prefetch.reduce(self.comm.unit.index, &self.comm.unit, grad, deliver, targets);
            return;
        }
        let device = grad.device();
        // Reduce even when no shard needs a gradient: every rank must issue the collective.
        let reduced = match &self.comm.prefetch {
            Some(prefetch) => prefetch.reduce_blocking(&self.comm.unit, grad),
            None => self.comm.unit.reduce(grad),
        };
        match self.parents {
            Parents::Flat => {
                let g = reduced.unwrap_or_else(|| Tensor::zeros([self.comm.unit.shard_len], &device));
                register_aliases(grads, &g, targets.aliases);
                if let Some(node) = &ops.parents[0] {
                    grads.register::<B>(node.id, g.into_primitive().tensor());
                }
            }
            Parents::Host(host, ids) => {
                if let Some(g) = reduced {
                    host.accumulate_grad(&ids, g);
                }
            }
            Parents::Direct(_) => {
                // Without sync the full gradient was kept for later; the shards get nothing
                // now (leaves need no gradient to be registered).
                let Some(g) = reduced else { return };
                register_pieces(grads, g, targets);
            }
        }
    }
}

/// The direct parents' nodes (the shards, in unit order; `None` where a shard needs no
/// gradient) with their shapes and dtypes: where a reduced flat shard gradient's pieces go.
fn shard_targets(nodes: impl Iterator<Item = Option<NodeId>>, shapes: &[(Shape, DType)]) -> Vec<ShardTarget> {
    nodes.zip(shapes.iter().cloned()).map(|(node, (shape, dtype))| (node, shape, dtype)).collect()
}

/// The last step of a backward pass through gathers whose reduce-scatters run on the
/// communication thread: it collects them into the pass's gradients
/// ([`Prefetcher::collect_into`]).
#[derive(Debug)]
struct BackwardEnd<B: Backend> {
    prefetch: Arc<Prefetcher<B>>,
}

impl<B: Backend> Backward<B, 1> for BackwardEnd<B> {
    type State = ();

    fn backward(self, _ops: Ops<Self::State, 1>, grads: &mut Gradients, _checkpointer: &mut Checkpointer) {
        // No gradient flows into this node: it is a parent of the gathers only to be reached
        // by backward, at depth 1, after every gather (depth ≥ 2).
        self.prefetch.collect_into(grads);
    }
}

/// Where a re-gather finds the shards.
#[derive(Debug)]
enum Sources<B: Backend> {
    /// Checkpointed parents of the op.
    Nodes(Vec<NodeId>),
    /// The host store (offload), uploaded to this device.
    Host(Arc<HostStore>, Arc<Vec<(ParamId, usize)>>, B::Device),
}

#[derive(Debug)]
struct RetroGather<B: Backend> {
    sources: Sources<B>,
    comm: GatherComm<B>,
}

impl<B: Backend> RetroForward for RetroGather<B> {
    fn forward(&self, states: &mut BackwardStates, out_node: NodeId) {
        // The shard states are taken (and so released) even when the re-gather was
        // prefetched; they are concatenated only when it was not.
        let pieces: Vec<B::FloatTensorPrimitive> = match &self.sources {
            Sources::Nodes(ids) => ids.iter().map(|id| states.get_state(id)).collect(),
            Sources::Host(..) => Vec::new(),
        };
        let shard = move || match &self.sources {
            Sources::Nodes(_) => flat_concat::<B>(pieces),
            Sources::Host(host, ids, device) => {
                let ids: Vec<ParamId> = ids.iter().map(|(id, _)| *id).collect();
                host.upload::<B>(&ids, device)
            }
        };
        let full = match &self.comm.prefetch {
            Some(p) => p.backward_gather(self.comm.unit.index, &self.comm.unit, shard),
            None => self.comm.unit.gather(shard(), Phase::BackwardGather),
        };
        states.save(out_node, full.into_primitive().tensor());
    }
}

fn register<B: Backend, C: CheckpointStrategy, const N: usize>(
    parents: &[&FloatTensor<Autodiff<B, C>>],
    n_sources: usize,
    kind: Parents,
    comm: GatherComm<B>,
    recompute: bool,
    output: B::FloatTensorPrimitive,
) -> FloatTensor<Autodiff<B, C>> {
    let parents: [&FloatTensor<Autodiff<B, C>>; N] = match parents.try_into() {
        Ok(p) => p,
        Err(_) => unreachable!("dispatched on the parent count"),
    };
    let nodes = parents.map(|p| p.node.clone());
    let sources = match &kind {
        Parents::Host(host, ids) => {
            Sources::Host(host.clone(), ids.clone(), B::float_device(&parents[0].primitive))
        }
        _ => Sources::Nodes(parents[..n_sources].iter().map(|p| p.node.id).collect()),
    };
    let prep = GatherBackward { comm: comm.clone(), parents: kind }.prepare::<C>(nodes);
    let ops = if recompute {
        prep.memory_bound().retro_forward(RetroGather { sources, comm }).parents(parents).stateful()
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
            other => unreachable!("{other} parents exceed MAX_DIRECT_PARENTS + 2"),
        }
    };
    (@call $k:literal, ($($arg:expr),*)) => {
        register::<B, C, $k>($($arg),*)
    };
}

#[allow(private_interfaces)] // the crate-private hook types, as on the trait
impl<B: Backend, C: CheckpointStrategy> FsdpBackend for Autodiff<B, C> {
    fn fsdp_all_gather(
        shards: Vec<FloatTensor<Self>>,
        anchor: Option<FloatTensor<Self>>,
        end: Option<FloatTensor<Self>>,
        comm: GatherComm<B>,
        recompute: bool,
    ) -> FloatTensor<Self> {
        let flat = || flat_concat::<B>(shards.iter().map(|s| s.primitive.clone()).collect());
        let output = comm.forward_gather(flat);
        let output = output.into_primitive().tensor();
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
        parents.extend(end.as_ref().filter(|e| e.is_tracked()));
        dispatch!(
            parents.len(),
            (&parents, n_sources, kind, comm, recompute, output),
            [1 2 3 4 5 6 7 8 9 10 11 12 13 14 15 16 17 18 19 20 21 22 23 24 25 26 27 28 29 30 31 32 33]
        )
    }

    fn fsdp_backward_end(
        prefetch: Arc<Prefetcher<B>>,
        device: &burn::tensor::Device<B>,
    ) -> FloatTensor<Self> {
        let leaf = Tensor::<Self, 1>::zeros([1], device).require_grad().into_primitive().tensor();
        let output = B::float_zeros(Shape::new([1]), device, leaf.primitive.dtype().into());
        let end = BackwardEnd { prefetch };
        match end.prepare::<C>([leaf.node.clone()]).compute_bound().stateful() {
            OpsKind::Tracked(prep) => prep.finish((), output),
            OpsKind::UnTracked(prep) => prep.finish(output),
        }
    }

    fn fsdp_all_gather_offloaded(
        anchor: FloatTensor<Self>,
        end: Option<FloatTensor<Self>>,
        comm: GatherComm<B>,
        host: Arc<HostStore>,
        ids: Arc<Vec<(ParamId, usize)>>,
        recompute: bool,
    ) -> FloatTensor<Self> {
        let device = B::float_device(&anchor.primitive);
        let keys: Vec<ParamId> = ids.iter().map(|(id, _)| *id).collect();
        let shard = || host.upload::<B>(&keys, &device);
        let output = comm.forward_gather(shard);
        let output = output.into_primitive().tensor();
        let kind = Parents::Host(host, ids);
        match end.as_ref().filter(|e| e.is_tracked()) {
            Some(end) => register::<B, C, 2>(&[&anchor, end], 0, kind, comm, recompute, output),
            None => register::<B, C, 1>(&[&anchor], 0, kind, comm, recompute, output),
        }
    }

    fn fsdp_param_view(
        gathered: &FloatTensor<Self>,
        view: ParamView,
        group: &Arc<ViewGroup>,
    ) -> FloatTensor<Self> {
        crate::fsdp::view::param_view::<B, C>(gathered, view, group)
    }

    fn recomputes() -> bool {
        is_balanced::<C>()
    }

    fn autodiff_node(tensor: &FloatTensor<Self>) -> NodeId {
        tensor.node.id
    }

    fn is_tracked(tensor: &FloatTensor<Self>) -> bool {
        tensor.is_tracked()
    }
}

/// Whether the autodiff checkpoint strategy `C` is Burn's `BalancedCheckpointing` (under which a
/// resharded unit's views are recomputed from a re-gather in backward).
pub(crate) fn is_balanced<C: 'static>() -> bool {
    std::any::TypeId::of::<C>()
        == std::any::TypeId::of::<burn::backend::autodiff::checkpoint::strategy::BalancedCheckpointing>()
}
