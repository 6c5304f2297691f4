//! [`DeviceGroup`]: a burn-fsdp [`ProcessGroup`] whose collectives run on device buffers
//! through a [`DeviceCommunicator`], on the group's own stream.

use std::collections::VecDeque;
use std::sync::{Arc, Mutex, MutexGuard, Weak};
use std::time::{Duration, Instant};

use burn::tensor::backend::DeviceOps;
use burn::tensor::{DType, Shape, Tensor, TensorPrimitive};
use burn_cubecl::kernel::into_contiguous;
use burn_cubecl::tensor::CubeTensor;
use burn_cubecl::{BoolElement, CubeBackend, FloatElement, IntElement};
use burn_fsdp::comm::{CollectiveKind, CommCounters, CommError, CommStats, ProcessGroup, ReduceOp, Tag};
use cubecl_runtime::client::ComputeClient;

use super::stream::CommStream;
use super::watchdog::{Watchdog, Watched};
use super::{CollectiveError, CommDType, CommOp, DeviceCommunicator, UNIQUE_ID_BYTES};
use crate::driver::{DevicePtr, DriverError, EventHandle, StreamHandle};
use crate::mccl::{MacaCommunicator, Mccl};
use crate::runtime::{
    DriverRuntime, GpuDevice, MacaDevice, MacaPlatform, MetaxEmuPlatform, Platform, registry,
};

/// Default collective timeout (as burn-fsdp's `LocalGroup`).
pub const DEFAULT_TIMEOUT: Duration = Duration::from_secs(60);

/// A [`DeviceGroup`] over MCCL on MetaX GPUs (backend [`Metax`](crate::Metax)).
pub type MetaxGroup = DeviceGroup<MacaPlatform, MacaCommunicator>;

/// A [`DeviceGroup`] of in-process ranks on emulated MetaX devices (backend
/// [`MetaxEmu`](crate::MetaxEmu)): collectives on the devices' streams, device memory to device
/// memory ([`EmuCommunicator`](super::EmuCommunicator)).
pub type MetaxEmuGroup = DeviceGroup<MetaxEmuPlatform, super::EmuCommunicator>;

/// Longest sleep of the watchdog and of host waits between two checks.
const MAX_PAUSE: Duration = Duration::from_millis(50);

/// One collective queued on the communication stream and not yet seen completed.
struct InFlight {
    done: EventHandle,
    deadline: Instant,
    kind: CollectiveKind,
    tag: Tag,
}

/// Why the group no longer communicates.
enum Failure {
    /// `abort`, a failed library or driver call, or a stall already reported to a caller.
    Failed { failed_rank: usize, reason: String },
    /// A stall the watchdog found and no caller has been told about yet.
    Stalled { kind: CollectiveKind, tag: Tag },
}

#[derive(Default)]
struct State {
    inflight: VecDeque<InFlight>,
    failure: Option<Failure>,
}

/// What [`Inner::reap`] found.
enum Reaped {
    /// Nothing is in flight any more.
    Idle,
    /// Collectives are in flight, none overdue.
    Pending,
    /// The oldest collective in flight missed its deadline.
    Overdue(CollectiveKind, Tag),
    /// A driver call failed.
    Error(DriverError),
}

/// The part of a group shared with its watchdog.
struct Inner<C> {
    rank: usize,
    size: usize,
    timeout: Duration,
    device_index: usize,
    stream: CommStream,
    /// `None` once the group has shut down.
    comm: Mutex<Option<C>>,
    state: Mutex<State>,
    counters: CommCounters,
}

fn lock<T>(m: &Mutex<T>) -> MutexGuard<'_, T> {
    // Every update under these locks is a single assignment, push or pop: a panic cannot leave
    // the data half updated.
    m.lock().unwrap_or_else(|e| e.into_inner())
}

impl<C: DeviceCommunicator> Inner<C> {
    fn stalled_error(&self, kind: CollectiveKind, tag: Tag) -> CommError {
        CommError::Stalled { kind, tag, rank: self.rank, timeout: self.timeout }
    }

