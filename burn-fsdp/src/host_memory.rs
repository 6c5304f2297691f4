//! Host memory for ranks that run as threads of one process on the CPU.
//!
//! FSDP allocates and frees unit-sized host buffers every forward and backward (the gathered
//! unit, its parameters' views, the flat gradient, the reduce-scatter's pieces), and the
//! model's own activations come and go as fast. With glibc's defaults much of that memory goes
//! back to the kernel when it is freed — large blocks are unmapped, the tops of the per-thread
//! arenas trimmed — and comes back as fresh pages on the next allocation: a page fault and a
//! page cleared by the kernel for every 4 KiB touched. A GPU caching allocator (PyTorch's)
//! keeps such memory instead; [`retain_host_memory`] asks glibc to do the same.
//!
//! Measured (docs/performance.md, "Host memory retained"): FSDP over two in-process ranks on
//! two cores of the 2-core CI machine, Qwen3 of 29M parameters on Flex, page faults per run
//! 0.59–0.68 M → 0.25–0.30 M and tokens/s +8 % on average over alternated runs (though within
//! that virtual machine's run-to-run spread); single-device training on one core unchanged.
//! Qwen3-0.6B at W = 4 (2 × 128 tokens per rank, 2 cores), whose unit buffers are larger than
//! any mmap threshold glibc allows, once no block is mmapped and one arena serves every thread:
//! 159 → 66 s a step, 218 M → 6.5 M page faults and 683 → 32 s of kernel time over 3 steps,
//! the same peak memory (22.0 and 22.3 GiB).
//! Results are bit-identical: only where memory comes from changes.
//!
//! Retained memory has a cost at the peak: blocks of a vocabulary-sized buffer's size stay in
//! the heap between uses and smaller blocks split the space they leave. [`MappedLargeBlocks`],
//! a global allocator a program installs, maps each block of 128 MiB or more on its own
//! (transparent huge pages requested) and unmaps it when freed: Qwen3-0.6B at W = 4 peaked at
//! 17.6 → 16.5 GiB RSS with it (same live bytes), with fewer page faults (7.7 M → 2.7 M over
//! 3 steps). Before it maps such a block it also trims the heap (`malloc_trim`) when enough
//! small blocks were freed since the last time: the heap otherwise keeps the forward's
//! activations' pages through backward, under the large gradient blocks mapped there (Qwen3-0.6B
//! at W = 4, with the head's gradient made late: 17.0 → 13.7 GiB peak RSS, at 13.7 GiB of live
//! bytes).
//!
//! Call it once at the start of `main`, before any other thread starts: it changes the
//! allocator of the whole process (so a library does not call it on its own), and arenas that
//! threads made before it keep glibc's defaults (`tests/host_memory.rs`).
//!
//! ```
//! // At the start of a program that trains with in-process ranks on the CPU:
//! let retained = burn_fsdp::retain_host_memory();
//! # let _ = retained;
//! ```

/// The glibc settings of [`retain_host_memory`], as `(mallopt parameter, value, name)`.
#[cfg(all(target_os = "linux", target_env = "gnu"))]
const SETTINGS: [(libc::c_int, libc::c_int, &str); 5] = [
    // Setting the threshold turns off glibc's dynamic one (which would follow the sizes freed).
    (libc::M_MMAP_THRESHOLD, 32 << 20, "M_MMAP_THRESHOLD"),
    // No block is mmapped at all, however large: glibc cannot raise the threshold above
    // 32 MiB, and Qwen3-0.6B's unit buffers (~60 MiB a decoder layer in f32, 594 MiB the
    // embedding and its gradient) were unmapped when freed and faulted in again, page by page,
    // on every use (218 M page faults in 3 steps at W = 4; 6.5 M without).
    (libc::M_MMAP_MAX, 0, "M_MMAP_MAX"),
    // Never trim an arena's free top below 2 GiB (the largest `int`).
    (libc::M_TRIM_THRESHOLD, libc::c_int::MAX, "M_TRIM_THRESHOLD"),
    // Grow an arena by 256 MiB at a time, not by each request.
    (libc::M_TOP_PAD, 256 << 20, "M_TOP_PAD"),
    // One arena, the main one, for the whole process: memory freed by one rank thread is
    // reused by the others, and a block larger than a thread arena's 64 MiB heap (which glibc
    // would mmap whatever `M_MMAP_MAX` says) comes from the main heap too.
    (libc::M_ARENA_MAX, 1, "M_ARENA_MAX"),
];

