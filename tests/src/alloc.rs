//! A counting global allocator for memory tests: live and peak bytes, and a log of large
//! allocations while switched on.
//!
//! The `memory` test binary installs it with
//! `#[global_allocator] static ALLOCATOR: tests::alloc::Counting = tests::alloc::Counting;`
//! and holds only tests that read the counters. The counters are process-wide, so each of
//! those tests holds [`exclusive`] while it runs: one at a time, nothing else allocating.

use std::alloc::{GlobalAlloc, Layout, System};
use std::sync::atomic::{AtomicBool, AtomicIsize, AtomicUsize, Ordering};
use std::sync::{Mutex, MutexGuard};

/// Bytes allocated and not yet freed.
pub static CURRENT: AtomicIsize = AtomicIsize::new(0);
/// The highest [`CURRENT`] since it was last reset.
pub static PEAK: AtomicIsize = AtomicIsize::new(0);

/// Allocations of at least this many bytes are logged while [`log_large`] is on.
pub const LARGE: usize = 1 << 20;
const LOG_CAP: usize = 1 << 14;
static LOG_ON: AtomicBool = AtomicBool::new(false);
static LOG_LEN: AtomicUsize = AtomicUsize::new(0);
static LOG: [AtomicUsize; LOG_CAP] = [const { AtomicUsize::new(0) }; LOG_CAP];

/// Forwards to [`System`], counting.
pub struct Counting;

fn grew(by: usize) {
    let now = CURRENT.fetch_add(by as isize, Ordering::Relaxed) + by as isize;
    PEAK.fetch_max(now, Ordering::Relaxed);
}

fn record(size: usize) {
    if size >= LARGE && LOG_ON.load(Ordering::Relaxed) {
        let i = LOG_LEN.fetch_add(1, Ordering::Relaxed);
        if i < LOG_CAP {
            LOG[i].store(size, Ordering::Relaxed);
        }
    }
}

// SAFETY: every method forwards to `System` with the caller's arguments unchanged, so the
// GlobalAlloc contract holds exactly as for `System`; the counters and the log are plain
// atomics (the log never allocates).
unsafe impl GlobalAlloc for Counting {
    unsafe fn alloc(&self, layout: Layout) -> *mut u8 {
        // SAFETY: same layout as given to us.
        let p = unsafe { System.alloc(layout) };
        if !p.is_null() {
            grew(layout.size());
            record(layout.size());
        }
        p
    }
    unsafe fn alloc_zeroed(&self, layout: Layout) -> *mut u8 {
        // SAFETY: same layout as given to us.
        let p = unsafe { System.alloc_zeroed(layout) };
        if !p.is_null() {
            grew(layout.size());
            record(layout.size());
        }
        p
    }
    unsafe fn dealloc(&self, ptr: *mut u8, layout: Layout) {
        // SAFETY: `ptr` was returned by `alloc`/`realloc` above with this layout.
        unsafe { System.dealloc(ptr, layout) };
        CURRENT.fetch_sub(layout.size() as isize, Ordering::Relaxed);
    }
    unsafe fn realloc(&self, ptr: *mut u8, layout: Layout, new_size: usize) -> *mut u8 {
        // SAFETY: forwarded unchanged.
        let p = unsafe { System.realloc(ptr, layout, new_size) };
        if !p.is_null() {
            let delta = new_size as isize - layout.size() as isize;
            let now = CURRENT.fetch_add(delta, Ordering::Relaxed) + delta;
            PEAK.fetch_max(now, Ordering::Relaxed);
            if new_size > layout.size() {
                record(new_size);
            }
        }
        p
    }
}

static EXCLUSIVE: Mutex<()> = Mutex::new(());

/// The counters for the calling test alone: every test of the `memory` binary holds this
/// guard from its first line, so no other test allocates while it measures. A test that
/// panicked while holding it leaves it usable (its poison is ignored).
pub fn exclusive() -> MutexGuard<'static, ()> {
    EXCLUSIVE.lock().unwrap_or_else(|p| p.into_inner())
}

/// Live bytes now.
pub fn live() -> isize {
    CURRENT.load(Ordering::Relaxed)
}

/// Restarts the peak at the live bytes now.
pub fn reset_peak() {
    PEAK.store(live(), Ordering::Relaxed);
}

/// The peak since [`reset_peak`].
pub fn peak() -> isize {
    PEAK.load(Ordering::Relaxed)
}

/// Starts (clearing) or stops the log of allocations of at least [`LARGE`] bytes.
pub fn log_large(on: bool) {
    if on {
        LOG_LEN.store(0, Ordering::Relaxed);
    }
    LOG_ON.store(on, Ordering::Relaxed);
}

/// The sizes logged since the log was last started (at most 16384 of them; `None` if more
/// were made, so that a test never passes on a truncated log).
pub fn large_allocations() -> Option<Vec<usize>> {
    let n = LOG_LEN.load(Ordering::Relaxed);
    (n <= LOG_CAP).then(|| LOG[..n].iter().map(|s| s.load(Ordering::Relaxed)).collect())
}