    /// The error a call of `kind`/`tag` gets if the group has failed. An unreported stall is
    /// reported once as [`CommError::Stalled`], then like any failure.
    fn check(&self, st: &mut State, kind: CollectiveKind, tag: &Tag) -> Result<(), CommError> {
        match st.failure.take() {
            None => Ok(()),
            Some(Failure::Stalled { kind: k, tag: t }) => {
                let err = self.stalled_error(k, t);
                st.failure = Some(Failure::Failed { failed_rank: self.rank, reason: err.to_string() });
                Err(err)
            }
            Some(Failure::Failed { failed_rank, reason }) => {
                let err = CommError::PeerFailed {
                    kind,
                    tag: tag.clone(),
                    rank: self.rank,
                    failed_rank,
                    reason: reason.clone(),
                };
                st.failure = Some(Failure::Failed { failed_rank, reason });
                Err(err)
            }
        }
    }

    /// Forgets the collectives that completed, oldest first, and says whether the oldest
    /// remaining one is overdue. Call on the device thread or the watchdog thread.
    fn reap(&self, st: &mut State) -> Reaped {
        while let Some(front) = st.inflight.front() {
            match self.stream.query(front.done) {
                Ok(true) => {
                    self.stream.forget(front.done);
                    st.inflight.pop_front();
                }
                Ok(false) if Instant::now() >= front.deadline => {
                    return Reaped::Overdue(front.kind, front.tag.clone());
                }
                Ok(false) => return Reaped::Pending,
                Err(e) => return Reaped::Error(e),
            }
        }
        Reaped::Idle
    }

    /// Records `failure` (the first one wins) and forgets the collectives in flight; their
    /// events are destroyed when `destroy_events` (only on a thread where the device is
    /// current), leaked otherwise. The caller then aborts the communicator.
    fn mark_failed(&self, st: &mut State, failure: Failure, destroy_events: bool) {
        if st.failure.is_none() {
            st.failure = Some(failure);
        }
        for entry in st.inflight.drain(..) {
            if destroy_events {
                self.stream.forget(entry.done);
            }
        }
    }

    /// Aborts the communicator (the caller must not hold the state lock).
    fn abort_comm(comm: &mut Option<C>) {
        if let Some(comm) = comm.as_mut() {
            // Nothing more can be done about a failed abort: the group is failed either way.
            let _ = comm.abort();
        }
    }

    /// Queues one collective on the communication stream, between the event waits of the
    /// ordering rule. Runs on the device's server thread.
    /// `ranges`: the collective's buffers, which it is ordered by (see [`CommStream`]); `None`
    /// orders it after, and every compute stream before, everything (a barrier).
    fn enqueue<F>(
        &self,
        kind: CollectiveKind,
        tag: &Tag,
        ranges: Option<[(u64, u64); 2]>,
        call: F,
    ) -> Result<(), CommError>
    where
        F: FnOnce(&C, StreamHandle) -> Result<(), CollectiveError>,
    {
        let mut comm = lock(&self.comm);
        {
            let mut st = lock(&self.state);
            self.check(&mut st, kind, tag)?;
            let failure = match self.reap(&mut st) {
                Reaped::Idle | Reaped::Pending => None,
                Reaped::Overdue(k, t) => Some(self.stalled_error(k, t)),
                Reaped::Error(e) => Some(self.own_failure(kind, tag, e.to_string())),
            };
            if let Some(err) = failure {
                let reason = err.to_string();
                self.mark_failed(&mut st, Failure::Failed { failed_rank: self.rank, reason }, true);
                drop(st);
                Self::abort_comm(&mut comm);
                return Err(err);
            }
        }
        let Some(c) = comm.as_ref() else {
            return Err(self.own_failure(kind, tag, "the group was shut down".into()));
        };
        let queued = (|| {
            match &ranges {
                Some(ranges) => self.stream.wait_for_buffers(ranges)?,
                None => self.stream.wait_for_compute()?,
            }
            call(c, self.stream.handle())?;
            Ok::<_, CollectiveError>(match &ranges {
                Some(ranges) => self.stream.release_buffers(ranges)?,
                None => self.stream.release_compute()?,
            })
        })();
        match queued {
            Ok(done) => {
                let entry =
                    InFlight { done, deadline: Instant::now() + self.timeout, kind, tag: tag.clone() };
                lock(&self.state).inflight.push_back(entry);
                Ok(())
            }
            Err(e) => {
                let reason = e.to_string();
                let err = self.own_failure(kind, tag, reason.clone());
                self.mark_failed(
                    &mut lock(&self.state),
                    Failure::Failed { failed_rank: self.rank, reason },
                    true,
                );
                Self::abort_comm(&mut comm);
                Err(err)
            }
        }
    }

