//! Tier-2 tests: the MACA driver layer against the mock `libmcruntime.so`.

mod common;

use burn_metax_backend::driver::{Driver, DriverError, MacaDriver, MacaError, StreamHandle};
use common::{Control, mock_root, mock_root_missing_launch};

fn driver() -> MacaDriver {
    MacaDriver::load_from(mock_root()).expect("load the mock runtime")
}

const KERNELS: &str = r#"
#include <mc_runtime.h>
extern "C" __global__ void add_one(float* x, unsigned int n) { }
extern "C" __global__ void  scale (float* x, float a) { }
"#;

#[test]
fn loader_opens_the_mock_and_reads_properties() {
    let d = driver();
    assert_eq!(d.name(), "maca");
    assert!(d.runtime_path().ends_with("lib/libmcruntime.so"));
    assert!(d.has_rtc(), "mcrtc symbols are exported by libmcruntime.so");
    assert!(!d.has_mccl());
    assert_eq!(d.device_count().expect("count"), 1);
    let p = d.device_properties(0).expect("properties");
    assert_eq!(p.name, "MetaX Mock C500");
    assert_eq!(p.warp_size, 64);
    assert_eq!(p.max_threads_per_block, 1024);
    assert_eq!(p.max_shared_memory_per_block, 64 * 1024);
    assert_eq!(p.compute_capability, (10, 0));
    assert_eq!(p.total_memory, 64 << 30);
    assert!(matches!(d.device_properties(5), Err(DriverError::Api { error, .. }) if error.code() == 101));
    assert!(d.set_device(1).is_err(), "only one mock device");
    d.set_device(0).expect("device 0");
    assert_eq!(d.current_device(), 0);

    // A failing device query is an error, not an empty list; "no device" is an empty list.
    let control = Control::open();
    control.inject("mcGetDeviceCount", MacaError::NO_DEVICE.code(), 0, 1);
    assert_eq!(d.device_count().expect("no device is not an error"), 0);
    control.inject("mcGetDeviceCount", 35, 0, 1);
    assert!(
        d.device_count().expect_err("insufficient driver").to_string().contains("mcErrorInsufficientDriver")
    );
    let enumerated = MacaDriver::enumerate_devices_in(mock_root());
    assert_eq!(enumerated.len(), 1);
    assert_eq!(enumerated[0].warp_size, 64);
}

#[test]
fn missing_library_is_a_clear_error_and_enumerates_nothing() {
    let root = std::env::temp_dir().join("burn-metax-backend-no-such-maca");
    let err = MacaDriver::load_from(&root).expect_err("no library there");
    match &err {
        DriverError::LibraryNotFound { path, .. } => {
            assert_eq!(path, &root.join("lib/libmcruntime.so"));
        }
        other => panic!("unexpected error {other:?}"),
    }
    let message = err.to_string();
    assert!(message.contains("libmcruntime.so"), "{message}");
    assert!(message.contains("MACA_PATH"), "{message}");
    assert!(MacaDriver::enumerate_devices_in(&root).is_empty());
}

#[test]
fn missing_symbol_is_named() {
    let err = MacaDriver::load_from(mock_root_missing_launch()).expect_err("symbol missing");
    match &err {
        DriverError::MissingSymbol { symbol, library } => {
            assert_eq!(*symbol, "mcModuleLaunchKernel");
            assert!(library.ends_with("lib/libmcruntime.so"));
        }
        other => panic!("unexpected error {other:?}"),
    }
    assert!(err.to_string().contains("`mcModuleLaunchKernel`"));
    assert!(MacaDriver::enumerate_devices_in(mock_root_missing_launch()).is_empty());
}

#[test]
fn error_codes_map_to_names() {
    let d = driver();
    let control = Control::open();
    control.inject("mcMalloc", 2, 0, 1);
    let err = d.malloc(16).expect_err("injected");
    assert_eq!(err, DriverError::Api { call: "mcMalloc", error: MacaError::MEMORY_ALLOCATION });
    assert_eq!(err.to_string(), "mcMalloc failed: mcErrorMemoryAllocation (2): out of device memory");
    // The injection was for one call only.
    let ptr = d.malloc(16).expect("second call succeeds");
    // SAFETY: allocated above, unused.
    unsafe { d.free(ptr) }.expect("free");

    control.inject("mcStreamCreateWithFlags", 4242, 0, 1);
    let err = d.stream_create(true).expect_err("injected");
    assert!(err.to_string().contains("mcError 4242"), "{err}");
    assert_eq!(d.runtime_error_name(700).as_deref(), Some("mcErrorIllegalAddress"));
    assert_eq!(d.runtime_error_string(2).as_deref(), Some("out of memory"));
    // Non-sticky errors do not poison the device.
    assert!(d.poisoned(0).is_none());
    control.clear();
}

