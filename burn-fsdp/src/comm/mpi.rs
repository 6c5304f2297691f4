//! MPI process groups: one rank per process, over OpenMPI or MPICH (`--features mpi`).
//!
//! [`MpiGroup::world`] initialises MPI (once per process) and returns this process's handle
//! on `MPI_COMM_WORLD`; [`MpiGroup::split`] makes sub-groups (e.g. the dimensions of a 2D
//! mesh). Collectives work on host buffers of any backend: a tensor is read to the host
//! (`into_data`), exchanged as bytes, and the result is uploaded to the input's device.
//!
//! The semantics are those of [`LocalGroup`](crate::LocalGroup), number for number:
//! reductions add the ranks' values **in rank order** on every rank (bf16/f16 accumulated in
//! f32 and rounded once), so an MPI run is bit-identical to the in-process run of the same
//! world size. Reduce-scatter is an all-to-all followed by that ordered sum; all-reduce is a
//! reduce-scatter followed by an all-gather.
//!
//! # Failure handling
//!
//! - Every collective starts with an all-gather of a 128-byte header (sequence number, kind,
//!   tag, dtype, length), so ranks that issue different collectives, or the same collective
//!   with different sizes, all get [`CommError::Mismatch`]/[`CommError::BadInput`] instead of
//!   corrupting memory or hanging.
//! - Collectives are non-blocking MPI calls polled against the group's timeout: a peer that
//!   died or stopped calling collectives gives [`CommError::Stalled`] (MPI cannot say which
//!   peer). Launchers like `mpirun` usually kill the job first when a process dies.
//! - [`ProcessGroup::abort`] sends a notice to every peer on a private communicator; peers
//!   waiting in (or later entering) a collective return [`CommError::PeerFailed`] with the
//!   reason.
//!
//! MPI is finalised when the last handle (every group, and every [`MpiGroup::split`] of it)
//! is dropped; MPI cannot be initialised again in the same process afterwards.

use std::sync::{Arc, Mutex, MutexGuard, Weak};
use std::time::{Duration, Instant};

use burn::tensor::backend::Backend;
use burn::tensor::{DType, Tensor};
use mpi::Threading;
use mpi::environment::Universe;
use mpi::request::{Request, StaticScope};
use mpi::topology::{Color, SimpleCommunicator};
use mpi::traits::*;

use crate::comm::{CollectiveKind, CommCounters, CommError, CommStats, ProcessGroup, ReduceOp, Tag};

/// Serialises every MPI call of the process. MPI is initialised with at least
/// `MPI_THREAD_SERIALIZED`, which allows calls from any thread but never two at once.
static MPI_LOCK: Mutex<()> = Mutex::new(());

fn mpi_lock() -> MutexGuard<'static, ()> {
    // Nothing guarded by the lock can be left half-updated by a panic (it guards MPI calls,
    // not data), so a poisoned lock is still usable.
    MPI_LOCK.lock().unwrap_or_else(|p| p.into_inner())
}

/// The initialised MPI environment; finalises MPI when dropped.
struct Env {
    universe: Option<Universe>,
}

// SAFETY: `Universe` is a token for the initialised MPI library and holds no thread-affine
// data; MPI was initialised with `MPI_THREAD_SERIALIZED` or better, and every MPI call made
// through it (including `MPI_Finalize` in its drop) happens under `MPI_LOCK`.
unsafe impl Send for Env {}
// SAFETY: as above: shared references only reach MPI under `MPI_LOCK`.
unsafe impl Sync for Env {}

impl Drop for Env {
    fn drop(&mut self) {
        let _g = mpi_lock();
        drop(self.universe.take());
    }
}

/// The live environment, if any (weak: MPI is finalised when the last group goes).
static ENV: Mutex<Option<Weak<Env>>> = Mutex::new(None);

/// MPI tag of abort notices on each group's control communicator.
const ABORT_TAG: i32 = 0x0AB0;
/// Size of an abort notice: a rank (u32) and a UTF-8 reason.
const NOTICE_LEN: usize = 1024;
/// Size of a collective header.
const HEADER_LEN: usize = 128;
/// How many tag bytes a header carries (for messages; equality uses all of them).
const HEADER_TAG_LEN: usize = HEADER_LEN - 32;