    /// A failure of this rank, as the error of the call that saw it.
    fn own_failure(&self, kind: CollectiveKind, tag: &Tag, reason: String) -> CommError {
        CommError::PeerFailed { kind, tag: tag.clone(), rank: self.rank, failed_rank: self.rank, reason }
    }

    /// Whether every queued collective has completed (`Ok(true)`), some are still running
    /// (`Ok(false)`), or the oldest is overdue or the group failed (`Err`). Runs on the device's
    /// server thread.
    fn poll(&self, kind: CollectiveKind, tag: &Tag) -> Result<bool, CommError> {
        let mut st = lock(&self.state);
        self.check(&mut st, kind, tag)?;
        let err = match self.reap(&mut st) {
            Reaped::Idle => return Ok(true),
            Reaped::Pending => return Ok(false),
            Reaped::Overdue(k, t) => self.stalled_error(k, t),
            Reaped::Error(e) => self.own_failure(kind, tag, e.to_string()),
        };
        self.mark_failed(&mut st, Failure::Failed { failed_rank: self.rank, reason: err.to_string() }, true);
        drop(st);
        Self::abort_comm(&mut lock(&self.comm));
        Err(err)
    }

    /// Waits (bounded by the timeout) for the collectives in flight, aborts the communicator if
    /// they do not complete, then destroys the communicator and the stream. Runs on the device's
    /// server thread when the group is dropped.
    fn shutdown(&self) {
        loop {
            let mut st = lock(&self.state);
            if st.failure.is_some() {
                self.mark_failed(
                    &mut st,
                    Failure::Failed { failed_rank: self.rank, reason: String::new() },
                    true,
                );
                break;
            }
            match self.reap(&mut st) {
                Reaped::Idle => break,
                Reaped::Pending => {}
                Reaped::Overdue(..) | Reaped::Error(_) => {
                    let failure = Failure::Failed { failed_rank: self.rank, reason: String::new() };
                    self.mark_failed(&mut st, failure, true);
                    drop(st);
                    Self::abort_comm(&mut lock(&self.comm));
                    break;
                }
            }
            drop(st);
            std::thread::sleep(Duration::from_millis(1));
        }
        drop(lock(&self.comm).take());
        self.stream.destroy();
    }
}

impl<C: DeviceCommunicator> Watched for Inner<C> {
    fn prepare_thread(&self) {
        // The watchdog queries and destroys events of this device.
        let _ = self.stream.driver().set_device(self.device_index);
    }

    fn watch(&self) -> Duration {
        let mut st = lock(&self.state);
        if st.failure.is_some() {
            return MAX_PAUSE;
        }
        let Some(front) = st.inflight.front() else { return MAX_PAUSE };
        let now = Instant::now();
        if now < front.deadline {
            return (front.deadline - now).min(MAX_PAUSE);
        }
        let failure = match self.reap(&mut st) {
            Reaped::Idle => return MAX_PAUSE,
            Reaped::Pending => return Duration::from_millis(1),
            Reaped::Overdue(kind, tag) => Failure::Stalled { kind, tag },
            Reaped::Error(e) => Failure::Failed { failed_rank: self.rank, reason: e.to_string() },
        };
        self.mark_failed(&mut st, failure, true);
        drop(st);
        Self::abort_comm(&mut lock(&self.comm));
        MAX_PAUSE
    }
}

