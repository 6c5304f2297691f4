//! Ordering by need: which streams a piece of device work waits for.
//!
//! Every operation the server queues — a kernel launch, a device → host read, a host → device
//! write — and every page it frees touches device memory ranges. [`Uses`] remembers, for each
//! range, the operation that touched it last: its stream and an event recorded on that stream
//! right after it (a [`Mark`], one per operation). Before an operation is queued on stream `S`,
//! `S` waits (on the device) for the marks of **other** streams on the ranges it touches, and for
//! nothing else; afterwards the operation's own mark replaces them. A mark of stream `T` that `S`
//! already waited for (or an older one of `T`) is not waited for twice.
//!
//! That covers the three hazards between streams:
//! - a read after another stream's write, including a write *in place* into a buffer created on
//!   the reading stream (FSDP's communication thread reducing into a gradient);
//! - a write after another stream's read or write;
//! - memory reused after it was freed: a buffer freed on its stream and handed out again by that
//!   stream's pool is the same address range, so the new owner's first use waits for the last
//!   use by any other stream. A page given back to the driver waits the same way first.
//!
//! Operations are not told apart into reads and writes (CubeCL does not say which bindings a
//! kernel writes): every use counts as a write, which is never wrong, only stricter than
//! needed for two streams reading one buffer.
//!
//! [`StreamOrdering`] selects the rule per device: [`StreamOrdering::ByNeed`] (the default),
//! [`StreamOrdering::AllStreams`] (the earlier rule: every operation waits for the work queued
//! on every other stream — kept to measure against) and [`StreamOrdering::Unordered`] (no wait at
//! all beyond CubeCL's own, a negative control for tests: it computes wrong results).

use std::collections::{BTreeMap, HashMap};
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex, MutexGuard};

use crate::driver::{Driver, EventHandle, StreamHandle};

/// How the operations of one device's streams are ordered against each other.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Default)]
pub enum StreamOrdering {
    /// An operation waits for the last use of each memory range it touches by another stream
    /// (the module's rule). The default.
    #[default]
    ByNeed,
    /// An operation waits for all the work queued so far on every other stream of the device:
    /// correct, but it serialises the streams (a communication stream cannot overlap compute).
    AllStreams,
    /// No wait beyond CubeCL's own (a stream waits for the stream that *created* a buffer).
    /// Wrong results by design: only for tests that must show a missing wait is detected.
    Unordered,
}

impl StreamOrdering {
    /// The rule named `name`: `by-need`, `all-streams` or `none`.
    pub fn parse(name: &str) -> Option<Self> {
        match name.trim() {
            "by-need" => Some(Self::ByNeed),
            "all-streams" => Some(Self::AllStreams),
            "none" | "unordered" => Some(Self::Unordered),
            _ => None,
        }
    }

    /// The rule as a small number (for [`DeviceOrder`]'s packed cache).
    fn code(self) -> u64 {
        match self {
            Self::ByNeed => 0,
            Self::AllStreams => 1,
            Self::Unordered => 2,
        }
    }

    /// The rule [`StreamOrdering::code`] gave `code`.
    fn from_code(code: u64) -> Self {
        match code {
            1 => Self::AllStreams,
            2 => Self::Unordered,
            _ => Self::ByNeed,
        }
    }

    /// The rule's name, as [`StreamOrdering::parse`] reads it.
    pub fn name(self) -> &'static str {
        match self {
            Self::ByNeed => "by-need",
            Self::AllStreams => "all-streams",
            Self::Unordered => "none",
        }
    }
}

/// The rules set with [`set_stream_ordering`], by platform name and device.
static SETTINGS: Mutex<Vec<(&'static str, usize, StreamOrdering)>> = Mutex::new(Vec::new());
/// Bumped by every [`set_stream_ordering`], so that servers re-read their rule only then.
static GENERATION: AtomicU64 = AtomicU64::new(0);

fn settings() -> MutexGuard<'static, Vec<(&'static str, usize, StreamOrdering)>> {
    // Every update is a single push or assignment: a panic cannot leave it half done.
    SETTINGS.lock().unwrap_or_else(|e| e.into_inner())
}

/// Sets how the streams of device `device` of platform `platform` (a
/// [`super::Platform::NAME`], e.g. `"metax-emu"`) are ordered, from the next operation on;
/// returns the rule it replaces.
///
/// Without a call, a device uses `$METAX_STREAM_ORDERING` (`by-need`, `all-streams` or
/// `none`), else [`StreamOrdering::ByNeed`].
///
/// ```
/// use burn_metax_backend::runtime::{StreamOrdering, set_stream_ordering, stream_ordering};
///
/// let before = set_stream_ordering("metax-emu", 7, StreamOrdering::AllStreams);
/// assert_eq!(stream_ordering("metax-emu", 7), StreamOrdering::AllStreams);
/// set_stream_ordering("metax-emu", 7, before);
/// ```
pub fn set_stream_ordering(
    platform: &'static str,
    device: usize,
    ordering: StreamOrdering,
) -> StreamOrdering {
    let mut settings = settings();
    let before = match settings.iter_mut().find(|(p, d, _)| *p == platform && *d == device) {
        Some(slot) => std::mem::replace(&mut slot.2, ordering),
        None => {
            settings.push((platform, device, ordering));
            default_ordering()
        }
    };
    GENERATION.fetch_add(1, Ordering::Release);
    before
}

