//! Tensor parallelism (Megatron-style), applied from outside the model by a plan of module
//! paths, as torchtitan's `parallelize_module` does.
//!
//! A [`TpPlan`] names, by dotted parameter path with `*` wildcards:
//! - [`TpStyle::Colwise`] weights (`[out, in]`, split on `out`: q/k/v, gate/up), whose layer
//!   then produces a slice of the heads/features on each tp rank;
//! - [`TpStyle::Rowwise`] weights (split on `in`: o, down), whose layer produces a partial sum;
//! - [`TpStyle::PartialGrad`] parameters that stay whole but see only this rank's heads (the
//!   per-head q/k norms), so their gradients are summed over the tp group;
//!
//! and, by submodule name (the model's [`ModuleHooks`] points), the inputs that enter a
//! column-parallel region (identity forward, all-reduce of the gradient in backward: Megatron's
//! `f`) and the outputs that leave a row-parallel one (all-reduce forward, identity backward:
//! Megatron's `g`). Everything else is replicated: every tp rank computes identical values
//! and identical gradients for it.
//!
//! [`TensorParallel::apply`] slices a model's parameters for this tp rank and returns the
//! hooks. FSDP then shards the tp-local parameters over the data-parallel group
//! (`Fsdp::wrap(model, &mesh.submesh("dp"), …)`).
//!
//! Attention reads its head counts from its weights, so a tp rank's attention simply runs with
//! `heads / tp` query heads and `kv_heads / tp` key/value heads (GQA groups stay intact when
//! both divide by tp).

use std::collections::{HashMap, HashSet};
use std::sync::Arc;

use burn::backend::Autodiff;
use burn::backend::autodiff::checkpoint::base::Checkpointer;
use burn::backend::autodiff::checkpoint::strategy::CheckpointStrategy;
use burn::backend::autodiff::grads::Gradients;
use burn::backend::autodiff::ops::{Backward, Ops, OpsKind};
use burn::module::{AutodiffModule, Module, ModuleMapper, ModuleVisitor, Param, ParamId};
use burn::optim::GradientsParams;
use burn::tensor::backend::{AutodiffBackend, Backend};
use burn::tensor::ops::FloatTensor;
use burn::tensor::{Shape, Tensor, TensorMetadata, TensorPrimitive};

use crate::comm::{CommError, ProcessGroup, ReduceOp, Tag};
use crate::hooks::ModuleHooks;
use crate::walk::describe_params;

/// How one parameter is laid out across the tp group.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum TpStyle {
    /// Split dim 0 (output features) into tp equal slices of whole `granule`s (e.g. heads).
    Colwise {
        /// Rows per indivisible group (head_dim for attention projections, 1 for MLPs).
        granule: usize,
    },
    /// Split dim 1 (input features) into tp equal slices of whole `granule`s.
    Rowwise {
        /// Columns per indivisible group.
        granule: usize,
    },
    /// Whole on every rank, but each rank's gradient is a partial sum (summed over tp).
    PartialGrad,
}

/// A tensor-parallel plan: parameter styles by path pattern, and the hook points where
/// activations enter and leave parallel regions.
#[derive(Debug, Clone, Default)]
pub struct TpPlan {
    /// `(pattern, style)`; `*` matches one path segment (`model.layers.*.mlp.up_proj.weight`).
    pub params: Vec<(String, TpStyle)>,
    /// Hook points whose input enters a column-parallel region (Megatron's `f`).
    pub copy_inputs: Vec<String>,
    /// Hook points whose output leaves a row-parallel region (Megatron's `g`).
    pub reduce_outputs: Vec<String>,
}

/// `pattern` matches `path` segment by segment, `*` matching any one segment.
pub fn path_matches(pattern: &str, path: &str) -> bool {
    let (p, s): (Vec<&str>, Vec<&str>) = (pattern.split('.').collect(), path.split('.').collect());
    p.len() == s.len() && p.iter().zip(&s).all(|(a, b)| *a == "*" || a == b)
}

impl TpPlan {
    /// The style of the parameter at `path` (first matching rule), if any.
    pub fn style_of(&self, path: &str) -> Option<TpStyle> {
        self.params.iter().find(|(p, _)| path_matches(p, path)).map(|(_, s)| *s)
    }
}

