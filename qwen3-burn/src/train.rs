//! The language-modelling loss and fixed training batches.

use std::path::Path;
use std::sync::{Arc, Mutex};

use burn::backend::Autodiff;
use burn::backend::autodiff::checkpoint::base::Checkpointer;
use burn::backend::autodiff::checkpoint::strategy::CheckpointStrategy;
use burn::backend::autodiff::grads::Gradients;
use burn::backend::autodiff::ops::{Backward, Ops, OpsKind};
use burn::tensor::activation::log_softmax;
use burn::tensor::backend::{AutodiffBackend, Backend};
use burn::tensor::ops::FloatTensor;
use burn::tensor::{
    DType, IndexingUpdateOp, Int, Shape, Tensor, TensorData, TensorMetadata, TensorPrimitive,
};

use crate::checkpoint::SafetensorsFile;
use crate::error::{Qwen3Error, Result};

/// Mean token cross-entropy of `logits` against `labels` (PyTorch's `cross_entropy`, mean).
///
/// # Shapes
/// - logits: `[batch, seq, vocab]`
/// - labels: `[batch, seq]`
/// - output: `[1]`
pub fn cross_entropy<B: Backend>(logits: Tensor<B, 3>, labels: Tensor<B, 2, Int>) -> Tensor<B, 1> {
    let [b, t, v] = logits.dims();
    let logp = log_softmax(logits.reshape([b * t, v]), 1);
    let picked = logp.gather(1, labels.reshape([b * t, 1]));
    picked.mean().neg()
}

/// Whether [`chunked_cross_entropy`] makes the head's gradient late, in backward, from the
/// kept logits' gradient: with fewer `tokens` than `hidden` units, where the logits' gradient
/// (`[tokens, vocab]`) is the smaller of the two.
pub fn head_gradient_made_late(tokens: usize, hidden: usize) -> bool {
    tokens < hidden
}

