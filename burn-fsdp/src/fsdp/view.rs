//! The parameters of a gathered unit: each one cut out of the unit's all-gathered buffer by a
//! differentiable op whose backward writes into **one** gradient buffer per unit.
//!
//! Built from Burn's own ops (`reshape` → `narrow` → `reshape` → `narrow`), a parameter's
//! view would hand backward a zero-filled buffer of the whole gathered unit per parameter
//! (the `narrow` backward), summed one after another: for a decoder layer of 11 parameters,
//! 11 unit-sized allocations and 10 unit-sized additions per rank, where one buffer is enough.
//! Here the first view whose backward runs allocates the gathered buffer's gradient and every
//! other view writes its piece into that same buffer in place (FSDP2's reduce-scatter copy-in).
//!
//! The values are unchanged: each element of the buffer receives its parameter's gradient
//! (where the narrow path added it to zero).
//!
//! What backward keeps follows the unit's `reshard_after_forward`. A resharded unit's views
//! are memory-bound (like Burn's `narrow`): under `BalancedCheckpointing` a view that backward
//! needs is recomputed from the re-gathered buffer instead of being kept. A unit that stays
//! gathered (the root, by default) gets compute-bound views: a view that backward needs is
//! kept itself, and the gathered buffer is freed as soon as its views are cut. (A memory-bound
//! op makes Burn keep its parents until backward starts, in case a recomputation needs them:
//! for Qwen3-0.6B's root unit that was a second 594 MiB copy of the embedding per rank, held
//! from the embedding lookup to the end of forward and, for the final norm's weight, into
//! backward.)

use std::marker::PhantomData;
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};

use burn::backend::Autodiff;
use burn::backend::autodiff::NodeId;
use burn::backend::autodiff::checkpoint::base::Checkpointer;
use burn::backend::autodiff::checkpoint::retro_forward::RetroForward;
use burn::backend::autodiff::checkpoint::state::BackwardStates;
use burn::backend::autodiff::checkpoint::strategy::CheckpointStrategy;
use burn::backend::autodiff::grads::Gradients;
use burn::backend::autodiff::ops::{Backward, Ops, OpsKind};
use burn::tensor::backend::Backend;
use burn::tensor::ops::FloatTensor;
use burn::tensor::{Shape, Slice, TensorMetadata};

use crate::fsdp::param::ShardedParam;

/// The gradient buffer shared by the views of one gather (one forward of one unit).
#[derive(Debug)]
pub struct ViewGroup {
    world: usize,
    unit_len: usize,
    /// Whether the gathered buffer is recomputed (re-gathered) in backward: then the views
    /// are memory-bound and recomputed from it, else compute-bound and kept when needed.
    recompute: bool,
    /// Whether a view's backward has registered the gathered buffer's gradient yet.
    started: AtomicBool,
}

impl ViewGroup {
    /// A group for a gathered buffer of `world` rows of `unit_len` elements; `recompute`:
    /// whether that buffer is re-gathered in backward (`reshard_after_forward`).
    pub fn new(world: usize, unit_len: usize, recompute: bool) -> Arc<Self> {
        Arc::new(Self { world, unit_len, recompute, started: AtomicBool::new(false) })
    }
}

/// Where one parameter lies in its unit's gathered buffer.
#[derive(Debug, Clone)]
pub struct ParamView {
    /// Offset of the parameter's shard in each rank's flat shard.
    pub offset: usize,
    /// The sharded parameter (its shape, rows per rank and padding).
    pub param: ShardedParam,
}

impl ParamView {
    /// The view of `param` at `offset` of its unit's flat shard.
    pub fn of(param: &ShardedParam, offset: usize) -> Self {
        Self { offset, param: param.clone() }
    }

    fn padded_shape(&self, world: usize) -> Shape {
        let mut padded = self.param.global_shape.clone();
        if let Some(d0) = padded.first_mut() {
            *d0 = self.param.rows_per_rank * world;
        }
        Shape::from(padded)
    }

    /// Where rank `r`'s shard of the parameter lies in the flat gathered buffer.
    fn range(&self, r: usize, unit_len: usize) -> [Slice; 1] {
        let start = r * unit_len + self.offset;
        [Slice::from(start..start + self.param.shard_numel())]
    }

    /// The parameter's full value from the flat gathered buffer (`[world · unit_len]`).
    ///
    /// Each rank's rows are written into one buffer of the parameter's (padded) shape, a
    /// rank at a time: `reshape` and `cat` copy on some backends (NdArray: a `cat` is two
    /// copies of its result), so the gathered buffer is never reshaped and nothing of the
    /// parameter's full size is made but the result (for Qwen3-0.6B's embedding, 594 MiB per
    /// rank, where the `cat` path made three such buffers at once).
    /// On NdArray the pieces are copied straight from the gathered buffer's memory, once;
    /// elsewhere with the backend's ops.
    pub fn cut<B: Backend>(&self, gathered: FloatTensor<B>, world: usize, unit_len: usize) -> FloatTensor<B> {
        match host::cut::<B>(self, &gathered, world, unit_len) {
            Some(full) => full,
            None => self.cut_generic::<B>(gathered, world, unit_len),
        }
    }

