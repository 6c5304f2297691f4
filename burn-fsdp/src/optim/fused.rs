//! [`TorchAdamW`](super::TorchAdamW)'s update in one pass over memory, on Flex tensors of
//! `f32` in standard layout.
//!
//! The generic update is eleven element-wise tensor ops, four of which allocate a result of the
//! parameter's size; on a CPU each is a pass over memory, and for a 29M-parameter model they
//! were ~12 % of a training step on Flex. Here each element goes through the same `f32`
//! operations in the same order, with the same `f32` constants (Flex rounds a scalar operand to
//! `f32`, as done below), so the result is the same, bit for bit (tested against the generic
//! path on NdArray, the reference backend, which always takes the generic path).

use burn::backend::flex::FlexTensor;
use burn::tensor::backend::Backend;
use burn::tensor::ops::FloatTensor;
use burn::tensor::{DType, Shape, Tensor, TensorPrimitive};

use super::AdamScalars as Scalars;
use crate::downcast::{cast, must};

/// One element of the update: the new parameter, `exp_avg` and `exp_avg_sq`.
#[inline(always)]
fn element(p: f32, g: f32, m: f32, v: f32, k: &Scalars) -> (f32, f32, f32) {
    let p = match k.decay {
        Some(d) => p * d,
        None => p,
    };
    let m = m + (g - m) * k.one_minus_b1;
    let v = v * k.b2 + (g * g) * k.one_minus_b2;
    let denom = v.sqrt() / k.sqrt_bias_correction2 + k.eps;
    (p - (m / denom) * k.step_size, m, v)
}

/// A flat `f32` Flex tensor of `n` elements owned here (copied when shared or not flat: once,
/// into a vector handed over as it is — `into_data` of a shared tensor copies twice).
fn owned(t: FlexTensor, n: usize) -> FlexTensor {
    let flat = t.is_unique() && t.layout().contiguous_offsets() == Some((0, n));
    if flat {
        return t;
    }
    match t.as_slice::<f32>() {
        Some(s) => FlexTensor::from_data(burn::tensor::TensorData::new(s.to_vec(), [s.len()])),
        None => FlexTensor::from_data(t.into_data()),
    }
}

/// `t` as a Flex tensor of `f32` in standard layout, or `t` back.
fn flex<B: Backend>(t: Tensor<B, 1>) -> Result<FlexTensor, Tensor<B, 1>> {
    match cast::<FloatTensor<B>, FlexTensor>(t.into_primitive().tensor()) {
        Ok(f) if f.dtype() == DType::F32 && f.layout().contiguous_offsets().is_some() => Ok(f),
        Ok(f) => Err(back(f)),
        Err(t) => Err(Tensor::from_primitive(TensorPrimitive::Float(t))),
    }
}

/// A Flex tensor back as `B`'s tensor (`B` is Flex: the caller got it from [`flex`]).
fn back<B: Backend>(t: FlexTensor) -> Tensor<B, 1> {
    Tensor::from_primitive(TensorPrimitive::Float(must::<FlexTensor, FloatTensor<B>>(
        t,
        "came from B's float tensor",
    )))
}

/// The parameter and the optimizer state (`exp_avg`, `exp_avg_sq`), if any.
pub(super) type Update<B> = (Tensor<B, 1>, Option<(Tensor<B, 1>, Tensor<B, 1>)>);

/// The update when `param`, `grad` and the state are Flex tensors of `f32` in standard layout
/// with as many elements: the new parameter, `exp_avg` and `exp_avg_sq` (in place where this
/// holds the only reference). Otherwise the arguments back, for the generic path.
pub(super) fn adamw<B: Backend>(
    param: Tensor<B, 1>,
    grad: &Tensor<B, 1>,
    state: Option<(Tensor<B, 1>, Tensor<B, 1>)>,
    k: &Scalars,
) -> Result<[Tensor<B, 1>; 3], Update<B>> {
    let n = param.shape().num_elements();
    let fits = |t: &Tensor<B, 1>| t.shape().num_elements() == n;
    if !fits(grad) || state.as_ref().is_some_and(|(m, v)| !fits(m) || !fits(v)) {
        return Err((param, state));
    }
    let g = match flex(grad.clone()) {
        Ok(g) => g,
        Err(_) => return Err((param, state)),
    };
    let p = match flex(param) {
        Ok(p) => p,
        Err(param) => return Err((param, state)),
    };
    let (m, v) = match state {
        None => {
            (FlexTensor::zeros(Shape::new([n]), DType::F32), FlexTensor::zeros(Shape::new([n]), DType::F32))
        }
        Some((m, v)) => match (flex(m), flex(v)) {
            (Ok(m), Ok(v)) => (m, v),
            (m, v) => {
                let t = |r: Result<FlexTensor, Tensor<B, 1>>| r.map_or_else(|t| t, back);
                return Err((back(p), Some((t(m), t(v)))));
            }
        },
    };
    let (mut p, mut m, mut v) = (owned(p, n), owned(m, n), owned(v, n));
    let g = g.as_slice::<f32>().expect("checked above: f32 in standard layout");
    let ps = &mut p.storage_mut::<f32>()[..n];
    let ms = &mut m.storage_mut::<f32>()[..n];
    let vs = &mut v.storage_mut::<f32>()[..n];
    for i in 0..n {
        (ps[i], ms[i], vs[i]) = element(ps[i], g[i], ms[i], vs[i], k);
    }
    Ok([back(p), back(m), back(v)])
}