/// [`cross_entropy`] of the LM head's logits `hidden · headᵀ`, computed `chunk` token rows at
/// a time: the `[tokens, vocab]` logits (and their log-softmax) never exist at once, only
/// `[chunk, vocab]` pieces of them. Same value and gradients as
/// `cross_entropy(hidden · headᵀ, labels)` (up to summation order).
///
/// The gradient with respect to `hidden` is computed here, during the forward pass, chunk by
/// chunk, and handed to autodiff as it is ([`LossBackend::precomputed_loss`]). So is the
/// gradient with respect to `head` when there are at least as many tokens as hidden units.
/// With fewer, it is made late ([`LossBackend::deferred_gradient`]): forward keeps the
/// logits' gradient (`[tokens, vocab]`, smaller than the head's `[vocab, hidden]`: a quarter
/// of it at 256 tokens and a hidden size of 1 024), and backward turns it into the head's
/// gradient only when it reaches the head's other uses (a tied embedding's lookup), after
/// every layer has freed its activations. The same sums in the same order either way: the
/// results are bit-identical. Backward registers both (scaled by the loss's incoming gradient
/// when it is not 1) without a `head`-sized copy. Any scaling of the loss afterwards (`/ k`
/// for gradient accumulation, …) scales them as it should. Use [`cross_entropy`] where no
/// backward follows (evaluation), since this one always computes the gradients.
///
/// # Shapes
/// - hidden: `[batch, seq, hidden]` (the model's final hidden states,
///   [`Qwen3::hidden_with`](crate::Qwen3::hidden_with))
/// - head: `[vocab, hidden]` ([`Qwen3::head_weight`](crate::Qwen3::head_weight))
/// - labels: `[batch, seq]`
/// - output: `[1]`
///
/// # Panics
/// If `hidden` and `head` disagree on the hidden size, or `chunk` is 0.
pub fn chunked_cross_entropy<B: LossBackend>(
    hidden: Tensor<B, 3>,
    head: Tensor<B, 2>,
    labels: Tensor<B, 2, Int>,
    chunk: usize,
) -> Tensor<B, 1> {
    let [b, t, d] = hidden.dims();
    let [v, d_head] = head.dims();
    assert_eq!(d, d_head, "hidden states [.., {d}] do not fit an LM head of shape [{v}, {d_head}]");
    assert!(chunk > 0, "chunked_cross_entropy needs a chunk of at least one row");
    let n = b * t;
    let hidden = hidden.reshape([n, d]);
    let (h, w) = (hidden.clone().inner(), head.clone().inner());
    let labels = labels.inner().reshape([n, 1]);
    let device = h.device();
    let (h_dtype, w_dtype) = (h.dtype(), w.dtype());
    let f32 = |x: Tensor<B::InnerBackend, 2>| if x.dtype() == DType::F32 { x } else { x.cast(DType::F32) };
    let mut loss_sum = Tensor::<B::InnerBackend, 1>::zeros([1], &device);
    let mut d_hidden = Vec::with_capacity(n.div_ceil(chunk));
    // The head is used in row blocks of `head_block_rows` vocabulary entries (see there): on
    // a CPU backend no product below has the head's size, on a GPU one product per chunk
    // covers the whole vocabulary. The blocks are slices, not copies.
    let block = head_block_rows::<B::InnerBackend>(v);
    let blocks: Vec<(std::ops::Range<usize>, Tensor<B::InnerBackend, 2>)> = (0..v)
        .step_by(block)
        .map(|start| {
            let rows = start..(start + block).min(v);
            (rows.clone(), w.clone().slice([rows, 0..d]))
        })
        .collect();
    let ranges: Vec<std::ops::Range<usize>> = blocks.iter().map(|(rows, _)| rows.clone()).collect();
    // The head's gradient is made from the logits' gradient ([tokens, vocab]) and the hidden
    // states. With fewer tokens than hidden units the logits' gradient is the smaller of the
    // two: it is kept, with each chunk's hidden states, and the head's gradient made in
    // backward. Else the head's gradient is made here, chunk by chunk.
    let late = head_gradient_made_late(n, d);
    let mut d_logits_of_chunks = Vec::with_capacity(if late { n.div_ceil(chunk) } else { 0 });
    let mut d_head_now = (!late).then(|| zeros_like_head::<B::InnerBackend>([v, d], w_dtype, &device));
    for start in (0..n).step_by(chunk) {
        let rows = chunk.min(n - start);
        let h_c = h.clone().narrow(0, start, rows);
        let l_c = labels.clone().narrow(0, start, rows);
        // h_c · headᵀ block by block, each as (block · h_cᵀ)ᵀ: the head is read in its own
        // layout and only the chunk's small [rows, hidden] block is transposed (a transposed
        // operand is copied element by element on CPU backends). Each logit is one dot
        // product over `hidden`, the same whatever the blocking.
        let h_t = h_c.clone().transpose();
        let mut logits: Vec<_> =
            blocks.iter().map(|(_, w_b)| w_b.clone().matmul(h_t.clone()).transpose()).collect();
        // A single block is taken as it is (a transposed view) off the CPU backends. On them
        // it is still concatenated, which makes it contiguous: NdArray's reductions below
        // add a transposed tensor's rows in another order, and taking the view changed its
        // training trajectories in the last bits.
        let logits = if logits.len() == 1 && !on_cpu_backend::<B::InnerBackend>() {
            logits.remove(0)
        } else {
            Tensor::cat(logits, 1)
        };
        let logits = f32(logits);
        let shifted = logits.clone() - logits.max_dim(1);
        let exp = shifted.clone().exp();
        let sum = exp.clone().sum_dim(1);
        // -log p(label) = log Σ exp(shifted) - shifted[label]
        loss_sum = loss_sum + (sum.clone().log() - shifted.gather(1, l_c.clone())).sum();
        // ∂/∂logits of the mean: (softmax - onehot(label)) / n
        let minus_one = Tensor::<B::InnerBackend, 2>::full([rows, 1], -1.0, &device);
        let d_logits = (exp / sum).scatter(1, l_c, minus_one, IndexingUpdateOp::Add).div_scalar(n as f64);
        let d_logits = if w_dtype == DType::F32 { d_logits } else { d_logits.cast(w_dtype) };
        let mut d_h: Option<Tensor<B::InnerBackend, 2>> = None;
        for (range, w_b) in &blocks {
            let d_b = d_logits.clone().slice([0..rows, range.clone()]);
            let part = d_b.clone().matmul(w_b.clone());
            d_h = Some(match d_h {
                Some(acc) => acc + part,
                None => part,
            });
        }
        d_hidden.push(d_h.expect("the vocabulary has at least one entry"));
        match d_head_now.take() {
            Some(d_head) => d_head_now = Some(add_head_gradient(d_head, &ranges, h_c, d_logits)),
            None => d_logits_of_chunks.push((h_c, d_logits)),
        }
    }
    drop(blocks);
    let d_hidden = Tensor::cat(d_hidden, 0);
    let d_hidden = if d_hidden.dtype() == h_dtype { d_hidden } else { d_hidden.cast(h_dtype) };
    let value = loss_sum.div_scalar(n as f64);
    let head = head.into_primitive().tensor();
    let (second, d_second) = match d_head_now {
        Some(d_head) => (head, d_head.into_primitive().tensor()),
        None => {
            let d_head = DeferredGradient::new(move || {
                // One buffer, each block's rows summed into it in place, chunk after chunk
                // (each chunk's logits' gradient freed once used): the same sums, in the same
                // order, as when made in forward.
                let mut d_head = zeros_like_head::<B::InnerBackend>([v, d], w_dtype, &device);
                for (h_c, d_logits) in d_logits_of_chunks {
                    d_head = add_head_gradient(d_head, &ranges, h_c, d_logits);
                }
                d_head.into_primitive().tensor()
            });
            // The loss hands its incoming gradient `g` on to the head's deferred node as
            // `g · 1`.
            let one = Tensor::<B::InnerBackend, 1>::ones([1], &value.device()).into_primitive().tensor();
            match B::deferred_gradient(head.clone(), d_head) {
                Some(node) => (node, one),
                // An untracked head takes no gradient: the deferred one is dropped unmade.
                None => (head, one),
            }
        }
    };
    let loss = B::precomputed_loss(
        value.into_primitive().tensor(),
        [hidden.into_primitive().tensor(), second],
        [d_hidden.into_primitive().tensor(), d_second],
    );
    Tensor::from_primitive(TensorPrimitive::Float(loss))
}