/// Makes glibc keep freed host memory for reuse instead of returning it to the kernel; returns
/// whether it did (`false`, and nothing changed, where the C library is not glibc).
///
/// Process-wide and permanent: a program's peak memory is unchanged (freed memory is reused,
/// not added to), but memory freed after the peak stays with the process until it exits.
/// Setting any one of these parameters turns off glibc's dynamic mmap threshold, so they are
/// set together or not at all; alone, a trim threshold or top pad made training 2× slower
/// (every block above 128 KiB mmapped and unmapped again). See the [module](self) docs.
pub fn retain_host_memory() -> bool {
    #[cfg(all(target_os = "linux", target_env = "gnu"))]
    {
        SETTINGS.iter().all(|&(param, value, _)| {
            // SAFETY: `mallopt` only sets the allocator's tuning parameters (under glibc's
            // own lock); every parameter/value pair here is one glibc documents as valid.
            unsafe { libc::mallopt(param, value) == 1 }
        })
    }
    #[cfg(not(all(target_os = "linux", target_env = "gnu")))]
    {
        false
    }
}

// Tested in `tests/host_memory.rs`: a process of its own, as in a program that calls
// `retain_host_memory` first thing (the unit tests' threads and arenas exist before any test).

/// Blocks at least this large are mapped by [`MappedLargeBlocks`] on their own.
pub const MAPPED_BLOCK_BYTES: usize = 128 << 20;

/// A global allocator that maps each block of at least [`MAPPED_BLOCK_BYTES`] on its own
/// (anonymous `mmap`, transparent huge pages requested) and unmaps it when freed, and hands
/// every other block to the system allocator.
///
/// With [`retain_host_memory`] the system allocator keeps every freed block for reuse. Blocks
/// of a vocabulary-sized buffer's size (Qwen3-0.6B's embedding and its gradient, 594 MiB) then
/// stay in the one heap between their uses, and smaller blocks allocated in between split the
/// space they leave, so that the next large block extends the heap instead: the process holds
/// more than its live bytes at its peak. Mapped apart, such a block leaves no hole behind, and
/// with 2 MiB pages it costs a few hundred page faults, not 150,000.
///
/// Install it in a program's `main` crate (a library does not choose the process's allocator):
///
/// ```
/// #[global_allocator]
/// static ALLOCATOR: burn_fsdp::host_memory::MappedLargeBlocks = burn_fsdp::host_memory::MappedLargeBlocks;
/// ```
///
/// Before it maps a block, it returns to the kernel the pages of the system allocator's free
/// blocks ([`malloc_trim`](https://man7.org/linux/man-pages/man3/malloc_trim.3.html), glibc
/// only) when at least [`TRIM_AFTER_FREED_BYTES`] of small blocks were freed since it last did.
/// [`retain_host_memory`] keeps freed memory with the process, so without this the heap holds
/// its high-water mark (the forward's activations) while backward's large gradient blocks are
/// mapped beside it: Qwen3-0.6B at W = 4 peaked at the forward's heap plus the end of
/// backward's blocks. Trimmed there, the heap gives back what backward freed, and the pages come
/// back (one fault each) as the next forward touches them.
///
/// On targets other than Linux it is the system allocator.
#[derive(Debug, Clone, Copy, Default)]
pub struct MappedLargeBlocks;

/// Bytes of small blocks freed since the last trim that make [`MappedLargeBlocks`] trim the
/// system allocator's heap before mapping its next block.
pub const TRIM_AFTER_FREED_BYTES: usize = 512 << 20;

/// Small-block bytes freed since the last trim (see [`MappedLargeBlocks`]).
#[cfg(target_os = "linux")]
static FREED_SINCE_TRIM: std::sync::atomic::AtomicUsize = std::sync::atomic::AtomicUsize::new(0);

#[cfg(target_os = "linux")]
impl MappedLargeBlocks {
    /// Counts `bytes` of small blocks freed.
    fn freed(bytes: usize) {
        FREED_SINCE_TRIM.fetch_add(bytes, std::sync::atomic::Ordering::Relaxed);
    }

