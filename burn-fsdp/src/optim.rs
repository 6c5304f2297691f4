//! AdamW with PyTorch semantics, and global gradient-norm clipping.
//!
//! Burn's own `AdamW` is mathematically close to PyTorch's but computes the bias corrections
//! in `f32` and differs in operation order; Burn's `GradientClippingConfig::Norm` clips each
//! parameter separately. Reproducing PyTorch trajectories needs both exactly as
//! `torch.optim.AdamW` (single-tensor path) and `torch.nn.utils.clip_grad_norm_` do them, so
//! they are written here. The same optimizer steps FSDP shards: it only sees `Param`s and
//! their gradients, whatever their shapes.

use std::collections::HashMap;

use burn::module::{AutodiffModule, ModuleMapper, ModuleVisitor, Param, ParamId};
use burn::optim::GradientsParams;
use burn::tensor::backend::{AutodiffBackend, Backend};
use burn::tensor::{Tensor, TensorData};

#[cfg(feature = "cpu")]
mod fused;
/// Without the `cpu` feature every update and gradient takes the generic path.
#[cfg(not(feature = "cpu"))]
mod fused {
    use burn::tensor::Tensor;
    use burn::tensor::backend::Backend;

    /// The parameter and the optimizer state (`exp_avg`, `exp_avg_sq`), if any.
    pub(super) type Update<B> = (Tensor<B, 1>, Option<(Tensor<B, 1>, Tensor<B, 1>)>);

    /// Never fused here: the arguments back, for the generic path.
    pub(super) fn adamw<B: Backend>(
        param: Tensor<B, 1>,
        _grad: &Tensor<B, 1>,
        state: Option<(Tensor<B, 1>, Tensor<B, 1>)>,
        _k: &super::AdamScalars,
    ) -> Result<[Tensor<B, 1>; 3], Update<B>> {
        Err((param, state))
    }

    /// `grad` as it is.
    pub(super) fn standard_layout<B: Backend, const D: usize>(grad: Tensor<B, D>) -> Tensor<B, D> {
        grad
    }

    /// No fused sum of squares: the generic path.
    pub(super) fn sq_sum<B: Backend, const D: usize>(
        _grad: &Tensor<B, D>,
        _squares: &mut Vec<f32>,
    ) -> Option<f32> {
        None
    }
}

/// The update's scalars, each rounded to `f32` as the generic path's scalar operands are.
#[derive(Debug, Clone, Copy)]
#[cfg_attr(not(feature = "cpu"), allow(dead_code))]
pub(crate) struct AdamScalars {
    /// `1 - lr · weight_decay`, when there is weight decay.
    pub(crate) decay: Option<f32>,
    /// `1 - β₁`.
    pub(crate) one_minus_b1: f32,
    /// `β₂`.
    pub(crate) b2: f32,
    /// `1 - β₂`.
    pub(crate) one_minus_b2: f32,
    /// `√(1 - β₂ᵗ)`.
    pub(crate) sqrt_bias_correction2: f32,
    /// `ε`.
    pub(crate) eps: f32,
    /// `lr / (1 - β₁ᵗ)`.
    pub(crate) step_size: f32,
}

/// Hyper-parameters of [`TorchAdamW`] (PyTorch names and defaults, except `weight_decay`).
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct TorchAdamWConfig {
    /// Learning rate.
    pub lr: f64,
    /// Coefficients of the running averages of the gradient and its square.
    pub betas: (f64, f64),
    /// Added to the denominator, outside the square root.
    pub eps: f64,
    /// Decoupled weight decay: `p *= 1 - lr * weight_decay` before the Adam update.
    pub weight_decay: f64,
}

impl Default for TorchAdamWConfig {
    fn default() -> Self {
        Self { lr: 1e-3, betas: (0.9, 0.999), eps: 1e-8, weight_decay: 1e-2 }
    }
}