/// `d_head[block] += d_logits[:, block]ᵀ · h_c` for every vocabulary block of `ranges`, in
/// order: one chunk's contribution to the head's gradient.
///
/// # Shapes
/// - d_head: `[vocab, hidden]`, h_c: `[rows, hidden]`, d_logits: `[rows, vocab]`
fn add_head_gradient<B: Backend>(
    mut d_head: Tensor<B, 2>,
    ranges: &[std::ops::Range<usize>],
    h_c: Tensor<B, 2>,
    d_logits: Tensor<B, 2>,
) -> Tensor<B, 2> {
    let rows = h_c.dims()[0];
    for range in ranges {
        let d_b = d_logits.clone().slice([0..rows, range.clone()]);
        d_head = add_rows(d_head, range.clone(), d_b.transpose().matmul(h_c.clone()));
    }
    d_head
}

/// Zeros of the head's shape and dtype. On Flex, `f32` zeros are handed over as one zeroed
/// vector (`Tensor::zeros` fills a byte vector and then copies it into aligned memory: a
/// second head-sized buffer for a moment). Elsewhere they are the backend's own zeros: on a
/// GPU a fill kernel, where a zeroed host vector would be a head-sized upload per step
/// (600 MiB at Qwen3-0.6B's vocabulary).
fn zeros_like_head<B: Backend>(shape: [usize; 2], dtype: DType, device: &B::Device) -> Tensor<B, 2> {
    match dtype {
        DType::F32 if floats_are::<B, burn::backend::flex::FlexTensor>() => {
            Tensor::from_data(TensorData::new(vec![0f32; shape[0] * shape[1]], shape), device)
        }
        DType::F32 => Tensor::zeros(shape, device),
        _ => Tensor::<B, 2>::zeros(shape, device).cast(dtype),
    }
}

