//! Bytes the server copied between host and device memory (reads and writes, not kernels'
//! argument uploads), per device and per client stream: what a caller's own thread made cross
//! the host boundary, told apart from what other threads did meanwhile.
//!
//! Benchmarks read it around a call to count that call's copies
//! (`cargo xtask bench --device metax-emu --step-profile` does, around each collective).

use std::collections::HashMap;
use std::sync::{Mutex, MutexGuard};

use cubecl_common::stream_id::StreamId;

type Key = (&'static str, usize, u64);

static BYTES: Mutex<Option<HashMap<Key, u64>>> = Mutex::new(None);

fn bytes() -> MutexGuard<'static, Option<HashMap<Key, u64>>> {
    // Every update is one addition: a panic cannot leave the map half changed.
    BYTES.lock().unwrap_or_else(|e| e.into_inner())
}

/// Counts `n` bytes copied for client stream `stream` of device `device` of `platform`.
pub(crate) fn add(platform: &'static str, device: usize, stream: StreamId, n: u64) {
    if n > 0 {
        *bytes().get_or_insert_with(HashMap::new).entry((platform, device, stream.value)).or_insert(0) += n;
    }
}

/// Bytes copied so far between host and device memory for client stream `stream` (a thread's
/// [`StreamId::current`]) on device `device` of platform `platform` (a
/// [`super::Platform::NAME`]): the data of reads (device → host) and writes (host → device).
///
/// ```
/// use burn_metax_backend::runtime::host_bytes_of_stream;
/// use cubecl_common::stream_id::StreamId;
///
/// assert_eq!(host_bytes_of_stream("metax-emu", 63, StreamId::current()), 0);
/// ```
pub fn host_bytes_of_stream(platform: &str, device: usize, stream: StreamId) -> u64 {
    bytes()
        .as_ref()
        .and_then(|m| m.iter().find(|((p, d, s), _)| *p == platform && *d == device && *s == stream.value))
        .map_or(0, |(_, n)| *n)
}

/// [`host_bytes_of_stream`] for the calling thread's stream.
pub fn host_bytes_of_this_thread(platform: &str, device: usize) -> u64 {
    host_bytes_of_stream(platform, device, StreamId::current())
}

/// Bytes copied so far between host and device memory on device `device` of platform
/// `platform`, by every client stream: the sum of [`host_bytes_of_stream`] over the streams.
///
/// ```
/// use burn_metax_backend::runtime::host_bytes_of_device;
///
/// assert_eq!(host_bytes_of_device("metax-emu", 63), 0);
/// ```
pub fn host_bytes_of_device(platform: &str, device: usize) -> u64 {
    bytes()
        .as_ref()
        .map_or(0, |m| m.iter().filter(|((p, d, _), _)| *p == platform && *d == device).map(|(_, n)| n).sum())
}