    /// [`Self::cut`] with the backend's ops: any backend.
    fn cut_generic<B: Backend>(
        &self,
        gathered: FloatTensor<B>,
        world: usize,
        unit_len: usize,
    ) -> FloatTensor<B> {
        let rows = self.param.rows_per_rank;
        let piece_shape = Shape::from(self.param.shard_shape());
        let padded = self.padded_shape(world);
        let mut full = B::float_zeros(padded, &B::float_device(&gathered), gathered.dtype().into());
        for r in 0..world {
            let piece = B::float_slice(gathered.clone(), &self.range(r, unit_len));
            let piece = if piece_shape.num_dims() == 1 {
                piece
            } else {
                B::float_reshape(piece, piece_shape.clone())
            };
            full = B::float_slice_assign(full, &[Slice::from(r * rows..(r + 1) * rows)], piece);
        }
        drop(gathered);
        let d0 = self.param.global_shape.first().copied().unwrap_or(1);
        if rows * world == d0 || self.param.global_shape.is_empty() {
            full
        } else {
            B::float_slice(full, &[Slice::from(0..d0)])
        }
    }

    /// Writes `grad` (the parameter's gradient, `global_shape`) into its places in `buffer`
    /// (`[world · unit_len]`, or a fresh zero buffer when `None`).
    fn write_into<B: Backend>(
        &self,
        grad: FloatTensor<B>,
        buffer: Option<FloatTensor<B>>,
        world: usize,
        unit_len: usize,
    ) -> FloatTensor<B> {
        match host::write_into::<B>(self, grad, buffer, world, unit_len) {
            Ok(written) => written,
            Err((grad, buffer)) => self.write_generic::<B>(grad, buffer, world, unit_len),
        }
    }

    /// [`Self::write_into`] with the backend's ops: any backend.
    fn write_generic<B: Backend>(
        &self,
        grad: FloatTensor<B>,
        buffer: Option<FloatTensor<B>>,
        world: usize,
        unit_len: usize,
    ) -> FloatTensor<B> {
        let device = B::float_device(&grad);
        let dtype = grad.dtype();
        let mut buffer = match buffer {
            Some(b) => b,
            None => B::float_zeros(Shape::new([world * unit_len]), &device, dtype.into()),
        };
        for r in 0..world {
            // Rank r's rows of the parameter; rows past the end are padding (zero gradient).
            let rows = self.param.rows_of(r);
            if rows.is_empty() {
                break;
            }
            let have = rows.len() * self.param.row_numel();
            // Flattened one rank's rows at a time: a reshape may copy (NdArray), and a copy
            // of 1/world of the gradient is all this then holds at once.
            // (All of the gradient's rows — one rank — need no slice, which copies on NdArray.)
            let piece = match Some(&rows.len()) == self.param.global_shape.first() {
                true => grad.clone(),
                false => B::float_slice(grad.clone(), &[Slice::from(rows)]),
            };
            let piece = if self.param.global_shape.len() == 1 {
                piece
            } else {
                B::float_reshape(piece, Shape::new([have]))
            };
            let start = r * unit_len + self.offset;
            let place = [Slice::from(start..start + have)];
            // The parameter's place in the buffer is still zero: each view's backward runs
            // once per gather (Burn sums a view's uses first) and writes only its own place.
            // So the piece is written, not added (FSDP2's copy-in), and the buffer is the
            // assignment's only owner, which backends that can write in place do.
            buffer = B::float_slice_assign(buffer, &place, piece);
        }
        buffer
    }

    /// Rank `r`'s rows of the parameter in its shard (`0..rows_per_rank` less any padding),
    /// as a range of elements of the parameter's flattened value.
    #[cfg_attr(not(feature = "cpu"), allow(dead_code))]
    fn elements_of(&self, r: usize) -> std::ops::Range<usize> {
        let (rows, row) = (self.param.rows_of(r), self.param.row_numel());
        rows.start * row..rows.end * row
    }
}

/// The views on the CPU backends, NdArray and Flex. Their generic path is slow there: NdArray's
/// `slice`, `reshape` and `cat` each copy their result, so [`ParamView::cut`] would cost a zero
/// fill and three copies of the parameter (slice, reshape, assign), and its backward as many;
/// Flex's `slice_assign` copies its whole destination on every call (its copy-on-write sees
/// the destination shared with itself), so writing a unit's gradients that way costs one copy
/// of the unit's buffer per parameter and rank. On NdArray and Flex tensors of `f32`/`f64` in
/// standard layout the pieces are copied once, straight between the buffers' memory, and the
/// result is handed to the backend without a further copy (`from_data` keeps an owned `Vec`);
/// the gradient buffer is written in place when nothing else holds it. Every other backend,
/// dtype or layout takes the generic path; both give the same bits (the tests run the views on
/// both paths against Burn's own narrow path). Behind the `cpu` feature.
#[cfg(feature = "cpu")]
mod host {
    use std::any::Any;

    use burn::backend::flex::FlexTensor;
    use burn::backend::ndarray::{NdArrayTensor, SharedArray};
    use burn::tensor::backend::Backend;
    use burn::tensor::ops::FloatTensor;
    use burn::tensor::{DType, Element, TensorData};

    use super::ParamView;
    use crate::downcast::{cast, must};

    #[cfg(test)]
    thread_local! {
        /// Tests set this to send this thread's views down the generic path.
        pub(super) static GENERIC_ONLY: std::cell::Cell<bool> = const { std::cell::Cell::new(false) };
    }

    /// Whether the host paths may be taken (always, outside tests).
    fn enabled() -> bool {
        #[cfg(test)]
        if GENERIC_ONLY.with(|g| g.get()) {
            return false;
        }
        true
    }