/// `acc[rows] + part` written into `acc`'s rows: in place on Flex when `acc` has one owner
/// (standard layout, the same dtype as `part`), else with `slice_assign` (in place where the
/// backend's is: NdArray). Flex's `slice_assign` copies its whole destination on every call
/// (it takes a second reference to it before writing), which for the head's gradient of
/// Qwen3-0.6B was 38 blocks × 3 chunks of 594 MiB copies per rank and step. Same bits either
/// way: each element is one `f32` (or `f64`) addition.
///
/// # Shapes
/// - acc: `[n, d]`, part: `[rows.len(), d]`
fn add_rows<B: Backend>(acc: Tensor<B, 2>, rows: std::ops::Range<usize>, part: Tensor<B, 2>) -> Tensor<B, 2> {
    let [n, d] = acc.dims();
    let (acc, part) = match in_place::add_rows::<B>(acc, rows.start * d, part) {
        Ok(sum) => return sum,
        Err(back) => back,
    };
    if rows == (0..n) {
        // One block: the whole buffer (the same additions, without a slice and its write-back).
        return acc + part;
    }
    let ranges = [rows, 0..d];
    let sum = acc.clone().slice(ranges.clone()) + part;
    acc.slice_assign(ranges, sum)
}

/// [`add_rows`] on Flex's memory.
mod in_place {
    use std::any::Any;

    use burn::backend::flex::FlexTensor;
    use burn::tensor::backend::Backend;
    use burn::tensor::{DType, Tensor, TensorPrimitive};

    /// `acc[at..] += part` in `acc`'s memory when both are Flex tensors of one float dtype,
    /// `acc` has one owner and starts its buffer, and `part` is in standard layout; else
    /// both back.
    #[allow(clippy::type_complexity)]
    pub(super) fn add_rows<B: Backend>(
        acc: Tensor<B, 2>,
        at: usize,
        part: Tensor<B, 2>,
    ) -> Result<Tensor<B, 2>, (Tensor<B, 2>, Tensor<B, 2>)> {
        let (mut acc_p, part_p) = match (acc.into_primitive(), part.into_primitive()) {
            (TensorPrimitive::Float(a), TensorPrimitive::Float(p)) => (a, p),
            (a, p) => return Err((Tensor::from_primitive(a), Tensor::from_primitive(p))),
        };
        let added = match (
            (&mut acc_p as &mut dyn Any).downcast_mut::<FlexTensor>(),
            (&part_p as &dyn Any).downcast_ref::<FlexTensor>(),
        ) {
            (Some(acc), Some(part)) => add(acc, at, part),
            _ => false,
        };
        let (acc, part) = (TensorPrimitive::Float(acc_p), TensorPrimitive::Float(part_p));
        match added {
            true => Ok(Tensor::from_primitive(acc)),
            false => Err((Tensor::from_primitive(acc), Tensor::from_primitive(part))),
        }
    }

    fn add(acc: &mut FlexTensor, at: usize, part: &FlexTensor) -> bool {
        fn typed<E: burn::tensor::Element + bytemuck::Pod + std::ops::AddAssign>(
            acc: &mut FlexTensor,
            at: usize,
            part: &FlexTensor,
        ) -> bool {
            let n = acc.layout().num_elements();
            if acc.layout().contiguous_offsets() != Some((0, n)) {
                return false;
            }
            let Some(src) = part.as_slice::<E>() else { return false };
            let Some(dst) = acc.try_storage_mut::<E>() else { return false };
            let Some(dst) = dst[..n].get_mut(at..at + src.len()) else { return false };
            for (a, &b) in dst.iter_mut().zip(src) {
                *a += b;
            }
            true
        }
        if acc.dtype() != part.dtype() {
            return false;
        }
        match acc.dtype() {
            DType::F32 => typed::<f32>(acc, at, part),
            DType::F64 => typed::<f64>(acc, at, part),
            _ => false,
        }
    }
}

/// Autodiff backends that accept a value together with its gradients, computed ahead
/// ([`chunked_cross_entropy`]'s loss). Implemented for every [`Autodiff`] backend.
pub trait LossBackend: AutodiffBackend {
    /// The scalar `value` (`[1]`) as a function of `inputs` whose gradient with respect to
    /// `inputs[i]` is `grads[i]` (same shape): backward adds `g · grads[i]` to `inputs[i]`'s
    /// gradient, `g` being the output's incoming gradient (exactly `grads[i]` when `g` is 1).
    /// An input that is not tracked gets nothing.
    fn precomputed_loss(
        value: FloatTensor<Self::InnerBackend>,
        inputs: [FloatTensor<Self>; 2],
        grads: [FloatTensor<Self::InnerBackend>; 2],
    ) -> FloatTensor<Self>;