/// One rank's handle on a group of ranks whose collectives run on device buffers through a
/// [`DeviceCommunicator`] (MCCL or NCCL), for the backends of platform `P`
/// (`CubeBackend<DriverRuntime<P>, F, I, BT>`: [`Metax`](crate::Metax), `CudaProxy`).
///
/// # What a collective does
///
/// The input is made contiguous, the output is allocated on the device (through the compute
/// client, from the calling thread's stream pool), and the collective is queued on the group's
/// own **communication stream** on the device's server thread:
///
/// 1. the communication stream waits, on the device, for the last use of the input's and the
///    output's memory by any other stream (ordering by need, the device's default rule; see
///    [`crate::runtime::StreamOrdering`]) — so it sees every write to its input, whichever
///    stream queued it;
/// 2. the library call is queued on the communication stream;
/// 3. an event is recorded after it, and the collective becomes the last use of both buffers:
///    a compute stream waits for it exactly when it reads the output or reuses the input's
///    memory, and compute that touches neither runs on alongside.
///
/// Under the all-streams rule, step 1 waits for every compute stream and step 3 makes every
/// compute stream wait (the rule before ordering by need, kept to measure against). A barrier
/// always does: it orders everything queued before it.
///
/// The call then returns the output tensor: nothing waits on the host. Semantics follow
/// burn-fsdp's `LocalGroup`: all-gather `[n]` → `[size·n]` in rank order; reduce-scatter
/// `[size·n]` → `[n]` (this rank's chunk); all-reduce; broadcast; `Avg` is the library's average
/// (`mcclAvg`/`ncclAvg`), whose rounding (and the library's summation order, and for bf16/f16
/// the accumulation type) may differ from `LocalGroup`'s rank-order f32 sum in the last bits.
/// A group of one returns its input unchanged without a library call (unless
/// [`DeviceGroup::communicate_at_size_one`]). f16, bf16, f32 and f64 are supported; other dtypes
/// give [`CommError::BadInput`].
///
/// # Timeouts
///
/// Every collective gets a deadline (enqueue time + the group's timeout). It is enforced:
/// - at every later call of the group (the completed collectives are reaped first, and an
///   incomplete one past its deadline fails the call);
/// - in [`ProcessGroup::barrier`] and [`DeviceGroup::synchronize`], which wait on the host
///   (polling the communication stream's events) for everything queued so far;
/// - by a watchdog thread (groups of more than one rank), while the rank is elsewhere — e.g.
///   blocked reading a tensor that a stalled collective writes.
///
/// An overdue collective aborts the communicator (so its device work stops waiting for peers and
/// blocked reads return, with undefined data) and marks the group failed: the next call returns
/// [`CommError::Stalled`] naming the collective that stalled, later calls
/// [`CommError::PeerFailed`]. The timeout does not bound the library's enqueue call itself
/// (NCCL may block in it while connecting to peers on a communicator's first collective).
///
/// # Failures
///
/// [`ProcessGroup::abort`] aborts the communicator and fails the group: later calls of this rank
/// return [`CommError::PeerFailed`]. Other ranks are not told (no side channel): their
/// collectives with the aborted rank stall and fail after their timeout. A failed library or
/// driver call fails the group the same way, with an error naming the call and the library's
/// message (as [`CommError::PeerFailed`] with this rank as the failed one).
///
/// # Tags
///
/// Tags are **not** checked across ranks: that needs a header exchange and a host round trip per
/// collective. Ranks issuing collectives in a different order get wrong data or, for different
/// sizes, a stall.
pub struct DeviceGroup<P: Platform, C: DeviceCommunicator> {
    inner: Arc<Inner<C>>,
    client: ComputeClient<DriverRuntime<P>>,
    communicate_at_size_one: bool,
    watchdog: Option<Watchdog>,
}

impl<P: Platform, C: DeviceCommunicator> std::fmt::Debug for DeviceGroup<P, C> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("DeviceGroup")
            .field("platform", &P::NAME)
            .field("device", &self.inner.device_index)
            .field("rank", &self.inner.rank)
            .field("size", &self.inner.size)
            .field("timeout", &self.inner.timeout)
            .finish_non_exhaustive()
    }
}

fn server_error(e: impl std::fmt::Debug) -> CollectiveError {
    CollectiveError::Server(format!("{e:?}"))
}

impl<P: Platform, C: DeviceCommunicator> DeviceGroup<P, C> {
    /// The group of `comm` on `device`, with collective timeout `timeout`. `comm` must have been
    /// created for `device` (its current device when it was initialised).
    ///
    /// Starts the device's server if needed, creates the communication stream on the server
    /// thread, and (for more than one rank) the watchdog thread.
    pub fn new(device: P::Device, comm: C, timeout: Duration) -> Result<Self, CollectiveError> {
        let client = DriverRuntime::<P>::try_client(&device)?;
        // The server registers its streams when it starts; make sure it has.
        client.flush().map_err(server_error)?;
        let index = device.index();
        let streams = registry::device_streams(P::NAME, index)
            .ok_or_else(|| CollectiveError::Server(format!("{} device {index} has no server", P::NAME)))?;
        let stream = client.exclusive(move || CommStream::create(streams)).map_err(server_error)??;
        let (rank, size) = (comm.rank(), comm.size());
        let inner = Arc::new(Inner {
            rank,
            size,
            timeout,
            device_index: index,
            stream,
            comm: Mutex::new(Some(comm)),
            state: Mutex::new(State::default()),
            counters: CommCounters::default(),
        });
        let watchdog = if size > 1 {
            let target: Weak<dyn Watched> = Arc::downgrade(&(inner.clone() as Arc<dyn Watched>));
            let name = format!("{}-comm-watchdog-{index}", P::NAME);
            Some(Watchdog::spawn(name, target).map_err(|e| CollectiveError::Server(e.to_string()))?)
        } else {
            None
        };
        Ok(Self { inner, client, communicate_at_size_one: false, watchdog })
    }

