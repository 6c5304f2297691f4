//! [`Fence`]: an event recorded on a stream, to wait for the work queued before it.

use std::sync::Arc;

use cubecl_common::backtrace::BackTrace;
use cubecl_core::server::ServerError;

use crate::driver::{Driver, DriverError, EventHandle, StreamHandle};

/// An event recorded on a stream after the work queued so far.
///
/// Creating or recording the event may fail (e.g. on a poisoned device); the failure is kept and
/// reported when the fence is waited for, so that building a fence never panics.
pub struct Fence {
    driver: Arc<dyn Driver>,
    event: Result<EventHandle, DriverError>,
}

impl std::fmt::Debug for Fence {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Fence").field("event", &self.event).finish()
    }
}

impl Fence {
    /// Records a new event on `stream`.
    pub(crate) fn new(driver: Arc<dyn Driver>, stream: StreamHandle) -> Self {
        let event = driver.event_create(false).and_then(|event| match driver.event_record(event, stream) {
            Ok(()) => Ok(event),
            Err(err) => {
                let _ = driver.event_destroy(event);
                Err(err)
            }
        });
        Self { driver, event }
    }

    /// Makes `stream` wait (on the device) for the fence's work, then destroys the event.
    ///
    /// If the device-side wait cannot be queued, the host waits for the event instead, so the
    /// ordering is kept either way.
    pub(crate) fn wait_async(self, stream: StreamHandle) {
        let Ok(event) = self.event else { return };
        if self.driver.stream_wait_event(stream, event).is_err() {
            let _ = self.driver.event_synchronize(event);
        }
        let _ = self.driver.event_destroy(event);
    }

    /// Whether the fence's work has completed, without waiting (`mcEventQuery`). A fence that
    /// could not be recorded, or whose query fails, counts as reached: the device is broken and
    /// [`Fence::wait_sync`] returns at once with the error.
    pub(crate) fn reached(&self) -> bool {
        match &self.event {
            Ok(event) => self.driver.event_query(*event).unwrap_or(true),
            Err(_) => true,
        }
    }

    /// Destroys the event of a fence that [`Fence::reached`] (no wait).
    pub(crate) fn release(self) {
        if let Ok(event) = self.event {
            let _ = self.driver.event_destroy(event);
        }
    }

    /// Blocks the calling thread until the fence's work has completed, then destroys the event.
    pub(crate) fn wait_sync(self) -> Result<(), ServerError> {
        let event = self.event.map_err(server_error)?;
        let synced = self.driver.event_synchronize(event);
        let destroyed = self.driver.event_destroy(event);
        synced.map_err(server_error)?;
        destroyed.map_err(server_error)
    }
}

/// A driver error as a CubeCL server error.
pub(crate) fn server_error(error: DriverError) -> ServerError {
    ServerError::Generic { reason: error.to_string(), backtrace: BackTrace::capture() }
}
