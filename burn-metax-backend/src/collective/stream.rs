//! [`CommStream`]: a group's communication stream, and the events that order it against the
//! server's compute streams.

use std::sync::Arc;

use crate::driver::{Driver, DriverError, EventHandle, StreamHandle};
use crate::runtime::StreamOrdering;
use crate::runtime::registry::DeviceStreams;

/// A driver stream owned by a device group, on which its collectives are queued.
///
/// Its methods make driver calls on the streams of one device: call them on that device's
/// server thread (where the device is current), except [`CommStream::query`] and
/// [`CommStream::forget`], which the watchdog calls from its own thread after making the
/// device current there.
pub(crate) struct CommStream {
    driver: Arc<dyn Driver>,
    device: DeviceStreams,
    handle: StreamHandle,
}

impl std::fmt::Debug for CommStream {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("CommStream").field("handle", &self.handle).finish_non_exhaustive()
    }
}

impl CommStream {
    /// Creates the stream (non-blocking: it never synchronises implicitly with the legacy
    /// default stream, like the server's streams).
    pub(crate) fn create(device: DeviceStreams) -> Result<Self, DriverError> {
        let driver = device.driver().clone();
        let handle = driver.stream_create(true)?;
        Ok(Self { driver, device, handle })
    }

    /// The stream.
    pub(crate) fn handle(&self) -> StreamHandle {
        self.handle
    }

    /// The driver.
    pub(crate) fn driver(&self) -> &Arc<dyn Driver> {
        &self.driver
    }

    /// Orders the communication stream before a collective whose buffers are `ranges`. By need
    /// (the device's default rule, [`crate::runtime::StreamOrdering`]): it waits for the last use
    /// of each range by another stream, and for nothing else. Under the other rules: for the work
    /// queued so far on every compute stream ([`CommStream::wait_for_compute`]).
    pub(crate) fn wait_for_buffers(&self, ranges: &[(u64, u64)]) -> Result<(), DriverError> {
        if self.device.order().rule() == StreamOrdering::ByNeed {
            self.device.order().uses().wait_for(self.handle, ranges);
            Ok(())
        } else {
            self.wait_for_compute()
        }
    }

    /// After a collective whose buffers are `ranges`: records an event for the watchdog and
    /// returns it (the caller destroys it with [`CommStream::forget`]). By need, the collective
    /// becomes the last use of its ranges, so that a compute stream waits for it exactly when
    /// it reads the output or reuses the input's memory. Under the other rules, every compute
    /// stream waits for it ([`CommStream::release_compute`]).
    pub(crate) fn release_buffers(&self, ranges: &[(u64, u64)]) -> Result<EventHandle, DriverError> {
        if self.device.order().rule() != StreamOrdering::ByNeed {
            return self.release_compute();
        }
        self.device.order().uses().mark(&self.driver, self.handle, ranges);
        let done = self.driver.event_create(false)?;
        match self.driver.event_record(done, self.handle) {
            Ok(()) => Ok(done),
            Err(e) => {
                let _ = self.driver.event_destroy(done);
                Err(e)
            }
        }
    }

    /// Makes the communication stream wait (on the device) for the work queued so far on every
    /// compute stream of the device: a collective queued next sees every write to its input.
    pub(crate) fn wait_for_compute(&self) -> Result<(), DriverError> {
        for compute in self.device.streams() {
            let event = self.driver.event_create(false)?;
            let waited = self
                .driver
                .event_record(event, compute)
                .and_then(|()| self.driver.stream_wait_event(self.handle, event));
            // Destroying an event whose wait is queued is allowed: the wait keeps its work.
            let destroyed = self.driver.event_destroy(event);
            waited?;
            destroyed?;
        }
        Ok(())
    }

    /// Records an event after the work queued so far on the communication stream, and makes
    /// every compute stream wait for it (on the device): later kernels see the collective's
    /// output, and the memory of its input is not reused before the collective has read it.
    /// Returns the event; the caller destroys it with [`CommStream::forget`].
    pub(crate) fn release_compute(&self) -> Result<EventHandle, DriverError> {
        let done = self.driver.event_create(false)?;
        let queued = (|| {
            self.driver.event_record(done, self.handle)?;
            for compute in self.device.streams() {
                self.driver.stream_wait_event(compute, done)?;
            }
            Ok(())
        })();
        match queued {
            Ok(()) => Ok(done),
            Err(e) => {
                let _ = self.driver.event_destroy(done);
                Err(e)
            }
        }
    }

    /// Whether the work before `event` has completed (does not block).
    pub(crate) fn query(&self, event: EventHandle) -> Result<bool, DriverError> {
        self.driver.event_query(event)
    }

    /// Destroys an event returned by [`CommStream::release_compute`].
    pub(crate) fn forget(&self, event: EventHandle) {
        let _ = self.driver.event_destroy(event);
    }

    /// Destroys the stream (its queued work still completes).
    pub(crate) fn destroy(&self) {
        let _ = self.driver.stream_destroy(self.handle);
    }
}
