//! In-process ranks: one thread per rank, collectives through shared memory.
//!
//! [`LocalGroup::new_group`] makes the handles of one group; [`launch`] runs a closure on
//! `world` threads and turns a panicking or failing rank into an error on every other rank
//! (the group is aborted, so nobody waits for the timeout).

use std::collections::HashMap;
use std::panic::{AssertUnwindSafe, catch_unwind};
use std::sync::{Arc, Condvar, Mutex, MutexGuard};
use std::time::{Duration, Instant};

use burn::tensor::backend::Backend;
use burn::tensor::{DType, Tensor, TensorData};

use crate::comm::{CollectiveKind, CommCounters, CommError, CommStats, ProcessGroup, ReduceOp, Tag};

/// Default collective timeout.
pub const DEFAULT_TIMEOUT: Duration = Duration::from_secs(60);

struct Round {
    kind: CollectiveKind,
    tag: Tag,
    first_rank: usize,
    inputs: Vec<Option<Arc<TensorData>>>,
    arrived: usize,
    left: usize,
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
/// use burn_fsdp::local::launch;
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
        input: TensorData,
    ) -> Result<Vec<Arc<TensorData>>, CommError> {
        let bytes = input.as_bytes().len() as u64;
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
        round.inputs[self.rank] = Some(Arc::new(input));
        round.arrived += 1;
        self.shared.cv.notify_all();
        let deadline = Instant::now() + self.shared.timeout;
        loop {
            if let Some((failed_rank, reason)) = &st.aborted {
                return Err(self.peer_failed(kind, tag, *failed_rank, reason));
            }
            let round =
                st.rounds.get_mut(&seq).ok_or_else(|| self.bad(kind, tag, "round vanished".into()))?;
            if round.arrived == size {
                let inputs: Vec<Arc<TensorData>> = round.inputs.iter().flatten().cloned().collect();
                round.left += 1;
                if round.left == size {
                    st.rounds.remove(&seq);
                }
                return Ok(inputs);
            }
            let now = Instant::now();
            if now >= deadline {
                let missing =
                    round.inputs.iter().enumerate().filter(|(_, i)| i.is_none()).map(|(r, _)| r).collect();
                let err = CommError::Timeout {
                    kind,
                    tag: tag.clone(),
                    rank: self.rank,
                    missing,
                    timeout: self.shared.timeout,
                };
                st.aborted = Some((self.rank, err.to_string()));
                self.shared.cv.notify_all();
                return Err(err);
            }
            st = self.shared.cv.wait_timeout(st, deadline - now).unwrap_or_else(|p| p.into_inner()).0;
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

    fn same_len(
        &self,
        kind: CollectiveKind,
        tag: &Tag,
        inputs: &[Arc<TensorData>],
    ) -> Result<usize, CommError> {
        let n = inputs[0].num_elements();
        let dtype = inputs[0].dtype;
        for (r, i) in inputs.iter().enumerate() {
            if i.num_elements() != n || i.dtype != dtype {
                return Err(self.bad(
                    kind,
                    tag,
                    format!(
                        "rank {r} contributed {} elements of {:?}, rank 0 {n} of {dtype:?}",
                        i.num_elements(),
                        i.dtype
                    ),
                ));
            }
        }
        Ok(n)
    }
}

/// `range` of `d` as f32 values (borrowed when `d` already holds f32).
fn f32_range(d: &TensorData, range: std::ops::Range<usize>) -> std::borrow::Cow<'_, [f32]> {
    match d.as_slice::<f32>() {
        Ok(s) if d.dtype == DType::F32 => std::borrow::Cow::Borrowed(&s[range]),
        _ => {
            let all = d.clone().convert::<f32>().to_vec::<f32>().unwrap_or_default();
            std::borrow::Cow::Owned(all[range].to_vec())
        }
    }
}

fn reduce_into(acc: &mut [f32], x: &[f32], op: ReduceOp) {
    match op {
        ReduceOp::Sum | ReduceOp::Avg => acc.iter_mut().zip(x).for_each(|(a, b)| *a += b),
        ReduceOp::Max => acc.iter_mut().zip(x).for_each(|(a, b)| *a = a.max(*b)),
    }
}

