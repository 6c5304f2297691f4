//! `retain_host_memory` in a process of its own (one test in this file): called before any
//! other thread starts, as at the start of a program's `main`.

/// Page faults of the calling thread so far.
#[cfg(all(target_os = "linux", target_env = "gnu"))]
fn thread_page_faults() -> i64 {
    // SAFETY: `rusage` is plain old data (all-zero bytes are valid) and `getrusage` fills it;
    // RUSAGE_THREAD counts this thread only.
    unsafe {
        let mut r: libc::rusage = std::mem::zeroed();
        assert_eq!(libc::getrusage(libc::RUSAGE_THREAD, &mut r), 0);
        r.ru_minflt + r.ru_majflt
    }
}

/// One training step's host memory, roughly: blocks of 1–40 MiB allocated and touched
/// (activations, gathered units), then freed in another order than allocated.
#[cfg(all(target_os = "linux", target_env = "gnu"))]
fn step() -> usize {
    const MIB: usize = 1 << 20;
    let sizes = [3 * MIB, 12 * MIB, MIB, 6 * MIB, 40 * MIB];
    let blocks: Vec<Vec<u8>> = sizes.iter().chain(&sizes).map(|&len| vec![1u8; len]).collect();
    let touched = blocks.iter().map(Vec::len).sum();
    let (even, odd): (Vec<_>, Vec<_>) = blocks.into_iter().enumerate().partition(|(i, _)| i % 2 == 0);
    drop(std::hint::black_box(even));
    drop(std::hint::black_box(odd));
    touched
}

#[cfg(all(target_os = "linux", target_env = "gnu"))]
#[test]
fn steady_steps_on_a_rank_thread_reuse_their_memory_without_page_faults() {
    // With glibc's defaults each such step on a thread of its own faults in ~20 000 pages (its
    // blocks are unmapped when freed, or trimmed off the thread's arena); retained, the steps
    // after the first two reuse the same memory.
    assert!(burn_fsdp::retain_host_memory());
    let (faults, pages) = std::thread::spawn(|| {
        step();
        step();
        let before = thread_page_faults();
        let touched = step() + step();
        (thread_page_faults() - before, (touched / 4096) as i64)
    })
    .join()
    .unwrap();
    assert!(faults < pages / 100, "{faults} page faults in two steps that touched {pages} pages");
}

#[cfg(not(all(target_os = "linux", target_env = "gnu")))]
#[test]
fn does_nothing_without_glibc() {
    assert!(!burn_fsdp::retain_host_memory());
}
