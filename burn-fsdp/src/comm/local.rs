//! In-process ranks: one thread per rank, collectives through shared memory.
//!
//! [`LocalGroup::new_group`] makes the handles of one group; [`launch`] runs a closure on
//! `world` threads and turns a panicking or failing rank into an error on every other rank
//! (the group is aborted, so nobody waits for the timeout).

use std::collections::HashMap;
use std::ops::Range;
use std::panic::{AssertUnwindSafe, catch_unwind};
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Condvar, Mutex, MutexGuard};
use std::time::{Duration, Instant};

#[cfg(feature = "cpu")]
use burn::backend::flex::FlexTensor;
use burn::tensor::backend::Backend;
use burn::tensor::{DType, Element, Tensor, TensorData, bf16, f16};
#[cfg(feature = "cpu")]
use burn::tensor::{TensorPrimitive, ops::FloatTensor};

use crate::comm::{
    CollectiveFailure, CollectiveKind, CommCounters, CommError, CommStats, ProcessGroup, ReduceOp, Tag,
    panic_message, quiet_collective_panics,
};

/// Default collective timeout.
pub const DEFAULT_TIMEOUT: Duration = Duration::from_secs(60);

/// Nanoseconds spent in collectives of each kind, summed over all ranks of all groups.
static TOTAL_NANOS: [AtomicU64; 5] = [const { AtomicU64::new(0) }; 5];
/// Of which waiting for the other ranks to arrive.
static WAIT_NANOS: [AtomicU64; 5] = [const { AtomicU64::new(0) }; 5];

/// Wall time spent inside in-process collectives, summed over every rank (thread) of every
/// [`LocalGroup`] of the process, per [`CollectiveKind::index`]: a diagnostic for benchmarks.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct CollectiveTime {
    /// Time from entering a collective to returning from it.
    pub total: [Duration; 5],
    /// The part of `total` spent waiting for the last rank to arrive (load imbalance and
    /// synchronisation rather than data movement).
    pub waiting: [Duration; 5],
}

impl CollectiveTime {
    /// The counters now.
    pub fn now() -> Self {
        let read =
            |a: &[AtomicU64; 5]| std::array::from_fn(|i| Duration::from_nanos(a[i].load(Ordering::Relaxed)));
        Self { total: read(&TOTAL_NANOS), waiting: read(&WAIT_NANOS) }
    }

    /// `self - earlier`, per counter.
    pub fn since(&self, earlier: &Self) -> Self {
        Self {
            total: std::array::from_fn(|i| self.total[i].saturating_sub(earlier.total[i])),
            waiting: std::array::from_fn(|i| self.waiting[i].saturating_sub(earlier.waiting[i])),
        }
    }
}

/// Adds the time until it is dropped to [`WAIT_NANOS`] of its kind.
struct Waiting(CollectiveKind, Instant);

impl Drop for Waiting {
    fn drop(&mut self) {
        WAIT_NANOS[self.0.index()].fetch_add(self.1.elapsed().as_nanos() as u64, Ordering::Relaxed);
    }
}

/// Adds the time until it is dropped to [`TOTAL_NANOS`] of its kind.
struct Timed(CollectiveKind, Instant);

impl Timed {
    fn start(kind: CollectiveKind) -> Self {
        Self(kind, Instant::now())
    }
}

impl Drop for Timed {
    fn drop(&mut self) {
        TOTAL_NANOS[self.0.index()].fetch_add(self.1.elapsed().as_nanos() as u64, Ordering::Relaxed);
    }
}

/// What a rank contributes. All-gather, reduce-scatter and all-reduce share the rank's
/// elements on the host (`Vec<HostChunk>`, one per destination chunk), which the receiving
/// ranks combine with plain slice copies and loops into one pre-sized buffer per rank (each
/// rank gets its own output, as on separate devices). Broadcast shares the root's host copy
/// ([`BroadcastPart`]).
type Payload = Arc<dyn std::any::Any + Send + Sync>;

/// One destination chunk of a rank's contribution: `n` elements of `dtype`, as bytes.
enum HostChunk {
    /// Copied out of the rank's tensor (any backend).
    Copied(TensorData),
    /// Bytes `bytes` of a Flex tensor's own memory, shared rather than copied: the peers read
    /// it while the round lasts, and nothing writes to it meanwhile (Flex writes in place only
    /// into a buffer it holds alone; this clone makes it shared).
    #[cfg(feature = "cpu")]
    Flex { tensor: FlexTensor, bytes: Range<usize>, n: usize },
}

impl HostChunk {
    fn as_bytes(&self) -> &[u8] {
        match self {
            HostChunk::Copied(d) => d.as_bytes(),
            #[cfg(feature = "cpu")]
            HostChunk::Flex { tensor, bytes, .. } => &tensor.bytes()[bytes.clone()],
        }
    }

    fn num_elements(&self) -> usize {
        match self {
            HostChunk::Copied(d) => d.shape.num_elements(),
            #[cfg(feature = "cpu")]
            HostChunk::Flex { n, .. } => *n,
        }
    }

    fn dtype(&self) -> DType {
        match self {
            HostChunk::Copied(d) => d.dtype,
            #[cfg(feature = "cpu")]
            HostChunk::Flex { tensor, .. } => tensor.dtype(),
        }
    }

    /// The chunk as tensor data of its own (copied when shared).
    fn to_data(&self) -> TensorData {
        match self {
            HostChunk::Copied(d) => d.clone(),
            #[cfg(feature = "cpu")]
            HostChunk::Flex { n, .. } => {
                TensorData::from_bytes_vec(self.as_bytes().to_vec(), [*n], self.dtype())
            }
        }
    }
}

