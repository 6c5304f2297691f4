//! [`StagingQueue`]: host buffers kept alive until the device has read them, released without
//! blocking the host.
//!
//! Every launch uploads its info buffer (scalars and metadata) from page-locked staging memory,
//! and every write uploads its data the same way; the copy is asynchronous, so the staging
//! memory must outlive it. CubeCL's `PendingDropQueue` keeps such buffers in batches and, at
//! each flush (every 64 buffers), *waits on the host* for the batch before last. On a step of a
//! few thousand launches that is one host wait every 64 launches (31 per step of the tiny model
//! on one emulated device), which caps how far the host can run ahead of the device at 128
//! launches.
//!
//! This queue seals the same batches behind an event, but releases a batch only once a
//! non-blocking query says its event was reached. The host waits only when more than
//! [`MAX_IN_FLIGHT_BATCHES`] batches or [`MAX_IN_FLIGHT_BYTES`] bytes are still held — the
//! bound on host memory, as deep as a GPU's own launch queue — and when the queue is dropped.

use std::collections::VecDeque;
use std::sync::Arc;

use cubecl_common::bytes::Bytes;

use super::fence::Fence;
use crate::driver::{Driver, StreamHandle};

/// A batch is sealed once it holds this many buffers…
pub(crate) const BATCH_BUFFERS: usize = 64;
/// … or this many bytes.
pub(crate) const BATCH_BYTES: usize = 64 << 20;
/// At most this many sealed batches are held before the host waits for the oldest.
pub(crate) const MAX_IN_FLIGHT_BATCHES: usize = 256;
/// At most this many bytes are held in sealed batches before the host waits for the oldest.
pub(crate) const MAX_IN_FLIGHT_BYTES: usize = 512 << 20;

/// Host buffers of one stream that queued device work still reads.
pub(crate) struct StagingQueue {
    driver: Arc<dyn Driver>,
    stream: StreamHandle,
    /// Buffers of the batch being filled, not yet behind a fence.
    staged: Vec<Bytes>,
    staged_bytes: usize,
    /// Sealed batches, oldest first: each is free once its fence has been reached.
    in_flight: VecDeque<(Fence, Vec<Bytes>, usize)>,
    in_flight_bytes: usize,
}

impl std::fmt::Debug for StagingQueue {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("StagingQueue")
            .field("stream", &self.stream)
            .field("staged", &self.staged.len())
            .field("in_flight", &self.in_flight.len())
            .finish()
    }
}

impl StagingQueue {
    /// An empty queue for the buffers of `stream`.
    pub(crate) fn new(driver: Arc<dyn Driver>, stream: StreamHandle) -> Self {
        Self {
            driver,
            stream,
            staged: Vec::new(),
            staged_bytes: 0,
            in_flight: VecDeque::new(),
            in_flight_bytes: 0,
        }
    }

    /// Keeps `bytes` alive until the work queued so far on the stream (and the next sealing
    /// point) has been reached.
    pub(crate) fn push(&mut self, bytes: Bytes) {
        self.staged_bytes += bytes.len();
        self.staged.push(bytes);
    }

    /// Whether the batch being filled is full ([`BATCH_BUFFERS`], [`BATCH_BYTES`]).
    pub(crate) fn batch_full(&self) -> bool {
        self.staged.len() >= BATCH_BUFFERS || self.staged_bytes >= BATCH_BYTES
    }

    /// Seals the batch being filled behind an event recorded on the stream after the work that
    /// reads it, then releases every batch whose event was reached, oldest first,
    /// without waiting. The host waits for the oldest batches only while more than
    /// [`MAX_IN_FLIGHT_BATCHES`] or [`MAX_IN_FLIGHT_BYTES`] are held.
    pub(crate) fn seal(&mut self) {
        if !self.staged.is_empty() {
            let batch = std::mem::take(&mut self.staged);
            let bytes = std::mem::take(&mut self.staged_bytes);
            self.in_flight.push_back((Fence::new(self.driver.clone(), self.stream), batch, bytes));
            self.in_flight_bytes += bytes;
        }
        while let Some((fence, _, _)) = self.in_flight.front() {
            let over =
                self.in_flight.len() > MAX_IN_FLIGHT_BATCHES || self.in_flight_bytes > MAX_IN_FLIGHT_BYTES;
            let reached = fence.reached();
            if !over && !reached {
                break;
            }
            if let Some((fence, batch, bytes)) = self.in_flight.pop_front() {
                if reached {
                    fence.release();
                } else {
                    // Over the bound: the host waits. A failed wait means the device is
                    // broken: its streams report that error, and it reads nothing more.
                    let _ = fence.wait_sync();
                }
                drop(batch);
                self.in_flight_bytes -= bytes;
            }
        }
    }