impl TorchAdamWConfig {
    /// Builds the optimizer with empty state.
    pub fn init<B: Backend>(&self) -> TorchAdamW<B> {
        TorchAdamW { config: *self, state: HashMap::new() }
    }
}

/// The Adam state of one parameter, flattened to 1D.
#[derive(Debug, Clone)]
pub struct AdamState<B: Backend> {
    /// Number of updates applied so far.
    pub step: u64,
    /// Running average of the gradient (`exp_avg`), flattened.
    pub exp_avg: Tensor<B, 1>,
    /// Running average of the squared gradient (`exp_avg_sq`), flattened.
    pub exp_avg_sq: Tensor<B, 1>,
}

/// AdamW exactly as `torch.optim.AdamW` (`foreach=False`) computes it.
///
/// Per parameter `p` with gradient `g`, at step `t`:
/// ```text
/// p   *= 1 - lr·wd
/// m    = m + (1-β1)(g - m)          (lerp)
/// v    = β2·v + (1-β2)·g·g
/// p   -= lr/(1-β1^t) · m / (sqrt(v)/sqrt(1-β2^t) + eps)
/// ```
///
/// # Example
///
/// ```
/// use burn::backend::{Autodiff, NdArray};
/// use burn::module::Param;
/// use burn::optim::GradientsParams;
/// use burn::tensor::Tensor;
/// use burn_fsdp::TorchAdamWConfig;
///
/// type B = Autodiff<NdArray>;
/// let device = Default::default();
/// let w = Param::from_tensor(Tensor::<B, 1>::from_floats([1.0, -2.0], &device));
/// let loss = (w.val() * w.val()).sum();
/// let grads = GradientsParams::from_grads(loss.backward(), &w);
/// let mut adam = TorchAdamWConfig { lr: 0.1, ..Default::default() }.init();
/// let w = adam.step(w, grads);
/// assert_eq!(adam.state_len(), 1);
/// # let _ = w;
/// ```
#[derive(Debug, Clone)]
pub struct TorchAdamW<B: Backend> {
    config: TorchAdamWConfig,
    state: HashMap<ParamId, AdamState<B>>,
}

impl<B: Backend> TorchAdamW<B> {
    /// The hyper-parameters.
    pub fn config(&self) -> &TorchAdamWConfig {
        &self.config
    }

    /// Changes the learning rate (for schedules).
    pub fn set_lr(&mut self, lr: f64) {
        self.config.lr = lr;
    }

    /// Number of parameters with state.
    pub fn state_len(&self) -> usize {
        self.state.len()
    }

    /// The state of one parameter, if it has been stepped.
    pub fn state(&self, id: &ParamId) -> Option<&AdamState<B>> {
        self.state.get(id)
    }

    /// Replaces the state of one parameter (checkpoint loading).
    pub fn set_state(&mut self, id: ParamId, state: AdamState<B>) {
        self.state.insert(id, state);
    }

    /// Moves every state tensor with `f` (e.g. to another device).
    pub fn map_state(&mut self, mut f: impl FnMut(Tensor<B, 1>) -> Tensor<B, 1>) {
        for s in self.state.values_mut() {
            s.exp_avg = f(s.exp_avg.clone());
            s.exp_avg_sq = f(s.exp_avg_sq.clone());
        }
    }