    /// A tensor's elements in logical order, borrowed from its memory.
    enum Elements<'a> {
        F32(&'a [f32]),
        F64(&'a [f64]),
    }

    /// The elements of an NdArray or Flex tensor of `f32`/`f64` in standard layout, or `None`.
    fn elements<B: Backend>(t: &FloatTensor<B>) -> Option<Elements<'_>> {
        let any = t as &dyn Any;
        if let Some(t) = any.downcast_ref::<NdArrayTensor>() {
            return match t {
                NdArrayTensor::F32(s) => s.view().to_slice().map(Elements::F32),
                NdArrayTensor::F64(s) => s.view().to_slice().map(Elements::F64),
                _ => None,
            };
        }
        let t = any.downcast_ref::<FlexTensor>()?;
        match t.dtype() {
            DType::F32 => t.as_slice::<f32>().map(Elements::F32),
            DType::F64 => t.as_slice::<f64>().map(Elements::F64),
            _ => None,
        }
    }

    /// The parameter's value out of the gathered buffer's memory, or `None` (generic path).
    pub(super) fn cut<B: Backend>(
        view: &ParamView,
        gathered: &FloatTensor<B>,
        world: usize,
        unit_len: usize,
    ) -> Option<FloatTensor<B>> {
        if !enabled() {
            return None;
        }
        let Some(flex) = (gathered as &dyn Any).downcast_ref::<FlexTensor>() else {
            return cut_copied::<B>(view, gathered, world, unit_len);
        };
        // B is Flex: its float tensors are FlexTensor.
        const FLEX: &str = "the gathered buffer is a FlexTensor, so B's float tensor is";
        let cut = shared::cut(view, flex, world, unit_len, || {
            cut_copied::<burn::backend::Flex>(view, flex, world, unit_len)
        })?;
        Some(must::<FlexTensor, FloatTensor<B>>(cut, FLEX))
    }

    /// The parameter's value copied out of the gathered buffer's memory, or `None`.
    fn cut_copied<B: Backend>(
        view: &ParamView,
        gathered: &FloatTensor<B>,
        world: usize,
        unit_len: usize,
    ) -> Option<FloatTensor<B>> {
        fn pieces<E: Copy>(view: &ParamView, src: &[E], world: usize, unit_len: usize) -> Vec<E> {
            let mut out = Vec::with_capacity(view.param.numel().max(1));
            for r in 0..world {
                let have = view.elements_of(r).len();
                let start = r * unit_len + view.offset;
                out.extend_from_slice(&src[start..start + have]);
            }
            out
        }
        let shape = view.param.global_shape.clone();
        let data = match elements::<B>(gathered)? {
            Elements::F32(s) => TensorData::new(pieces(view, s, world, unit_len), shape),
            Elements::F64(s) => TensorData::new(pieces(view, s, world, unit_len), shape),
        };
        Some(B::float_from_data(data, &B::float_device(gathered)))
    }

    /// One cut per gathered buffer for all the ranks of a process. In-process ranks on Flex
    /// receive the same all-gathered buffer (one allocation, shared read-only: see
    /// `LocalGroup`'s all-gather), so their cuts of a parameter are equal; the first rank to
    /// cut it makes the copy and the others share it (Flex copies a shared buffer before any
    /// write, so no rank sees another's changes). For Qwen3-0.6B at W = 4 that is one
    /// 594 MiB embedding per process instead of one per rank.
    ///
    /// The registry holds only weak references: a cut lives as long as some rank holds it,
    /// and a later gather (a new buffer) is cut afresh. An entry is found by the address of
    /// the gathered buffer's allocation, which cannot be reused while the entry's weak
    /// reference to it exists.
    mod shared {
        use std::sync::{Arc, Mutex, Weak};

        use burn::backend::flex::{FlexTensor, Layout};
        use burn::tensor::{Bytes, DType};

        use super::ParamView;

        struct Entry {
            gathered: Weak<Bytes>,
            /// The gathered tensor's first element in its buffer, and the cut's place in it.
            at: (usize, usize, usize, usize),
            shape: Vec<usize>,
            dtype: DType,
            cut: Weak<Bytes>,
        }

        static CUTS: Mutex<Vec<Entry>> = Mutex::new(Vec::new());

        /// `view`'s cut of `gathered`: one another rank made and still holds, or `make()`'s.
        pub(super) fn cut(
            view: &ParamView,
            gathered: &FlexTensor,
            world: usize,
            unit_len: usize,
            make: impl FnOnce() -> Option<FlexTensor>,
        ) -> Option<FlexTensor> {
            let source = gathered.data_arc();
            let at = (gathered.layout().start_offset(), view.offset, world, unit_len);
            let shape = view.param.global_shape.clone();
            // Held while cutting, so that ranks cutting the same buffer at once wait for the
            // first one's copy instead of making their own.
            let mut cuts = CUTS.lock().unwrap_or_else(|p| p.into_inner());
            cuts.retain(|e| e.gathered.strong_count() > 0 && e.cut.strong_count() > 0);
            let found = cuts.iter().find(|e| {
                std::ptr::eq(e.gathered.as_ptr(), Arc::as_ptr(&source))
                    && e.at == at
                    && e.shape == shape
                    && e.dtype == gathered.dtype()
            });
            if let Some(cut) = found.and_then(|e| e.cut.upgrade()) {
                return Some(FlexTensor::from_arc(cut, Layout::contiguous(shape.into()), gathered.dtype()));
            }
            let made = make()?;
            if made.layout().contiguous_offsets() == Some((0, made.layout().num_elements())) {
                cuts.push(Entry {
                    gathered: Arc::downgrade(&source),
                    at,
                    shape,
                    dtype: made.dtype(),
                    cut: Arc::downgrade(&made.data_arc()),
                });
            }
            Some(made)
        }
    }