    /// Returns the free pages of the system allocator's heap to the kernel when enough was
    /// freed since the last time (glibc; elsewhere nothing).
    fn trim() {
        use std::sync::atomic::Ordering;
        if FREED_SINCE_TRIM.load(Ordering::Relaxed) < TRIM_AFTER_FREED_BYTES {
            return;
        }
        FREED_SINCE_TRIM.store(0, Ordering::Relaxed);
        #[cfg(target_env = "gnu")]
        // SAFETY: `malloc_trim` only releases pages of free chunks, under the allocator's own
        // locks; it allocates nothing (no call back into this allocator).
        unsafe {
            libc::malloc_trim(0);
        }
    }

    /// Whether a block of `layout` is mapped on its own.
    fn mapped(layout: std::alloc::Layout) -> bool {
        layout.size() >= MAPPED_BLOCK_BYTES && layout.align() <= 4096
    }

    /// A fresh zeroed mapping of `size` bytes, or null.
    fn map(size: usize) -> *mut u8 {
        Self::trim();
        // SAFETY: an anonymous private mapping at an address of the kernel's choice touches no
        // existing memory; the result is checked before use.
        let p = unsafe {
            libc::mmap(
                std::ptr::null_mut(),
                size,
                libc::PROT_READ | libc::PROT_WRITE,
                libc::MAP_PRIVATE | libc::MAP_ANONYMOUS,
                -1,
                0,
            )
        };
        if p == libc::MAP_FAILED {
            return std::ptr::null_mut();
        }
        // SAFETY: `p` is the mapping of `size` bytes just made; the advice only changes how
        // its pages are backed (a failure leaves 4 KiB pages, which is fine).
        unsafe { libc::madvise(p, size, libc::MADV_HUGEPAGE) };
        p.cast()
    }
}

// SAFETY: a mapped block is `size` bytes, page-aligned (so aligned for any `align` ≤ 4096, the
// only ones mapped), zeroed, and unmapped exactly once, in `dealloc` or `realloc`, with the size
// it was mapped with (the layout the caller gives back is the one it was allocated with). Every
// other block goes to `System` with the caller's arguments unchanged. Whether a block is mapped
// depends on its layout alone, so `dealloc` and `realloc` know where it came from.
#[cfg(target_os = "linux")]
unsafe impl std::alloc::GlobalAlloc for MappedLargeBlocks {
    unsafe fn alloc(&self, layout: std::alloc::Layout) -> *mut u8 {
        match Self::mapped(layout) {
            true => Self::map(layout.size()),
            // SAFETY: forwarded unchanged.
            false => unsafe { std::alloc::System.alloc(layout) },
        }
    }
    unsafe fn alloc_zeroed(&self, layout: std::alloc::Layout) -> *mut u8 {
        match Self::mapped(layout) {
            // A fresh anonymous mapping reads as zeros.
            true => Self::map(layout.size()),
            // SAFETY: forwarded unchanged.
            false => unsafe { std::alloc::System.alloc_zeroed(layout) },
        }
    }
    unsafe fn dealloc(&self, ptr: *mut u8, layout: std::alloc::Layout) {
        match Self::mapped(layout) {
            // SAFETY: `ptr` is a mapping of `layout.size()` bytes made by `map` (see above).
            true => unsafe {
                libc::munmap(ptr.cast(), layout.size());
            },
            // SAFETY: forwarded unchanged.
            false => {
                Self::freed(layout.size());
                unsafe { std::alloc::System.dealloc(ptr, layout) }
            }
        }
    }
    unsafe fn realloc(&self, ptr: *mut u8, layout: std::alloc::Layout, new_size: usize) -> *mut u8 {
        // SAFETY: the caller's contract: `new_size` is non-zero and, rounded to the alignment,
        // does not overflow `isize`.
        let new = unsafe { std::alloc::Layout::from_size_align_unchecked(new_size, layout.align()) };
        match (Self::mapped(layout), Self::mapped(new)) {
            // SAFETY: forwarded unchanged.
            (false, false) => unsafe { std::alloc::System.realloc(ptr, layout, new_size) },
            _ => {
                // SAFETY: `new` is a valid layout (above); the old block holds `layout.size()`
                // bytes and the new one `new_size`, so the copy stays inside both; the old
                // block is freed once, with its own layout.
                unsafe {
                    let p = self.alloc(new);
                    if !p.is_null() {
                        std::ptr::copy_nonoverlapping(ptr, p, layout.size().min(new_size));
                        self.dealloc(ptr, layout);
                    }
                    p
                }
            }
        }
    }
}

