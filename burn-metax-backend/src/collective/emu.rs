//! [`EmuCommunicator`]: a [`DeviceCommunicator`] between emulated MetaX devices of one process,
//! for in-process ranks: the collectives run on the devices' streams, device memory to device
//! memory, and the host threads that queue them never touch the data.
//!
//! The emulated devices share one address space (as devices with peer access do), so a
//! collective is a host function queued on each rank's communication stream
//! ([`EmuDriver::launch_host_function`]): when every rank's stream has reached it, each reads the
//! others' buffers and writes its own output, like a collective kernel of MCCL or NCCL would.
//! Reductions add the ranks' elements in rank order, with sub-f32 types accumulated in f32 and
//! rounded once — burn-fsdp's `LocalGroup` rule ([`burn_fsdp::comm::host::reduce_to_data`]), so
//! results are bit-identical to in-process host collectives.
//!
//! A rank whose stream never reaches a collective (it died, or it issued another one) leaves
//! the others waiting on their streams, as with a real library; [`DeviceGroup`]'s watchdog then
//! aborts the communicator ([`DeviceCommunicator::abort`]), which releases every waiting stream
//! of the group.
//!
//! A collective holds its stream until every rank's stream has reached it, as a collective
//! kernel does. Two groups whose collectives can hold each other's streams can deadlock, as two
//! NCCL communicators sharing streams can: CubeCL maps threads to a fixed number of streams per
//! device (`value % max_streams`), so two jobs training at once in one process, on the same
//! devices, may share streams. Run one such job per process at a time.
//!
//! [`DeviceGroup`]: super::DeviceGroup

use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, Condvar, Mutex, MutexGuard};
use std::time::Duration;

use super::{CollectiveError, CommDType, CommOp, DeviceCommunicator};
use crate::driver::{DevicePtr, StreamHandle};
use crate::emu::EmuDriver;

/// How long a stream waits for the other ranks before it checks again whether the group was
/// aborted.
const POLL: Duration = Duration::from_millis(50);

/// What the ranks of one group share.
#[derive(Debug)]
struct Rendezvous {
    size: usize,
    state: Mutex<Round>,
    changed: Condvar,
    aborted: AtomicBool,
}

/// The collective in progress.
#[derive(Debug, Default)]
struct Round {
    /// Number of the collective the ranks are in (they issue the same ones in the same order).
    number: u64,
    /// Each rank's input: address and length in bytes.
    inputs: Vec<Option<(usize, usize)>>,
    /// Ranks done reading the others' inputs.
    done: usize,
}

fn lock(m: &Mutex<Round>) -> MutexGuard<'_, Round> {
    // Updates are plain assignments: a panic cannot leave the round half changed.
    m.lock().unwrap_or_else(|e| e.into_inner())
}

impl Rendezvous {
    /// Waits until `ready` holds or the group is aborted (`false`).
    fn wait<'a>(
        &self,
        mut round: MutexGuard<'a, Round>,
        ready: impl Fn(&Round) -> bool,
    ) -> Option<MutexGuard<'a, Round>> {
        while !ready(&round) {
            if self.aborted.load(Ordering::Acquire) {
                return None;
            }
            round =
                self.changed.wait_timeout(round, POLL).map(|(g, _)| g).unwrap_or_else(|e| e.into_inner().0);
        }
        Some(round)
    }

    /// Rank `rank`'s part of collective `number` (run on its stream's worker): publishes its
    /// input, waits for every rank's, computes its output from them with `compute`, waits until
    /// every rank has read the inputs, then writes the output with `write` (so an in-place
    /// collective never overwrites an input another rank still reads).
    fn collective(
        &self,
        number: u64,
        rank: usize,
        input: (usize, usize),
        compute: impl FnOnce(&[(usize, usize)]) -> Vec<u8>,
        write: impl FnOnce(&[u8]),
    ) {
        let Some(mut round) = self.wait(lock(&self.state), |r| r.number == number) else { return };
        if round.inputs.len() != self.size {
            round.inputs = vec![None; self.size];
        }
        round.inputs[rank] = Some(input);
        self.changed.notify_all();
        let Some(round) = self.wait(round, |r| r.inputs.iter().all(Option::is_some)) else { return };
        let inputs: Vec<(usize, usize)> = round.inputs.iter().flatten().copied().collect();
        drop(round);
        let output = compute(&inputs);
        let mut round = lock(&self.state);
        round.done += 1;
        if round.done == self.size {
            *round = Round { number: number + 1, inputs: vec![None; self.size], done: 0 };
        }
        self.changed.notify_all();
        if self.wait(round, |r| r.number > number).is_none() {
            return;
        }
        write(&output);
    }
}