    /// A gradient and the gradient buffer so far, handed back for the generic path.
    type Generic<B> = (FloatTensor<B>, Option<FloatTensor<B>>);

    /// [`ParamView::write_into`](super::ParamView) on NdArray or Flex, or its arguments back.
    pub(super) fn write_into<B: Backend>(
        view: &ParamView,
        grad: FloatTensor<B>,
        buffer: Option<FloatTensor<B>>,
        world: usize,
        unit_len: usize,
    ) -> Result<FloatTensor<B>, Generic<B>> {
        if !enabled() {
            return Err((grad, buffer));
        }
        let grad = match cast::<FloatTensor<B>, FlexTensor>(grad) {
            Ok(g) => {
                // B is Flex: its float tensors (the buffer, the result) are FlexTensor.
                const FLEX: &str = "the gradient is a FlexTensor, so B's float tensor is";
                let buffer = buffer.map(|b| must::<FloatTensor<B>, FlexTensor>(b, FLEX));
                return match flex_write(view, &g, buffer, world, unit_len) {
                    Ok(written) => Ok(must(written, FLEX)),
                    Err(buffer) => Err((must(g, FLEX), buffer.map(|b| must(b, FLEX)))),
                };
            }
            Err(grad) => grad,
        };
        let fits = match (
            (&grad as &dyn Any).downcast_ref(),
            buffer.as_ref().map(|b| (b as &dyn Any).downcast_ref()),
        ) {
            (Some(NdArrayTensor::F32(g)), None | Some(Some(NdArrayTensor::F32(_)))) => {
                g.view().is_standard_layout()
            }
            (Some(NdArrayTensor::F64(g)), None | Some(Some(NdArrayTensor::F64(_)))) => {
                g.view().is_standard_layout()
            }
            _ => false,
        };
        if !fits {
            return Err((grad, buffer));
        }
        let grad: NdArrayTensor = must(grad, "checked above: an NdArray gradient");
        let buffer: Option<NdArrayTensor> = buffer.map(|b| must(b, "checked above: an NdArray buffer"));
        // The gradient's rows written into the buffer (or a fresh one), as tensor `$dtype`.
        macro_rules! placed {
            ($dtype:ident, $grad:expr, $buffer:expr, $zero:expr) => {{
                let src = $grad.view();
                let src = src.as_slice().expect("checked above: standard layout");
                let mut buffer =
                    $buffer.unwrap_or_else(|| SharedArray::from_elem(vec![world * unit_len], $zero));
                place(view, src, buffer.as_slice_mut().expect("a flat buffer is contiguous"), world);
                NdArrayTensor::$dtype(buffer.into())
            }};
        }
        let written = match (grad, buffer) {
            (NdArrayTensor::F32(g), None) => placed!(F32, g, None, 0f32),
            (NdArrayTensor::F32(g), Some(NdArrayTensor::F32(b))) => {
                placed!(F32, g, Some(b.into_owned()), 0f32)
            }
            (NdArrayTensor::F64(g), None) => placed!(F64, g, None, 0f64),
            (NdArrayTensor::F64(g), Some(NdArrayTensor::F64(b))) => {
                placed!(F64, g, Some(b.into_owned()), 0f64)
            }
            _ => unreachable!("checked above: an f32 or f64 gradient and buffer of its dtype"),
        };
        Ok(must(written, "checked above: B's float tensor is NdArrayTensor"))
    }

    /// [`write_into`] on Flex: the gradient (standard layout) written into the buffer's memory,
    /// in place when the buffer is not shared (copy-on-write otherwise), or the buffer back.
    fn flex_write(
        view: &ParamView,
        grad: &FlexTensor,
        buffer: Option<FlexTensor>,
        world: usize,
        unit_len: usize,
    ) -> Result<FlexTensor, Option<FlexTensor>> {
        fn typed<E: Element + bytemuck::Pod>(
            view: &ParamView,
            src: &[E],
            buffer: Option<FlexTensor>,
            world: usize,
            unit_len: usize,
        ) -> Result<FlexTensor, Option<FlexTensor>> {
            let n = world * unit_len;
            let mut buffer = unit_buffer::<E>(buffer, n)?;
            place(view, src, &mut buffer.storage_mut::<E>()[..n], world);
            Ok(buffer)
        }
        match elements::<burn::backend::Flex>(grad) {
            Some(Elements::F32(src)) => typed(view, src, buffer, world, unit_len),
            Some(Elements::F64(src)) => typed(view, src, buffer, world, unit_len),
            None => flex_write_transposed(view, grad, buffer, world, unit_len),
        }
    }