/// A heap buffer handed to MPI: leaked while a request may use it, reclaimed afterwards.
struct Leaked {
    ptr: *mut [u8],
}

impl Leaked {
    fn new(v: Vec<u8>) -> Self {
        Self { ptr: Box::into_raw(v.into_boxed_slice()) }
    }

    /// A `'static` view for a request.
    ///
    /// # Safety
    /// The caller must not reclaim the buffer while a request using the view is pending.
    unsafe fn get(&self) -> &'static mut [u8] {
        // SAFETY: `ptr` came from `Box::into_raw` and is only freed by `reclaim`, which the
        // caller promises not to call while the view is in use.
        unsafe { &mut *self.ptr }
    }

    /// Takes the buffer back.
    ///
    /// # Safety
    /// Every request that used a view of this buffer must have completed.
    unsafe fn reclaim(self) -> Vec<u8> {
        // SAFETY: `ptr` came from `Box::into_raw` and no view is in use any more.
        unsafe { Box::from_raw(self.ptr) }.into_vec()
    }
}

/// An abort notice receive posted on the control communicator.
struct Listener {
    request: Option<Request<'static, [u8]>>,
    buf: Leaked,
}

/// One rank's handle on an MPI communicator.
///
/// # Example
///
/// Run under a launcher, e.g. `mpirun -n 4 my-program`:
///
/// ```no_run
/// use burn::backend::NdArray;
/// use burn::tensor::Tensor;
/// use burn_fsdp::comm::{ProcessGroup, ReduceOp, Tag};
/// use burn_fsdp::comm::mpi::MpiGroup;
///
/// let group = MpiGroup::world(std::time::Duration::from_secs(60)).expect("MPI");
/// let x = Tensor::<NdArray, 1>::from_floats([group.rank() as f32], &Default::default());
/// let sum = ProcessGroup::<NdArray>::all_reduce(&*group, x, ReduceOp::Sum, &Tag::new("demo")).unwrap();
/// println!("rank {}: sum of ranks = {}", group.rank(), sum.into_scalar());
/// ```
pub struct MpiGroup {
    // Field order is drop order: requests and communicators go before the environment.
    listener: Mutex<Listener>,
    comm: SimpleCommunicator,
    ctrl: SimpleCommunicator,
    rank: usize,
    size: usize,
    timeout: Duration,
    seq: Mutex<u64>,
    aborted: Mutex<Option<(usize, String)>>,
    counters: CommCounters,
    env: Arc<Env>,
}

// SAFETY: the communicators and requests are plain MPI handles; every MPI call made through
// them happens under the process-wide `MPI_LOCK` (MPI is initialised with at least
// `MPI_THREAD_SERIALIZED`), and the Rust-side state is behind mutexes.
unsafe impl Send for MpiGroup {}
// SAFETY: as above.
unsafe impl Sync for MpiGroup {}

fn transport(msg: impl Into<String>) -> CommError {
    CommError::BadInput { kind: CollectiveKind::Barrier, tag: Tag::new("mpi-init"), rank: 0, msg: msg.into() }
}

impl MpiGroup {
    /// This process's handle on `MPI_COMM_WORLD`, initialising MPI on first use.
    ///
    /// Errors when MPI cannot be initialised (or was already finalised in this process).
    pub fn world(timeout: Duration) -> Result<Arc<Self>, CommError> {
        let env = {
            let mut slot = ENV.lock().unwrap_or_else(|p| p.into_inner());
            match slot.as_ref().and_then(Weak::upgrade) {
                Some(env) => env,
                None => {
                    if slot.is_some() {
                        return Err(transport(
                            "MPI was already finalised in this process and cannot be initialised again",
                        ));
                    }
                    let _g = mpi_lock();
                    let (universe, level) = mpi::initialize_with_threading(Threading::Serialized)
                        .ok_or_else(|| transport("MPI_Init_thread failed (is MPI already initialised?)"))?;
                    if level < Threading::Serialized {
                        return Err(transport(format!(
                            "the MPI library provides only {level:?} threading; MPI_THREAD_SERIALIZED is needed"
                        )));
                    }
                    let env = Arc::new(Env { universe: Some(universe) });
                    *slot = Some(Arc::downgrade(&env));
                    env
                }
            }
        };
        let comm = {
            let _g = mpi_lock();
            let Some(universe) = env.universe.as_ref() else {
                return Err(transport("MPI environment already finalised"));
            };
            universe.world().duplicate()
        };
        Ok(Arc::new(Self::from_comm(comm, timeout, env)))
    }