    /// Runs `f` on `device`'s server thread, where the device is current: communicators are
    /// initialised there (`mcclCommInitRank`/`ncclCommInitRank` use the calling thread's device).
    pub fn on_device_thread<R: Send + 'static>(
        device: &P::Device,
        f: impl FnOnce() -> R + Send,
    ) -> Result<R, CollectiveError> {
        let client = DriverRuntime::<P>::try_client(device)?;
        client.flush().map_err(server_error)?;
        client.exclusive(f).map_err(server_error)
    }

    /// For tests: in a group of one rank, run the collectives through the library anyway
    /// (instead of returning the input), so that a single device exercises the whole path.
    pub fn communicate_at_size_one(mut self, yes: bool) -> Self {
        self.communicate_at_size_one = yes;
        self
    }

    /// The collective timeout.
    pub fn timeout(&self) -> Duration {
        self.inner.timeout
    }

    /// The communication stream (for inspection, e.g. by tests).
    pub fn comm_stream(&self) -> StreamHandle {
        self.inner.stream.handle()
    }

    /// Waits on the host until every collective queued so far has completed, enforcing the
    /// timeout ([`CommError::Stalled`] for one that misses its deadline).
    pub fn synchronize(&self) -> Result<(), CommError> {
        self.wait_all(CollectiveKind::Barrier, &Tag::new("synchronize"))
    }

    fn skip(&self) -> bool {
        self.inner.size == 1 && !self.communicate_at_size_one
    }

    fn bad(&self, kind: CollectiveKind, tag: &Tag, msg: String) -> CommError {
        CommError::BadInput { kind, tag: tag.clone(), rank: self.inner.rank, msg }
    }

    fn check_failed(&self, kind: CollectiveKind, tag: &Tag) -> Result<(), CommError> {
        self.inner.check(&mut lock(&self.inner.state), kind, tag)
    }

    fn exclusive<R: Send + 'static>(
        &self,
        kind: CollectiveKind,
        tag: &Tag,
        f: impl FnOnce() -> Result<R, CommError> + Send,
    ) -> Result<R, CommError> {
        self.client.exclusive(f).map_err(|e| self.inner.own_failure(kind, tag, format!("{e:?}")))?
    }

    fn wait_all(&self, kind: CollectiveKind, tag: &Tag) -> Result<(), CommError> {
        let mut pause = Duration::from_micros(20);
        loop {
            let inner = &self.inner;
            if self.exclusive(kind, tag, || inner.poll(kind, tag))? {
                return Ok(());
            }
            std::thread::sleep(pause);
            pause = (pause * 2).min(Duration::from_millis(1));
        }
    }
}

impl DeviceGroup<MacaPlatform, MacaCommunicator> {
    /// Joins the MCCL communicator `id` (made by [`Mccl::unique_id`] on one rank and sent to the
    /// others) as `rank` of `size`, on `device`, with collective timeout `timeout`.
    ///
    /// `mcclCommInitRank` runs on the device's server thread (where the device is current) and
    /// blocks until every rank has joined.
    pub fn mccl(
        device: MacaDevice,
        mccl: Arc<Mccl>,
        id: [u8; UNIQUE_ID_BYTES],
        rank: usize,
        size: usize,
        timeout: Duration,
    ) -> Result<Self, CollectiveError> {
        let comm =
            Self::on_device_thread(&device, move || MacaCommunicator::from_unique_id(mccl, id, rank, size))??;
        Self::new(device, comm, timeout)
    }
}