    /// Buffers held: in the batch being filled, and in sealed batches.
    #[cfg(test)]
    fn held(&self) -> (usize, usize) {
        (self.staged.len(), self.in_flight.iter().map(|(_, b, _)| b.len()).sum())
    }
}

impl Drop for StagingQueue {
    fn drop(&mut self) {
        // The stream goes away: its queued copies may still read the buffers, the unsealed ones
        // included, so seal those too and wait for every batch.
        if !self.staged.is_empty() {
            let batch = std::mem::take(&mut self.staged);
            self.in_flight.push_back((Fence::new(self.driver.clone(), self.stream), batch, 0));
        }
        for (fence, batch, _) in self.in_flight.drain(..) {
            let _ = fence.wait_sync();
            drop(batch);
        }
    }
}

#[cfg(test)]
mod tests {
    use std::sync::Arc;

    use super::*;
    use crate::driver::Driver;
    use crate::emu::{EmuConfig, EmuDriver};

    fn driver() -> Arc<EmuDriver> {
        Arc::new(EmuDriver::new(EmuConfig::uniform(1, Default::default())).expect("a host C++ compiler"))
    }

    fn buffer() -> Bytes {
        Bytes::from_bytes_vec(vec![7; 16])
    }

    #[test]
    fn batches_are_released_without_a_host_wait_once_the_device_passed_them() {
        let emu = driver();
        let dyn_driver: Arc<dyn Driver> = emu.clone();
        let stream = dyn_driver.stream_create(true).expect("stream");
        let mut queue = StagingQueue::new(dyn_driver.clone(), stream);
        for _ in 0..BATCH_BUFFERS {
            queue.push(buffer());
        }
        assert!(queue.batch_full());
        // The stream is held: the sealed batch stays, and sealing does not wait for it.
        let release = emu.hold_stream(stream).expect("hold");
        queue.seal();
        assert_eq!(queue.held(), (0, BATCH_BUFFERS));
        let syncs = emu.counters(0).host_syncs;
        queue.push(buffer());
        queue.seal();
        assert_eq!(queue.held(), (0, BATCH_BUFFERS + 1), "nothing reached yet: nothing released");
        assert_eq!(emu.counters(0).host_syncs, syncs, "sealing never waited on the host");
        drop(release);
        dyn_driver.stream_synchronize(stream).expect("sync");
        queue.seal();
        assert_eq!(queue.held(), (0, 0), "both batches released once the stream passed them");
        dyn_driver.stream_destroy(stream).expect("destroy");
    }

    #[test]
    fn past_the_bound_the_host_waits_for_the_oldest_batch() {
        let emu = driver();
        let dyn_driver: Arc<dyn Driver> = emu.clone();
        let stream = dyn_driver.stream_create(true).expect("stream");
        let mut queue = StagingQueue::new(dyn_driver.clone(), stream);
        let release = emu.hold_stream(stream).expect("hold");
        for _ in 0..MAX_IN_FLIGHT_BATCHES {
            queue.push(buffer());
            queue.seal();
        }
        assert_eq!(queue.held(), (0, MAX_IN_FLIGHT_BATCHES));
        // One more batch goes over the bound: the seal waits until the stream is let go.
        let releaser = std::thread::spawn(move || {
            std::thread::sleep(std::time::Duration::from_millis(200));
            drop(release);
        });
        let syncs = emu.counters(0).host_syncs;
        queue.push(buffer());
        queue.seal();
        // The seal waited for the oldest batch (one host sync); once the stream is let go the
        // others are reached as well and released without waiting.
        assert_eq!(emu.counters(0).host_syncs, syncs + 1, "one host wait, for the oldest batch");
        assert!(queue.held().1 <= MAX_IN_FLIGHT_BATCHES, "held {:?}", queue.held());
        releaser.join().expect("releaser");
        drop(queue);
        dyn_driver.stream_destroy(stream).expect("destroy");
    }
}