/// A rank's part of a broadcast: the size and dtype it expects, and the data if it is the root.
struct BroadcastPart {
    n: usize,
    dtype: DType,
    data: Option<TensorData>,
}

struct Round {
    kind: CollectiveKind,
    tag: Tag,
    first_rank: usize,
    inputs: Vec<Option<Payload>>,
    arrived: usize,
    left: usize,
    /// [`LocalGroup::exchange_shared`]: the rank that completed the arrivals, whether a
    /// rank is making the result, and the result once made (Flex, with the `cpu` feature).
    last: usize,
    #[cfg_attr(not(feature = "cpu"), allow(dead_code))]
    making: bool,
    #[cfg_attr(not(feature = "cpu"), allow(dead_code))]
    output: Option<Payload>,
}

#[derive(Default)]
struct State {
    rounds: HashMap<u64, Round>,
    aborted: Option<(usize, String)>,
}

struct Shared {
    size: usize,
    timeout: Duration,
    state: Mutex<State>,
    cv: Condvar,
}

impl Shared {
    fn lock(&self) -> MutexGuard<'_, State> {
        // A rank that panicked while holding the lock cannot have left the state half
        // updated (every update is a single insert/remove), so the poison is ignored.
        self.state.lock().unwrap_or_else(|p| p.into_inner())
    }
}

/// One rank's handle on an in-process group (ranks are threads of one process).
///
/// # Example
///
/// ```
/// use burn::backend::NdArray;
/// use burn::tensor::Tensor;
/// use burn_fsdp::comm::{ProcessGroup, ReduceOp, Tag};
/// use burn_fsdp::comm::local::launch;
///
/// let sums = launch(3, std::time::Duration::from_secs(10), |group| {
///     let x = Tensor::<NdArray, 1>::from_floats([group.rank() as f32 + 1.0], &Default::default());
///     let s = ProcessGroup::<NdArray>::all_reduce(&*group, x, ReduceOp::Sum, &Tag::new("demo"))?;
///     Ok::<_, burn_fsdp::CommError>(s.into_scalar())
/// })
/// .unwrap();
/// assert_eq!(sums, vec![6.0, 6.0, 6.0]);
/// ```
pub struct LocalGroup {
    rank: usize,
    shared: Arc<Shared>,
    seq: Mutex<u64>,
    counters: CommCounters,
}

impl LocalGroup {
    /// Handles of a new group of `size` ranks (index = rank).
    pub fn new_group(size: usize, timeout: Duration) -> Vec<Arc<LocalGroup>> {
        let shared = Arc::new(Shared { size, timeout, state: Mutex::default(), cv: Condvar::new() });
        (0..size)
            .map(|rank| {
                Arc::new(LocalGroup {
                    rank,
                    shared: shared.clone(),
                    seq: Mutex::new(0),
                    counters: CommCounters::default(),
                })
            })
            .collect()
    }

    fn next_seq(&self) -> u64 {
        let mut s = self.seq.lock().unwrap_or_else(|p| p.into_inner());
        let v = *s;
        *s += 1;
        v
    }

    /// Deposits `input`, waits for every rank, and returns all inputs in rank order.
    fn exchange(
        &self,
        kind: CollectiveKind,
        tag: &Tag,
        input: Payload,
        bytes: u64,
    ) -> Result<Vec<Payload>, CommError> {
        let (seq, mut st) = self.arrive(kind, tag, input, bytes)?;
        let size = self.shared.size;
        let _waiting = Waiting(kind, Instant::now());
        let deadline = Instant::now() + self.shared.timeout;
        loop {
            // A round every rank joined has completed, whatever happened after it: a peer
            // that took its result and then failed must not fail this rank's copy of the
            // same, finished collective (the failure reaches this rank at its next one).
            let round =
                st.rounds.get_mut(&seq).ok_or_else(|| self.bad(kind, tag, "round vanished".into()))?;
            if round.arrived == size {
                let inputs: Vec<Payload> = round.inputs.iter().flatten().cloned().collect();
                round.left += 1;
                if round.left == size {
                    st.rounds.remove(&seq);
                }
                return Ok(inputs);
            }
            if let Some((failed_rank, reason)) = &st.aborted {
                return Err(self.peer_failed(kind, tag, *failed_rank, reason));
            }
            st = self.wait_or_time_out(st, seq, kind, tag, deadline)?;
        }
    }

    /// Deposits `input` for this rank's next collective; returns its sequence number, with
    /// the state still locked.
    fn arrive(
        &self,
        kind: CollectiveKind,
        tag: &Tag,
        input: Payload,
        bytes: u64,
    ) -> Result<(u64, MutexGuard<'_, State>), CommError> {
        self.counters.record(kind, bytes);
        let seq = self.next_seq();
        let size = self.shared.size;
        let mut st = self.shared.lock();
        if let Some((failed_rank, reason)) = &st.aborted {
            return Err(self.peer_failed(kind, tag, *failed_rank, reason));
        }
        let round = st.rounds.entry(seq).or_insert_with(|| Round {
            kind,
            tag: tag.clone(),
            first_rank: self.rank,
            inputs: vec![None; size],
            arrived: 0,
            left: 0,
            last: 0,
            making: false,
            output: None,
        });
        if round.kind != kind || round.tag != *tag {
            let err = CommError::Mismatch {
                seq,
                rank: self.rank,
                mine: format!("{kind} `{tag}`"),
                other_rank: round.first_rank,
                theirs: format!("{} `{}`", round.kind, round.tag),
            };
            st.aborted = Some((self.rank, err.to_string()));
            self.shared.cv.notify_all();
            return Err(err);
        }
        round.inputs[self.rank] = Some(input);
        round.arrived += 1;
        round.last = self.rank;
        self.shared.cv.notify_all();
        Ok((seq, st))
    }

