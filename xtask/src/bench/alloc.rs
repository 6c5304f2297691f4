//! Memory: a counting global allocator, installed by the `xtask` binary (`main.rs`).

use std::alloc::{GlobalAlloc, Layout};

use burn_fsdp::host_memory::MappedLargeBlocks;
use std::sync::atomic::{AtomicBool, AtomicIsize, Ordering};

pub(super) static LIVE: AtomicIsize = AtomicIsize::new(0);
pub(super) static PEAK: AtomicIsize = AtomicIsize::new(0);
static COUNTING: AtomicBool = AtomicBool::new(false);

/// The `xtask` binary's global allocator: [`MappedLargeBlocks`] (blocks of 128 MiB or more
/// mapped on their own, the rest from the system allocator), plus process-wide live and peak
/// bytes for the memory figures of `bench` (two relaxed atomics per allocation).
pub struct CountingAlloc;

fn count(delta: isize) {
    let now = LIVE.fetch_add(delta, Ordering::Relaxed) + delta;
    if delta > 0 {
        PEAK.fetch_max(now, Ordering::Relaxed);
    }
}

// SAFETY: every method forwards to `MappedLargeBlocks` with the caller's arguments unchanged,
// so the `GlobalAlloc` contract holds exactly as for it; the counters are plain atomics.
unsafe impl GlobalAlloc for CountingAlloc {
    unsafe fn alloc(&self, layout: Layout) -> *mut u8 {
        // SAFETY: same layout as given to us.
        let p = unsafe { MappedLargeBlocks.alloc(layout) };
        if !p.is_null() {
            COUNTING.store(true, Ordering::Relaxed);
            count(layout.size() as isize);
        }
        p
    }
    unsafe fn alloc_zeroed(&self, layout: Layout) -> *mut u8 {
        // SAFETY: same layout as given to us.
        let p = unsafe { MappedLargeBlocks.alloc_zeroed(layout) };
        if !p.is_null() {
            count(layout.size() as isize);
        }
        p
    }
    unsafe fn dealloc(&self, ptr: *mut u8, layout: Layout) {
        // SAFETY: `ptr` was returned by this allocator (so by `MappedLargeBlocks`) with this layout.
        unsafe { MappedLargeBlocks.dealloc(ptr, layout) };
        count(-(layout.size() as isize));
    }
    unsafe fn realloc(&self, ptr: *mut u8, layout: Layout, new_size: usize) -> *mut u8 {
        // SAFETY: forwarded unchanged.
        let p = unsafe { MappedLargeBlocks.realloc(ptr, layout, new_size) };
        if !p.is_null() {
            count(new_size as isize - layout.size() as isize);
        }
        p
    }
}

/// Live bytes now (process-wide), or `None` when [`CountingAlloc`] is not the global allocator.
pub(super) fn live_bytes() -> Option<isize> {
    COUNTING.load(Ordering::Relaxed).then(|| LIVE.load(Ordering::Relaxed))
}
