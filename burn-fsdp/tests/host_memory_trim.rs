//! `MappedLargeBlocks` gives the heap's free pages back before it maps a block, in a process
//! of its own (one test in this file) that retains host memory as `xtask` does.

#[cfg(all(target_os = "linux", target_env = "gnu"))]
#[test]
fn freed_small_blocks_are_given_back_before_a_large_block_is_mapped() {
    use std::alloc::{GlobalAlloc, Layout};

    use burn_fsdp::host_memory::{MAPPED_BLOCK_BYTES, MappedLargeBlocks, TRIM_AFTER_FREED_BYTES};

    /// Resident anonymous memory of this process, bytes.
    fn rss_anon() -> usize {
        let status = std::fs::read_to_string("/proc/self/status").expect("/proc/self/status");
        let kib: usize = status
            .lines()
            .find_map(|l| l.strip_prefix("RssAnon:"))
            .and_then(|v| v.trim().trim_end_matches("kB").trim().parse().ok())
            .expect("RssAnon in /proc/self/status");
        kib << 10
    }

    assert!(burn_fsdp::retain_host_memory());
    std::thread::spawn(|| {
        let a = MappedLargeBlocks;
        let small = Layout::from_size_align(1 << 20, 64).expect("a valid layout");
        let count = 2 * TRIM_AFTER_FREED_BYTES / small.size();
        let before = rss_anon();
        // SAFETY: each block is allocated with `small`, written within its size, and freed
        // once with the same layout; the large block likewise.
        unsafe {
            let blocks: Vec<*mut u8> = (0..count).map(|_| a.alloc(small)).collect();
            assert!(blocks.iter().all(|p| !p.is_null()));
            for &p in &blocks {
                std::ptr::write_bytes(p, 1, small.size());
            }
            let touched = count * small.size();
            assert!(rss_anon() >= before + touched * 3 / 4, "the small blocks are resident");
            for &p in &blocks {
                a.dealloc(p, small);
            }
            // Retained: freed, but still the process's.
            assert!(rss_anon() >= before + touched * 3 / 4, "freed small blocks stay with the heap");
            let large = Layout::from_size_align(MAPPED_BLOCK_BYTES, 64).expect("a valid layout");
            let p = a.alloc(large);
            assert!(!p.is_null());
            let after = rss_anon();
            assert!(
                after < before + touched / 4,
                "mapping a large block gave the freed heap back: {} MiB resident above the start \
                 for {} MiB freed",
                after.saturating_sub(before) >> 20,
                touched >> 20
            );
            a.dealloc(p, large);
        }
    })
    .join()
    .expect("the allocating thread");
}