#[test]
fn malloc_and_free() {
    let d = driver();
    let control = Control::open();
    let before = control.live_allocations();
    let a = d.malloc(1 << 20).expect("malloc");
    let b = d.malloc(3).expect("malloc");
    assert_ne!(a, b);
    assert_eq!(control.live_allocations(), before + 2);
    // SAFETY: both allocated above and unused.
    unsafe {
        d.free(a).expect("free");
        d.free(b).expect("free");
    }
    assert_eq!(control.live_allocations(), before);
    // SAFETY: freeing twice is rejected by the runtime, not undefined behaviour, for the mock.
    let err = unsafe { d.free(a) }.expect_err("double free");
    assert_eq!(err, DriverError::Api { call: "mcFree", error: MacaError::INVALID_VALUE });

    let s = d.stream_create(true).expect("stream");
    let c = d.malloc_async(64, s).expect("malloc_async");
    assert_eq!(control.live_allocations(), before + 1);
    // SAFETY: nothing uses `c`.
    unsafe { d.free_async(c, s) }.expect("free_async");
    d.stream_synchronize(s).expect("sync");
    assert_eq!(control.live_allocations(), before);
    d.stream_destroy(s).expect("destroy");
    let (free, total) = d.memory_info().expect("memory info");
    assert!(free <= total);
}

#[test]
fn host_device_round_trip() {
    let d = driver();
    let data: Vec<u8> = (0..=255u8).cycle().take(10_000).collect();
    let ptr = d.malloc(data.len()).expect("malloc");
    let mut back = vec![0u8; data.len()];
    // SAFETY: `ptr` holds `data.len()` bytes; the copies are blocking.
    unsafe {
        d.memcpy_htod(ptr, &data).expect("htod");
        d.memcpy_dtoh(&mut back, ptr).expect("dtoh");
    }
    assert_eq!(back, data);

    // Out-of-bounds copies are rejected by the runtime.
    let mut too_big = vec![0u8; data.len() + 1];
    // SAFETY: the mock validates device ranges and rejects this copy before touching memory.
    let err = unsafe { d.memcpy_dtoh(&mut too_big, ptr) }.expect_err("out of bounds");
    assert_eq!(err, DriverError::Api { call: "mcMemcpy", error: MacaError::INVALID_VALUE });

    // Pinned staging buffer, async copies, device-to-device.
    let s = d.stream_create(true).expect("stream");
    let pinned = d.malloc_host(data.len()).expect("malloc_host");
    let other = d.malloc(data.len()).expect("malloc");
    // SAFETY: `pinned` holds `data.len()` bytes and is only used by the queued copies until the
    // stream is synchronised.
    unsafe {
        std::ptr::write_bytes(pinned.as_mut_ptr(), 0, data.len());
        d.memcpy_dtod_async(other, ptr, data.len(), s).expect("dtod");
        d.memcpy_dtoh_async(pinned.as_mut_ptr(), other, data.len(), s).expect("dtoh async");
    }
    d.stream_synchronize(s).expect("sync");
    // SAFETY: the stream is synchronised, so the copy into `pinned` is complete.
    let staged = unsafe { std::slice::from_raw_parts(pinned.as_mut_ptr(), data.len()) };
    assert_eq!(staged, &data[..]);
    // SAFETY: no queued work uses these anymore.
    unsafe {
        d.free_host(pinned).expect("free_host");
        d.free(ptr).expect("free");
        d.free(other).expect("free");
    }
    d.stream_destroy(s).expect("destroy");
}