    /// A tracked `[1]` zero that depends on `input` alone: its backward runs `gradient` and
    /// adds `g · gradient()` to `input`'s gradient, `g` being this output's incoming gradient.
    /// Backward runs a node after every node deeper than it, so this one runs beside
    /// `input`'s other direct uses (for a model's head tied to its embedding: after every
    /// layer, beside the lookup), and the gradient exists only from then on. `None` when
    /// `input` is not tracked (`gradient` is dropped unrun).
    ///
    /// Feed the result to [`precomputed_loss`](Self::precomputed_loss) with a gradient of
    /// one: the loss's incoming gradient then reaches `gradient`.
    fn deferred_gradient(
        input: FloatTensor<Self>,
        gradient: DeferredGradient<Self::InnerBackend>,
    ) -> Option<FloatTensor<Self>>;
}

/// A gradient made when backward needs it ([`LossBackend::deferred_gradient`]): a closure run
/// at most once, on the inner backend.
pub struct DeferredGradient<B: Backend>(Arc<Mutex<Option<DeferredFn<B>>>>);

/// The closure of a [`DeferredGradient`].
type DeferredFn<B> = Box<dyn FnOnce() -> FloatTensor<B> + Send>;

impl<B: Backend> DeferredGradient<B> {
    /// The gradient `make()` returns, made when backward reaches it.
    pub fn new(make: impl FnOnce() -> FloatTensor<B> + Send + 'static) -> Self {
        Self(Arc::new(Mutex::new(Some(Box::new(make)))))
    }

    /// Makes the gradient; `None` when it was made already.
    fn take(&self) -> Option<FloatTensor<B>> {
        let make = self.0.lock().unwrap_or_else(|poisoned| poisoned.into_inner()).take();
        make.map(|make| make())
    }
}

impl<B: Backend> Clone for DeferredGradient<B> {
    fn clone(&self) -> Self {
        Self(self.0.clone())
    }
}

impl<B: Backend> std::fmt::Debug for DeferredGradient<B> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("DeferredGradient")
    }
}

/// Backward of [`LossBackend::deferred_gradient`]: makes the gradient, scales it by the
/// incoming one and registers it on the input.
#[derive(Debug)]
struct Deferred;

impl<B: Backend> Backward<B, 1> for Deferred {
    type State = DeferredGradient<B>;

    fn backward(self, ops: Ops<Self::State, 1>, grads: &mut Gradients, _checkpointer: &mut Checkpointer) {
        let g = grads.consume::<B>(&ops.node);
        let [Some(parent)] = &ops.parents else { return };
        let Some(grad) = ops.state.take() else { return };
        grads.register::<B>(parent.id, scaled::<B>(grad, &g));
    }
}

/// `grad · incoming`, `incoming` a one-element gradient, on the device: the incoming gradient
/// is not read, so the backward never waits for the device (a read here was a host sync per
/// micro-batch). The product is the one `grad · g` with `g` read gave: the same `f32` (or
/// `grad`'s dtype) multiplication, element by element.
fn scaled<B: Backend>(grad: FloatTensor<B>, incoming: &FloatTensor<B>) -> FloatTensor<B> {
    let dtype = grad.dtype();
    let mut g = B::float_reshape(incoming.clone(), Shape::from(vec![1usize; grad.shape().num_dims()]));
    if g.dtype() != dtype {
        g = B::float_cast(g, dtype.into());
    }
    B::float_mul(grad, g)
}

/// Backward of [`LossBackend::precomputed_loss`]: its state is the gradients.
#[derive(Debug)]
struct PrecomputedLoss;

impl<B: Backend> Backward<B, 2> for PrecomputedLoss {
    type State = [Option<FloatTensor<B>>; 2];

    fn backward(self, ops: Ops<Self::State, 2>, grads: &mut Gradients, _checkpointer: &mut Checkpointer) {
        let g = grads.consume::<B>(&ops.node);
        for (parent, grad) in ops.parents.iter().zip(ops.state) {
            let (Some(parent), Some(grad)) = (parent, grad) else { continue };
            grads.register::<B>(parent.id, scaled::<B>(grad, &g));
        }
    }
}