/// One in-process rank's communicator over emulated MetaX devices (see the module docs).
///
/// ```no_run
/// use burn_metax_backend::collective::{EmuCommunicator, MetaxEmuGroup};
/// use burn_metax_backend::MetaxEmuDevice;
///
/// # fn main() -> Result<(), Box<dyn std::error::Error>> {
/// let comms = EmuCommunicator::group(4)?;
/// let groups = comms
///     .into_iter()
///     .enumerate()
///     .map(|(rank, comm)| MetaxEmuGroup::new(MetaxEmuDevice::new(rank), comm, std::time::Duration::from_secs(60)))
///     .collect::<Result<Vec<_>, _>>()?;
/// # Ok(()) }
/// ```
#[derive(Debug)]
pub struct EmuCommunicator {
    rank: usize,
    shared: Arc<Rendezvous>,
    driver: Arc<EmuDriver>,
    /// Number of the next collective this rank queues.
    next: AtomicU64,
}

impl EmuCommunicator {
    /// The communicators of a group of `size` in-process ranks, by rank.
    pub fn group(size: usize) -> Result<Vec<Self>, CollectiveError> {
        if size == 0 {
            return Err(CollectiveError::InvalidArgument("a group needs at least one rank".into()));
        }
        let driver = crate::runtime::emu_driver()?;
        let shared = Arc::new(Rendezvous {
            size,
            state: Mutex::new(Round { number: 0, inputs: vec![None; size], done: 0 }),
            changed: Condvar::new(),
            aborted: AtomicBool::new(false),
        });
        Ok((0..size)
            .map(|rank| Self {
                rank,
                shared: shared.clone(),
                driver: driver.clone(),
                next: AtomicU64::new(0),
            })
            .collect())
    }

    /// A handle that aborts the whole group from anywhere (e.g. when one rank's thread fails
    /// outside a collective): every rank's waiting collectives return and later ones fail.
    pub fn abort_handle(&self) -> EmuGroupAbort {
        EmuGroupAbort(self.shared.clone())
    }

    /// Queues this rank's part of the next collective on `stream`.
    fn queue(
        &self,
        stream: StreamHandle,
        input: (usize, usize),
        compute: impl FnOnce(&[(usize, usize)]) -> Vec<u8> + Send + 'static,
        write: impl FnOnce(&[u8]) + Send + 'static,
    ) -> Result<(), CollectiveError> {
        if self.shared.aborted.load(Ordering::Acquire) {
            return Err(CollectiveError::InvalidArgument("the communicator was aborted".into()));
        }
        let number = self.next.fetch_add(1, Ordering::Relaxed);
        let (shared, rank) = (self.shared.clone(), self.rank);
        let function = Box::new(move || shared.collective(number, rank, input, compute, write));
        self.driver.launch_host_function(stream, function)?;
        Ok(())
    }
}

/// Aborts every rank of an [`EmuCommunicator`] group ([`EmuCommunicator::abort_handle`]).
#[derive(Debug, Clone)]
pub struct EmuGroupAbort(Arc<Rendezvous>);

impl EmuGroupAbort {
    /// Aborts the group (idempotent).
    pub fn abort(&self) {
        self.0.aborted.store(true, Ordering::Release);
        self.0.changed.notify_all();
    }
}

/// The bytes `[start, start + len)` of a rank's device buffer.
///
/// # Safety
/// The range lies in live device memory of the emulated devices (one host address space) that
/// nothing writes while the returned slice is used: the ranks' inputs, between the collective's
/// two rendezvous.
unsafe fn bytes<'a>(start: usize, len: usize) -> &'a [u8] {
    if len == 0 {
        return &[];
    }
    // SAFETY: the caller's contract.
    unsafe { std::slice::from_raw_parts(start as *const u8, len) }
}