#[test]
fn async_copies_run_in_stream_order() {
    let d = driver();
    let control = Control::open();
    let n = 4096;
    let ptr = d.malloc(n).expect("malloc");
    let first = vec![1u8; n];
    let second = vec![2u8; n];
    let mut out_a = vec![0u8; n];
    let mut out_b = vec![0u8; n];
    let s = d.stream_create(true).expect("stream");
    // SAFETY: every host buffer outlives the stream synchronisation below.
    unsafe {
        d.memcpy_htod_async(ptr, first.as_ptr(), n, s).expect("copy 1");
        d.memcpy_dtoh_async(out_a.as_mut_ptr(), ptr, n, s).expect("read 1");
        d.memcpy_htod_async(ptr, second.as_ptr(), n, s).expect("copy 2");
        d.memcpy_dtoh_async(out_b.as_mut_ptr(), ptr, n, s).expect("read 2");
    }
    // The mock defers queued work until something waits for it.
    assert_eq!(control.pending_ops(s.as_raw()), 4);
    d.stream_synchronize(s).expect("sync");
    assert_eq!(control.pending_ops(s.as_raw()), 0);
    assert_eq!(out_a, first);
    assert_eq!(out_b, second);

    // Cross-stream ordering through an event: the reader stream waits for the writer stream.
    let writer = d.stream_create(true).expect("stream");
    let reader = d.stream_create(true).expect("stream");
    let event = d.event_create(false).expect("event");
    let third = vec![3u8; n];
    let mut out_c = vec![0u8; n];
    // SAFETY: host buffers outlive the synchronisation below.
    unsafe {
        d.memcpy_htod_async(ptr, third.as_ptr(), n, writer).expect("write");
        d.event_record(event, writer).expect("record");
        d.stream_wait_event(reader, event).expect("wait");
        d.memcpy_dtoh_async(out_c.as_mut_ptr(), ptr, n, reader).expect("read");
    }
    assert!(!d.event_query(event).expect("query"), "nothing has run yet");
    d.stream_synchronize(reader).expect("sync reader only");
    assert_eq!(out_c, third, "the wait made the reader see the writer's copy");
    assert!(d.event_query(event).expect("query"));

    // The blocking-read hazard: a blocking copy (legacy default stream) does NOT wait for
    // non-blocking streams, so the runtime must synchronise them first.
    let fourth = vec![4u8; n];
    let mut stale = vec![0u8; n];
    // SAFETY: `fourth` outlives the device synchronisation below.
    unsafe {
        d.memcpy_htod_async(ptr, fourth.as_ptr(), n, writer).expect("write");
        d.memcpy_dtoh(&mut stale, ptr).expect("blocking read");
    }
    assert_eq!(stale, third, "the blocking read ran before the queued write");
    d.device_synchronize().expect("device sync");
    let mut fresh = vec![0u8; n];
    // SAFETY: `ptr` holds `n` bytes.
    unsafe { d.memcpy_dtoh(&mut fresh, ptr) }.expect("read");
    assert_eq!(fresh, fourth);

    d.event_destroy(event).expect("event");
    for stream in [s, writer, reader] {
        d.stream_destroy(stream).expect("destroy");
    }
    // SAFETY: all work using `ptr` has completed.
    unsafe { d.free(ptr) }.expect("free");
}

#[test]
fn timing_events_measure_elapsed_time() {
    let d = driver();
    let s = d.stream_create(false).expect("stream");
    let (start, end) = (d.event_create(true).expect("event"), d.event_create(true).expect("event"));
    d.event_record(start, s).expect("record");
    d.event_record(end, s).expect("record");
    d.event_synchronize(end).expect("sync");
    assert!(d.event_elapsed_ms(start, end).expect("elapsed") >= 0.0);
    let untimed = d.event_create(false).expect("event");
    d.event_record(untimed, s).expect("record");
    d.stream_synchronize(StreamHandle::DEFAULT).expect("default stream");
    assert!(d.event_elapsed_ms(start, untimed).is_err());
    for e in [start, end, untimed] {
        d.event_destroy(e).expect("destroy");
    }
    d.stream_destroy(s).expect("destroy");
}