/// Errors of [`TensorParallel::apply`].
#[derive(Debug, Clone, PartialEq, thiserror::Error)]
pub enum TpError {
    /// A parameter cannot be split evenly.
    #[error(
        "tensor parallelism: parameter `{param}` has {size} along dim {dim} ({groups} groups of {granule}), which do not split across tp = {tp}"
    )]
    Indivisible {
        /// Parameter path.
        param: String,
        /// Split dimension.
        dim: usize,
        /// Its size.
        size: usize,
        /// Indivisible group size (e.g. head_dim).
        granule: usize,
        /// Number of groups.
        groups: usize,
        /// Tensor-parallel degree.
        tp: usize,
    },
    /// A plan rule names a 2D split for a parameter of another rank.
    #[error("tensor parallelism: parameter `{param}` has shape {shape:?}; {style:?} needs a 2D weight")]
    NotAMatrix {
        /// Parameter path.
        param: String,
        /// Its shape.
        shape: Vec<usize>,
        /// The rule's style.
        style: TpStyle,
    },
    /// No parameter matched a rule (a typo in the plan).
    #[error("tensor parallelism: no parameter matches the plan rule `{0}`")]
    UnusedRule(String),
}

/// A parameter's tp layout, by id.
#[derive(Debug, Clone)]
struct Layout {
    path: String,
    style: TpStyle,
    global_shape: Vec<usize>,
}

/// This rank's tensor-parallel state: the tp group, the plan, and the layout of every
/// parameter that the plan touches. It is also the model's [`ModuleHooks`].
pub struct TensorParallel<B: Backend> {
    group: Arc<dyn ProcessGroup<B>>,
    plan: TpPlan,
    layouts: HashMap<ParamId, Layout>,
    by_path: HashMap<String, ParamId>,
}

impl<B: Backend> std::fmt::Debug for TensorParallel<B> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("TensorParallel")
            .field("rank", &self.group.rank())
            .field("size", &self.group.size())
            .field("plan", &self.plan)
            .finish()
    }
}

/// `(dim, start, len)` of rank `rank`'s slice of a `shape` parameter under `style`.
fn slice_of(
    style: TpStyle,
    path: &str,
    shape: &[usize],
    rank: usize,
    tp: usize,
) -> Result<Option<(usize, usize, usize)>, TpError> {
    let (dim, granule) = match style {
        TpStyle::Colwise { granule } => (0, granule.max(1)),
        TpStyle::Rowwise { granule } => (1, granule.max(1)),
        TpStyle::PartialGrad => return Ok(None),
    };
    if shape.len() != 2 {
        return Err(TpError::NotAMatrix { param: path.to_owned(), shape: shape.to_vec(), style });
    }
    let size = shape[dim];
    if !size.is_multiple_of(granule) || !(size / granule).is_multiple_of(tp) {
        return Err(TpError::Indivisible {
            param: path.to_owned(),
            dim,
            size,
            granule,
            groups: size / granule,
            tp,
        });
    }
    let len = size / tp;
    Ok(Some((dim, rank * len, len)))
}

impl<B: Backend> TensorParallel<B> {
    /// Slices `model`'s parameters for this rank of `group` as `plan` says. Every tp rank
    /// calls this with the same full model.
    pub fn apply<AB, M>(model: M, group: Arc<dyn ProcessGroup<B>>, plan: TpPlan) -> Result<(M, Self), TpError>
    where
        AB: AutodiffBackend<InnerBackend = B>,
        M: Module<AB>,
    {
        let (rank, tp) = (group.rank(), group.size());
        let mut layouts = HashMap::new();
        let mut by_path = HashMap::new();
        let mut used = HashSet::new();
        for (id, path, shape) in describe_params::<AB, M>(&model) {
            let Some(i) = plan.params.iter().position(|(p, _)| path_matches(p, &path)) else { continue };
            used.insert(i);
            let style = plan.params[i].1;
            slice_of(style, &path, &shape, rank, tp)?;
            by_path.insert(path.clone(), id);
            layouts.insert(id, Layout { path, style, global_shape: shape });
        }
        if let Some((p, _)) = plan.params.iter().enumerate().find(|(i, _)| !used.contains(i)).map(|(_, r)| r)
        {
            return Err(TpError::UnusedRule(p.clone()));
        }
        let this = Self { group, plan, layouts, by_path };
        let mut slicer = Slicer::<AB> { tp: &this, _b: Default::default() };
        let model = model.map(&mut slicer);
        Ok((model, this))
    }

    /// The tensor-parallel group.
    pub fn group(&self) -> &Arc<dyn ProcessGroup<B>> {
        &self.group
    }

    /// The plan.
    pub fn plan(&self) -> &TpPlan {
        &self.plan
    }

    /// Whether parameter `id` is split across tp ranks (each holds a different slice).
    pub fn is_split(&self, id: ParamId) -> bool {
        self.layouts.get(&id).is_some_and(|l| l.style != TpStyle::PartialGrad)
    }

