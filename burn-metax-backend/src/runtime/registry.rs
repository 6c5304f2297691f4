//! The process-wide registry of started servers: for each `(platform, device)`, the driver and
//! the list of driver streams the server created.
//!
//! It lets code outside the server order its own driver work against the server's streams
//! (the device communicators of [`crate::collective`] run collectives on their own stream,
//! ordered against every compute stream by events) without reaching into the server, which
//! lives on its device thread. A server registers itself when it starts; a later server of the
//! same device (none is started in practice) replaces the entry.

use std::sync::{Arc, Mutex, MutexGuard};

use super::order::DeviceOrder;
use super::stream::StreamRegistry;
use crate::driver::{Driver, StreamHandle};

/// What the registry keeps for one device.
#[derive(Clone)]
pub struct DeviceStreams {
    driver: Arc<dyn Driver>,
    streams: StreamRegistry,
    order: Arc<DeviceOrder>,
}

impl std::fmt::Debug for DeviceStreams {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("DeviceStreams")
            .field("driver", &self.driver)
            .field("streams", &self.streams())
            .finish()
    }
}

impl DeviceStreams {
    /// The driver the server uses.
    pub fn driver(&self) -> &Arc<dyn Driver> {
        &self.driver
    }

    /// The device's stream-ordering state: the last use of each memory range.
    pub(crate) fn order(&self) -> &Arc<DeviceOrder> {
        &self.order
    }

    /// Every driver stream the server has created so far (its compute streams).
    pub fn streams(&self) -> Vec<StreamHandle> {
        self.streams.lock().unwrap_or_else(|e| e.into_inner()).clone()
    }
}

type Entries = Vec<(&'static str, usize, DeviceStreams)>;

static DEVICES: Mutex<Entries> = Mutex::new(Vec::new());

fn devices() -> MutexGuard<'static, Entries> {
    // Every update is a single push or assignment: a panic cannot leave it half done.
    DEVICES.lock().unwrap_or_else(|e| e.into_inner())
}

/// Records the server of device `index` of platform `platform`.
pub(crate) fn register(
    platform: &'static str,
    index: usize,
    driver: Arc<dyn Driver>,
    streams: StreamRegistry,
    order: Arc<DeviceOrder>,
) {
    let entry = DeviceStreams { driver, streams, order };
    let mut devices = devices();
    match devices.iter_mut().find(|(p, i, _)| *p == platform && *i == index) {
        Some(slot) => slot.2 = entry,
        None => devices.push((platform, index, entry)),
    }
}

/// The driver and streams of the server of device `index` of platform `platform` (the
/// platform's [`super::Platform::NAME`]), if that server has started.
pub fn device_streams(platform: &str, index: usize) -> Option<DeviceStreams> {
    devices().iter().find(|(p, i, _)| *p == platform && *i == index).map(|(_, _, e)| e.clone())
}