    /// Applies one update to a single tensor and returns the new value.
    ///
    /// # Shapes
    /// - `param`, `grad`: any shape, equal.
    pub fn update_tensor<const D: usize>(
        &mut self,
        id: ParamId,
        param: Tensor<B, D>,
        grad: Tensor<B, D>,
    ) -> Tensor<B, D> {
        let shape = param.shape();
        let n = shape.num_elements();
        let g = grad.reshape([n]);
        let p = param.reshape([n]);
        let TorchAdamWConfig { lr, betas: (b1, b2), eps, weight_decay } = self.config;
        let state = self.state.remove(&id);
        let step = state.as_ref().map_or(0, |s| s.step) + 1;
        let bias_correction1 = 1.0 - b1.powi(step as i32);
        let bias_correction2 = 1.0 - b2.powi(step as i32);
        let step_size = lr / bias_correction1;
        // Flex, f32: the same operations in one pass over memory (the same bits).
        let scalars = AdamScalars {
            decay: (weight_decay != 0.0).then_some((1.0 - lr * weight_decay) as f32),
            one_minus_b1: (1.0 - b1) as f32,
            b2: b2 as f32,
            one_minus_b2: (1.0 - b2) as f32,
            sqrt_bias_correction2: bias_correction2.sqrt() as f32,
            eps: eps as f32,
            step_size: step_size as f32,
        };
        let (p, moments) = match fused::adamw(p, &g, state.map(|s| (s.exp_avg, s.exp_avg_sq)), &scalars) {
            Ok([p, exp_avg, exp_avg_sq]) => {
                self.state.insert(id, AdamState { step, exp_avg, exp_avg_sq });
                return p.reshape(shape);
            }
            Err(generic) => generic,
        };
        let (exp_avg, exp_avg_sq) = moments.unwrap_or_else(|| (g.zeros_like(), g.zeros_like()));
        let p = if weight_decay != 0.0 { p.mul_scalar(1.0 - lr * weight_decay) } else { p };
        let m = exp_avg.clone() + (g.clone() - exp_avg).mul_scalar(1.0 - b1);
        let v = exp_avg_sq.mul_scalar(b2) + g.clone().mul(g).mul_scalar(1.0 - b2);
        let denom = v.clone().sqrt().div_scalar(bias_correction2.sqrt()).add_scalar(eps);
        let p = p - m.clone().div(denom).mul_scalar(step_size);
        self.state.insert(id, AdamState { step, exp_avg: m, exp_avg_sq: v });
        p.reshape(shape)
    }
}

impl<B: Backend> TorchAdamW<B> {
    /// Steps every parameter of `module` that has a gradient in `grads`.
    pub fn step<AB, M>(&mut self, module: M, mut grads: GradientsParams) -> M
    where
        AB: AutodiffBackend<InnerBackend = B>,
        M: AutodiffModule<AB>,
    {
        let mut mapper = StepMapper { optim: self, grads: &mut grads, updated: HashMap::new() };
        module.map(&mut mapper)
    }
}

struct StepMapper<'a, B: Backend> {
    optim: &'a mut TorchAdamW<B>,
    grads: &'a mut GradientsParams,
    /// Parameters updated so far: a parameter met again (a module cloned into several places:
    /// tied weights) gets the same updated tensor, so the tie holds.
    updated: HashMap<ParamId, Box<dyn std::any::Any>>,
}

impl<AB: AutodiffBackend> ModuleMapper<AB> for StepMapper<'_, AB::InnerBackend> {
    fn map_float<const D: usize>(&mut self, param: Param<Tensor<AB, D>>) -> Param<Tensor<AB, D>> {
        let (id, tensor, mapper) = param.consume();
        if let Some(t) = self.updated.get(&id).and_then(|t| t.downcast_ref::<Tensor<AB, D>>()) {
            return Param::from_mapped_value(id, t.clone(), mapper);
        }
        let Some(grad) = self.grads.remove::<AB::InnerBackend, D>(id) else {
            return Param::from_mapped_value(id, tensor, mapper);
        };
        let require_grad = tensor.is_require_grad();
        let updated = self.optim.update_tensor(id, tensor.inner(), grad);
        let mut updated = Tensor::from_inner(updated);
        if require_grad {
            updated = updated.require_grad();
        }
        self.updated.insert(id, Box::new(updated.clone()));
        Param::from_mapped_value(id, updated, mapper)
    }
}

/// Sum of squares of every gradient of `module` found in `grads` (as an `f64`).
///
/// This is the local part of a global norm: FSDP sums it over ranks before the square root.
pub fn grad_sq_sum<AB: AutodiffBackend, M: AutodiffModule<AB>>(module: &M, grads: &GradientsParams) -> f64 {
    grad_sq_sum_split::<AB, M>(module, grads, |_| true).0
}

