//! The token-embedding lookup, with a lighter backward when training on Flex.
//!
//! Burn's embedding backward on Flex (`embedding_backward`) fills a `[vocab, hidden]` zero
//! buffer as bytes, copies it into aligned memory, and then copies it once more before adding
//! the rows (`select_add` starts from a copy of its input): three vocabulary-sized buffers
//! where one is enough. For Qwen3-0.6B that is 594 MiB each, per rank, at the end of backward,
//! while the tied head's gradient is still held. Here, on `Autodiff<Flex>` (with or without
//! checkpointing) and `f32`, the gradient is one zeroed vector into which the rows are added
//! in token order: the same bits as Burn's (both start from zero and add the rows one token at
//! a time). Every other backend and dtype uses Burn's own op.

use burn::backend::Autodiff;
use burn::backend::Flex;
use burn::backend::autodiff::checkpoint::base::Checkpointer;
use burn::backend::autodiff::checkpoint::strategy::{
    BalancedCheckpointing, CheckpointStrategy, NoCheckpointing,
};
use burn::backend::autodiff::grads::Gradients;
use burn::backend::autodiff::ops::{Backward, Ops, OpsKind};
use burn::tensor::backend::Backend;
use burn::tensor::ops::{FloatTensor, FloatTensorOps, IntTensor, IntTensorOps, ModuleOps};
use burn::tensor::{DType, Int, Shape, Tensor, TensorData, TensorMetadata, TensorPrimitive};
use burn_fsdp::downcast::{cast, must};

/// The rows of `weight` at `ids`: Burn's `embedding`, with the lighter backward on Flex.
///
/// # Shapes
/// - weight: `[vocab, hidden]`
/// - ids: `[batch, seq]`
/// - output: `[batch, seq, hidden]`
pub(crate) fn embedding<B: Backend>(weight: Tensor<B, 2>, ids: Tensor<B, 2, Int>) -> Tensor<B, 3> {
    let (weight, ids) = match on_flex::<B, BalancedCheckpointing>(weight, ids) {
        Ok(rows) => return rows,
        Err(back) => back,
    };
    let (weight, ids) = match on_flex::<B, NoCheckpointing>(weight, ids) {
        Ok(rows) => return rows,
        Err(back) => back,
    };
    burn::tensor::module::embedding(weight, ids)
}

type FlexAd<C> = Autodiff<Flex, C>;
type Back<B> = (Tensor<B, 2>, Tensor<B, 2, Int>);

/// [`embedding`] when `B` is `Autodiff<Flex, C>`, else the arguments back.
fn on_flex<B: Backend, C: CheckpointStrategy>(
    weight: Tensor<B, 2>,
    ids: Tensor<B, 2, Int>,
) -> Result<Tensor<B, 3>, Back<B>> {
    let weight = match cast::<Tensor<B, 2>, Tensor<FlexAd<C>, 2>>(weight) {
        Ok(w) => w,
        Err(w) => return Err((w, ids)),
    };
    const SAME: &str = "the weight's backend is Autodiff<Flex, C>, so is the ids'";
    let ids = must::<Tensor<B, 2, Int>, Tensor<FlexAd<C>, 2, Int>>(ids, SAME);
    let rows = lookup::<C>(weight, ids);
    Ok(must::<Tensor<FlexAd<C>, 3>, Tensor<B, 3>>(rows, SAME))
}

/// The embedding op on `Autodiff<Flex, C>`: Flex's own forward; [`LeanBackward`].
fn lookup<C: CheckpointStrategy>(
    weight: Tensor<FlexAd<C>, 2>,
    ids: Tensor<FlexAd<C>, 2, Int>,
) -> Tensor<FlexAd<C>, 3> {
    let weight = weight.into_primitive().tensor();
    let ids = ids.into_primitive();
    let shape = weight.primitive.shape();
    let rows = match LeanBackward.prepare::<C>([weight.node]).compute_bound().stateful() {
        OpsKind::Tracked(prep) => prep.finish((shape, ids.clone()), Flex::embedding(weight.primitive, ids)),
        OpsKind::UnTracked(prep) => prep.finish(Flex::embedding(weight.primitive, ids)),
    };
    Tensor::from_primitive(TensorPrimitive::Float(rows))
}

/// Backward of [`lookup`]: its state is the weight's shape and the ids (Burn's keeps the
/// weight itself, only to read its shape).
#[derive(Debug)]
struct LeanBackward;

impl Backward<Flex, 1> for LeanBackward {
    type State = (Shape, IntTensor<Flex>);

