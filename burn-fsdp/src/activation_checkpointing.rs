//! Block-level activation checkpointing: each block keeps only its input through forward and
//! is run again in backward (PyTorch's `checkpoint_wrapper`, torchtitan's full AC).
//!
//! Burn 0.21 cannot differentiate a block inside another backward: every `backward()` ends by
//! locking every autodiff graph of the process, including the one whose backward would be
//! running it (a self-deadlock; see docs/fsdp-design.md). So the recomputation is a
//! **segmented backward** driven from here, every piece of which is a top-level `backward()`:
//!
//! 1. Forward: a block run through [`CheckpointRunner::run_recomputable`] runs untracked (its
//!    parameters and input detached: nothing of it is kept for backward) and hands the model
//!    a fresh leaf holding its output. Only the block's input is kept.
//! 2. [`Checkpointed::backward`]: `loss.backward()` ends at those leaves; then, last block
//!    first, each block runs again (tracked, on a leaf holding its input; under FSDP through a
//!    fresh all-gather whose backward reduce-scatters its gradient) and `Σ y · ∂L/∂y` is
//!    differentiated, giving its parameters' gradients and `∂L/∂x` for the block before.
//!    Inputs that no checkpointed block produced (the embedding's output) get one last
//!    backward of `Σ x · ∂L/∂x` through their own graph.
//!
//! Every piece's gradients are collected; [`Checkpointed::gradients`] sums them per parameter
//! (or [`Fsdp::backward_checkpointed`](crate::Fsdp::backward_checkpointed) under FSDP).
//!
//! # Example
//!
//! ```
//! use burn::backend::{Autodiff, NdArray};
//! use burn::nn::{Linear, LinearConfig};
//! use burn::tensor::Tensor;
//! use burn_fsdp::UnitRunner;
//! use burn_fsdp::activation_checkpointing::checkpointed;
//!
//! type B = Autodiff<NdArray>;
//! let device = Default::default();
//! let blocks: Vec<Linear<B>> = (0..3).map(|_| LinearConfig::new(4, 4).init(&device)).collect();
//! let x = Tensor::<B, 2>::ones([2, 4], &device);
//! let run = checkpointed(|runner| {
//!     let mut h = x;
//!     for block in &blocks {
//!         h = runner.run_recomputable(block, h, |b: &Linear<B>, h| b.forward(h).tanh());
//!     }
//!     h.sum()
//! });
//! let grads = run.gradients(&blocks);
//! assert!(grads.get::<NdArray, 2>(blocks[0].weight.id).is_some());
//! ```

use std::collections::HashMap;
use std::rc::Rc;

use burn::backend::autodiff::NodeId;
use burn::module::{AutodiffModule, Module, ModuleMapper, ModuleVisitor, Param};
use burn::optim::GradientsParams;
use burn::tensor::backend::{AutodiffBackend, Backend};
use burn::tensor::ops::FloatTensor;
use burn::tensor::{Shape, Tensor, TensorMetadata, TensorPrimitive};

use crate::fsdp::op::FsdpBackend;
use crate::runner::{Direct, UnitRunner};

/// A gradient, as the inner backend holds it.
type InnerGrad<B> = FloatTensor<<B as AutodiffBackend>::InnerBackend>;

/// A block run in forward without its activations, to be run again in backward.
struct Segment<'a, B: Backend> {
    /// The input as the model passed it (its graph leads to earlier code).
    input: FloatTensor<B>,
    /// The leaf handed to the model in place of the block's output.
    output: FloatTensor<B>,
    /// Runs the block again, tracked, on a leaf holding the input.
    rerun: Box<dyn FnOnce(FloatTensor<B>) -> FloatTensor<B> + 'a>,
}

/// The [`UnitRunner`] of a checkpointed forward: blocks run through
/// [`run_recomputable`](UnitRunner::run_recomputable) keep only their input; blocks run
/// through [`run`](UnitRunner::run) run as usual (tracked). Made by [`checkpointed`] or
/// [`Fsdp::forward_checkpointed`](crate::Fsdp::forward_checkpointed).
pub struct CheckpointRunner<'a, B: Backend, R> {
    /// Runs the blocks in forward.
    pub(crate) inner: R,
    /// Runs them again in backward (under FSDP: a runner whose gathers are not resharded,
    /// since the block's graph lives only for its own backward).
    rerun: R,
    segments: Vec<Segment<'a, B>>,
}

impl<'a, B: Backend, R> CheckpointRunner<'a, B, R> {
    /// A checkpointing runner over `inner` (forward) and `rerun` (backward).
    pub(crate) fn new(inner: R, rerun: R) -> Self {
        Self { inner, rerun, segments: Vec::new() }
    }
}

