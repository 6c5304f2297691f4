//! Moving a backend's tensor primitive into its concrete type (and back), for the host paths
//! that work on the CPU backends' memory directly (here, and in models' own fast paths).
//!
//! ```
//! use burn_fsdp::downcast::{cast, must};
//! assert_eq!(cast::<u8, u16>(7), Err(7));
//! assert_eq!(must::<u8, u8>(7, "a u8"), 7);
//! ```

use std::any::Any;

/// `value` as type `T` when it is one (moved, not copied); else `value` back.
pub fn cast<S: 'static, T: 'static>(value: S) -> Result<T, S> {
    let mut slot = Some(value);
    match (&mut slot as &mut dyn Any).downcast_mut::<Option<T>>() {
        Some(t) => Ok(t.take().expect("the slot was just filled")),
        None => Err(slot.expect("the slot is still filled")),
    }
}

/// `value` as type `T`, which the caller has checked it is (`checked` says how).
///
/// # Panics
/// If `value` is not a `T`: a broken invariant of the caller, naming `checked`.
pub fn must<S: 'static, T: 'static>(value: S, checked: &str) -> T {
    match cast(value) {
        Ok(t) => t,
        Err(_) => unreachable!("{checked}"),
    }
}

/// `t` reshaped to `shape`, sharing its memory where Burn would copy: Flex copies a
/// contiguous tensor that starts past the beginning of its buffer (a `narrow` of a flat
/// gradient) on every `reshape`; here it becomes a view at the same offset. Any other tensor
/// goes through Burn's `reshape`. Same values either way.
pub(crate) fn reshape_shared<B: burn::tensor::backend::Backend, const D: usize>(
    t: burn::tensor::Tensor<B, 1>,
    shape: burn::tensor::Shape,
) -> burn::tensor::Tensor<B, D> {
    #[cfg(not(feature = "cpu"))]
    return t.reshape(shape);
    #[cfg(feature = "cpu")]
    flex_reshape_shared(t, shape)
}

#[cfg(feature = "cpu")]
fn flex_reshape_shared<B: burn::tensor::backend::Backend, const D: usize>(
    t: burn::tensor::Tensor<B, 1>,
    shape: burn::tensor::Shape,
) -> burn::tensor::Tensor<B, D> {
    use burn::backend::flex::{FlexTensor, Layout};
    use burn::tensor::{Tensor, TensorPrimitive, ops::FloatTensor};
    if t.shape().num_elements() != shape.num_elements() || shape.num_dims() != D {
        return t.reshape(shape);
    }
    let prim = match t.into_primitive() {
        TensorPrimitive::Float(p) => p,
        q => return Tensor::<B, 1>::from_primitive(q).reshape(shape),
    };
    let prim = match cast::<FloatTensor<B>, FlexTensor>(prim) {
        Ok(f) => match f.layout().contiguous_offsets() {
            Some((start, _)) => {
                // Flex's own row-major strides for `shape`, at the piece's offset.
                let strides = Layout::contiguous(shape.clone()).strides().to_vec();
                let (data, dtype) = (f.data_arc(), f.dtype());
                let view = FlexTensor::from_arc(data, Layout::new(shape, strides, start), dtype);
                return Tensor::from_primitive(TensorPrimitive::Float(must(
                    view,
                    "B's float tensor is Flex",
                )));
            }
            None => must::<FlexTensor, FloatTensor<B>>(f, "came from B's float tensor"),
        },
        Err(p) => p,
    };
    Tensor::<B, 1>::from_primitive(TensorPrimitive::Float(prim)).reshape(shape)
}

/// The values of `data` as `f32`, converting from its dtype. Burn converts every float and
/// integer dtype; one it cannot (a quantized tensor) is [`FsdpError::Values`] naming `what` —
/// never an empty vector that a norm, a checkpoint or a shard would silently take for zeros.
pub(crate) fn f32_values(
    data: burn::tensor::TensorData,
    what: impl FnOnce() -> String,
) -> Result<Vec<f32>, crate::FsdpError> {
    let dtype = data.dtype;
    data.convert::<f32>()
        .to_vec::<f32>()
        .map_err(|e| crate::FsdpError::Values { what: what(), reason: format!("{dtype:?}: {e:?}") })
}

#[cfg(test)]
mod tests {
    use burn::tensor::TensorData;

    #[test]
    fn values_convert_to_f32_or_fail_naming_the_tensor() {
        let v =
            super::f32_values(TensorData::new(vec![1.5f64, -2.0], [2]), || "w".into()).expect("f64 converts");
        assert_eq!(v, [1.5, -2.0]);
        let v = super::f32_values(TensorData::new(vec![3i64], [1]), || "w".into()).expect("i64 converts");
        assert_eq!(v, [3.0]);
    }
}