/// `grad` in standard layout: on Flex a gradient in another layout (a linear layer's weight
/// gradient comes out of Flex's matmul backward transposed, strides `[1, rows]`) is copied once
/// (a transposed `f32` matrix with [`transposed_rows`](crate::transpose::transposed_rows), other
/// layouts with Flex's `to_contiguous`); anything else comes back as it is. Both readers of a gradient
/// after backward — the global norm's sum of squares and the optimizer — would otherwise
/// each make that transposing pass on their own (on the benchmark model, ~7 % of a
/// single-device step for the two).
pub(super) fn standard_layout<B: Backend, const D: usize>(grad: Tensor<B, D>) -> Tensor<B, D> {
    match cast::<FloatTensor<B>, FlexTensor>(grad.into_primitive().tensor()) {
        Ok(f) => {
            let f = match f.layout().contiguous_offsets() {
                Some(_) => f,
                None => transposed_f32(&f).unwrap_or_else(|| f.to_contiguous()),
            };
            Tensor::from_primitive(TensorPrimitive::Float(must::<FlexTensor, FloatTensor<B>>(
                f,
                "came from B's float tensor",
            )))
        }
        Err(t) => Tensor::from_primitive(TensorPrimitive::Float(t)),
    }
}

/// A Flex `f32` matrix in transposed layout (strides `[1, rows]` from the start of its memory)
/// copied into standard layout with [`transposed_rows`](crate::transpose::transposed_rows);
/// `None` for any other tensor.
fn transposed_f32(t: &FlexTensor) -> Option<FlexTensor> {
    let ([rows, cols], src) = crate::transpose::flex_column_major::<f32>(t)?;
    let mut out = vec![0f32; rows * cols];
    crate::transpose::transposed_rows(src, rows, cols, 0..rows, &mut out);
    Some(FlexTensor::from_data(burn::tensor::TensorData::new(out, [rows, cols])))
}

/// `Σ x²` of a Flex `f32` gradient in standard layout, computed as `grad.square().sum()` does
/// on Flex — the squares in order, then Flex's own SIMD sum over them — so the same bits, but
/// into `squares`, a buffer the caller reuses from gradient to gradient of one norm instead
/// of a fresh gradient-sized tensor each. The caller drops it after the norm: kept from step
/// to step (it once was, thread-local), it held the largest gradient shard's size per rank
/// between steps and through the next step's peak. `None` for anything else (other
/// backends, dtypes, layouts: the caller takes the generic path).
pub(super) fn sq_sum<B: Backend, const D: usize>(grad: &Tensor<B, D>, squares: &mut Vec<f32>) -> Option<f32> {
    let t = cast::<FloatTensor<B>, FlexTensor>(grad.clone().into_primitive().tensor()).ok()?;
    if t.dtype() != DType::F32 {
        return None;
    }
    let x = t.as_slice::<f32>()?;
    squares.clear();
    squares.extend(x.iter().map(|v| v * v));
    Some(burn::backend::flex::simd::kernels::sum_f32(squares))
}

#[cfg(test)]
mod tests {
    use burn::backend::{Flex, NdArray};
    use burn::module::ParamId;
    use burn::tensor::{Distribution, Tensor, TensorData};

    use crate::optim::TorchAdamWConfig;