impl<'a, B: FsdpBackend, R: UnitRunner<B> + Clone + 'a> UnitRunner<B> for CheckpointRunner<'a, B, R> {
    fn run<M: Module<B>, const D: usize>(
        &mut self,
        unit: &M,
        x: Tensor<B, D>,
        f: impl FnOnce(&M, Tensor<B, D>) -> Tensor<B, D>,
    ) -> Tensor<B, D> {
        self.inner.run(unit, x, f)
    }

    fn run_recomputable<M: Module<B> + 'static, const D: usize>(
        &mut self,
        unit: &M,
        x: Tensor<B, D>,
        f: impl Fn(&M, Tensor<B, D>) -> Tensor<B, D> + 'static,
    ) -> Tensor<B, D> {
        // A lazy parameter cloned before its first use is initialised separately in each
        // clone (a new tensor each time): initialise them in `unit` itself first, so that the
        // forward, the rerun and the caller's gradients all see one tensor per parameter.
        unit.visit(&mut Initialise);
        let f = Rc::new(f);
        let g = f.clone();
        // Untracked: no op of the block records anything for backward.
        let untracked = x.clone().detach().set_require_grad(false);
        let y = self.inner.run(unit, untracked, move |view, x| g(&view.clone().map(&mut Detach), x));
        let y = y.detach().require_grad();
        let mut runner = self.rerun.clone();
        let unit = unit.clone();
        let rerun = Box::new(move |x: FloatTensor<B>| {
            let x = Tensor::<B, D>::from_primitive(TensorPrimitive::Float(x));
            runner.run(&unit, x, |view, x| f(view, x)).into_primitive().tensor()
        });
        self.segments.push(Segment {
            input: x.into_primitive().tensor(),
            output: y.clone().into_primitive().tensor(),
            rerun,
        });
        y
    }
}

/// Touches every float parameter (running a lazy initialiser in place).
struct Initialise;

impl<B: Backend> ModuleVisitor<B> for Initialise {
    fn visit_float<const D: usize>(&mut self, param: &Param<Tensor<B, D>>) {
        let _ = param.val();
    }
}

/// Maps every float parameter to an untracked copy (same values, no graph).
struct Detach;

impl<B: AutodiffBackend> ModuleMapper<B> for Detach {
    fn map_float<const D: usize>(&mut self, param: Param<Tensor<B, D>>) -> Param<Tensor<B, D>> {
        let (id, tensor, mapper) = param.consume();
        // Burn's `detach` keeps `require_grad` (a detached leaf is a new leaf): drop it too.
        Param::from_mapped_value(id, tensor.detach().set_require_grad(false), mapper)
    }
}

/// A forward run with activation checkpointing, waiting for its backward.
pub struct Checkpointed<'a, B: Backend> {
    loss: Tensor<B, 1>,
    segments: Vec<Segment<'a, B>>,
    /// Leaves that stand for tracked tensors (FSDP's gathered root parameters): their
    /// gradients are handed to the originals by one last backward.
    roots: Vec<(FloatTensor<B>, FloatTensor<B>)>,
    /// Called before every piece after the first (FSDP: a barrier of all ranks; see
    /// [`Fsdp::forward_checkpointed`](crate::Fsdp::forward_checkpointed)).
    between_pieces: Option<Box<dyn Fn() + 'a>>,
}

/// Runs `f` with a [`CheckpointRunner`] over [`Direct`]: the single-device form of
/// [`Fsdp::forward_checkpointed`](crate::Fsdp::forward_checkpointed). `f` returns the loss.
pub fn checkpointed<B: FsdpBackend>(
    f: impl FnOnce(&mut CheckpointRunner<'static, B, Direct>) -> Tensor<B, 1>,
) -> Checkpointed<'static, B> {
    let mut runner = CheckpointRunner::new(Direct, Direct);
    let loss = f(&mut runner);
    Checkpointed::new(loss, runner, Vec::new(), None)
}

fn flat<B: Backend>(t: FloatTensor<B>) -> Tensor<B, 1> {
    let n = t.shape().num_elements();
    Tensor::from_primitive(TensorPrimitive::Float(B::float_reshape(t, Shape::new([n]))))
}

/// `Σ t · g` over pairs: a scalar whose gradient with respect to each `t` is its `g`.
fn dot_sum<B: AutodiffBackend>(
    pairs: Vec<(FloatTensor<B>, FloatTensor<B::InnerBackend>)>,
) -> Option<Tensor<B, 1>> {
    pairs
        .into_iter()
        .map(|(t, g)| {
            let g = Tensor::<B, 1>::from_inner(flat::<B::InnerBackend>(g));
            let t = flat::<B>(t);
            let g = if g.dtype() == t.dtype() { g } else { g.cast(t.dtype()) };
            (t * g).sum()
        })
        .reduce(|a, b| a + b)
}

impl<'a, B: FsdpBackend> Checkpointed<'a, B> {
    pub(crate) fn new<R>(
        loss: Tensor<B, 1>,
        runner: CheckpointRunner<'a, B, R>,
        roots: Vec<(FloatTensor<B>, FloatTensor<B>)>,
        between_pieces: Option<Box<dyn Fn() + 'a>>,
    ) -> Self {
        Self { loss, segments: runner.segments, roots, between_pieces }
    }

    /// The loss (its value; differentiate with [`backward`](Self::backward)).
    pub fn loss(&self) -> Tensor<B, 1> {
        self.loss.clone().detach()
    }