    fn backward(self, ops: Ops<Self::State, 1>, grads: &mut Gradients, _checkpointer: &mut Checkpointer) {
        let (shape, ids) = ops.state;
        let grad = grads.consume::<Flex>(&ops.node);
        let [parent] = ops.parents;
        if let Some(parent) = parent {
            grads.register::<Flex>(parent.id, weight_grad(shape, grad, ids));
        }
    }
}

/// The weight's gradient: `grad`'s rows (`[batch, seq, hidden]`) added into zero rows at
/// `ids`, one token after another — what Flex's `embedding_backward` computes, with one
/// buffer.
fn weight_grad(shape: Shape, grad: FloatTensor<Flex>, ids: IntTensor<Flex>) -> FloatTensor<Flex> {
    let [vocab, hidden] = shape.dims();
    let lean = (grad.dtype() == DType::F32)
        .then(|| {
            let ids = Tensor::<Flex, 2, Int>::from_primitive(ids.clone()).into_data().convert::<i64>();
            let ids = ids.to_vec::<i64>().ok()?;
            let ids: Vec<usize> =
                ids.iter().map(|&i| usize::try_from(i).ok().filter(|&i| i < vocab)).collect::<Option<_>>()?;
            let grad = Tensor::<Flex, 3>::from_primitive(TensorPrimitive::Float(grad.clone())).into_data();
            let grad = grad.as_slice::<f32>().ok()?;
            if grad.len() != ids.len() * hidden {
                return None;
            }
            let mut out = vec![0f32; vocab * hidden];
            for (row, g) in ids.iter().zip(grad.chunks_exact(hidden.max(1))) {
                for (o, &g) in out[row * hidden..(row + 1) * hidden].iter_mut().zip(g) {
                    *o += g;
                }
            }
            Some(Flex::float_from_data(TensorData::new(out, [vocab, hidden]), &Default::default()))
        })
        .flatten();
    match lean {
        Some(grad) => grad,
        // Burn's own backward (it reads only the weight's shape): an empty stand-in of that
        // shape would allocate it, so the rows go through Flex's select_add directly.
        None => {
            let [batch, seq] = ids.shape().dims();
            let ids = Flex::int_reshape(ids, Shape::new([batch * seq]));
            let grad = Flex::float_reshape(grad, Shape::new([batch * seq, hidden]));
            let zeros =
                Flex::float_zeros(Shape::new([vocab, hidden]), &Default::default(), grad.dtype().into());
            Flex::float_select_add(zeros, 0, ids, grad)
        }
    }
}

#[cfg(test)]
mod tests {
    use burn::backend::autodiff::checkpoint::strategy::BalancedCheckpointing;
    use burn::backend::{Autodiff, Flex};
    use burn::tensor::backend::AutodiffBackend;
    use burn::tensor::{Distribution, Int, Tensor, TensorData};

    /// The lookup and its weight gradient equal Burn's own op bit for bit, on Flex with and
    /// without checkpointing, with repeated ids (rows added more than once) and rows no id
    /// reaches, and with the weight used a second time (a tied head: the gradients add).
    fn same_as_burn<A: AutodiffBackend>() {
        let device = Default::default();
        let w0 = Tensor::<A::InnerBackend, 2>::random([11, 6], Distribution::Normal(0.0, 1.0), &device);
        let ids = Tensor::<A, 2, Int>::from_data(
            TensorData::new(vec![3i64, 7, 3, 0, 10, 3, 7, 1], [2, 4]),
            &device,
        );
        let head = Tensor::<A::InnerBackend, 2>::random([8, 6], Distribution::Normal(0.0, 1.0), &device);
        let run = |ours: bool| {
            let w = Tensor::<A, 2>::from_inner(w0.clone()).require_grad();
            let rows = match ours {
                true => super::embedding(w.clone(), ids.clone()),
                false => burn::tensor::module::embedding(w.clone(), ids.clone()),
            };
            let tied = w.clone().matmul(Tensor::from_inner(head.clone()).transpose()).sin().sum();
            let loss = (rows.clone() * rows.clone()).sum() + rows.cos().sum() + tied;
            let grads = loss.backward();
            (loss.into_data(), w.grad(&grads).expect("the weight has a gradient").into_data())
        };
        let (want_loss, want_grad) = run(false);
        let (loss, grad) = run(true);
        assert_eq!(loss, want_loss);
        assert_eq!(grad, want_grad);
    }

    #[test]
    fn lookup_and_gradient_equal_burns_on_flex() {
        same_as_burn::<Autodiff<Flex>>();
        same_as_burn::<Autodiff<Flex, BalancedCheckpointing>>();
        // Any other backend takes Burn's op.
        same_as_burn::<Autodiff<burn::backend::NdArray>>();
    }
}