    /// The unit's gradient buffer for [`flex_write`]: `buffer`, or a fresh zero one, when it
    /// is a flat buffer of `n` elements of `E` from the start of its memory (as made here or
    /// by an earlier view of the unit); else the buffer back, for the generic path.
    fn unit_buffer<E: Element>(
        buffer: Option<FlexTensor>,
        n: usize,
    ) -> Result<FlexTensor, Option<FlexTensor>> {
        // A zero vector handed over as it is (`FlexTensor::zeros` makes a byte vector and
        // then copies it into aligned memory: a second pass over the unit's size).
        let buffer =
            buffer.unwrap_or_else(|| FlexTensor::from_data(TensorData::new(vec![E::from_elem(0.0); n], [n])));
        if buffer.dtype() != E::dtype() || buffer.layout().contiguous_offsets() != Some((0, n)) {
            return Err(Some(buffer));
        }
        Ok(buffer)
    }

    /// [`flex_write`] of a matrix gradient in transposed layout — strides `[1, rows]` from
    /// the start of its memory, as Flex's matmul backward makes a linear layer's weight
    /// gradient —, read in place; the generic path would first copy it into standard layout
    /// (a transposing copy of every weight gradient per rank and backward: ~3.4 % of a rank's
    /// time at W = 2 on the benchmark model). Anything else: the buffer back.
    fn flex_write_transposed(
        view: &ParamView,
        grad: &FlexTensor,
        buffer: Option<FlexTensor>,
        world: usize,
        unit_len: usize,
    ) -> Result<FlexTensor, Option<FlexTensor>> {
        fn typed<E: Element + bytemuck::Pod>(
            view: &ParamView,
            grad: &FlexTensor,
            buffer: Option<FlexTensor>,
            world: usize,
            unit_len: usize,
        ) -> Result<FlexTensor, Option<FlexTensor>> {
            let Some(([rows, cols], src)) = crate::transpose::flex_column_major::<E>(grad) else {
                return Err(buffer);
            };
            if view.param.global_shape[..] != [rows, cols] || rows < 2 || cols < 2 {
                return Err(buffer);
            }
            let n = world * unit_len;
            let mut buffer = unit_buffer::<E>(buffer, n)?;
            let dst = &mut buffer.storage_mut::<E>()[..n];
            for r in 0..world {
                let elements = view.elements_of(r);
                if elements.is_empty() {
                    break;
                }
                // Whole rows (a parameter is sharded by rows): element (row, c) of the
                // parameter is `src[c · rows + row]`.
                let (row0, row1) = (elements.start / cols, elements.end / cols);
                let base = r * unit_len + view.offset;
                let place = &mut dst[base..base + (row1 - row0) * cols];
                crate::transpose::transposed_rows(src, rows, cols, row0..row1, place);
            }
            Ok(buffer)
        }
        match grad.dtype() {
            DType::F32 => typed::<f32>(view, grad, buffer, world, unit_len),
            DType::F64 => typed::<f64>(view, grad, buffer, world, unit_len),
            _ => Err(buffer),
        }
    }

    /// Writes each rank's rows of `src` (a parameter's gradient) into their places of `dst`
    /// (the unit's gradient buffer, `world · unit_len`).
    fn place<E: Copy>(view: &ParamView, src: &[E], dst: &mut [E], world: usize) {
        let unit_len = dst.len() / world;
        for r in 0..world {
            let rows = view.elements_of(r);
            if rows.is_empty() {
                break;
            }
            let start = r * unit_len + view.offset;
            dst[start..start + rows.len()].copy_from_slice(&src[rows]);
        }
    }
}

#[derive(Debug)]
struct ViewBackward {
    view: ParamView,
    group: Arc<ViewGroup>,
}

impl<B: Backend> Backward<B, 1> for ViewBackward {
    type State = ();

    fn backward(self, ops: Ops<Self::State, 1>, grads: &mut Gradients, _checkpointer: &mut Checkpointer) {
        let grad = grads.consume::<B>(&ops.node);
        let Some(parent) = &ops.parents[0] else { return };
        let (world, unit_len) = (self.group.world, self.group.unit_len);
        // The parent is the all-gather op's output: `consume` takes a non-leaf's gradient out
        // of the container, so registering it again does not add it twice. (A leaf's would
        // stay: then each view registers a buffer of its own, which Burn adds.)
        let is_leaf = parent.parents.is_empty();
        let reuse = self.group.started.swap(true, Ordering::Relaxed) && !is_leaf;
        let buffer = reuse.then(|| grads.consume::<B>(parent));
        let buffer = self.view.write_into::<B>(grad, buffer, world, unit_len);
        grads.register::<B>(parent.id, buffer);
    }
}

/// Recomputes a view from the (re-gathered) buffer's state.
#[derive(Debug)]
struct RetroView<B> {
    gathered: NodeId,
    view: ParamView,
    world: usize,
    unit_len: usize,
    _backend: PhantomData<fn() -> B>,
}

impl<B: Backend> RetroForward for RetroView<B> {
    fn forward(&self, states: &mut BackwardStates, out_node: NodeId) {
        let gathered = states.get_state::<B::FloatTensorPrimitive>(&self.gathered);
        states.save(out_node, self.view.cut::<B>(gathered, self.world, self.unit_len));
    }
}