    /// Number of blocks that were checkpointed.
    pub fn num_checkpointed(&self) -> usize {
        self.segments.len()
    }

    /// Runs the segmented backward; returns the gradients of every piece, in order (sum them
    /// per parameter: [`gradients`](Self::gradients)).
    pub fn backward(self) -> Vec<B::Gradients> {
        let Checkpointed { loss, mut segments, roots, between_pieces } = self;
        let between = || {
            if let Some(f) = &between_pieces {
                f();
            }
        };
        let key = |t: &FloatTensor<B>| B::autodiff_node(t);
        let outputs: HashMap<NodeId, usize> =
            segments.iter().enumerate().map(|(i, s)| (key(&s.output), i)).collect();
        // ∂L/∂(output leaf) of each segment, accumulated over the pieces.
        let mut pending: Vec<Option<FloatTensor<B::InnerBackend>>> = vec![None; segments.len()];
        let collect = |grads: &B::Gradients, segments: &[Segment<'a, B>], pending: &mut [Option<_>]| {
            for (i, s) in segments.iter().enumerate() {
                if let Some(g) = B::grad(&s.output, grads) {
                    add_into::<B::InnerBackend>(&mut pending[i], g);
                }
            }
        };
        let mut all = Vec::with_capacity(segments.len() + 3);
        let grads = loss.backward();
        collect(&grads, &segments, &mut pending);
        all.push(grads);
        // Inputs no segment produced, with their gradients.
        let mut external: Vec<(FloatTensor<B>, Option<InnerGrad<B>>)> = Vec::new();
        while let Some(segment) = segments.pop() {
            let Some(gy) = pending.pop().flatten() else { continue };
            between();
            let leaf = B::from_inner(B::inner(segment.input.clone()));
            let leaf = B::float_set_require_grad(leaf, true);
            let y = (segment.rerun)(leaf.clone());
            let Some(objective) = dot_sum::<B>(vec![(y, gy)]) else { continue };
            let grads = objective.backward();
            // A block may also read an earlier block's output that it captured.
            collect(&grads, &segments, &mut pending);
            if let Some(gx) = B::grad(&leaf, &grads) {
                match outputs.get(&key(&segment.input)) {
                    Some(&j) if j < segments.len() => add_into::<B::InnerBackend>(&mut pending[j], gx),
                    _ => match external.iter_mut().find(|(t, _)| key(t) == key(&segment.input)) {
                        Some((_, g)) => add_into::<B::InnerBackend>(g, gx),
                        None => external.push((segment.input, Some(gx))),
                    },
                }
            }
            all.push(grads);
        }
        let external: Vec<_> = external
            .into_iter()
            .filter_map(|(t, g)| Some((t, g?)))
            .filter(|(t, _)| B::is_tracked(t))
            .collect();
        if let Some(objective) = dot_sum::<B>(external) {
            between();
            all.push(objective.backward());
        }
        // Root leaves: their gradients, summed over the pieces, go to the tracked originals.
        let roots: Vec<_> = roots
            .into_iter()
            .filter_map(|(leaf, original)| {
                let mut sum = None;
                for grads in &all {
                    if let Some(g) = B::grad(&leaf, grads) {
                        add_into::<B::InnerBackend>(&mut sum, g);
                    }
                }
                Some((original, sum?))
            })
            .collect();
        if let Some(objective) = dot_sum::<B>(roots) {
            between();
            all.push(objective.backward());
        }
        all
    }

    /// [`backward`](Self::backward), summed per parameter of `module` (the single-device
    /// counterpart of `GradientsParams::from_grads(loss.backward(), &module)`).
    pub fn gradients<M: AutodiffModule<B>>(self, module: &M) -> GradientsParams {
        let mut total = GradientsParams::new();
        for grads in self.backward() {
            add_grads::<B, M>(module, &mut total, GradientsParams::from_grads(grads, module));
        }
        total
    }
}

fn add_into<B: Backend>(into: &mut Option<FloatTensor<B>>, g: FloatTensor<B>) {
    *into = Some(match into.take() {
        Some(e) => B::float_add(e, g),
        None => g,
    });
}

/// `into += from`, parameter by parameter (missing entries are taken as they are).
pub(crate) fn add_grads<B: AutodiffBackend, M: AutodiffModule<B>>(
    module: &M,
    into: &mut GradientsParams,
    mut from: GradientsParams,
) {
    struct Add<'a> {
        into: &'a mut GradientsParams,
        from: &'a mut GradientsParams,
    }
    impl<B: AutodiffBackend> ModuleVisitor<B> for Add<'_> {
        fn visit_float<const D: usize>(&mut self, param: &Param<Tensor<B, D>>) {
            let Some(g) = self.from.remove::<B::InnerBackend, D>(param.id) else { return };
            let sum = match self.into.remove::<B::InnerBackend, D>(param.id) {
                Some(e) => e + g,
                None => g,
            };
            self.into.register::<B::InnerBackend, D>(param.id, sum);
        }
    }
    module.visit(&mut Add { into, from: &mut from });
}