/// Reduces `range` of every input in rank order (the same order on every rank, so all ranks
/// get bit-identical results).
fn reduce_range(inputs: &[Arc<TensorData>], range: std::ops::Range<usize>, op: ReduceOp) -> Vec<f32> {
    let mut acc = f32_range(&inputs[0], range.clone()).into_owned();
    for i in &inputs[1..] {
        reduce_into(&mut acc, &f32_range(i, range.clone()), op);
    }
    if op == ReduceOp::Avg {
        let w = inputs.len() as f32;
        acc.iter_mut().for_each(|a| *a /= w);
    }
    acc
}

fn from_f32<B: Backend>(v: Vec<f32>, dtype: DType, device: &B::Device) -> Tensor<B, 1> {
    let n = v.len();
    let data = TensorData::new(v, [n]);
    let data = if dtype == DType::F32 { data } else { data.convert_dtype(dtype) };
    Tensor::from_data(data, device)
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
        if self.shared.size == 1 {
            return Ok(input);
        }
        let kind = CollectiveKind::AllGather;
        let device = input.device();
        let inputs = self.exchange(kind, tag, input.into_data())?;
        let n = self.same_len(kind, tag, &inputs)?;
        let mut bytes = Vec::with_capacity(inputs.iter().map(|i| i.as_bytes().len()).sum());
        for i in &inputs {
            bytes.extend_from_slice(i.as_bytes());
        }
        let data = TensorData::from_bytes_vec(bytes, [n * inputs.len()], inputs[0].dtype);
        Ok(Tensor::from_data(data, &device))
    }

    fn reduce_scatter(
        &self,
        input: Tensor<B, 1>,
        op: ReduceOp,
        tag: &Tag,
    ) -> Result<Tensor<B, 1>, CommError> {
        if self.shared.size == 1 {
            return Ok(input);
        }
        let kind = CollectiveKind::ReduceScatter;
        let size = self.shared.size;
        let device = input.device();
        let inputs = self.exchange(kind, tag, input.into_data())?;
        let total = self.same_len(kind, tag, &inputs)?;
        if total % size != 0 {
            return Err(self.bad(kind, tag, format!("{total} elements do not split into {size} chunks")));
        }
        let n = total / size;
        let out = reduce_range(&inputs, self.rank * n..(self.rank + 1) * n, op);
        Ok(from_f32(out, inputs[0].dtype, &device))
    }

    fn all_reduce(&self, input: Tensor<B, 1>, op: ReduceOp, tag: &Tag) -> Result<Tensor<B, 1>, CommError> {
        if self.shared.size == 1 {
            return Ok(input);
        }
        let kind = CollectiveKind::AllReduce;
        let device = input.device();
        let inputs = self.exchange(kind, tag, input.into_data())?;
        let n = self.same_len(kind, tag, &inputs)?;
        Ok(from_f32(reduce_range(&inputs, 0..n, op), inputs[0].dtype, &device))
    }

    fn broadcast(&self, input: Tensor<B, 1>, root: usize, tag: &Tag) -> Result<Tensor<B, 1>, CommError> {
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
        let device = input.device();
        let inputs = self.exchange(kind, tag, input.into_data())?;
        Ok(Tensor::from_data((*inputs[root]).clone(), &device))
    }

    fn barrier(&self, tag: &Tag) -> Result<(), CommError> {
        if self.shared.size == 1 {
            return Ok(());
        }
        self.exchange(CollectiveKind::Barrier, tag, TensorData::new(Vec::<f32>::new(), [0])).map(|_| ())
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

fn panic_message(p: &(dyn std::any::Any + Send)) -> String {
    if let Some(s) = p.downcast_ref::<String>() {
        s.clone()
    } else if let Some(s) = p.downcast_ref::<&str>() {
        (*s).to_owned()
    } else {
        "panic".to_owned()
    }
}

/// Runs `f` on `world` threads, each with its rank's handle of a fresh [`LocalGroup`].
///
/// Returns every rank's value, or the error of the rank that failed first (a rank that
/// failed only because a peer did is not reported as the cause). A rank that panics or
/// returns an error aborts the group, so its peers stop within their current collective.
pub fn launch<T, E, F>(world: usize, timeout: Duration, f: F) -> Result<Vec<T>, RankError>
where
    T: Send,
    E: std::fmt::Display,
    F: Fn(Arc<LocalGroup>) -> Result<T, E> + Send + Sync,
{
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