    /// The unsplit (global) shape of the parameter at `path`, given its tp-local shape.
    pub fn global_shape(&self, path: &str, local: &[usize]) -> Vec<usize> {
        match self.by_path.get(path).and_then(|id| self.layouts.get(id)) {
            Some(l) => l.global_shape.clone(),
            None => local.to_vec(),
        }
    }

    /// This rank's slice of a full (global) row-major parameter `full` at `path`, with its
    /// shape; the values unchanged when the parameter is not split.
    pub fn local_slice(&self, path: &str, shape: &[usize], full: &[f32]) -> (Vec<usize>, Vec<f32>) {
        let style = self.by_path.get(path).and_then(|id| self.layouts.get(id)).map(|l| l.style);
        let Some(style) = style else { return (shape.to_vec(), full.to_vec()) };
        let Ok(Some((dim, start, len))) = slice_of(style, path, shape, self.group.rank(), self.group.size())
        else {
            return (shape.to_vec(), full.to_vec());
        };
        let (rows, cols) = (shape[0], shape[1]);
        if dim == 0 {
            (vec![len, cols], full[start * cols..(start + len) * cols].to_vec())
        } else {
            let mut out = Vec::with_capacity(rows * len);
            for r in 0..rows {
                out.extend_from_slice(&full[r * cols + start..r * cols + start + len]);
            }
            (vec![rows, len], out)
        }
    }

    /// Reassembles the global parameter at `path` from every tp rank's full local slice
    /// (`local`, row-major, shape `shape`): an all-gather over the tp group. Every tp rank
    /// must call this for the same parameters in the same order.
    pub fn unsplit(
        &self,
        path: &str,
        shape: &[usize],
        local: Vec<f32>,
        device: &B::Device,
    ) -> Result<(Vec<usize>, Vec<f32>), crate::FsdpError> {
        let style = self.by_path.get(path).and_then(|id| self.layouts.get(id)).map(|l| l.style);
        let (Some(style), true) = (style, self.group.size() > 1) else { return Ok((shape.to_vec(), local)) };
        if style == TpStyle::PartialGrad {
            return Ok((shape.to_vec(), local));
        }
        let n = local.len();
        let t = Tensor::<B, 1>::from_data(burn::tensor::TensorData::new(local, [n]), device);
        let all = self.group.all_gather(t, &Tag::new(format!("tp:unsplit:{path}")))?;
        let all = crate::downcast::f32_values(all.into_data(), || format!("`{path}` (its tp slices)"))?;
        let tp = self.group.size();
        let (rows, cols) = (shape[0], shape[1]);
        match style {
            TpStyle::Colwise { .. } => Ok((vec![rows * tp, cols], all)),
            _ => {
                // Rank r's block holds columns r·cols.. of every row.
                let mut out = Vec::with_capacity(all.len());
                for row in 0..rows {
                    for r in 0..tp {
                        let base = r * n + row * cols;
                        out.extend_from_slice(&all[base..base + cols]);
                    }
                }
                Ok((vec![rows, cols * tp], out))
            }
        }
    }

    /// Sums the gradients of [`TpStyle::PartialGrad`] parameters over the tp group (one
    /// all-reduce for all of them). Call after backward, before clipping and the step.
    pub fn reduce_partial_grads<AB, M>(
        &self,
        module: &M,
        grads: &mut GradientsParams,
    ) -> Result<(), CommError>
    where
        AB: AutodiffBackend<InnerBackend = B>,
        M: AutodiffModule<AB>,
    {
        if self.group.size() == 1 {
            return Ok(());
        }
        let partial: HashSet<ParamId> =
            self.layouts.iter().filter(|(_, l)| l.style == TpStyle::PartialGrad).map(|(id, _)| *id).collect();
        let mut collect = CollectGrads::<B> { ids: &partial, grads, pieces: Vec::new() };
        module.visit(&mut collect);
        let pieces = collect.pieces;
        if pieces.is_empty() {
            return Ok(());
        }
        let flat = Tensor::cat(pieces.iter().map(|(_, _, t)| t.clone()).collect(), 0);
        let summed = self.group.all_reduce(flat, ReduceOp::Sum, &Tag::new("tp:partial-grads"))?;
        let mut offset = 0;
        let mut replaced = HashMap::new();
        for (id, shape, t) in pieces {
            let n = t.shape().num_elements();
            replaced.insert(id, (shape, summed.clone().narrow(0, offset, n)));
            offset += n;
        }
        let mut put = PutGrads::<B> { grads, replaced };
        module.visit(&mut put);
        Ok(())
    }
}