impl<P: Platform, C: DeviceCommunicator> Drop for DeviceGroup<P, C> {
    fn drop(&mut self) {
        drop(self.watchdog.take());
        let inner = self.inner.clone();
        // If the server thread is gone, the communicator is dropped with the last `Arc`.
        let _ = self.client.exclusive(move || inner.shutdown());
    }
}

/// The backend of platform `P` with element types `F`, `I`, `BT`.
type Cube<P, F, I, BT> = CubeBackend<DriverRuntime<P>, F, I, BT>;

impl<P, C> DeviceGroup<P, C>
where
    P: Platform,
    P::Device: DeviceOps,
    C: DeviceCommunicator,
{
    /// Runs one collective of `input` into a new `out_len`-element tensor: see the type's
    /// documentation for the steps.
    fn run<F, I, BT, Call>(
        &self,
        kind: CollectiveKind,
        tag: &Tag,
        input: Tensor<Cube<P, F, I, BT>, 1>,
        out_len: usize,
        call: Call,
    ) -> Result<Tensor<Cube<P, F, I, BT>, 1>, CommError>
    where
        F: FloatElement,
        I: IntElement,
        BT: BoolElement,
        Call: FnOnce(&C, DevicePtr, DevicePtr, CommDType, StreamHandle) -> Result<(), CollectiveError> + Send,
    {
        self.check_failed(kind, tag)?;
        let dtype = input.dtype();
        let Some(comm_dtype) = CommDType::from_dtype(dtype) else {
            return Err(self.bad(kind, tag, format!("{dtype:?} is not supported (f16, bf16, f32, f64 are)")));
        };
        let n = input.shape().num_elements();
        self.inner.counters.record(kind, (n * comm_dtype.size()) as u64);
        let device = input.device();
        if n == 0 || out_len == 0 {
            return Ok(Tensor::empty([out_len], (&device, dtype)));
        }
        let tensor = into_contiguous(input.into_primitive().tensor());
        let client = tensor.client.clone();
        let out_bytes = out_len * comm_dtype.size();
        let output = client.empty(out_bytes);
        let resource_error = |e| self.inner.own_failure(kind, tag, format!("device buffer: {e:?}"));
        let send = client.get_resource(tensor.handle.clone()).map_err(resource_error)?;
        let recv = client.get_resource(output.clone()).map_err(resource_error)?;
        let (send_ptr, recv_ptr) = (send.resource().ptr, recv.resource().ptr);
        if send.resource().size < (n * comm_dtype.size()) as u64 || recv.resource().size < out_bytes as u64 {
            return Err(self.bad(kind, tag, "a device buffer is smaller than its tensor".into()));
        }
        let inner = &self.inner;
        let range = |ptr: DevicePtr, len: usize| (ptr.as_raw() as u64, (ptr.as_raw() + len) as u64);
        let ranges = [range(send_ptr, n * comm_dtype.size()), range(recv_ptr, out_bytes)];
        self.exclusive(kind, tag, move || {
            inner.enqueue(kind, tag, Some(ranges), move |comm, stream| {
                call(comm, send_ptr, recv_ptr, comm_dtype, stream)
            })
        })?;
        // The compute streams now wait for the collective: the input's memory may go back to its
        // pool (later work that reuses it is queued after the wait).
        drop((send, recv, tensor));
        let out = CubeTensor::new_contiguous(client, device, Shape::new([out_len]), output, dtype);
        Ok(Tensor::from_primitive(TensorPrimitive::Float(out)))
    }
}

