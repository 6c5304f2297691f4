//! Errors of the runtime layer (device discovery).

use crate::driver::DriverError;

/// Why a device of a platform cannot be used.
#[derive(Debug, Clone, PartialEq, thiserror::Error)]
pub enum BackendError {
    /// The platform has no usable device at all (driver missing, or it reports none).
    #[error("no {platform} device available: {reason}")]
    Unavailable {
        /// The platform's name ("metax", "cuda-proxy").
        platform: &'static str,
        /// Why, naming the library looked for and the environment variable that controls it.
        reason: String,
    },
    /// The driver works but the requested ordinal does not exist.
    #[error("{platform} device {index} does not exist ({count} visible)")]
    NoSuchDevice {
        /// The platform's name.
        platform: &'static str,
        /// The requested ordinal.
        index: usize,
        /// The number of visible devices.
        count: usize,
    },
    /// The device exists but a driver call on it failed (e.g. it is poisoned).
    #[error("{platform} device {index}: {error}")]
    Driver {
        /// The platform's name.
        platform: &'static str,
        /// The device ordinal.
        index: usize,
        /// The driver's error.
        error: DriverError,
    },
}