#[test]
fn compile_load_and_launch_are_recorded() {
    let d = driver();
    let control = Control::open();
    let compiles = control.compile_count();
    let compiled = d.compile(KERNELS, "kernels.mc", &["-std=c++17", "-O3"]).expect("compile");
    assert_eq!(control.compile_count(), compiles + 1);
    assert!(compiled.log.contains("2 kernel(s)"), "{}", compiled.log);
    assert!(compiled.log.contains("-O3"), "{}", compiled.log);

    let module = d.module_load_data(&compiled.image).expect("load");
    let add_one = d.module_get_function(module, "add_one").expect("add_one");
    d.module_get_function(module, "scale").expect("scale");
    let missing = d.module_get_function(module, "nope").expect_err("missing kernel");
    assert!(
        matches!(missing, DriverError::Api { call: "mcModuleGetFunction", error } if error.code() == 500)
    );

    let s = d.stream_create(true).expect("stream");
    let buffer = d.malloc(256).expect("malloc");
    let mut x = buffer.as_raw() as u64;
    let mut len = 64u32;
    let mut params = [(&mut x as *mut u64).cast(), (&mut len as *mut u32).cast()];
    let launches = control.launch_count();
    // SAFETY: the parameters match `add_one(float*, unsigned)`; `buffer` outlives the launch.
    unsafe { d.launch_kernel(add_one, [2, 1, 1], [64, 1, 1], 0, s, &mut params) }.expect("launch");
    assert_eq!(control.launch_count(), launches + 1);
    let launch = control.last_launch().expect("recorded");
    assert_eq!(launch.grid, [2, 1, 1]);
    assert_eq!(launch.block, [64, 1, 1]);
    assert_eq!(launch.stream, s.as_raw());
    assert_eq!(launch.function, add_one.as_raw());
    assert_eq!(control.launches_run(s.as_raw()), 0, "deferred until synchronised");
    d.stream_synchronize(s).expect("sync");
    assert_eq!(control.launches_run(s.as_raw()), 1);

    // SAFETY: the launch is rejected for its configuration before anything runs.
    let err = unsafe { d.launch_kernel(add_one, [1, 1, 1], [2048, 1, 1], 0, s, &mut params) }
        .expect_err("too many threads");
    assert!(matches!(err, DriverError::Api { error, .. } if error.code() == 9));

    // A rejected program comes back with the compiler's log.
    let err = d.compile("#error no MACA here\n", "bad.mc", &[]).expect_err("compile error");
    match &err {
        DriverError::Compilation { program, error, log } => {
            assert_eq!(program, "bad.mc");
            assert_eq!(error.code(), 6);
            assert!(log.contains("#error no MACA here"), "{log}");
        }
        other => panic!("unexpected error {other:?}"),
    }
    assert!(d.module_load_data(&[]).is_err());
    d.module_unload(module).expect("unload");
    d.stream_destroy(s).expect("destroy");
    // SAFETY: the stream was synchronised; nothing uses `buffer` anymore.
    unsafe { d.free(buffer) }.expect("free");
}

#[test]
fn sticky_error_poisons_the_device() {
    let d = driver();
    let control = Control::open();
    let s = d.stream_create(true).expect("stream");
    // The kernel "faults": the next synchronisation reports an illegal address.
    control.inject("mcStreamSynchronize", MacaError::ILLEGAL_ADDRESS.code(), 0, 1);
    let err = d.stream_synchronize(s).expect_err("fault");
    assert_eq!(err, DriverError::Api { call: "mcStreamSynchronize", error: MacaError::ILLEGAL_ADDRESS });

    // Every later call on the device fails without reaching the runtime.
    let poisoned =
        DriverError::Poisoned { device: 0, call: "mcStreamSynchronize", error: MacaError::ILLEGAL_ADDRESS };
    assert_eq!(d.poisoned(0), Some(poisoned.clone()));
    assert_eq!(d.malloc(16).expect_err("poisoned"), poisoned);
    assert_eq!(d.stream_synchronize(s).expect_err("poisoned"), poisoned);
    assert_eq!(d.device_synchronize().expect_err("poisoned"), poisoned);
    let message = poisoned.to_string();
    assert!(message.contains("device 0 is poisoned"), "{message}");
    assert!(message.contains("mcErrorIllegalAddress"), "{message}");
    control.clear();
}

/// Run by `maca_path_environment_is_honoured` in a child process with `MACA_PATH` set.
#[test]
#[ignore = "runs only as a child process of maca_path_environment_is_honoured"]
fn child_env_probe() {
    if std::env::var_os("BURN_METAX_CHILD_PROBE").is_none() {
        return;
    }
    let d = MacaDriver::load().expect("MACA_PATH points at the mock");
    assert_eq!(d.device_count().expect("count"), 3);
    assert_eq!(MacaDriver::enumerate_devices().len(), 3);
    // MCMOCK_INJECT makes every mcMalloc fail in this process.
    let err = d.malloc(8).expect_err("injected through the environment");
    assert_eq!(err, DriverError::Api { call: "mcMalloc", error: MacaError::MEMORY_ALLOCATION });
}

#[test]
fn maca_path_environment_is_honoured() {
    let exe = std::env::current_exe().expect("test executable");
    let output = std::process::Command::new(exe)
        .args(["--exact", "child_env_probe", "--ignored", "--nocapture"])
        .env("BURN_METAX_CHILD_PROBE", "1")
        .env("MACA_PATH", mock_root())
        .env("MCMOCK_DEVICE_COUNT", "3")
        .env("MCMOCK_INJECT", "mcMalloc=2")
        .output()
        .expect("run the child probe");
    let stdout = String::from_utf8_lossy(&output.stdout);
    assert!(output.status.success(), "child failed:\n{stdout}\n{}", String::from_utf8_lossy(&output.stderr));
    assert!(stdout.contains("1 passed"), "{stdout}");
}