impl<B: Backend, C: CheckpointStrategy> LossBackend for Autodiff<B, C> {
    fn precomputed_loss(
        value: FloatTensor<B>,
        inputs: [FloatTensor<Self>; 2],
        grads: [FloatTensor<B>; 2],
    ) -> FloatTensor<Self> {
        let [x, y] = inputs;
        let [dx, dy] = grads;
        let state = [x.is_tracked().then_some(dx), y.is_tracked().then_some(dy)];
        match PrecomputedLoss.prepare::<C>([x.node, y.node]).compute_bound().stateful() {
            OpsKind::Tracked(prep) => prep.finish(state, value),
            OpsKind::UnTracked(prep) => prep.finish(value),
        }
    }

    fn deferred_gradient(
        input: FloatTensor<Self>,
        gradient: DeferredGradient<B>,
    ) -> Option<FloatTensor<Self>> {
        if !input.is_tracked() {
            return None;
        }
        let device = B::float_device(&input.primitive);
        let zero = B::float_zeros([1].into(), &device, input.primitive.dtype().into());
        match Deferred.prepare::<C>([input.node]).compute_bound().stateful() {
            OpsKind::Tracked(prep) => Some(prep.finish(gradient, zero)),
            OpsKind::UnTracked(prep) => Some(prep.finish(zero)),
        }
    }
}

/// Vocabulary rows of the head per product in [`chunked_cross_entropy`] on a CPU backend
/// (16 MiB of f32 at hidden size 1024).
const HEAD_BLOCK_ROWS: usize = 4096;

/// Vocabulary rows of the head per product in [`chunked_cross_entropy`] on backend `B`, for a
/// vocabulary of `vocab` entries.
///
/// - **CPU backends (Flex, NdArray): 4 096.** They copy each matmul operand, so a
///   `[vocab, hidden]` product and its copies would be several head-sized buffers at once
///   (594 MiB each for Qwen3-0.6B); 4 096-row blocks keep every product small.
/// - **Every other backend (GPUs): the whole vocabulary.** A GPU matmul copies nothing, and
///   one `[chunk, hidden] × [hidden, vocab]` product per chunk (and one for each gradient)
///   keeps the device busy, where Qwen3's 151 936 entries in 4 096-row blocks made 38 small
///   products, each with its own launches, per chunk and per gradient.
///
/// Each logit is one dot product over `hidden` whatever the blocking; the CPU backends'
/// results (which the fixture tests pin bit for bit) do not depend on this choice.
///
/// ```
/// use burn::backend::{Flex, NdArray};
/// use qwen3_burn::train::head_block_rows;
///
/// assert_eq!(head_block_rows::<Flex>(151_936), 4096);
/// assert_eq!(head_block_rows::<NdArray>(151_936), 4096);
/// assert_eq!(head_block_rows::<Flex>(1000), 1000);
/// ```
pub fn head_block_rows<B: Backend>(vocab: usize) -> usize {
    let vocab = vocab.max(1);
    if on_cpu_backend::<B>() { HEAD_BLOCK_ROWS.min(vocab) } else { vocab }
}

/// Whether `B` is one of Burn's CPU backends (Flex, NdArray), by its float tensor type.
fn on_cpu_backend<B: Backend>() -> bool {
    floats_are::<B, burn::backend::flex::FlexTensor>()
        || floats_are::<B, burn::backend::ndarray::NdArrayTensor>()
}

/// Whether `B`'s float tensor primitive is `T`.
fn floats_are<B: Backend, T: 'static>() -> bool {
    std::any::TypeId::of::<B::FloatTensorPrimitive>() == std::any::TypeId::of::<T>()
}

/// A chunk size for [`chunked_cross_entropy`] that keeps each `[chunk, vocab]` f32 piece
/// near `bytes` (at least one row).
pub fn loss_chunk_rows(vocab: usize, bytes: usize) -> usize {
    (bytes / (4 * vocab.max(1))).max(1)
}

/// Splits token rows `[rows, seq + 1]` into inputs `[:, :-1]` and labels `[:, 1:]`.
pub fn inputs_and_labels<B: Backend>(tokens: Tensor<B, 2, Int>) -> (Tensor<B, 2, Int>, Tensor<B, 2, Int>) {
    let [_, t1] = tokens.dims();
    (tokens.clone().narrow(1, 0, t1 - 1), tokens.narrow(1, 1, t1 - 1))
}