/// `Σ g²` as a one-element tensor: `g.square().sum()`, without its gradient-sized temporary on
/// Flex `f32` (the same bits, see `fused::sq_sum`; `squares` is its buffer).
fn sq_sum<B: Backend, const D: usize>(g: Tensor<B, D>, squares: &mut Vec<f32>) -> Tensor<B, 1> {
    match fused::sq_sum(&g, squares) {
        Some(s) => Tensor::from_data(TensorData::new(vec![s], [1]), &g.device()),
        None => g.square().sum(),
    }
}

/// Puts every gradient of `module` in `grads` into standard layout where it is not (Flex:
/// see `fused::standard_layout`), so that the norm and the optimizer read it as it lies.
pub(crate) fn standard_layout_grads<AB: AutodiffBackend, M: AutodiffModule<AB>>(
    module: &M,
    grads: &mut GradientsParams,
) {
    struct Standard<'a> {
        grads: &'a mut GradientsParams,
    }
    impl<AB: AutodiffBackend> ModuleVisitor<AB> for Standard<'_> {
        fn visit_float<const D: usize>(&mut self, param: &Param<Tensor<AB, D>>) {
            if let Some(g) = self.grads.remove::<AB::InnerBackend, D>(param.id) {
                self.grads.register(param.id, fused::standard_layout(g));
            }
        }
    }
    module.visit(&mut Standard { grads });
}

/// [`grad_sq_sum`] split in two: the gradients of parameters for which `first` is true, and
/// the rest (e.g. tensor-parallel split parameters vs replicated ones).
pub fn grad_sq_sum_split<AB: AutodiffBackend, M: AutodiffModule<AB>>(
    module: &M,
    grads: &GradientsParams,
    first: impl Fn(burn::module::ParamId) -> bool,
) -> (f64, f64) {
    let [a, b] = grad_sq_sum_tensors(module, grads, first);
    (a.map(|t| t.into_scalar_f64()).unwrap_or(0.0), b.map(|t| t.into_scalar_f64()).unwrap_or(0.0))
}

/// [`grad_sq_sum_split`]'s two sums as one-element tensors on the device, not read (`None`
/// where no gradient falls in the part): `Σ g²` in the gradients' dtype.
pub fn grad_sq_sum_tensors<AB: AutodiffBackend, M: AutodiffModule<AB>>(
    module: &M,
    grads: &GradientsParams,
    first: impl Fn(burn::module::ParamId) -> bool,
) -> [Option<Tensor<AB::InnerBackend, 1>>; 2] {
    struct SqSum<'a, B: Backend, F> {
        grads: &'a GradientsParams,
        first: F,
        totals: [Option<Tensor<B, 1>>; 2],
        /// [`sq_sum`]'s buffer, freed with this pass.
        squares: Vec<f32>,
    }
    impl<AB: AutodiffBackend, F: Fn(burn::module::ParamId) -> bool> ModuleVisitor<AB>
        for SqSum<'_, AB::InnerBackend, F>
    {
        fn visit_float<const D: usize>(&mut self, param: &Param<Tensor<AB, D>>) {
            if let Some(g) = self.grads.get::<AB::InnerBackend, D>(param.id) {
                let s = sq_sum(g, &mut self.squares);
                let slot = &mut self.totals[usize::from(!(self.first)(param.id))];
                *slot = Some(match slot.take() {
                    Some(t) => t + s,
                    None => s,
                });
            }
        }
    }
    let mut v = SqSum::<AB::InnerBackend, _> { grads, first, totals: [None, None], squares: Vec::new() };
    module.visit(&mut v);
    v.totals
}