    fn from_comm(comm: SimpleCommunicator, timeout: Duration, env: Arc<Env>) -> Self {
        let _g = mpi_lock();
        let ctrl = comm.duplicate();
        let (rank, size) = (comm.rank() as usize, comm.size() as usize);
        let buf = Leaked::new(vec![0u8; NOTICE_LEN]);
        // SAFETY: the buffer is reclaimed only in `Drop`, after this request is cancelled and
        // completed (or never, if it cannot be).
        let view = unsafe { buf.get() };
        let request = ctrl.any_process().immediate_receive_into_with_tag(StaticScope, view, ABORT_TAG);
        Self {
            listener: Mutex::new(Listener { request: Some(request), buf }),
            comm,
            ctrl,
            rank,
            size,
            timeout,
            seq: Mutex::new(0),
            aborted: Mutex::new(None),
            counters: CommCounters::default(),
            env,
        }
    }

    /// Splits this group: ranks passing the same `color` form a new group, ordered by `key`
    /// (then by rank). Collective over this group: every rank must call it.
    pub fn split(&self, color: u32, key: u32) -> Result<Arc<Self>, CommError> {
        let comm = {
            let _g = mpi_lock();
            self.comm.split_by_color_with_key(Color::with_value(color as i32), key as i32)
        };
        let comm = comm.ok_or_else(|| transport("MPI_Comm_split returned no communicator"))?;
        Ok(Arc::new(Self::from_comm(comm, self.timeout, self.env.clone())))
    }

    /// This rank's index.
    pub fn rank(&self) -> usize {
        self.rank
    }

    /// Number of ranks.
    pub fn size(&self) -> usize {
        self.size
    }

    /// The collective timeout.
    pub fn timeout(&self) -> Duration {
        self.timeout
    }

    fn next_seq(&self) -> u64 {
        let mut s = self.seq.lock().unwrap_or_else(|p| p.into_inner());
        let v = *s;
        *s += 1;
        v
    }

    fn bad(&self, kind: CollectiveKind, tag: &Tag, msg: String) -> CommError {
        CommError::BadInput { kind, tag: tag.clone(), rank: self.rank, msg }
    }

    fn failed(&self, kind: CollectiveKind, tag: &Tag) -> Option<CommError> {
        let st = self.aborted.lock().unwrap_or_else(|p| p.into_inner());
        st.as_ref().map(|(failed_rank, reason)| CommError::PeerFailed {
            kind,
            tag: tag.clone(),
            rank: self.rank,
            failed_rank: *failed_rank,
            reason: reason.clone(),
        })
    }

    fn mark_failed(&self, rank: usize, reason: String) {
        let mut st = self.aborted.lock().unwrap_or_else(|p| p.into_inner());
        if st.is_none() {
            *st = Some((rank, reason));
        }
    }

    /// Checks for an abort notice from a peer (non-blocking).
    fn poll_notice(&self) {
        let mut l = self.listener.lock().unwrap_or_else(|p| p.into_inner());
        let Some(req) = l.request.take() else { return };
        let done = {
            let _g = mpi_lock();
            req.test()
        };
        match done {
            Ok(status) => {
                // SAFETY: the receive completed, so MPI no longer writes to the buffer; the
                // view is dropped before the buffer is ever reclaimed.
                let bytes = unsafe { l.buf.get() };
                let count = (status.count(u8::equivalent_datatype()).max(0) as usize).min(NOTICE_LEN);
                let msg = String::from_utf8_lossy(&bytes[4.min(count)..count]).into_owned();
                let from = status.source_rank().max(0) as usize;
                self.mark_failed(from, msg);
            }
            Err(req) => l.request = Some(req),
        }
    }