    /// Waits for a change of the state until `deadline`; past it, the group is aborted with
    /// a timeout naming the ranks that have not arrived at round `seq`.
    fn wait_or_time_out<'a>(
        &self,
        st: MutexGuard<'a, State>,
        seq: u64,
        kind: CollectiveKind,
        tag: &Tag,
        deadline: Instant,
    ) -> Result<MutexGuard<'a, State>, CommError> {
        let now = Instant::now();
        if now < deadline {
            return Ok(self.shared.cv.wait_timeout(st, deadline - now).unwrap_or_else(|p| p.into_inner()).0);
        }
        let mut st = st;
        let missing = st
            .rounds
            .get(&seq)
            .map(|round| {
                round.inputs.iter().enumerate().filter(|(_, i)| i.is_none()).map(|(r, _)| r).collect()
            })
            .unwrap_or_default();
        let err = CommError::Timeout {
            kind,
            tag: tag.clone(),
            rank: self.rank,
            missing,
            timeout: self.shared.timeout,
        };
        st.aborted = Some((self.rank, err.to_string()));
        self.shared.cv.notify_all();
        Err(err)
    }

    /// [`exchange`](Self::exchange) whose result is made once for all ranks: when every input
    /// is in, one rank that was waiting for them runs `make` on them (outside the lock) and
    /// every rank returns that one result. The rank that arrived last, the one behind, never
    /// makes it (a group has at least two ranks here). A failing `make` aborts the group.
    #[cfg(feature = "cpu")]
    fn exchange_shared(
        &self,
        kind: CollectiveKind,
        tag: &Tag,
        input: Payload,
        bytes: u64,
        make: impl FnOnce(&[Payload]) -> Result<Payload, CommError>,
    ) -> Result<Payload, CommError> {
        let (seq, mut st) = self.arrive(kind, tag, input, bytes)?;
        let size = self.shared.size;
        let _waiting = Waiting(kind, Instant::now());
        let deadline = Instant::now() + self.shared.timeout;
        let mut make = Some(make);
        loop {
            // As in `exchange`: a finished round is delivered even if a peer failed after it.
            let round =
                st.rounds.get_mut(&seq).ok_or_else(|| self.bad(kind, tag, "round vanished".into()))?;
            if let Some(output) = &round.output {
                let output = output.clone();
                round.left += 1;
                if round.left == size {
                    st.rounds.remove(&seq);
                }
                return Ok(output);
            }
            if let Some((failed_rank, reason)) = &st.aborted {
                return Err(self.peer_failed(kind, tag, *failed_rank, reason));
            }
            let round =
                st.rounds.get_mut(&seq).ok_or_else(|| self.bad(kind, tag, "round vanished".into()))?;
            if round.arrived == size
                && !round.making
                && round.last != self.rank
                && let Some(make) = make.take()
            {
                round.making = true;
                let inputs: Vec<Payload> = round.inputs.iter().flatten().cloned().collect();
                drop(st);
                let made = make(&inputs);
                drop(inputs);
                st = self.shared.lock();
                match made {
                    Ok(output) => {
                        if let Some(round) = st.rounds.get_mut(&seq) {
                            round.output = Some(output);
                        }
                        self.shared.cv.notify_all();
                    }
                    Err(err) => {
                        st.aborted.get_or_insert((self.rank, err.to_string()));
                        self.shared.cv.notify_all();
                        return Err(err);
                    }
                }
                continue;
            }
            st = self.wait_or_time_out(st, seq, kind, tag, deadline)?;
        }
    }

    fn peer_failed(&self, kind: CollectiveKind, tag: &Tag, failed_rank: usize, reason: &str) -> CommError {
        CommError::PeerFailed {
            kind,
            tag: tag.clone(),
            rank: self.rank,
            failed_rank,
            reason: reason.to_owned(),
        }
    }

    fn bad(&self, kind: CollectiveKind, tag: &Tag, msg: String) -> CommError {
        CommError::BadInput { kind, tag: tag.clone(), rank: self.rank, msg }
    }

    /// Chunk `pick` of every rank's host chunks, checked to have `n` elements of `dtype`.
    fn host_parts<'a>(
        &self,
        kind: CollectiveKind,
        tag: &Tag,
        inputs: &'a [Payload],
        pick: usize,
        n: usize,
        dtype: DType,
    ) -> Result<Vec<&'a HostChunk>, CommError> {
        let mut out = Vec::with_capacity(inputs.len());
        for (r, p) in inputs.iter().enumerate() {
            let Some(chunk) = p.downcast_ref::<Vec<HostChunk>>().and_then(|c| c.get(pick)) else {
                return Err(self.bad(kind, tag, format!("rank {r} contributed an input of another kind")));
            };
            if chunk.num_elements() != n || chunk.dtype() != dtype {
                return Err(self.bad(
                    kind,
                    tag,
                    format!(
                        "rank {r} contributed {} elements of {:?}, rank {} {n} of {dtype:?}",
                        chunk.num_elements(),
                        chunk.dtype(),
                        self.rank
                    ),
                ));
            }
            out.push(chunk);
        }
        Ok(out)
    }

    /// Reduce-scatter (`scatter`) or all-reduce of `input` through host chunks.
    fn reduce_through_host<B: Backend>(
        &self,
        kind: CollectiveKind,
        input: Tensor<B, 1>,
        op: ReduceOp,
        tag: &Tag,
        scatter: bool,
    ) -> Result<Tensor<B, 1>, CommError> {
        let size = self.shared.size;
        let device = input.device();
        let dtype = input.dtype();
        let chunks = if scatter { size } else { 1 };
        let n = input.shape().num_elements() / chunks;
        let bytes = payload_bytes(&input);
        let mine = host_chunks(input, chunks);
        let inputs = self.exchange(kind, tag, Arc::new(mine), bytes)?;
        let pick = if scatter { self.rank } else { 0 };
        let parts = self.host_parts(kind, tag, &inputs, pick, n, dtype)?;
        let bytes: Vec<&[u8]> = parts.iter().map(|p| p.as_bytes()).collect();
        let data = match crate::comm::host::reduce_to_data(&bytes, dtype, op, n) {
            Ok(data) => data,
            Err(_) => {
                let tensors: Vec<Tensor<B, 1>> =
                    parts.iter().map(|p| Tensor::from_data(p.to_data(), (&device, dtype))).collect();
                return Ok(reduce_range(&tensors, 0..n, op));
            }
        };
        Ok(Tensor::from_data(data, (&device, dtype)))
    }
}