/// Fixed token batches: `tokens` `[steps, rows, seq + 1]` (the fixtures' `batches.safetensors`).
#[derive(Debug, Clone, PartialEq)]
pub struct Batches {
    /// Number of steps.
    pub steps: usize,
    /// Rows of the global batch per step.
    pub rows: usize,
    /// Tokens per row (`seq + 1`).
    pub width: usize,
    /// Row-major values.
    pub tokens: Vec<i64>,
}

impl Batches {
    /// Reads tensor `tokens` from a safetensors file.
    pub fn load(path: impl AsRef<Path>) -> Result<Self> {
        let path = path.as_ref();
        let file = SafetensorsFile::open(path)?;
        let (tokens, shape) = file.read_i64("tokens")?;
        let [steps, rows, width] = shape[..] else {
            return Err(Qwen3Error::Shape {
                path: path.to_path_buf(),
                name: "tokens".into(),
                expected: vec![0, 0, 0],
                got: shape,
            });
        };
        if width < 2 {
            return Err(Qwen3Error::Shape {
                path: path.to_path_buf(),
                name: "tokens".into(),
                expected: vec![steps, rows, 2],
                got: shape.clone(),
            });
        }
        Ok(Self { steps, rows, width, tokens })
    }

    /// Largest token id.
    pub fn max_token(&self) -> i64 {
        self.tokens.iter().copied().max().unwrap_or(0)
    }

    /// Smallest token id.
    pub fn min_token(&self) -> i64 {
        self.tokens.iter().copied().min().unwrap_or(0)
    }

    /// Rows `rows` of step `step` as a `[rows.len(), width]` tensor.
    pub fn rows<B: Backend>(
        &self,
        step: usize,
        rows: std::ops::Range<usize>,
        device: &B::Device,
    ) -> Tensor<B, 2, Int> {
        let start = (step * self.rows + rows.start) * self.width;
        let end = (step * self.rows + rows.end) * self.width;
        let data = TensorData::new(self.tokens[start..end].to_vec(), [rows.len(), self.width]);
        Tensor::from_data(data, device)
    }
}

#[cfg(test)]
mod tests {
    use burn::backend::{Flex, NdArray};
    use burn::tensor::{Distribution, Tensor, TensorPrimitive};

    use super::{add_rows, scaled};

    /// `scaled` multiplies by the one-element incoming gradient on the device; the product is
    /// bit for bit the one of `mul_scalar` with that gradient read first (what the backward did
    /// before it stopped reading), on both CPU backends, for the incoming gradients a loop makes
    /// (1, and 1 / micro-batches).
    #[test]
    fn scaling_by_the_incoming_gradient_on_the_device_matches_the_read_scalar_bit_for_bit() {
        fn check<B: burn::tensor::backend::Backend>() {
            let device = Default::default();
            for g in [1.0f32, 0.5, 1.0 / 3.0, 0.25, 1.0 / 7.0] {
                let grad = Tensor::<B, 2>::random([37, 19], Distribution::Normal(0.0, 3.0), &device);
                let incoming = Tensor::<B, 1>::from_floats([g], &device);
                let want = grad.clone().mul_scalar(g).into_data();
                let got = Tensor::<B, 2>::from_primitive(TensorPrimitive::Float(scaled::<B>(
                    grad.into_primitive().tensor(),
                    &incoming.into_primitive().tensor(),
                )))
                .into_data();
                let (want, got) = (want.to_vec::<f32>().unwrap(), got.to_vec::<f32>().unwrap());
                assert!(want.iter().zip(&got).all(|(a, b)| a.to_bits() == b.to_bits()), "g = {g}");
            }
        }
        check::<Flex>();
        check::<NdArray>();
    }

    fn bytes_at(t: &Tensor<Flex, 2>) -> usize {
        match t.clone().into_primitive() {
            TensorPrimitive::Float(f) => f.bytes().as_ptr() as usize,
            TensorPrimitive::QFloat(_) => unreachable!("a float tensor"),
        }
    }