/// Parameter `view` of the gathered buffer `gathered` (`[world · unit_len]` of `group`).
pub(crate) fn param_view<B: Backend, C: CheckpointStrategy>(
    gathered: &FloatTensor<Autodiff<B, C>>,
    view: ParamView,
    group: &Arc<ViewGroup>,
) -> FloatTensor<Autodiff<B, C>> {
    let (world, unit_len) = (group.world, group.unit_len);
    let output = view.cut::<B>(gathered.primitive.clone(), world, unit_len);
    let retro = RetroView::<B> {
        gathered: gathered.node.id,
        view: view.clone(),
        world,
        unit_len,
        _backend: PhantomData,
    };
    let prep = (ViewBackward { view, group: group.clone() }).prepare::<C>([gathered.node.clone()]);
    let prep = if group.recompute {
        prep.memory_bound().retro_forward(retro).parents([gathered])
    } else {
        prep.compute_bound()
    };
    match prep.stateful() {
        OpsKind::Tracked(prep) => prep.finish((), output),
        OpsKind::UnTracked(prep) => prep.finish(output),
    }
}

/// Without the `cpu` feature every backend takes the generic path.
#[cfg(not(feature = "cpu"))]
mod host {
    use burn::tensor::backend::Backend;
    use burn::tensor::ops::FloatTensor;

    use super::ParamView;

    /// Never on the host: the generic path.
    pub(super) fn cut<B: Backend>(
        _: &ParamView,
        _: &FloatTensor<B>,
        _: usize,
        _: usize,
    ) -> Option<FloatTensor<B>> {
        None
    }