/// `Σ g²` of every gradient of `module` in `grads` (single device) as a one-element tensor
/// (in the gradients' dtype) on the device, not read (`None` without gradients); the gradients are put in
/// standard layout first, as [`clip_grad_norm`] does. Its square root is the norm
/// [`clip_grad_norm`] returns, bit for bit.
pub fn grad_sq_sum_device<AB: AutodiffBackend, M: AutodiffModule<AB>>(
    module: &M,
    grads: &mut GradientsParams,
) -> Option<Tensor<AB::InnerBackend, 1>> {
    standard_layout_grads(module, grads);
    let [all, _] = grad_sq_sum_tensors(module, grads, |_| true);
    all
}

/// Global L2 norm of all gradients of `module` (single device).
pub fn grad_norm<AB: AutodiffBackend, M: AutodiffModule<AB>>(module: &M, grads: &GradientsParams) -> f64 {
    grad_sq_sum(module, grads).sqrt()
}

/// Multiplies every gradient of `module` in `grads` by `factor`.
pub fn scale_grads<AB: AutodiffBackend, M: AutodiffModule<AB>>(
    module: &M,
    grads: &mut GradientsParams,
    factor: f64,
) {
    struct Scale<'a> {
        grads: &'a mut GradientsParams,
        factor: f64,
    }
    impl<AB: AutodiffBackend> ModuleVisitor<AB> for Scale<'_> {
        fn visit_float<const D: usize>(&mut self, param: &Param<Tensor<AB, D>>) {
            if let Some(g) = self.grads.remove::<AB::InnerBackend, D>(param.id) {
                self.grads.register(param.id, g.mul_scalar(self.factor));
            }
        }
    }
    module.visit(&mut Scale { grads, factor });
}

/// The factor `torch.nn.utils.clip_grad_norm_` multiplies gradients by, given the total norm.
pub fn clip_coefficient(total_norm: f64, max_norm: f64) -> f64 {
    (max_norm / (total_norm + 1e-6)).min(1.0)
}

/// Clips all gradients of `module` by their global L2 norm, as
/// `torch.nn.utils.clip_grad_norm_` does, and returns the norm before clipping.
///
/// Burn's `GradientClippingConfig::Norm` clips each parameter on its own; this is the global
/// version. A non-finite or non-positive `max_norm` only measures.
pub fn clip_grad_norm<AB: AutodiffBackend, M: AutodiffModule<AB>>(
    module: &M,
    grads: &mut GradientsParams,
    max_norm: f64,
) -> f64 {
    standard_layout_grads(module, grads);
    let norm = grad_norm(module, grads);
    clip_grads_to(module, grads, norm, max_norm);
    norm
}

/// The factor to scale gradients of global norm `norm` by so that it is at most `max_norm`
/// ([`clip_coefficient`]), or `None` when nothing changes: `max_norm` non-finite or ≤ 0 (only
/// measuring), or the norm already within it (or not a number).
pub fn clip_factor(norm: f64, max_norm: f64) -> Option<f64> {
    let coef = clip_coefficient(norm, max_norm);
    (max_norm.is_finite() && max_norm > 0.0 && coef < 1.0).then_some(coef)
}

/// Scales every gradient of `module` in `grads`, of global norm `norm`, by [`clip_factor`]
/// (single device; the second half of [`clip_grad_norm`] once the norm is known).
pub fn clip_grads_to<AB: AutodiffBackend, M: AutodiffModule<AB>>(
    module: &M,
    grads: &mut GradientsParams,
    norm: f64,
    max_norm: f64,
) {
    if let Some(coef) = clip_factor(norm, max_norm) {
        scale_grads(module, grads, coef);
    }
}

/// Reads a one-element tensor as `f64`.
pub(crate) trait ScalarF64 {
    fn into_scalar_f64(self) -> f64;
}

impl<B: Backend> ScalarF64 for Tensor<B, 1> {
    fn into_scalar_f64(self) -> f64 {
        use burn::tensor::ElementConversion;
        self.into_scalar().elem::<f64>()
    }
}