struct CollectGrads<'a, B: Backend> {
    ids: &'a HashSet<ParamId>,
    grads: &'a GradientsParams,
    pieces: Vec<(ParamId, Shape, Tensor<B, 1>)>,
}

impl<AB: AutodiffBackend> ModuleVisitor<AB> for CollectGrads<'_, AB::InnerBackend> {
    fn visit_float<const D: usize>(&mut self, param: &Param<Tensor<AB, D>>) {
        if !self.ids.contains(&param.id) {
            return;
        }
        if let Some(g) = self.grads.get::<AB::InnerBackend, D>(param.id) {
            let shape = g.shape();
            let n = shape.num_elements();
            self.pieces.push((param.id, shape, g.reshape([n])));
        }
    }
}

struct PutGrads<'a, B: Backend> {
    grads: &'a mut GradientsParams,
    replaced: HashMap<ParamId, (Shape, Tensor<B, 1>)>,
}

impl<AB: AutodiffBackend> ModuleVisitor<AB> for PutGrads<'_, AB::InnerBackend> {
    fn visit_float<const D: usize>(&mut self, param: &Param<Tensor<AB, D>>) {
        if let Some((shape, t)) = self.replaced.remove(&param.id) {
            self.grads.remove::<AB::InnerBackend, D>(param.id);
            self.grads.register::<AB::InnerBackend, D>(param.id, t.reshape(shape));
        }
    }
}

/// Replaces split parameters by this rank's slice (fresh leaves).
struct Slicer<'a, AB: AutodiffBackend> {
    tp: &'a TensorParallel<AB::InnerBackend>,
    _b: std::marker::PhantomData<AB>,
}

impl<AB: AutodiffBackend> ModuleMapper<AB> for Slicer<'_, AB> {
    fn map_float<const D: usize>(&mut self, param: Param<Tensor<AB, D>>) -> Param<Tensor<AB, D>> {
        let (id, tensor, mapper) = param.consume();
        let Some(layout) = self.tp.layouts.get(&id) else {
            return Param::from_mapped_value(id, tensor, mapper);
        };
        let slice = slice_of(
            layout.style,
            &layout.path,
            &layout.global_shape,
            self.tp.group.rank(),
            self.tp.group.size(),
        );
        let Ok(Some((dim, start, len))) = slice else {
            return Param::from_mapped_value(id, tensor, mapper);
        };
        let require_grad = tensor.is_require_grad();
        let device = tensor.device();
        let local = tensor.inner().narrow(dim, start, len);
        let mut t = Tensor::<AB, D>::from_data(local.into_data(), &device);
        if require_grad {
            t = t.require_grad();
        }
        Param::from_mapped_value(id, t, mapper)
    }
}

/// The model hooks of a [`TensorParallel`]: Megatron's `f` and `g` as autodiff ops.
pub struct TpHooks<'a, B: Backend> {
    tp: &'a TensorParallel<B>,
}

impl<B: Backend> TensorParallel<B> {
    /// The hooks to pass to the model's forward.
    pub fn hooks(&self) -> TpHooks<'_, B> {
        TpHooks { tp: self }
    }
}

impl<AB: TpBackend> ModuleHooks<AB> for TpHooks<'_, AB::InnerBackend> {
    fn input(&self, path: &str, x: Tensor<AB, 3>) -> Tensor<AB, 3> {
        if self.tp.group.size() == 1 || !self.tp.plan.copy_inputs.iter().any(|p| p == path) {
            return x;
        }
        let t = AB::tp_copy(
            x.into_primitive().tensor(),
            self.tp.group.clone(),
            Tag::new(format!("tp:{path}:input-grad")),
        );
        Tensor::from_primitive(TensorPrimitive::Float(t))
    }

    fn output(&self, path: &str, y: Tensor<AB, 3>) -> Tensor<AB, 3> {
        if self.tp.group.size() == 1 || !self.tp.plan.reduce_outputs.iter().any(|p| p == path) {
            return y;
        }
        let t = AB::tp_reduce(
            y.into_primitive().tensor(),
            self.tp.group.clone(),
            Tag::new(format!("tp:{path}:output")),
        );
        Tensor::from_primitive(TensorPrimitive::Float(t))
    }
}

/// Autodiff backends with the two tensor-parallel ops.
pub trait TpBackend: AutodiffBackend {
    /// Identity forward; backward sums the gradient over `group` (Megatron's `f`).
    fn tp_copy(
        x: FloatTensor<Self>,
        group: Arc<dyn ProcessGroup<Self::InnerBackend>>,
        tag: Tag,
    ) -> FloatTensor<Self>;
    /// Forward sums `x` over `group`; identity backward (Megatron's `g`).
    fn tp_reduce(
        x: FloatTensor<Self>,
        group: Arc<dyn ProcessGroup<Self::InnerBackend>>,
        tag: Tag,
    ) -> FloatTensor<Self>;
}