/// The rule device `device` of platform `platform` follows (see [`set_stream_ordering`]).
pub fn stream_ordering(platform: &str, device: usize) -> StreamOrdering {
    settings()
        .iter()
        .find(|(p, d, _)| *p == platform && *d == device)
        .map_or_else(default_ordering, |(_, _, o)| *o)
}

/// `$METAX_STREAM_ORDERING`, else [`StreamOrdering::ByNeed`] (an unknown name is ignored).
fn default_ordering() -> StreamOrdering {
    std::env::var("METAX_STREAM_ORDERING")
        .ok()
        .and_then(|name| StreamOrdering::parse(&name))
        .unwrap_or_default()
}

/// An event recorded on a stream right after one operation. The event is destroyed with the
/// last reference to the mark (a wait already queued on it keeps its work).
pub(crate) struct Mark {
    driver: Arc<dyn Driver>,
    /// `None` when the event could not be created or recorded: waiting for the mark then waits
    /// for everything queued on its stream by that time, which includes the operation.
    event: Option<EventHandle>,
    stream: StreamHandle,
    /// Order of the marks, over all streams (higher is later on its stream).
    seq: u64,
}

impl Drop for Mark {
    fn drop(&mut self) {
        if let Some(event) = self.event {
            let _ = self.driver.event_destroy(event);
        }
    }
}

impl Mark {
    /// Makes `stream` wait (on the device) for the mark; if the wait cannot be queued, the host
    /// waits for the event instead, so the order is kept either way.
    fn wait_on(&self, stream: StreamHandle) {
        match self.event {
            Some(event) => {
                if self.driver.stream_wait_event(stream, event).is_err() {
                    let _ = self.driver.event_synchronize(event);
                }
            }
            None => super::fence::Fence::new(self.driver.clone(), self.stream).wait_async(stream),
        }
    }
}

/// One tracked range: `[start, end)` was last used by `mark`'s operation.
struct Use {
    end: u64,
    mark: Arc<Mark>,
}

/// The last use of every device memory range of one device, and which marks each stream has
/// already waited for (see the module docs).
#[derive(Default)]
pub(crate) struct Uses {
    /// Non-overlapping ranges, by first byte.
    ranges: BTreeMap<u64, Use>,
    /// `(waiting stream, marking stream)` → the latest mark of the second that the first waited
    /// for.
    waited: HashMap<(StreamHandle, StreamHandle), u64>,
    next_seq: u64,
}

/// A device memory range `[start, end)`.
pub(crate) type Range = (u64, u64);

impl Uses {
    /// The keys of the tracked ranges that overlap `[start, end)`.
    fn overlapping(&self, (start, end): Range) -> Vec<u64> {
        let mut keys = Vec::new();
        if let Some((&key, used)) = self.ranges.range(..=start).next_back()
            && used.end > start
        {
            keys.push(key);
        }
        keys.extend(self.ranges.range(start + 1..end).map(|(&key, _)| key));
        keys
    }

    /// Makes `stream` wait for the last use, by another stream, of each of `ranges`. Returns
    /// how many waits it queued.
    pub(crate) fn wait_for(&mut self, stream: StreamHandle, ranges: &[Range]) -> usize {
        // The latest mark of each other stream among the ranges' last uses.
        let mut latest: Vec<Arc<Mark>> = Vec::new();
        for &range in ranges.iter().filter(|(start, end)| end > start) {
            for key in self.overlapping(range) {
                let mark = &self.ranges[&key].mark;
                if mark.stream == stream {
                    continue;
                }
                match latest.iter_mut().find(|m| m.stream == mark.stream) {
                    Some(m) if m.seq >= mark.seq => {}
                    Some(m) => *m = mark.clone(),
                    None => latest.push(mark.clone()),
                }
            }
        }
        let mut waits = 0;
        for mark in latest {
            let waited = self.waited.entry((stream, mark.stream)).or_insert(0);
            if *waited >= mark.seq {
                continue;
            }
            *waited = mark.seq;
            mark.wait_on(stream);
            waits += 1;
        }
        waits
    }