    /// Never on the host: the arguments back, for the generic path.
    #[allow(clippy::type_complexity)]
    pub(super) fn write_into<B: Backend>(
        _: &ParamView,
        grad: FloatTensor<B>,
        buffer: Option<FloatTensor<B>>,
        _: usize,
        _: usize,
    ) -> Result<FloatTensor<B>, (FloatTensor<B>, Option<FloatTensor<B>>)> {
        Err((grad, buffer))
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    #[cfg(feature = "cpu")]
    use burn::backend::Flex;
    use burn::backend::NdArray;
    use burn::backend::autodiff::checkpoint::strategy::{BalancedCheckpointing, NoCheckpointing};
    use burn::module::ParamId;
    use burn::tensor::backend::AutodiffBackend;
    use burn::tensor::{Distribution, Tensor, TensorPrimitive};

    /// The gathered buffer's gradient through the views equals, bit for bit, the one through
    /// Burn's own reshape/narrow ops (the path this replaces), with padded parameters, a view
    /// used twice (a tied weight), one never used, and values needed again in backward; the
    /// gathered buffer an op's output (as in FSDP) or a leaf; the views recomputed in backward
    /// (a resharded unit) or kept.
    fn views_match_narrow<B: AutodiffBackend + crate::FsdpBackend>(leaf: bool, recompute: bool) {
        let device = Default::default();
        let world = 3;
        let shapes = [vec![5, 4], vec![7], vec![2, 3], vec![4, 2]];
        let params: Vec<ShardedParam> =
            shapes.iter().map(|s| ShardedParam::new(ParamId::new(), "p".into(), s.clone(), world)).collect();
        let offsets: Vec<usize> = params
            .iter()
            .scan(0, |at, p| {
                let o = *at;
                *at += p.shard_numel();
                Some(o)
            })
            .collect();
        let unit_len: usize = params.iter().map(ShardedParam::shard_numel).sum();
        let x0 =
            Tensor::<B::InnerBackend, 1>::random([world * unit_len], Distribution::Normal(0.0, 1.0), &device);
        // The loss: A used twice (tied), B and C through products whose backward needs them,
        // D unused.
        let loss = |a: Tensor<B, 2>, b: Tensor<B, 1>, c: Tensor<B, 2>| {
            (a.clone() * a.clone()).sum()
                + a.sum_dim(1).sum().mul_scalar(3.0)
                + (b.clone() * b).sum()
                + c.exp().sum()
        };
        let run = |ours: bool| {
            let x = Tensor::<B, 1>::from_inner(x0.clone()).require_grad();
            let gathered = if leaf { x.clone() } else { x.clone().mul_scalar(1.0) };
            let (a, b, c): (Tensor<B, 2>, Tensor<B, 1>, Tensor<B, 2>) = if ours {
                let group = ViewGroup::new(world, unit_len, recompute);
                let g = gathered.into_primitive().tensor();
                let cut = |i: usize| {
                    let view = ParamView::of(&params[i], offsets[i]);
                    TensorPrimitive::Float(B::fsdp_param_view(&g, view, &group))
                };
                (
                    Tensor::from_primitive(cut(0)),
                    Tensor::from_primitive(cut(1)),
                    Tensor::from_primitive(cut(2)),
                )
            } else {
                let rows = gathered.reshape([world, unit_len]);
                let cols = |i: usize| rows.clone().narrow(1, offsets[i], params[i].shard_numel());
                (params[0].unshard(cols(0)), params[1].unshard(cols(1)), params[2].unshard(cols(2)))
            };
            let value = loss(a, b, c);
            let grads = value.backward();
            (value.into_data(), x.grad(&grads).expect("a gradient").into_data())
        };
        let (value_ours, grad_ours) = run(true);
        let (value_ref, grad_ref) = run(false);
        assert_eq!(value_ours, value_ref);
        assert_eq!(grad_ours, grad_ref);
    }

    #[test]
    fn views_match_narrow_without_checkpointing() {
        for (leaf, recompute) in [(false, false), (true, false), (false, true), (true, true)] {
            views_match_narrow::<Autodiff<NdArray, NoCheckpointing>>(leaf, recompute);
        }
    }

    #[test]
    fn views_match_narrow_recomputed_or_kept_under_balanced_checkpointing() {
        for (leaf, recompute) in [(false, false), (true, false), (false, true), (true, true)] {
            views_match_narrow::<Autodiff<NdArray, BalancedCheckpointing>>(leaf, recompute);
        }
    }

    #[cfg(feature = "cpu")]
    /// Runs `f` with this thread's views sent down the generic path.
    fn generic_only(f: impl FnOnce()) {
        host::GENERIC_ONLY.with(|g| g.set(true));
        f();
        host::GENERIC_ONLY.with(|g| g.set(false));
    }

    /// Flex on its host path, and both backends on the generic path: the same bits as the
    /// narrow path.
    #[cfg(feature = "cpu")]
    #[test]
    fn views_match_narrow_on_flex_and_on_the_generic_path() {
        for (leaf, recompute) in [(false, false), (true, false), (false, true), (true, true)] {
            views_match_narrow::<Autodiff<Flex, NoCheckpointing>>(leaf, recompute);
            views_match_narrow::<Autodiff<Flex, BalancedCheckpointing>>(leaf, recompute);
            generic_only(|| {
                views_match_narrow::<Autodiff<NdArray, NoCheckpointing>>(leaf, recompute);
                views_match_narrow::<Autodiff<Flex, NoCheckpointing>>(leaf, recompute);
                views_match_narrow::<Autodiff<Flex, BalancedCheckpointing>>(leaf, recompute);
            });
        }
    }

    /// The host path and the generic path give the same parameter and the same gradient
    /// buffer, bit for bit, with padding (world 3, 7 rows) and without (world 1), for a fresh
    /// buffer and one another view has written.
    #[cfg(feature = "cpu")]
    fn host_path_equals_generic_path<B: Backend>(transposed_in_place: bool) {
        type T<B> = FloatTensor<B>;
        let device = Default::default();
        let data = |t: T<B>| Tensor::<B, 1>::from_primitive(TensorPrimitive::Float(t)).into_data();
        let flat = |t: T<B>| Tensor::<B, 2>::from_primitive(TensorPrimitive::Float(t)).reshape([-1]);
        for world in [1, 3] {
            let param = ShardedParam::new(ParamId::new(), "p".into(), vec![7, 5], world);
            let other = ShardedParam::new(ParamId::new(), "q".into(), vec![2], world);
            let unit_len = other.shard_numel() + param.shard_numel();
            let (view, other) = (ParamView::of(&param, other.shard_numel()), ParamView::of(&other, 0));
            let random = |shape: Vec<usize>| {
                let n = shape.iter().product::<usize>();
                let t = Tensor::<B, 1>::random([n], Distribution::Normal(0.0, 1.0), &device);
                B::float_reshape(t.into_primitive().tensor(), Shape::from(shape))
            };
            let gathered = random(vec![world * unit_len]);
            let host =
                host::cut::<B>(&view, &gathered, world, unit_len).expect("an f32 tensor: the host path");
            let generic = view.cut_generic::<B>(gathered.clone(), world, unit_len);
            assert_eq!(flat(host).into_data(), flat(generic).into_data(), "world {world}: cut");

            let grad = random(vec![7, 5]);
            let other_grad = random(vec![2]);
            let first = |host: bool| match host {
                true => host::write_into::<B>(&other, other_grad.clone(), None, world, unit_len).ok(),
                false => Some(other.write_generic::<B>(other_grad.clone(), None, world, unit_len)),
            };
            for buffer in [false, true] {
                let buffer_host = buffer.then(|| first(true).expect("the host path"));
                let buffer_generic = buffer.then(|| first(false).expect("the generic path"));
                let Ok(host) = host::write_into::<B>(&view, grad.clone(), buffer_host, world, unit_len)
                else {
                    panic!("world {world}: an f32 gradient left to the generic path")
                };
                let generic = view.write_generic::<B>(grad.clone(), buffer_generic, world, unit_len);
                assert_eq!(data(host), data(generic), "world {world}: gradient (other view first: {buffer})");
            }
            // A transposed gradient (as a matmul's backward makes a weight gradient): read in
            // place on Flex, with the generic path's values; on NdArray left to the generic path.
            // 70 × 37 leaves partial 16 × 16 tiles, and rank rows that start mid-tile.
            for [rows, cols] in [[7, 5], [70, 37]] {
                let param = ShardedParam::new(ParamId::new(), "t".into(), vec![rows, cols], world);
                let unit_len = other.param.shard_numel() + param.shard_numel();
                let view = ParamView::of(&param, other.param.shard_numel());
                for buffer in [false, true] {
                    let transposed = B::float_swap_dims(random(vec![cols, rows]), 0, 1);
                    let other_grad = random(vec![2]);
                    let buffers = buffer.then(|| {
                        let b = other.write_generic::<B>(other_grad.clone(), None, world, unit_len);
                        (b.clone(), B::float_from_data(data(b), &device))
                    });
                    let (buffer_host, buffer_generic) = buffers.unzip();
                    let host = host::write_into::<B>(&view, transposed.clone(), buffer_host, world, unit_len);
                    let generic = view.write_generic::<B>(transposed, buffer_generic, world, unit_len);
                    match host {
                        Ok(host) if transposed_in_place => assert_eq!(
                            data(host),
                            data(generic),
                            "world {world}, {rows} × {cols}: transposed gradient (other view first: {buffer})"
                        ),
                        Ok(_) => panic!("world {world}: a transposed gradient taken in place off Flex"),
                        Err(_) => assert!(!transposed_in_place, "world {world}: not read in place on Flex"),
                    }
                }
            }
        }
    }

    #[cfg(feature = "cpu")]
    #[test]
    fn host_path_equals_generic_path_on_ndarray_and_flex() {
        host_path_equals_generic_path::<NdArray>(false);
        host_path_equals_generic_path::<Flex>(true);
    }

    /// Flex's gradient buffer is written in place when nothing else holds it, and copied
    /// (copy-on-write) when something does: the other holder keeps its values.
    #[cfg(feature = "cpu")]
    #[test]
    fn flex_buffer_written_in_place_only_when_unshared() {
        let device = Default::default();
        let view = ParamView::of(&ShardedParam::new(ParamId::new(), "f".into(), vec![4], 1), 0);
        let tensor = |v: [f32; 4]| Tensor::<Flex, 1>::from_floats(v, &device).into_primitive().tensor();
        let values = |t: &FloatTensor<Flex>| {
            Tensor::<Flex, 1>::from_primitive(TensorPrimitive::Float(t.clone()))
                .to_data()
                .to_vec::<f32>()
                .expect("f32 values")
        };
        let buffer = tensor([0.0; 4]);
        let held = buffer.clone();
        let written = host::write_into::<Flex>(&view, tensor([1.0, 2.0, 3.0, 4.0]), Some(buffer), 1, 4)
            .expect("the host path");
        assert_eq!(values(&held), vec![0.0; 4], "a shared buffer is copied, not written");
        assert_eq!(values(&written), vec![1.0, 2.0, 3.0, 4.0]);
        let at = written.bytes().as_ptr() as usize;
        let again = host::write_into::<Flex>(&view, tensor([5.0, 6.0, 7.0, 8.0]), Some(written), 1, 4)
            .expect("the host path");
        assert_eq!(again.bytes().as_ptr() as usize, at, "an unshared buffer is written in place");
        assert_eq!(values(&again), vec![5.0, 6.0, 7.0, 8.0]);
    }

    /// In-process ranks cutting the same gathered Flex buffer share one cut: the first cut
    /// is copied out of the buffer, the others hold the same memory (same values as the
    /// generic path). Another view, or a new gather, gets a cut of its own; once no rank
    /// holds a cut, the next one is made again; writing to a shared cut copies it first.
    #[cfg(feature = "cpu")]
    #[test]
    fn flex_ranks_share_one_cut_of_one_gathered_buffer() {
        let device = Default::default();
        let world = 3;
        let param = ShardedParam::new(ParamId::new(), "e".into(), vec![7, 5], world);
        let other = ShardedParam::new(ParamId::new(), "n".into(), vec![2], world);
        let unit_len = other.shard_numel() + param.shard_numel();
        let (view, other) = (ParamView::of(&param, other.shard_numel()), ParamView::of(&other, 0));
        let random = || {
            Tensor::<Flex, 1>::random([world * unit_len], Distribution::Normal(0.0, 1.0), &device)
                .into_primitive()
                .tensor()
        };
        let at = |t: &FloatTensor<Flex>| t.bytes().as_ptr() as usize;
        let values = |t: &FloatTensor<Flex>| {
            Tensor::<Flex, 2>::from_primitive(TensorPrimitive::Float(t.clone())).reshape([-1]).into_data()
        };
        let gathered = random();
        // Each rank holds its own handle on the one gathered buffer, as `LocalGroup` hands out.
        let ranks: Vec<FloatTensor<Flex>> = (0..world).map(|_| gathered.clone()).collect();
        let cuts: Vec<FloatTensor<Flex>> =
            ranks.iter().map(|g| host::cut::<Flex>(&view, g, world, unit_len).expect("host path")).collect();
        let generic = view.cut_generic::<Flex>(gathered.clone(), world, unit_len);
        for cut in &cuts {
            assert_eq!(at(cut), at(&cuts[0]), "the ranks' cuts share one buffer");
            assert_eq!(values(cut), values(&generic), "the shared cut has the parameter's values");
        }
        // Another parameter of the same buffer: a cut of its own.
        let norm = host::cut::<Flex>(&other, &ranks[0], world, unit_len).expect("host path");
        assert_ne!(at(&norm), at(&cuts[0]));
        // A new gather with other values: cut afresh, never the old cut.
        let regathered = random();
        let fresh = host::cut::<Flex>(&view, &regathered, world, unit_len).expect("host path");
        assert_ne!(at(&fresh), at(&cuts[0]));
        assert_eq!(values(&fresh), values(&view.cut_generic::<Flex>(regathered.clone(), world, unit_len)));
        // A rank writing to its cut (Flex: copy-on-write) leaves the others' values alone.
        let before = values(&cuts[1]);
        let mut cuts = cuts;
        let written =
            Tensor::<Flex, 2>::from_primitive(TensorPrimitive::Float(cuts.remove(0))).add_scalar(1.0);
        assert_eq!(values(&cuts[0]), before, "a shared cut is not written through");
        assert_ne!(at(&written.into_primitive().tensor()), at(&cuts[0]));
        // Nobody holds the first cut any more: the next cut of that buffer is made again.
        drop(cuts);
        let again = host::cut::<Flex>(&view, &ranks[1], world, unit_len).expect("host path");
        assert_eq!(values(&again), values(&generic));
    }
}
