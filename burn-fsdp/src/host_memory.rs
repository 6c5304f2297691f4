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