/// Whether `B`'s float tensors are Flex tensors (whose memory in-process ranks can share).
#[cfg(feature = "cpu")]
fn is_flex<B: Backend>() -> bool {
    std::any::TypeId::of::<FloatTensor<B>>() == std::any::TypeId::of::<FlexTensor>()
}

fn payload_bytes<B: Backend>(t: &Tensor<B, 1>) -> u64 {
    (t.shape().num_elements() * t.dtype().size()) as u64
}

/// A host copy of elements `range` of `t`, in `t`'s dtype.
///
/// Through `slice` first: on NdArray that is one `memcpy` into a fresh array, which
/// `into_data` then hands over without copying, whereas `into_data` of a tensor whose storage
/// is shared (a parameter shard, say) goes element by element (~100× slower).
fn host_range<B: Backend>(t: &Tensor<B, 1>, range: Range<usize>) -> TensorData {
    if range.is_empty() {
        return TensorData::from_bytes_vec(Vec::new(), [0], t.dtype());
    }
    t.clone().slice(range).into_data()
}

/// `t` split into `chunks` equal host chunks: on Flex (float dtypes, contiguous) the tensor's
/// own memory, shared with the peers, not copied; elsewhere copies (see [`host_range`]).
fn host_chunks<B: Backend>(t: Tensor<B, 1>, chunks: usize) -> Vec<HostChunk> {
    let n = t.shape().num_elements() / chunks;
    #[cfg(feature = "cpu")]
    let t = match crate::downcast::cast::<FloatTensor<B>, FlexTensor>(t.into_primitive().tensor()) {
        Ok(f) => {
            let float = matches!(f.dtype(), DType::F64 | DType::F32 | DType::F16 | DType::BF16);
            if let (true, Some((start, _))) = (float, f.layout().contiguous_offsets()) {
                let size = f.dtype().size();
                return (0..chunks)
                    .map(|k| HostChunk::Flex {
                        tensor: f.clone(),
                        bytes: (start + k * n) * size..(start + (k + 1) * n) * size,
                        n,
                    })
                    .collect();
            }
            Tensor::<B, 1>::from_primitive(TensorPrimitive::Float(crate::downcast::must(
                f,
                "came from B's float tensor",
            )))
        }
        Err(t) => Tensor::from_primitive(TensorPrimitive::Float(t)),
    };
    (0..chunks).map(|k| HostChunk::Copied(host_range(&t, k * n..(k + 1) * n))).collect()
}

/// The concatenation of `parts` (all of element type `E`) in one pre-sized vector.
fn concat_as<E: Element + bytemuck::Pod>(parts: &[&HostChunk]) -> TensorData {
    let len: usize = parts.iter().map(|p| p.num_elements()).sum();
    let mut out: Vec<E> = Vec::with_capacity(len);
    for p in parts {
        match bytemuck::try_cast_slice::<u8, E>(p.as_bytes()) {
            Ok(s) => out.extend_from_slice(s),
            // Misaligned bytes (never from a backend's memory, but possible in principle).
            Err(_) => {
                out.extend(p.as_bytes().chunks_exact(size_of::<E>()).map(bytemuck::pod_read_unaligned::<E>))
            }
        }
    }
    TensorData::new(out, [len])
}

/// The concatenation of `parts` of dtype `dtype`, or `None` for dtypes without a plain
/// element type (quantized, `Flex32`, bool), which the caller concatenates with backend ops.
fn concat_host(parts: &[&HostChunk], dtype: DType) -> Option<TensorData> {
    Some(match dtype {
        DType::F64 => concat_as::<f64>(parts),
        DType::F32 => concat_as::<f32>(parts),
        DType::F16 => concat_as::<f16>(parts),
        DType::BF16 => concat_as::<bf16>(parts),
        DType::I64 => concat_as::<i64>(parts),
        DType::I32 => concat_as::<i32>(parts),
        DType::I16 => concat_as::<i16>(parts),
        DType::I8 => concat_as::<i8>(parts),
        DType::U64 => concat_as::<u64>(parts),
        DType::U32 => concat_as::<u32>(parts),
        DType::U16 => concat_as::<u16>(parts),
        DType::U8 => concat_as::<u8>(parts),
        _ => return None,
    })
}

