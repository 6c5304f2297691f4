//! Streams and events of the emulated device. Each stream is a worker thread that executes its
//! queue in order — copies, kernel launches, event records, waits for other streams' events,
//! stream-ordered frees — while the host goes on: work really runs asynchronously, so a missing
//! wait shows up as wrong data, exactly as on a GPU.

use std::collections::VecDeque;
use std::sync::{Arc, Condvar, Mutex, MutexGuard};
use std::time::{Duration, Instant};

use super::module::Launch;
use super::{DeviceState, FaultReport};

pub(crate) fn lock<T>(m: &Mutex<T>) -> MutexGuard<'_, T> {
    m.lock().unwrap_or_else(|e| e.into_inner())
}

/// An event: a counter of records (bumped when a record is queued) and of completions (set when
/// the stream reaches the record).
#[derive(Debug)]
pub(crate) struct Event {
    state: Mutex<EventState>,
    done: Condvar,
}

#[derive(Debug, Default)]
struct EventState {
    device: Option<usize>,
    stream: Option<usize>,
    recorded: u64,
    completed: u64,
    completed_at: Option<Instant>,
}

impl Event {
    pub(crate) fn new() -> Self {
        Self { state: Mutex::new(EventState::default()), done: Condvar::new() }
    }

    /// Starts a new record; returns its generation.
    pub(crate) fn next_record(&self) -> u64 {
        let mut state = lock(&self.state);
        state.recorded += 1;
        state.recorded
    }

    /// Starts a new record on stream `stream` (raw handle) of `device`; returns its generation.
    pub(crate) fn next_record_on(&self, device: usize, stream: usize) -> u64 {
        let mut state = lock(&self.state);
        state.device = Some(device);
        state.stream = Some(stream);
        state.recorded += 1;
        state.recorded
    }

    /// The device of the stream the event was last recorded on.
    pub(crate) fn device(&self) -> Option<usize> {
        lock(&self.state).device
    }

    /// The raw handle of the stream the event was last recorded on.
    pub(crate) fn stream(&self) -> Option<usize> {
        lock(&self.state).stream
    }

    /// The generation of the latest record (0: never recorded).
    pub(crate) fn latest(&self) -> u64 {
        lock(&self.state).recorded
    }

    pub(crate) fn complete(&self, generation: u64) {
        let mut state = lock(&self.state);
        if generation > state.completed {
            state.completed = generation;
            state.completed_at = Some(Instant::now());
        }
        self.done.notify_all();
    }

    /// Whether record `generation` has completed.
    pub(crate) fn reached(&self, generation: u64) -> bool {
        lock(&self.state).completed >= generation
    }

    /// Waits until record `generation` has completed; `false` on timeout.
    pub(crate) fn wait(&self, generation: u64, timeout: Duration) -> bool {
        let deadline = Instant::now() + timeout;
        let mut state = lock(&self.state);
        while state.completed < generation {
            let now = Instant::now();
            if now >= deadline {
                return false;
            }
            state = self
                .done
                .wait_timeout(state, deadline - now)
                .map(|(g, _)| g)
                .unwrap_or_else(|e| e.into_inner().0);
        }
        true
    }

    /// When the latest completed record completed.
    pub(crate) fn completed_at(&self) -> Option<Instant> {
        lock(&self.state).completed_at
    }
}

/// One unit of queued work.
pub(crate) enum Op {
    /// `len` bytes from `src` to `dst` (host or device addresses, checked when queued).
    Copy { dst: usize, src: usize, len: usize },
    /// A kernel launch.
    Launch(Box<Launch>),
    /// Completes `event`'s record `generation`.
    Record(Arc<Event>, u64),
    /// Blocks the stream until `event`'s record `generation` has completed.
    Wait(Arc<Event>, u64),
    /// Frees a device allocation once the work before it is done.
    Free(usize),
    /// Runs a host function once the work before it is done (`mcLaunchHostFunc`); the
    /// emulated collectives are such functions.
    Host(Box<dyn FnOnce() + Send>),
}

#[derive(Default)]
struct Queue {
    ops: VecDeque<Op>,
    closing: bool,
}

/// A stream of one emulated device.
pub(crate) struct Stream {
    pub(crate) device: Arc<DeviceState>,
    queue: Mutex<Queue>,
    ready: Condvar,
}

impl std::fmt::Debug for Stream {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Stream").field("device", &self.device.index).finish_non_exhaustive()
    }
}

/// Stack of a stream worker: the header's block scheduler keeps about 72 KiB of lane state on it.
const WORKER_STACK: usize = 8 << 20;

impl Stream {
    /// Creates a stream and starts its worker thread.
    pub(crate) fn spawn(device: Arc<DeviceState>, name: String) -> std::io::Result<Arc<Self>> {
        let stream = Arc::new(Self { device, queue: Mutex::new(Queue::default()), ready: Condvar::new() });
        let worker = stream.clone();
        std::thread::Builder::new().name(name).stack_size(WORKER_STACK).spawn(move || worker.run())?;
        Ok(stream)
    }

    /// Queues `op`.
    pub(crate) fn push(&self, op: Op) {
        lock(&self.queue).ops.push_back(op);
        self.ready.notify_one();
    }

    /// Lets the worker finish the queued work and exit.
    pub(crate) fn close(&self) {
        lock(&self.queue).closing = true;
        self.ready.notify_one();
    }

    fn run(&self) {
        loop {
            let op = {
                let mut queue = lock(&self.queue);
                loop {
                    if let Some(op) = queue.ops.pop_front() {
                        break op;
                    }
                    if queue.closing {
                        return;
                    }
                    queue = self.ready.wait(queue).unwrap_or_else(|e| e.into_inner());
                }
            };
            self.execute(op);
        }
    }

    fn execute(&self, op: Op) {
        let device = &self.device;
        match op {
            Op::Copy { dst, src, len } => {
                if device.fault().is_none() {
                    // SAFETY: both ranges were checked when the copy was queued (device ranges
                    // against live allocations; host ranges are the caller's contract, valid
                    // until the stream passes this copy), and they do not overlap (distinct
                    // allocations, or `memmove` semantics below).
                    unsafe { std::ptr::copy(src as *const u8, dst as *mut u8, len) };
                }
            }
            Op::Launch(mut launch) => {
                if device.fault().is_none() {
                    let delay = device.config.launch_delay;
                    if !delay.is_zero() {
                        std::thread::sleep(delay);
                    }
                    if let Err(reason) = launch.run() {
                        device.set_fault(FaultReport { kernel: launch.module.name.clone(), reason });
                    }
                }
            }
            Op::Record(event, generation) => event.complete(generation),
            Op::Wait(event, generation) => {
                // A wait never gives up on the device: like a GPU, a stream waits for as long
                // as the awaited work takes (host waits have timeouts).
                while !event.wait(generation, Duration::from_secs(3600)) {}
            }
            Op::Host(function) => function(),
            Op::Free(ptr) => {
                // SAFETY: stream-ordered free: work queued before it on this stream is done, and
                // the caller guaranteed that no other work uses the allocation.
                let _ = unsafe { device.memory.free(ptr) };
            }
        }
    }
}