    /// Records a mark on `stream` after the work queued on it so far, and makes it the last use
    /// of each of `ranges`.
    pub(crate) fn mark(&mut self, driver: &Arc<dyn Driver>, stream: StreamHandle, ranges: &[Range]) {
        let ranges: Vec<Range> = ranges.iter().copied().filter(|(start, end)| end > start).collect();
        if ranges.is_empty() {
            return;
        }
        let event =
            driver.event_create(false).ok().and_then(|event| match driver.event_record(event, stream) {
                Ok(()) => Some(event),
                Err(_) => {
                    let _ = driver.event_destroy(event);
                    None
                }
            });
        self.next_seq += 1;
        let mark = Arc::new(Mark { driver: driver.clone(), event, stream, seq: self.next_seq });
        for range in ranges {
            self.remove(range);
            self.ranges.insert(range.0, Use { end: range.1, mark: mark.clone() });
        }
    }

    /// Forgets the uses of `range` (memory given back to the driver), keeping those of the bytes
    /// around it.
    pub(crate) fn remove(&mut self, (start, end): Range) {
        for key in self.overlapping((start, end)) {
            let Some(used) = self.ranges.remove(&key) else { continue };
            if key < start {
                self.ranges.insert(key, Use { end: start, mark: used.mark.clone() });
            }
            if used.end > end {
                self.ranges.insert(end, Use { end: used.end, mark: used.mark });
            }
        }
    }

    /// How many ranges are tracked (for tests).
    #[cfg(test)]
    fn len(&self) -> usize {
        self.ranges.len()
    }
}

/// `generation` (its low 62 bits) and `rule` in one word.
fn pack(generation: u64, rule: StreamOrdering) -> u64 {
    (generation << 2) | rule.code()
}

/// The ordering state of one device, shared by its server and its streams' storages.
pub(crate) struct DeviceOrder {
    platform: &'static str,
    device: usize,
    driver: Arc<dyn Driver>,
    uses: Mutex<Uses>,
    /// `GENERATION` when the rule was read, shifted left by 2, with the rule's code in the low
    /// two bits: one atomic, so that reading the rule (several times per launch) takes no lock.
    cached: AtomicU64,
}

impl std::fmt::Debug for DeviceOrder {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("DeviceOrder").field("platform", &self.platform).field("device", &self.device).finish()
    }
}

impl DeviceOrder {
    pub(crate) fn new(platform: &'static str, device: usize, driver: Arc<dyn Driver>) -> Self {
        let rule = stream_ordering(platform, device);
        Self {
            platform,
            device,
            driver,
            uses: Mutex::new(Uses::default()),
            cached: AtomicU64::new(pack(GENERATION.load(Ordering::Acquire), rule)),
        }
    }

    /// The device's rule now.
    pub(crate) fn rule(&self) -> StreamOrdering {
        let generation = GENERATION.load(Ordering::Acquire);
        let cached = self.cached.load(Ordering::Acquire);
        if cached >> 2 == generation & (u64::MAX >> 2) {
            return StreamOrdering::from_code(cached & 3);
        }
        // Read after the generation: a setting made since is picked up at the next call at the
        // latest (its bump makes the generation differ again).
        let rule = stream_ordering(self.platform, self.device);
        self.cached.store(pack(generation, rule), Ordering::Release);
        rule
    }

    /// The tracked uses.
    pub(crate) fn uses(&self) -> MutexGuard<'_, Uses> {
        // Updates are plain map edits: a panic cannot leave the map unusable.
        self.uses.lock().unwrap_or_else(|e| e.into_inner())
    }

    /// The driver.
    pub(crate) fn driver(&self) -> &Arc<dyn Driver> {
        &self.driver
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn ranges_split_and_merge_as_uses_replace_each_other() {
        let config = crate::emu::EmuConfig::uniform(1, Default::default());
        let driver: Arc<dyn Driver> =
            Arc::new(crate::emu::EmuDriver::new(config).expect("a host C++ compiler"));
        let mut uses = Uses::default();
        let (a, b) =
            (driver.stream_create(true).expect("stream"), driver.stream_create(true).expect("stream"));
        uses.mark(&driver, a, &[(0, 100)]);
        // B's use of the middle splits A's range in three.
        uses.mark(&driver, b, &[(40, 60)]);
        assert_eq!(uses.len(), 3);
        assert_eq!(uses.overlapping((0, 100)), vec![0, 40, 60]);
        // B waits for A's use of [0, 40) but not for its own; once only.
        assert_eq!(uses.wait_for(b, &[(10, 50)]), 1);
        assert_eq!(uses.wait_for(b, &[(10, 50)]), 0);
        // A waits for B's use.
        assert_eq!(uses.wait_for(a, &[(59, 61)]), 1);
        // Nothing waits for ranges no one used, and empty ranges are ignored.
        assert_eq!(uses.wait_for(a, &[(100, 200), (50, 50)]), 0);
        uses.remove((0, 100));
        assert_eq!(uses.len(), 0);
    }
}