    /// On Flex, rows are added into the accumulator's own memory when it has one owner, with
    /// the same bits as Burn's `slice` + `slice_assign` (NdArray's, and Flex's own); when
    /// another handle holds the accumulator, that one keeps its values.
    #[test]
    fn rows_added_in_place_on_flex_with_the_bits_of_slice_assign() {
        let device = Default::default();
        let acc = Tensor::<Flex, 2>::random([9, 4], Distribution::Normal(0.0, 1.0), &device);
        let part = Tensor::<Flex, 2>::random([3, 4], Distribution::Normal(0.0, 1.0), &device);
        let want = acc.clone().slice_assign([2..5, 0..4], acc.clone().slice([2..5, 0..4]) + part.clone());
        let nd = |t: &Tensor<Flex, 2>| Tensor::<NdArray, 2>::from_data(t.to_data(), &Default::default());
        let want_nd = add_rows(nd(&acc), 2..5, nd(&part));
        assert_eq!(want.to_data(), want_nd.to_data(), "NdArray and Flex agree");

        // Shared: the other handle keeps its values, the result is right.
        let held = acc.clone();
        let shared = add_rows(acc, 2..5, part.clone());
        assert_eq!(shared.to_data(), want.to_data());
        assert_ne!(held.to_data(), want.to_data(), "the other handle is not written through");

        // Sole owner: written where it lies.
        drop(held);
        let at = bytes_at(&shared);
        let twice = add_rows(shared, 6..9, part.clone());
        assert_eq!(bytes_at(&twice), at, "an unshared accumulator is written in place");
        let want_twice = want.clone().slice_assign([6..9, 0..4], want.slice([6..9, 0..4]) + part);
        assert_eq!(twice.to_data(), want_twice.to_data());
    }

    /// A deferred gradient is made after every node deeper than it (here: after the deferred
    /// gradient of a value three ops further from the leaf), once, scaled by what reaches it.
    #[test]
    fn a_deferred_gradient_is_made_after_deeper_nodes_and_scaled_by_the_incoming_gradient() {
        use std::sync::{Arc, Mutex};

        use burn::backend::Autodiff;

        use super::{DeferredGradient, LossBackend};

        type A = Autodiff<NdArray>;
        let device = Default::default();
        for scale in [1.0, 2.0] {
            let w = Tensor::<A, 1>::from_floats([1.0, 2.0, 3.0], &device).require_grad();
            // h = 3 · (2w + 1): ∂h/∂w = 6 per element, three ops deeper than w.
            let h = w.clone().mul_scalar(2.0).add_scalar(1.0).mul_scalar(3.0);
            let made = Arc::new(Mutex::new(Vec::new()));
            let deferred = |name: &'static str, value: f32| {
                let made = made.clone();
                DeferredGradient::<NdArray>::new(move || {
                    made.lock().unwrap().push(name);
                    Tensor::<NdArray, 1>::full([3], value, &device).into_primitive().tensor()
                })
            };
            let prim = |t: Tensor<A, 1>| t.into_primitive().tensor();
            let shallow = A::deferred_gradient(prim(w.clone()), deferred("w", 10.0)).expect("w is tracked");
            let deep = A::deferred_gradient(prim(h), deferred("h", 1.0)).expect("h is tracked");
            let half = || Tensor::<NdArray, 1>::full([1], 0.5, &device).into_primitive().tensor();
            let value = Tensor::<NdArray, 1>::zeros([1], &device).into_primitive().tensor();
            let loss = A::precomputed_loss(value, [deep, shallow], [half(), half()]);
            let loss = Tensor::<A, 1>::from_primitive(TensorPrimitive::Float(loss)).mul_scalar(scale);
            let grads = loss.backward();
            assert_eq!(*made.lock().unwrap(), ["h", "w"], "the deeper node's gradient is made first");
            // scale · 0.5 · (10 + 6 · 1)
            let want = (scale * 0.5 * 16.0) as f32;
            let got = w.grad(&grads).expect("w has a gradient").into_data();
            got.assert_eq(&burn::tensor::TensorData::from([want; 3]), true);
        }
        // An untracked input takes no deferred gradient, and the closure is dropped unrun.
        let x = Tensor::<A, 1>::ones([3], &device).into_primitive().tensor();
        let unrun =
            DeferredGradient::<NdArray>::new(|| unreachable!("an untracked input's gradient is never made"));
        assert!(A::deferred_gradient(x, unrun).is_none());
    }
}