// SAFETY: every method forwards to `System` unchanged.
#[cfg(not(target_os = "linux"))]
unsafe impl std::alloc::GlobalAlloc for MappedLargeBlocks {
    unsafe fn alloc(&self, layout: std::alloc::Layout) -> *mut u8 {
        // SAFETY: forwarded unchanged.
        unsafe { std::alloc::System.alloc(layout) }
    }
    unsafe fn alloc_zeroed(&self, layout: std::alloc::Layout) -> *mut u8 {
        // SAFETY: forwarded unchanged.
        unsafe { std::alloc::System.alloc_zeroed(layout) }
    }
    unsafe fn dealloc(&self, ptr: *mut u8, layout: std::alloc::Layout) {
        // SAFETY: forwarded unchanged.
        unsafe { std::alloc::System.dealloc(ptr, layout) }
    }
    unsafe fn realloc(&self, ptr: *mut u8, layout: std::alloc::Layout, new_size: usize) -> *mut u8 {
        // SAFETY: forwarded unchanged.
        unsafe { std::alloc::System.realloc(ptr, layout, new_size) }
    }
}

#[cfg(all(test, target_os = "linux"))]
mod tests {
    use std::alloc::{GlobalAlloc, Layout};

    use super::{MAPPED_BLOCK_BYTES, MappedLargeBlocks};

    /// This process's anonymous resident memory, in bytes.
    fn rss_anon() -> usize {
        let status = std::fs::read_to_string("/proc/self/status").expect("/proc/self/status");
        let kib: usize = status
            .lines()
            .find_map(|l| l.strip_prefix("RssAnon:"))
            .and_then(|v| v.trim().trim_end_matches("kB").trim().parse().ok())
            .expect("RssAnon in /proc/self/status");
        kib << 10
    }

    /// A large block comes zeroed, keeps its contents through growing and shrinking (across
    /// the mapped/system boundary), and its memory goes back to the kernel when it is freed.
    #[test]
    fn large_blocks_are_mapped_zeroed_kept_through_realloc_and_given_back() {
        let a = MappedLargeBlocks;
        let size = 2 * MAPPED_BLOCK_BYTES;
        let layout = Layout::from_size_align(size, 64).expect("a valid layout");
        let before = rss_anon();
        // SAFETY: a non-zero layout; every access below stays inside the block's current
        // size, and each block is freed once with the layout it has at that time.
        unsafe {
            let p = a.alloc_zeroed(layout);
            assert!(!p.is_null());
            let block = std::slice::from_raw_parts_mut(p, size);
            assert!(block.iter().step_by(4093).all(|&b| b == 0), "a mapped block reads as zeros");
            for (i, b) in block.iter_mut().enumerate() {
                *b = (i % 251) as u8;
            }
            assert!(rss_anon() >= before + size / 2, "the block's pages are resident once touched");
            let touched = rss_anon();
            let grown = a.realloc(p, layout, size + MAPPED_BLOCK_BYTES);
            assert!(!grown.is_null());
            let shrunk =
                a.realloc(grown, Layout::from_size_align(size + MAPPED_BLOCK_BYTES, 64).unwrap(), 1 << 20);
            assert!(!shrunk.is_null());
            let kept = std::slice::from_raw_parts(shrunk, 1 << 20);
            assert!(kept.iter().enumerate().all(|(i, &b)| b == (i % 251) as u8), "contents kept");
            a.dealloc(shrunk, Layout::from_size_align(1 << 20, 64).unwrap());
            assert!(rss_anon() + size / 2 <= touched, "a freed mapped block goes back to the kernel");
            // A small block is the system allocator's.
            let small = Layout::from_size_align(4096, 8).unwrap();
            let q = a.alloc_zeroed(small);
            assert!(!q.is_null() && *q == 0);
            a.dealloc(q, small);
        }
    }
}