/// A writer of `out.len()` bytes at `dst`.
///
/// Safety is the caller's, as for [`bytes`]: `dst` holds as many bytes as are written, in live
/// device memory of this rank's own output, which nothing else touches until the stream moves
/// past the collective.
fn writer(dst: usize) -> impl FnOnce(&[u8]) + Send + 'static {
    move |out: &[u8]| {
        if !out.is_empty() {
            // SAFETY: see the function's documentation: the caller of the collective
            // guaranteed `dst` holds the output, and the output buffer is not an input of any
            // rank still reading (the write comes after every rank has read).
            unsafe { std::ptr::copy_nonoverlapping(out.as_ptr(), dst as *mut u8, out.len()) };
        }
    }
}

/// Rank-order reduction of `n` elements at byte offset `offset` of every input.
fn reduce(inputs: &[(usize, usize)], offset: usize, n: usize, dtype: CommDType, op: CommOp) -> Vec<u8> {
    let len = n * dtype.size();
    // SAFETY: every input holds at least `offset + len` bytes (the collective's contract) and is
    // not written between the rendezvous.
    let parts: Vec<&[u8]> = inputs.iter().map(|&(start, _)| unsafe { bytes(start + offset, len) }).collect();
    match burn_fsdp::comm::host::reduce_to_data(&parts, dtype.dtype(), op.into(), n) {
        Ok(data) => data.into_bytes().to_vec(),
        // Only for dtypes the communicator never accepts (CommDType is float only).
        Err(_) => vec![0; len],
    }
}

impl DeviceCommunicator for EmuCommunicator {
    fn library(&self) -> &'static str {
        "emulated device collectives"
    }

    fn rank(&self) -> usize {
        self.rank
    }

    fn size(&self) -> usize {
        self.shared.size
    }

    unsafe fn all_gather(
        &self,
        send: DevicePtr,
        recv: DevicePtr,
        send_count: usize,
        dtype: CommDType,
        stream: StreamHandle,
    ) -> Result<(), CollectiveError> {
        let len = send_count * dtype.size();
        let compute = move |inputs: &[(usize, usize)]| {
            let mut out = Vec::with_capacity(len * inputs.len());
            for &(start, _) in inputs {
                // SAFETY: each rank's input holds `len` bytes, unchanged between the rendezvous.
                out.extend_from_slice(unsafe { bytes(start, len) });
            }
            out
        };
        self.queue(stream, (send.as_raw(), len), compute, writer(recv.as_raw()))
    }

    unsafe fn reduce_scatter(
        &self,
        send: DevicePtr,
        recv: DevicePtr,
        recv_count: usize,
        dtype: CommDType,
        op: CommOp,
        stream: StreamHandle,
    ) -> Result<(), CollectiveError> {
        let chunk = recv_count * dtype.size();
        let offset = self.rank * chunk;
        let compute = move |inputs: &[(usize, usize)]| reduce(inputs, offset, recv_count, dtype, op);
        self.queue(stream, (send.as_raw(), chunk * self.shared.size), compute, writer(recv.as_raw()))
    }

    unsafe fn all_reduce(
        &self,
        send: DevicePtr,
        recv: DevicePtr,
        count: usize,
        dtype: CommDType,
        op: CommOp,
        stream: StreamHandle,
    ) -> Result<(), CollectiveError> {
        let compute = move |inputs: &[(usize, usize)]| reduce(inputs, 0, count, dtype, op);
        self.queue(stream, (send.as_raw(), count * dtype.size()), compute, writer(recv.as_raw()))
    }

    unsafe fn broadcast(
        &self,
        send: DevicePtr,
        recv: DevicePtr,
        count: usize,
        dtype: CommDType,
        root: usize,
        stream: StreamHandle,
    ) -> Result<(), CollectiveError> {
        if root >= self.shared.size {
            return Err(CollectiveError::InvalidArgument(format!(
                "broadcast from rank {root} in a group of {}",
                self.shared.size
            )));
        }
        let len = count * dtype.size();
        // SAFETY: the root's input holds `len` bytes, unchanged between the rendezvous.
        let compute = move |inputs: &[(usize, usize)]| unsafe { bytes(inputs[root].0, len) }.to_vec();
        self.queue(stream, (send.as_raw(), len), compute, writer(recv.as_raw()))
    }

    fn abort(&mut self) -> Result<(), CollectiveError> {
        self.abort_handle().abort();
        Ok(())
    }
}