    /// Four steps of the fused update on Flex and of the generic one on NdArray, from the same
    /// values: the same parameters and state, bit for bit, with and without weight decay, for a
    /// parameter this holds alone (updated in place) and one held elsewhere too (copied; the
    /// other holder keeps its values).
    #[test]
    fn fused_update_equals_the_generic_update() {
        for weight_decay in [0.0, 0.1] {
            let config = TorchAdamWConfig { lr: 0.01, betas: (0.9, 0.95), eps: 1e-8, weight_decay };
            let (mut flex, mut ndarray) = (config.init::<Flex>(), config.init::<NdArray>());
            let id = ParamId::new();
            let data = |seed: u64| {
                Tensor::<NdArray, 2>::random([3, 5], Distribution::Normal(0.0, 1.0), &Default::default())
                    .mul_scalar(seed as f64)
                    .into_data()
            };
            let start = data(1);
            let (mut p_flex, mut p_nd) = (
                Tensor::<Flex, 2>::from_data(start.clone(), &Default::default()),
                Tensor::<NdArray, 2>::from_data(start, &Default::default()),
            );
            let held = p_flex.clone();
            let before: TensorData = held.to_data();
            for step in 0..4 {
                let g = data(step + 2);
                p_flex = flex.update_tensor(id, p_flex, Tensor::from_data(g.clone(), &Default::default()));
                p_nd = ndarray.update_tensor(id, p_nd, Tensor::from_data(g, &Default::default()));
                assert_eq!(p_flex.to_data(), p_nd.to_data(), "weight decay {weight_decay}, step {step}");
                let (sf, sn) = (&flex.state[&id], &ndarray.state[&id]);
                assert_eq!(sf.exp_avg.to_data(), sn.exp_avg.to_data());
                assert_eq!(sf.exp_avg_sq.to_data(), sn.exp_avg_sq.to_data());
            }
            assert_eq!(held.to_data(), before, "a tensor held elsewhere keeps its values");
        }
    }

    /// The fused path is taken on Flex `f32` and left to the generic path on NdArray and on a
    /// gradient of another size.
    #[test]
    fn fused_path_taken_on_flex_f32_only() {
        let k = super::Scalars {
            decay: None,
            one_minus_b1: 0.1,
            b2: 0.95,
            one_minus_b2: 0.05,
            sqrt_bias_correction2: 0.2,
            eps: 1e-8,
            step_size: 0.1,
        };
        let flex = |n: usize| Tensor::<Flex, 1>::ones([n], &Default::default());
        assert!(super::adamw(flex(6), &flex(6), None, &k).is_ok());
        let nd = |n: usize| Tensor::<NdArray, 1>::ones([n], &Default::default());
        assert!(super::adamw(nd(6), &nd(6), None, &k).is_err());
        assert!(super::adamw(flex(6), &flex(5), None, &k).is_err(), "a gradient of another size");
    }

    /// The sum of squares without a temporary equals Flex's `square().sum()` bit for bit, on
    /// lengths with and without a SIMD remainder; a transposed gradient is put in standard
    /// layout with its values unchanged, and its sum of squares then equals Flex's of the
    /// transposed tensor (Flex squares it into standard layout first).
    #[test]
    fn sum_of_squares_and_standard_layout_match_flex() {
        use burn::tensor::TensorPrimitive;
        let dev = Default::default();
        for [rows, cols] in [[1usize, 1], [7, 5], [37, 53], [64, 128], [129, 257]] {
            let g =
                Tensor::<Flex, 2>::random([rows, cols], Distribution::Normal(0.0, 1.0), &dev).mul_scalar(3.0);
            let want = g.clone().square().sum().into_scalar();
            assert_eq!(
                super::sq_sum(&g, &mut Vec::new()).map(f32::to_bits),
                Some(want.to_bits()),
                "{rows}x{cols}"
            );
            let t = g.clone().transpose();
            let flex_t = t.clone().square().sum().into_scalar();
            let standard = super::standard_layout(t.clone());
            match standard.clone().into_primitive() {
                TensorPrimitive::Float(f) => assert!(f.layout().contiguous_offsets().is_some()),
                _ => unreachable!("a float tensor"),
            }
            assert_eq!(standard.to_data(), t.to_data(), "values unchanged");
            assert_eq!(
                super::sq_sum(&standard, &mut Vec::new()).map(f32::to_bits),
                Some(flex_t.to_bits()),
                "{rows}x{cols}ᵀ"
            );
        }
        let nd = Tensor::<NdArray, 1>::ones([4], &Default::default());
        assert_eq!(super::sq_sum(&nd, &mut Vec::new()), None, "NdArray takes the generic path");
    }
}