    /// Waits for `req`, polling for abort notices, until the timeout.
    fn wait<D: ?Sized>(
        &self,
        req: Request<'static, D>,
        kind: CollectiveKind,
        tag: &Tag,
    ) -> Result<(), CommError> {
        let deadline = Instant::now() + self.timeout;
        let mut req = req;
        let mut polls = 0u32;
        loop {
            let r = {
                let _g = mpi_lock();
                req.test()
            };
            match r {
                Ok(_) => return Ok(()),
                Err(back) => req = back,
            }
            polls = polls.wrapping_add(1);
            if polls.is_multiple_of(64) {
                self.poll_notice();
                if let Some(e) = self.failed(kind, tag) {
                    // SAFETY: every buffer of a collective request is a `Leaked` that is
                    // never reclaimed when the request is abandoned, so MPI may keep using it.
                    let _ = unsafe { req.into_raw() };
                    return Err(e);
                }
            }
            if Instant::now() >= deadline {
                // SAFETY: as above: the request's buffers stay leaked.
                let _ = unsafe { req.into_raw() };
                let err =
                    CommError::Stalled { kind, tag: tag.clone(), rank: self.rank, timeout: self.timeout };
                self.mark_failed(self.rank, err.to_string());
                return Err(err);
            }
            if polls < 2_000 {
                std::thread::yield_now();
            } else {
                std::thread::sleep(Duration::from_micros(50));
            }
        }
    }

    /// All-gathers `send` (equal length on every rank) into a `size × len` buffer.
    fn all_gather_bytes(&self, send: Vec<u8>, kind: CollectiveKind, tag: &Tag) -> Result<Vec<u8>, CommError> {
        let len = send.len();
        if len > i32::MAX as usize || len * self.size > i32::MAX as usize {
            return Err(self.bad(kind, tag, format!("{len} bytes per rank exceed MPI's 32-bit counts")));
        }
        let send = Leaked::new(send);
        let recv = Leaked::new(vec![0u8; len * self.size]);
        let req = {
            let _g = mpi_lock();
            // SAFETY: both buffers are reclaimed below only after the request completed; if it
            // is abandoned, they stay leaked.
            let (s, r) = unsafe { (send.get(), recv.get()) };
            self.comm.immediate_all_gather_into(StaticScope, &*s, r)
        };
        self.wait(req, kind, tag)?;
        // SAFETY: the request completed.
        unsafe {
            drop(send.reclaim());
            Ok(recv.reclaim())
        }
    }

    /// All-to-all of `send` (`size` equal chunks): chunk `r` goes to rank `r`.
    fn all_to_all_bytes(&self, send: Vec<u8>, kind: CollectiveKind, tag: &Tag) -> Result<Vec<u8>, CommError> {
        let len = send.len();
        if len > i32::MAX as usize {
            return Err(self.bad(kind, tag, format!("{len} bytes exceed MPI's 32-bit counts")));
        }
        let send = Leaked::new(send);
        let recv = Leaked::new(vec![0u8; len]);
        let req = {
            let _g = mpi_lock();
            // SAFETY: see `all_gather_bytes`.
            let (s, r) = unsafe { (send.get(), recv.get()) };
            self.comm.immediate_all_to_all_into(StaticScope, &*s, r)
        };
        self.wait(req, kind, tag)?;
        // SAFETY: the request completed.
        unsafe {
            drop(send.reclaim());
            Ok(recv.reclaim())
        }
    }