/// Reduces `range` of every tensor in rank order (the same order on every rank, so all ranks
/// get bit-identical results). Sub-f32 dtypes are accumulated in f32 and rounded once.
fn reduce_range<B: Backend>(
    tensors: &[Tensor<B, 1>],
    range: std::ops::Range<usize>,
    op: ReduceOp,
) -> Tensor<B, 1> {
    let dtype = tensors[0].dtype();
    let widen = matches!(dtype, DType::BF16 | DType::F16);
    let part = |t: &Tensor<B, 1>| {
        let p = t.clone().slice(range.clone());
        if widen { p.cast(DType::F32) } else { p }
    };
    let mut acc = part(&tensors[0]);
    for t in &tensors[1..] {
        acc = match op {
            ReduceOp::Sum | ReduceOp::Avg => acc + part(t),
            ReduceOp::Max => acc.max_pair(part(t)),
        };
    }
    if op == ReduceOp::Avg {
        acc = acc.div_scalar(tensors.len() as f64);
    }
    if widen { acc.cast(dtype) } else { acc }
}

impl<B: Backend> ProcessGroup<B> for LocalGroup {
    fn rank(&self) -> usize {
        self.rank
    }

    fn size(&self) -> usize {
        self.shared.size
    }

    fn stats(&self) -> CommStats {
        self.counters.snapshot()
    }

    fn all_gather(&self, input: Tensor<B, 1>, tag: &Tag) -> Result<Tensor<B, 1>, CommError> {
        let _timed = Timed::start(CollectiveKind::AllGather);
        if self.shared.size == 1 {
            return Ok(input);
        }
        let kind = CollectiveKind::AllGather;
        let device = input.device();
        let (n, dtype) = (input.shape().num_elements(), input.dtype());
        let bytes = payload_bytes(&input);
        let mine = host_chunks(input, 1);
        #[cfg(feature = "cpu")]
        if is_flex::<B>() && concat_host(&[], dtype).is_some() {
            // Every rank's result is the same: one rank concatenates, all share its memory
            // (read-only for them: Flex copies a shared buffer before writing into it).
            let out = self.exchange_shared(kind, tag, Arc::new(mine), bytes, |inputs| {
                let parts = self.host_parts(kind, tag, inputs, 0, n, dtype)?;
                let data = concat_host(&parts, dtype).ok_or_else(|| self.bad(kind, tag, "dtype".into()))?;
                Ok(Arc::new(FlexTensor::from_data(data)) as Payload)
            })?;
            let Some(flex) = out.downcast_ref::<FlexTensor>() else {
                return Err(self.bad(kind, tag, "the shared result is not a Flex tensor".into()));
            };
            let prim = crate::downcast::must::<FlexTensor, FloatTensor<B>>(flex.clone(), "B is Flex");
            return Ok(Tensor::from_primitive(TensorPrimitive::Float(prim)));
        }
        let inputs = self.exchange(kind, tag, Arc::new(mine), bytes)?;
        let parts = self.host_parts(kind, tag, &inputs, 0, n, dtype)?;
        let data = match concat_host(&parts, dtype) {
            Some(data) => data,
            None => {
                let tensors: Vec<Tensor<B, 1>> =
                    parts.iter().map(|p| Tensor::from_data(p.to_data(), (&device, dtype))).collect();
                return Ok(Tensor::cat(tensors, 0));
            }
        };
        Ok(Tensor::from_data(data, (&device, dtype)))
    }

    fn reduce_scatter(
        &self,
        input: Tensor<B, 1>,
        op: ReduceOp,
        tag: &Tag,
    ) -> Result<Tensor<B, 1>, CommError> {
        let _timed = Timed::start(CollectiveKind::ReduceScatter);
        if self.shared.size == 1 {
            return Ok(input);
        }
        let kind = CollectiveKind::ReduceScatter;
        let size = self.shared.size;
        let total = input.shape().num_elements();
        if !total.is_multiple_of(size) {
            return Err(self.bad(kind, tag, format!("{total} elements do not split into {size} chunks")));
        }
        self.reduce_through_host(kind, input, op, tag, true)
    }

    fn all_reduce(&self, input: Tensor<B, 1>, op: ReduceOp, tag: &Tag) -> Result<Tensor<B, 1>, CommError> {
        let _timed = Timed::start(CollectiveKind::AllReduce);
        if self.shared.size == 1 {
            return Ok(input);
        }
        self.reduce_through_host(CollectiveKind::AllReduce, input, op, tag, false)
    }

    fn broadcast(&self, input: Tensor<B, 1>, root: usize, tag: &Tag) -> Result<Tensor<B, 1>, CommError> {
        let _timed = Timed::start(CollectiveKind::Broadcast);
        if self.shared.size == 1 {
            return Ok(input);
        }
        let kind = CollectiveKind::Broadcast;
        if root >= self.shared.size {
            return Err(self.bad(
                kind,
                tag,
                format!("root {root} outside the group of {}", self.shared.size),
            ));
        }
        // Through the host, as the other collectives: only the root copies its tensor out, and
        // every rank uploads the root's bytes to its own device (no device-to-device transfer,
        // which not every backend implements between its devices).
        let device = input.device();
        let (n, dtype) = (input.shape().num_elements(), input.dtype());
        let bytes = payload_bytes(&input);
        let data = (self.rank == root).then(|| host_range(&input, 0..n));
        drop(input);
        let mine = BroadcastPart { n, dtype, data };
        let inputs = self.exchange(kind, tag, Arc::new(mine), bytes)?;
        let mut root_data = None;
        for (r, p) in inputs.iter().enumerate() {
            let Some(part) = p.downcast_ref::<BroadcastPart>() else {
                return Err(self.bad(kind, tag, format!("rank {r} contributed an input of another kind")));
            };
            if part.n != n || part.dtype != dtype {
                return Err(self.bad(
                    kind,
                    tag,
                    format!(
                        "rank {r} contributed {} elements of {:?}, rank {} {n} of {dtype:?}",
                        part.n, part.dtype, self.rank
                    ),
                ));
            }
            if r == root {
                root_data = part.data.clone();
            }
        }
        let data = root_data.ok_or_else(|| self.bad(kind, tag, format!("root {root} sent no data")))?;
        Ok(Tensor::from_data(data, (&device, dtype)))
    }