impl<P, C, F, I, BT> ProcessGroup<Cube<P, F, I, BT>> for DeviceGroup<P, C>
where
    P: Platform,
    P::Device: DeviceOps,
    C: DeviceCommunicator,
    F: FloatElement,
    I: IntElement,
    BT: BoolElement,
{
    fn rank(&self) -> usize {
        self.inner.rank
    }

    fn size(&self) -> usize {
        self.inner.size
    }

    fn stats(&self) -> CommStats {
        self.inner.counters.snapshot()
    }

    fn all_gather(
        &self,
        input: Tensor<Cube<P, F, I, BT>, 1>,
        tag: &Tag,
    ) -> Result<Tensor<Cube<P, F, I, BT>, 1>, CommError> {
        if self.skip() {
            return Ok(input);
        }
        let n = input.shape().num_elements();
        let out_len = n * self.inner.size;
        self.run(CollectiveKind::AllGather, tag, input, out_len, move |comm, send, recv, dtype, stream| {
            // SAFETY: `send` holds the input's `n` elements and `recv` the output's `n · size`, both
            // of `dtype`; `run` keeps them allocated until every compute stream waits for the
            // collective, and their memory is not reused before that wait is reached.
            unsafe { comm.all_gather(send, recv, n, dtype, stream) }
        })
    }

    fn reduce_scatter(
        &self,
        input: Tensor<Cube<P, F, I, BT>, 1>,
        op: ReduceOp,
        tag: &Tag,
    ) -> Result<Tensor<Cube<P, F, I, BT>, 1>, CommError> {
        if self.skip() {
            return Ok(input);
        }
        let kind = CollectiveKind::ReduceScatter;
        let (total, size) = (input.shape().num_elements(), self.inner.size);
        if !total.is_multiple_of(size) {
            return Err(self.bad(kind, tag, format!("{total} elements do not split into {size} chunks")));
        }
        let chunk = total / size;
        self.run(kind, tag, input, chunk, move |comm, send, recv, dtype, stream| {
            // SAFETY: `send` holds the input's `chunk · size` elements and `recv` the output's
            // `chunk`; kept allocated as in `all_gather`.
            unsafe { comm.reduce_scatter(send, recv, chunk, dtype, CommOp::from(op), stream) }
        })
    }

    fn all_reduce(
        &self,
        input: Tensor<Cube<P, F, I, BT>, 1>,
        op: ReduceOp,
        tag: &Tag,
    ) -> Result<Tensor<Cube<P, F, I, BT>, 1>, CommError> {
        if self.skip() {
            return Ok(input);
        }
        let n = input.shape().num_elements();
        self.run(CollectiveKind::AllReduce, tag, input, n, move |comm, send, recv, dtype, stream| {
            // SAFETY: `send` and `recv` hold `n` elements each; kept allocated as in `all_gather`.
            unsafe { comm.all_reduce(send, recv, n, dtype, CommOp::from(op), stream) }
        })
    }

    fn broadcast(
        &self,
        input: Tensor<Cube<P, F, I, BT>, 1>,
        root: usize,
        tag: &Tag,
    ) -> Result<Tensor<Cube<P, F, I, BT>, 1>, CommError> {
        if self.skip() {
            return Ok(input);
        }
        let kind = CollectiveKind::Broadcast;
        if root >= self.inner.size {
            return Err(self.bad(kind, tag, format!("root {root} outside the group of {}", self.inner.size)));
        }
        let n = input.shape().num_elements();
        self.run(kind, tag, input, n, move |comm, send, recv, dtype, stream| {
            // SAFETY: `send` and `recv` hold `n` elements each; kept allocated as in `all_gather`.
            unsafe { comm.broadcast(send, recv, n, dtype, root, stream) }
        })
    }

    fn barrier(&self, tag: &Tag) -> Result<(), CommError> {
        if self.skip() {
            return Ok(());
        }
        let kind = CollectiveKind::Barrier;
        self.check_failed(kind, tag)?;
        self.inner.counters.record(kind, 0);
        // A one-element all-reduce, in place on a scratch buffer, then a host wait for it (and
        // everything queued before it).
        let scratch = self.client.empty(DType::F32.size());
        let resource = self
            .client
            .get_resource(scratch.clone())
            .map_err(|e| self.inner.own_failure(kind, tag, format!("device buffer: {e:?}")))?;
        let ptr = resource.resource().ptr;
        let inner = &self.inner;
        self.exclusive(kind, tag, move || {
            inner.enqueue(kind, tag, None, move |comm, stream| {
                // SAFETY: `ptr` holds one f32 (its value does not matter); the scratch buffer stays
                // allocated until the wait below has seen the collective complete (or the group
                // failed and the communicator was aborted).
                unsafe { comm.all_reduce(ptr, ptr, 1, CommDType::F32, CommOp::Sum, stream) }
            })
        })?;
        let waited = self.wait_all(kind, tag);
        drop((resource, scratch));
        waited
    }

    fn abort(&self, reason: &str) {
        let failure = Failure::Failed { failed_rank: self.inner.rank, reason: reason.to_owned() };
        // This thread may not have the device current: the events in flight are leaked.
        self.inner.mark_failed(&mut lock(&self.inner.state), failure, false);
        Inner::<C>::abort_comm(&mut lock(&self.inner.comm));
    }
}