    /// Exchanges headers and checks that every rank issued the same collective with the same
    /// dtype and length. Returns the lengths (elements) of every rank.
    fn handshake(
        &self,
        kind: CollectiveKind,
        tag: &Tag,
        dtype: u8,
        elems: u64,
        extra: u64,
    ) -> Result<(), CommError> {
        if let Some(e) = self.failed(kind, tag) {
            return Err(e);
        }
        let seq = self.next_seq();
        let header = Header { seq, kind: kind.index() as u8, dtype, elems, extra, tag: tag.0.clone() };
        let all = self.all_gather_bytes(header.encode(), kind, tag)?;
        let mine = header.encode();
        for (r, h) in all.chunks_exact(HEADER_LEN).enumerate() {
            if h == mine.as_slice() {
                continue;
            }
            let theirs = Header::decode(h);
            if theirs.seq != seq
                || theirs.kind != header.kind
                || h[..16] != mine[..16]
                || h[24..120] != mine[24..120]
            {
                let other_kind = CollectiveKind::ALL.get(theirs.kind as usize).copied();
                let err = CommError::Mismatch {
                    seq,
                    rank: self.rank,
                    mine: format!("{kind} `{tag}`"),
                    other_rank: r,
                    theirs: match other_kind {
                        Some(k) => format!("{k} `{}`", theirs.tag),
                        None => format!("an unknown collective `{}`", theirs.tag),
                    },
                };
                self.mark_failed(self.rank, err.to_string());
                return Err(err);
            }
            let err = self.bad(
                kind,
                tag,
                format!(
                    "rank {r} contributed {} elements of dtype #{} (extra {}), this rank {elems} of #{dtype} (extra {extra})",
                    theirs.elems, theirs.dtype, theirs.extra
                ),
            );
            self.mark_failed(self.rank, err.to_string());
            return Err(err);
        }
        Ok(())
    }
}

impl Drop for MpiGroup {
    fn drop(&mut self) {
        let l = self.listener.get_mut().unwrap_or_else(|p| p.into_inner());
        if let Some(req) = l.request.take() {
            let _g = mpi_lock();
            req.cancel();
            // A cancelled receive completes (cancelled, or with a late notice); wait briefly.
            let deadline = Instant::now() + Duration::from_secs(1);
            let mut req = req;
            loop {
                match req.test() {
                    Ok(_) => break,
                    Err(back) if Instant::now() < deadline => req = back,
                    Err(back) => {
                        // SAFETY: the buffer is not reclaimed below when the receive is
                        // abandoned (see the flag), so MPI may still write to it.
                        let _ = unsafe { back.into_raw() };
                        return;
                    }
                }
            }
            let buf = std::mem::replace(&mut l.buf, Leaked::new(Vec::new()));
            // SAFETY: the receive completed (cancelled or not).
            drop(unsafe { buf.reclaim() });
        }
    }
}

/// What every rank sends before a collective.
struct Header {
    seq: u64,
    kind: u8,
    dtype: u8,
    elems: u64,
    extra: u64,
    tag: String,
}

impl Header {
    fn tag_bytes(&self) -> Vec<u8> {
        let b = self.tag.as_bytes();
        b[..b.len().min(HEADER_TAG_LEN)].to_vec()
    }

    fn encode(&self) -> Vec<u8> {
        let mut out = Vec::with_capacity(HEADER_LEN);
        out.extend_from_slice(&self.seq.to_le_bytes());
        out.push(self.kind);
        out.push(self.dtype);
        let tag = self.tag_bytes();
        out.extend_from_slice(&(tag.len() as u16).to_le_bytes());
        // The tag is truncated for messages; its hash keeps longer tags distinguishable.
        out.extend_from_slice(&fnv32(self.tag.as_bytes()).to_le_bytes());
        out.extend_from_slice(&self.elems.to_le_bytes());
        // 24 bytes so far: then the tag (up to 96 bytes), and `extra` in the last 8.
        out.extend_from_slice(&tag);
        out.resize(HEADER_LEN - 8, 0);
        out.extend_from_slice(&self.extra.to_le_bytes());
        out
    }