fn all_reduce_prim<B: Backend>(
    t: B::FloatTensorPrimitive,
    group: &Arc<dyn ProcessGroup<B>>,
    tag: &Tag,
) -> B::FloatTensorPrimitive {
    let shape = t.shape();
    let n = shape.num_elements();
    let flat = Tensor::<B, 1>::from_primitive(TensorPrimitive::Float(B::float_reshape(t, Shape::new([n]))));
    // Runs inside forward or autodiff's backward, neither of which can return an error: a
    // failed collective unwinds with a `CollectiveFailure`, and the rank's launcher
    // turns it into an error and aborts the group (as FSDP's own collectives do).
    match group.all_reduce(flat, ReduceOp::Sum, tag) {
        Ok(r) => B::float_reshape(r.into_primitive().tensor(), shape),
        Err(e) => crate::comm::CollectiveFailure::raise(format!("tensor parallelism: {e}")),
    }
}

struct TpBackward<B: Backend> {
    group: Arc<dyn ProcessGroup<B>>,
    tag: Tag,
    /// `true`: backward all-reduces (`f`); `false`: backward is the identity (`g`).
    reduce_grad: bool,
}

impl<B: Backend> std::fmt::Debug for TpBackward<B> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("TpBackward").field("tag", &self.tag).field("reduce_grad", &self.reduce_grad).finish()
    }
}

impl<B: Backend> Backward<B, 1> for TpBackward<B> {
    type State = ();

    fn backward(self, ops: Ops<Self::State, 1>, grads: &mut Gradients, _checkpointer: &mut Checkpointer) {
        let grad = grads.consume::<B>(&ops.node);
        let grad = if self.reduce_grad { all_reduce_prim::<B>(grad, &self.group, &self.tag) } else { grad };
        if let Some(node) = &ops.parents[0] {
            grads.register::<B>(node.id, grad);
        }
    }
}

fn tp_op<B: Backend, C: CheckpointStrategy>(
    x: FloatTensor<Autodiff<B, C>>,
    group: Arc<dyn ProcessGroup<B>>,
    tag: Tag,
    reduce_grad: bool,
) -> FloatTensor<Autodiff<B, C>> {
    let output = if reduce_grad {
        x.primitive.clone()
    } else {
        all_reduce_prim::<B>(x.primitive.clone(), &group, &tag)
    };
    let prep =
        TpBackward { group, tag, reduce_grad }.prepare::<C>([x.node.clone()]).compute_bound().stateful();
    match prep {
        OpsKind::Tracked(prep) => prep.finish((), output),
        OpsKind::UnTracked(prep) => prep.finish(output),
    }
}

impl<B: Backend, C: CheckpointStrategy> TpBackend for Autodiff<B, C> {
    fn tp_copy(x: FloatTensor<Self>, group: Arc<dyn ProcessGroup<B>>, tag: Tag) -> FloatTensor<Self> {
        tp_op::<B, C>(x, group, tag, true)
    }

    fn tp_reduce(x: FloatTensor<Self>, group: Arc<dyn ProcessGroup<B>>, tag: Tag) -> FloatTensor<Self> {
        tp_op::<B, C>(x, group, tag, false)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn patterns_match_whole_segments() {
        assert!(path_matches("model.layers.*.mlp.up_proj.weight", "model.layers.12.mlp.up_proj.weight"));
        assert!(!path_matches("model.layers.*.mlp.up_proj.weight", "model.layers.1.mlp.down_proj.weight"));
        assert!(!path_matches("model.layers.*.weight", "model.layers.1.mlp.weight"));
    }

    #[test]
    fn slices_respect_granules() {
        let col = TpStyle::Colwise { granule: 4 };
        assert_eq!(slice_of(col, "q", &[16, 8], 1, 2), Ok(Some((0, 8, 8))));
        assert!(matches!(
            slice_of(col, "q", &[8, 8], 0, 4),
            Err(TpError::Indivisible { groups: 2, tp: 4, .. })
        ));
        let row = TpStyle::Rowwise { granule: 1 };
        assert_eq!(slice_of(row, "o", &[3, 6], 2, 3), Ok(Some((1, 4, 2))));
        assert!(matches!(slice_of(row, "o", &[6], 0, 2), Err(TpError::NotAMatrix { .. })));
    }
}