    fn barrier(&self, tag: &Tag) -> Result<(), CommError> {
        let _timed = Timed::start(CollectiveKind::Barrier);
        if self.shared.size == 1 {
            return Ok(());
        }
        self.exchange(CollectiveKind::Barrier, tag, Arc::new(()), 0).map(|_| ())
    }

    fn abort(&self, reason: &str) {
        self.fail(reason);
    }
}

impl LocalGroup {
    /// This rank's index.
    pub fn rank(&self) -> usize {
        self.rank
    }

    /// Number of ranks.
    pub fn size(&self) -> usize {
        self.shared.size
    }

    /// Marks the group failed by this rank (see [`ProcessGroup::abort`]).
    pub fn fail(&self, reason: &str) {
        let mut st = self.shared.lock();
        if st.aborted.is_none() {
            st.aborted = Some((self.rank, reason.to_owned()));
        }
        self.shared.cv.notify_all();
    }
}

/// Why a launched rank failed.
#[derive(Debug, Clone, thiserror::Error)]
#[error("rank {rank}: {message}")]
pub struct RankError {
    /// The failing rank.
    pub rank: usize,
    /// Its error or panic message.
    pub message: String,
}

/// Runs `f` on `world` threads, each with its rank's handle of a fresh [`LocalGroup`].
///
/// Returns every rank's value, or the error of the rank that failed first (a rank that
/// failed only because a peer did is not reported as the cause). A rank that panics or
/// returns an error aborts the group, so its peers stop within their current collective.
/// A [`CollectiveFailure`] unwinding out of `f` is reported as that rank's error (its
/// message, no "panicked"), and the panic hook prints nothing for it
/// ([`quiet_collective_panics`]).
pub fn launch<T, E, F>(world: usize, timeout: Duration, f: F) -> Result<Vec<T>, RankError>
where
    T: Send,
    E: std::fmt::Display,
    F: Fn(Arc<LocalGroup>) -> Result<T, E> + Send + Sync,
{
    quiet_collective_panics();
    let groups = LocalGroup::new_group(world, timeout);
    let f = &f;
    let results: Vec<Result<T, (String, bool)>> = std::thread::scope(|s| {
        let handles: Vec<_> = groups
            .iter()
            .map(|g| {
                let g = g.clone();
                s.spawn(move || {
                    let out = catch_unwind(AssertUnwindSafe(|| f(g.clone())));
                    let failure = match out {
                        Ok(Ok(v)) => return Ok(v),
                        Ok(Err(e)) => e.to_string(),
                        // A collective that failed inside forward/backward is an error report.
                        Err(p) if p.is::<CollectiveFailure>() => panic_message(p.as_ref()),
                        Err(p) => format!("panicked: {}", panic_message(p.as_ref())),
                    };
                    let secondary = failure.contains("aborted: rank");
                    g.fail(&failure);
                    Err((failure, secondary))
                })
            })
            .collect();
        handles
            .into_iter()
            .map(|h| h.join().unwrap_or_else(|p| Err((panic_message(p.as_ref()), false))))
            .collect()
    });
    let mut values = Vec::with_capacity(world);
    let mut first: Option<RankError> = None;
    let mut any: Option<RankError> = None;
    for (rank, r) in results.into_iter().enumerate() {
        match r {
            Ok(v) => values.push(v),
            Err((message, secondary)) => {
                let e = RankError { rank, message };
                if !secondary && first.is_none() {
                    first = Some(e.clone());
                }
                any.get_or_insert(e);
            }
        }
    }
    match first.or(any) {
        Some(e) => Err(e),
        None => Ok(values),
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use burn::backend::NdArray;
    use burn::tensor::TensorData;

    type B = NdArray<f32>;

    fn t(v: Vec<f32>) -> Tensor<B, 1> {
        let n = v.len();
        Tensor::from_data(TensorData::new(v, [n]), &Default::default())
    }

    fn vals(x: Tensor<B, 1>) -> Vec<f32> {
        x.into_data().to_vec::<f32>().unwrap()
    }

    #[test]
    fn every_collective_at_world_sizes_1_to_8() {
        for world in 1..=8usize {
            let out = launch(world, Duration::from_secs(10), |g| {
                let r = g.rank() as f32;
                let tag = Tag::new("t");
                // Rank r contributes [r, r + 0.5, r + 0.25] (3 elements: uneven w.r.t. most W).
                let mine = vec![r, r + 0.5, r + 0.25];
                let ag = vals(ProcessGroup::<B>::all_gather(&*g, t(mine.clone()), &tag)?);
                let rs_in: Vec<f32> = (0..world * 2).map(|i| i as f32 + r).collect();
                let rs_sum =
                    vals(ProcessGroup::<B>::reduce_scatter(&*g, t(rs_in.clone()), ReduceOp::Sum, &tag)?);
                let rs_avg = vals(ProcessGroup::<B>::reduce_scatter(&*g, t(rs_in), ReduceOp::Avg, &tag)?);
                let ar = vals(ProcessGroup::<B>::all_reduce(&*g, t(mine.clone()), ReduceOp::Max, &tag)?);
                let bc = vals(ProcessGroup::<B>::broadcast(&*g, t(mine), world - 1, &tag)?);
                ProcessGroup::<B>::barrier(&*g, &tag)?;
                Ok::<_, CommError>((ag, rs_sum, rs_avg, ar, bc, ProcessGroup::<B>::stats(&*g)))
            })
            .unwrap();
            let w = world as f32;
            let sum_r: f32 = (0..world).map(|r| r as f32).sum();
            for (rank, (ag, rs_sum, rs_avg, ar, bc, stats)) in out.into_iter().enumerate() {
                let want_ag: Vec<f32> =
                    (0..world).flat_map(|r| [r as f32, r as f32 + 0.5, r as f32 + 0.25]).collect();
                assert_eq!(ag, want_ag, "all_gather W={world}");
                let want_sum: Vec<f32> = (0..2).map(|j| ((rank * 2 + j) as f32) * w + sum_r).collect();
                assert_eq!(rs_sum, want_sum, "reduce_scatter sum W={world}");
                let want_avg: Vec<f32> = want_sum.iter().map(|x| x / w).collect();
                assert_eq!(rs_avg, want_avg, "reduce_scatter avg W={world}");
                let top = (world - 1) as f32;
                assert_eq!(ar, vec![top, top + 0.5, top + 0.25], "all_reduce max W={world}");
                assert_eq!(bc, vec![top, top + 0.5, top + 0.25], "broadcast W={world}");
                let expected_calls = if world == 1 { 0 } else { 1 };
                assert_eq!(stats.calls(CollectiveKind::AllGather), expected_calls);
                assert_eq!(stats.calls(CollectiveKind::ReduceScatter), 2 * expected_calls);
                assert_eq!(stats.calls(CollectiveKind::Barrier), expected_calls);
            }
        }
    }

    #[test]
    #[cfg(feature = "cpu")]
    fn a_flex_all_gather_is_made_once_and_shared_by_every_rank() {
        use burn::backend::Flex;
        for world in 2..=4usize {
            let out = launch(world, Duration::from_secs(10), |g| {
                let r = g.rank() as f32;
                let x = Tensor::<Flex, 1>::from_floats([r, r + 0.5, r + 0.25], &Default::default());
                let mut results = Vec::new();
                // Several rounds: a different rank may make each one.
                for k in 0..5 {
                    let y = ProcessGroup::<Flex>::all_gather(&*g, x.clone(), &Tag::new(format!("s{k}")))?;
                    let f =
                        crate::downcast::must::<_, FlexTensor>(y.clone().into_primitive().tensor(), "Flex");
                    results
                        .push((y.into_data().to_vec::<f32>().unwrap(), Arc::as_ptr(&f.data_arc()) as usize));
                }
                Ok::<_, CommError>(results)
            })
            .unwrap();
            let want: Vec<f32> =
                (0..world).flat_map(|r| [r as f32, r as f32 + 0.5, r as f32 + 0.25]).collect();
            for k in 0..5 {
                for rank_out in &out {
                    assert_eq!(rank_out[k].0, want, "W={world} round {k}");
                    assert_eq!(rank_out[k].1, out[0][k].1, "W={world} round {k}: one buffer for all ranks");
                }
            }
        }
        // A rank that never comes: the others time out naming it, nobody waits for a maker.
        let e = launch(3, Duration::from_millis(300), |g| {
            if g.rank() == 2 {
                return Ok(());
            }
            let x = Tensor::<Flex, 1>::from_floats([1.0], &Default::default());
            ProcessGroup::<Flex>::all_gather(&*g, x, &Tag::new("late")).map(|_| ())
        })
        .unwrap_err();
        assert!(e.message.contains("rank(s) [2] did not arrive"), "{e}");
    }

    /// A peer that took a finished collective's result and failed at once must not turn that
    /// collective into an error on the ranks still waking up from it; the failure reaches
    /// them at their next collective. Made deterministic by letting rank 1 arrive and fail
    /// under one hold of the lock, while rank 0 waits inside the barrier.
    #[test]
    fn a_round_finished_before_a_peer_fails_is_delivered_and_the_failure_comes_next() {
        let groups = LocalGroup::new_group(2, Duration::from_secs(10));
        let (g0, g1) = (groups[0].clone(), groups[1].clone());
        let tag = Tag::new("finished");
        let waiter = std::thread::spawn(move || {
            let first = ProcessGroup::<B>::barrier(&*g0, &Tag::new("finished"));
            let second = ProcessGroup::<B>::barrier(&*g0, &Tag::new("next"));
            (first, second)
        });
        while g1.shared.lock().rounds.is_empty() {
            std::thread::sleep(Duration::from_millis(1));
        }
        let (_, mut st) = g1.arrive(CollectiveKind::Barrier, &tag, Arc::new(()), 0).unwrap();
        st.aborted = Some((1, "rank 1 gives up".into()));
        g1.shared.cv.notify_all();
        drop(st);
        let (first, second) = waiter.join().unwrap();
        assert!(first.is_ok(), "the finished barrier is delivered: {first:?}");
        let e = second.unwrap_err().to_string();
        assert!(e.contains("rank 1") && e.contains("gives up"), "{e}");
    }

    #[test]
    fn reduce_scatter_of_an_unsplittable_length_is_an_error() {
        let e = launch(2, Duration::from_secs(10), |g| {
            ProcessGroup::<B>::reduce_scatter(&*g, t(vec![1.0; 3]), ReduceOp::Sum, &Tag::new("odd"))
                .map(|_| ())
        })
        .unwrap_err();
        assert!(e.message.contains("do not split"), "{e}");
    }

    #[test]
    fn host_sums_are_bit_identical_to_backend_ops() {
        // Values of mixed magnitudes and signs, so that rounding depends on the order.
        let mut x = 0x2545_f491_4f6c_dd1du64;
        let mut next = move || {
            x ^= x << 13;
            x ^= x >> 7;
            x ^= x << 17;
            ((x >> 11) as f64 / (1u64 << 53) as f64 - 0.5) as f32 * 10f32.powi((x % 9) as i32 - 4)
        };
        for world in [2usize, 3, 5, 7] {
            let n = 10_000;
            let inputs: Vec<Vec<f32>> = (0..world).map(|_| (0..n).map(|_| next()).collect()).collect();
            let data: Vec<TensorData> = inputs.iter().map(|v| TensorData::new(v.clone(), [n])).collect();
            let parts: Vec<&TensorData> = data.iter().collect();
            let tensors: Vec<Tensor<B, 1>> = inputs.into_iter().map(t).collect();
            for op in [ReduceOp::Sum, ReduceOp::Avg] {
                let bytes: Vec<&[u8]> = parts.iter().map(|p| p.as_bytes()).collect();
                let host = crate::comm::host::reduce_bytes(&bytes, DType::F32, op).unwrap();
                let host: Vec<f32> =
                    host.chunks_exact(4).map(|c| f32::from_le_bytes([c[0], c[1], c[2], c[3]])).collect();
                let ops = vals(reduce_range(&tensors, 0..n, op));
                let bits = |v: &[f32]| v.iter().map(|x| x.to_bits()).collect::<Vec<_>>();
                assert_eq!(bits(&host), bits(&ops), "W={world} {op:?}");
            }
        }
    }

    #[test]
    fn bf16_inputs_are_reduced_and_returned_in_bf16() {
        type F = burn::backend::Flex<f32>;
        let out = launch(2, Duration::from_secs(10), |g| {
            let x = Tensor::<F, 1>::from_floats([1.0, 2.5], &Default::default()).cast(DType::BF16);
            let r = ProcessGroup::<F>::all_reduce(&*g, x.clone(), ReduceOp::Sum, &Tag::new("bf"))?;
            let a = ProcessGroup::<F>::all_gather(&*g, x, &Tag::new("bf-ag"))?;
            Ok::<_, CommError>((
                r.dtype(),
                r.cast(DType::F32).into_data().to_vec::<f32>().unwrap(),
                a.dtype(),
            ))
        })
        .unwrap();
        for (dtype, v, ag_dtype) in out {
            assert_eq!((dtype, ag_dtype), (DType::BF16, DType::BF16));
            assert_eq!(v, vec![2.0, 5.0]);
        }
    }

    /// On Flex the ranks read each other's memory instead of copies of it: the same results
    /// as NdArray (which copies), bit for bit, for inputs that start inside their buffer (a
    /// slice) and inputs the caller still holds — whose values the collectives leave alone.
    #[test]
    #[cfg(feature = "cpu")]
    fn flex_contributions_are_shared_not_copied_and_give_the_same_bits() {
        type F = burn::backend::Flex<f32>;
        fn run<X: Backend>(world: usize) -> Vec<Vec<Vec<f32>>> {
            launch(world, Duration::from_secs(10), |g| {
                let r = g.rank();
                let dev = Default::default();
                // 4 + 6·world values of mixed magnitudes; the input is a slice from element 4.
                let all: Vec<f32> = (0..4 + 6 * world)
                    .map(|i| ((i * 7 + r * 13) % 11) as f32 * 0.37 - 1.5 + r as f32 * 1e-3)
                    .collect();
                let n = all.len();
                let full = Tensor::<X, 1>::from_data(TensorData::new(all, [n]), &dev);
                let x = full.clone().slice(4..n);
                let held = x.clone();
                let v = |t: Tensor<X, 1>| t.into_data().convert::<f32>().to_vec::<f32>().unwrap();
                let tag = Tag::new("flex");
                let ag = v(ProcessGroup::<X>::all_gather(&*g, x.clone(), &tag)?);
                let rs = v(ProcessGroup::<X>::reduce_scatter(&*g, x.clone(), ReduceOp::Sum, &tag)?);
                let avg = v(ProcessGroup::<X>::reduce_scatter(&*g, x.clone(), ReduceOp::Avg, &tag)?);
                let mut ar = ProcessGroup::<X>::all_reduce(&*g, x.clone(), ReduceOp::Max, &tag)?;
                // Writing to a rank's result must not reach anyone else's.
                ar = ar.add_scalar(r as f64);
                ProcessGroup::<X>::barrier(&*g, &tag)?;
                Ok::<_, CommError>(vec![ag, rs, avg, v(ar), v(held), v(full)])
            })
            .unwrap()
        }
        for world in [2usize, 3] {
            let (flex, nd) = (run::<F>(world), run::<B>(world));
            let bits = |v: &Vec<Vec<Vec<f32>>>| {
                v.iter()
                    .map(|r| {
                        r.iter()
                            .map(|x| x.iter().map(|f| f.to_bits()).collect::<Vec<_>>())
                            .collect::<Vec<_>>()
                    })
                    .collect::<Vec<_>>()
            };
            assert_eq!(bits(&flex), bits(&nd), "W={world}");
            for (rank, out) in flex.iter().enumerate() {
                assert_eq!(out[4], out[5][4..].to_vec(), "rank {rank}: the held input is unchanged");
            }
        }
    }
}