    fn decode(b: &[u8]) -> Self {
        let u64_at = |i: usize| {
            let mut a = [0u8; 8];
            a.copy_from_slice(&b[i..i + 8]);
            u64::from_le_bytes(a)
        };
        let tag_len = (u16::from_le_bytes([b[10], b[11]]) as usize).min(HEADER_TAG_LEN);
        Self {
            seq: u64_at(0),
            kind: b[8],
            dtype: b[9],
            elems: u64_at(16),
            extra: u64_at(HEADER_LEN - 8),
            tag: String::from_utf8_lossy(&b[24..24 + tag_len]).into_owned(),
        }
    }
}

/// 32-bit FNV-1a hash.
fn fnv32(bytes: &[u8]) -> u32 {
    bytes.iter().fold(0x811c_9dc5u32, |h, b| (h ^ *b as u32).wrapping_mul(0x0100_0193))
}

/// Wire code of a dtype.
use crate::comm::host::{dtype_code, from_bytes, to_bytes};

impl MpiGroup {
    fn prepare<B: Backend>(
        &self,
        kind: CollectiveKind,
        tag: &Tag,
        input: Tensor<B, 1>,
        extra: u64,
    ) -> Result<(Vec<u8>, DType, usize), CommError> {
        let (bytes, dtype, n) = to_bytes(input);
        self.counters.record(kind, bytes.len() as u64);
        let code = dtype_code(dtype)
            .ok_or_else(|| self.bad(kind, tag, format!("dtype {dtype:?} is not supported over MPI")))?;
        self.handshake(kind, tag, code, n as u64, extra)?;
        Ok((bytes, dtype, n))
    }

    /// Reduce-scatter of host bytes: `bytes` holds `size` equal chunks of `chunk` elements.
    fn reduce_scatter_bytes(
        &self,
        bytes: Vec<u8>,
        dtype: DType,
        op: ReduceOp,
        kind: CollectiveKind,
        tag: &Tag,
    ) -> Result<Vec<u8>, CommError> {
        let recv = self.all_to_all_bytes(bytes, kind, tag)?;
        let chunk = recv.len() / self.size;
        let parts: Vec<&[u8]> = recv.chunks_exact(chunk.max(1)).take(self.size).collect();
        if chunk == 0 {
            return Ok(Vec::new());
        }
        crate::comm::host::reduce_bytes(&parts, dtype, op).map_err(|m| self.bad(kind, tag, m))
    }
}

impl<B: Backend> ProcessGroup<B> for MpiGroup {
    fn rank(&self) -> usize {
        self.rank
    }

    fn size(&self) -> usize {
        self.size
    }

    fn stats(&self) -> CommStats {
        self.counters.snapshot()
    }

    fn all_gather(&self, input: Tensor<B, 1>, tag: &Tag) -> Result<Tensor<B, 1>, CommError> {
        if self.size == 1 {
            return Ok(input);
        }
        let kind = CollectiveKind::AllGather;
        let device = input.device();
        let (bytes, dtype, n) = self.prepare(kind, tag, input, 0)?;
        let out = self.all_gather_bytes(bytes, kind, tag)?;
        Ok(from_bytes::<B>(out, n * self.size, dtype, &device))
    }

    fn reduce_scatter(
        &self,
        input: Tensor<B, 1>,
        op: ReduceOp,
        tag: &Tag,
    ) -> Result<Tensor<B, 1>, CommError> {
        if self.size == 1 {
            return Ok(input);
        }
        let kind = CollectiveKind::ReduceScatter;
        let total = input.shape().num_elements();
        if !total.is_multiple_of(self.size) {
            return Err(self.bad(
                kind,
                tag,
                format!("{total} elements do not split into {} chunks", self.size),
            ));
        }
        let device = input.device();
        let (bytes, dtype, n) = self.prepare(kind, tag, input, op as u64)?;
        let out = self.reduce_scatter_bytes(bytes, dtype, op, kind, tag)?;
        Ok(from_bytes::<B>(out, n / self.size, dtype, &device))
    }

    fn all_reduce(&self, input: Tensor<B, 1>, op: ReduceOp, tag: &Tag) -> Result<Tensor<B, 1>, CommError> {
        if self.size == 1 {
            return Ok(input);
        }
        let kind = CollectiveKind::AllReduce;
        let device = input.device();
        let (mut bytes, dtype, n) = self.prepare(kind, tag, input, op as u64)?;
        // Pad to `size` equal chunks, reduce-scatter, all-gather the reduced chunks.
        let elem = dtype.size();
        let chunk = n.div_ceil(self.size);
        bytes.resize(chunk * self.size * elem, 0);
        let mine = self.reduce_scatter_bytes(bytes, dtype, op, kind, tag)?;
        let mut all = self.all_gather_bytes(mine, kind, tag)?;
        all.truncate(n * elem);
        Ok(from_bytes::<B>(all, n, dtype, &device))
    }

    fn broadcast(&self, input: Tensor<B, 1>, root: usize, tag: &Tag) -> Result<Tensor<B, 1>, CommError> {
        if self.size == 1 {
            return Ok(input);
        }
        let kind = CollectiveKind::Broadcast;
        if root >= self.size {
            return Err(self.bad(kind, tag, format!("root {root} outside the group of {}", self.size)));
        }
        let device = input.device();
        let (bytes, dtype, n) = self.prepare(kind, tag, input, root as u64)?;
        if bytes.len() > i32::MAX as usize {
            return Err(self.bad(kind, tag, format!("{} bytes exceed MPI's 32-bit counts", bytes.len())));
        }
        let buf = Leaked::new(bytes);
        let req = {
            let _g = mpi_lock();
            // SAFETY: the buffer is reclaimed only after the request completed.
            let b = unsafe { buf.get() };
            self.comm.process_at_rank(root as i32).immediate_broadcast_into(StaticScope, b)
        };
        self.wait(req, kind, tag)?;
        // SAFETY: the request completed.
        let out = unsafe { buf.reclaim() };
        Ok(from_bytes::<B>(out, n, dtype, &device))
    }

    fn barrier(&self, tag: &Tag) -> Result<(), CommError> {
        if self.size == 1 {
            return Ok(());
        }
        // The header exchange is an all-gather, which no rank leaves before all arrived.
        self.counters.record(CollectiveKind::Barrier, 0);
        self.handshake(CollectiveKind::Barrier, tag, 0, 0, 0)
    }

    fn abort(&self, reason: &str) {
        self.mark_failed(self.rank, reason.to_owned());
        let mut notice = (self.rank as u32).to_le_bytes().to_vec();
        let r = reason.as_bytes();
        notice.extend_from_slice(&r[..r.len().min(NOTICE_LEN - 4)]);
        let mut pending = Vec::new();
        for peer in (0..self.size).filter(|&p| p != self.rank) {
            let buf = Leaked::new(notice.clone());
            let _g = mpi_lock();
            // SAFETY: the buffer is reclaimed only after the send completed, else leaked.
            let b = unsafe { buf.get() };
            let req =
                self.ctrl.process_at_rank(peer as i32).immediate_send_with_tag(StaticScope, &*b, ABORT_TAG);
            pending.push((req, buf));
        }
        // Give the notices a moment to leave; the process is about to fail anyway.
        let deadline = Instant::now() + Duration::from_secs(2);
        for (req, buf) in pending {
            let mut req = req;
            loop {
                let r = {
                    let _g = mpi_lock();
                    req.test()
                };
                match r {
                    Ok(_) => {
                        // SAFETY: the send completed.
                        drop(unsafe { buf.reclaim() });
                        break;
                    }
                    Err(back) if Instant::now() < deadline => {
                        req = back;
                        std::thread::sleep(Duration::from_micros(100));
                    }
                    Err(back) => {
                        // SAFETY: the buffer stays leaked.
                        let _ = unsafe { back.into_raw() };
                        break;
                    }
                }
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn header_round_trip() {
        let h = Header { seq: 7, kind: 2, dtype: 4, elems: 123, extra: 9, tag: "layers.3/grad".into() };
        let b = h.encode();
        assert_eq!(b.len(), HEADER_LEN);
        let d = Header::decode(&b);
        assert_eq!(
            (d.seq, d.kind, d.dtype, d.elems, d.extra, d.tag.as_str()),
            (7, 2, 4, 123, 9, "layers.3/grad")
        );
    }
}
