//! Tier-2 tests: the CubeCL runtime (server, memory pools, streams, kernel cache) and the `Metax`
//! Burn backend over the mock `libmcruntime.so`.
//!
//! The device's server is process-wide and runs on its own thread, so these tests use the mock's
//! process-wide records (`mcmockGlobal*`, `mcmockTotal*`) and run one at a time (`SERIAL`).

mod common;

use std::sync::{Mutex, MutexGuard};

use burn::backend::Autodiff;
use burn::tensor::backend::AutodiffBackend;
use burn::tensor::{Tensor, TensorData};
use burn_metax_backend::runtime::{BackendError, StreamOrdering, set_stream_ordering};
use burn_metax_backend::{MacaDevice, MacaRuntime, Metax};
use common::{Control, install_mock_runtime};
use cubecl_common::stream_id::StreamId;
use cubecl_runtime::client::ComputeClient;

static SERIAL: Mutex<()> = Mutex::new(());

fn setup() -> (MutexGuard<'static, ()>, Control) {
    let guard = SERIAL.lock().unwrap_or_else(|e| e.into_inner());
    install_mock_runtime();
    (guard, Control::open())
}

/// `Autodiff<Metax>` is a Burn autodiff backend (checked at compile time).
#[test]
fn autodiff_metax_is_an_autodiff_backend() {
    fn assert_autodiff<B: AutodiffBackend>() {}
    assert_autodiff::<Autodiff<Metax>>();
    assert_autodiff::<Autodiff<Metax<half::f16>>>();
}

#[test]
fn devices_are_enumerated_through_the_mock() {
    let (_guard, _control) = setup();
    assert_eq!(MacaRuntime::devices(), vec![MacaDevice::new(0)]);
    assert_eq!(MacaRuntime::first_device().expect("device 0"), MacaDevice::new(0));
    let props = MacaRuntime::check_device(&MacaDevice::new(0)).expect("usable");
    assert_eq!(props.warp_size, 64);
    let err = MacaRuntime::check_device(&MacaDevice::new(3)).expect_err("no device 3");
    assert_eq!(err, BackendError::NoSuchDevice { platform: "metax", index: 3, count: 1 });
    assert_eq!(err.to_string(), "metax device 3 does not exist (1 visible)");
    let client = MacaRuntime::try_client(&MacaDevice::new(0)).expect("client");
    let hardware = &client.properties().hardware;
    assert_eq!((hardware.plane_size_min, hardware.plane_size_max), (64, 64));
    assert_eq!(hardware.max_units_per_cube, 1024);
}

#[test]
fn host_device_round_trip_through_the_server() {
    let (_guard, _control) = setup();
    let client = MacaRuntime::try_client(&MacaDevice::new(0)).expect("client");
    for len in [1usize, 7, 256, 4096, 1 << 20] {
        let data: Vec<u8> = (0..len).map(|i| (i * 31 % 251) as u8).collect();
        let handle = client.create_from_slice(&data);
        let back = client.read_one(handle).expect("read");
        assert_eq!(&back[..], &data[..], "{len} bytes");
    }
    // Several buffers in one read.
    let a = client.create_from_slice(&[1, 2, 3]);
    let b = client.create_from_slice(&[4, 5, 6, 7]);
    let out = cubecl_common::reader::read_sync(client.read_async(vec![a, b])).expect("read");
    assert_eq!((&out[0][..], &out[1][..]), (&[1u8, 2, 3][..], &[4u8, 5, 6, 7][..]));
}

#[test]
fn memory_pool_reuses_freed_allocations() {
    let (_guard, control) = setup();
    let client = MacaRuntime::try_client(&MacaDevice::new(0)).expect("client");
    let data = vec![3u8; 64 * 1024];
    // Warm up the pools of this stream.
    for _ in 0..4 {
        let handle = client.create_from_slice(&data);
        client.read_one(handle).expect("read");
    }
    let before = control.total_mallocs();
    for _ in 0..50 {
        let handle = client.create_from_slice(&data);
        assert_eq!(&client.read_one(handle).expect("read")[..], &data[..]);
    }
    let after = control.total_mallocs();
    assert!(after - before <= 2, "50 create/free cycles made {} device allocations", after - before);
    let usage = client.memory_usage().expect("usage");
    assert!(usage.bytes_reserved >= data.len() as u64, "{usage:?}");
}

/// Sets the stream-ordering rule of mock device 0 until dropped.
struct Rule(StreamOrdering);

impl Rule {
    fn set(rule: StreamOrdering) -> Self {
        Self(set_stream_ordering("metax", 0, rule))
    }
}

impl Drop for Rule {
    fn drop(&mut self) {
        set_stream_ordering("metax", 0, self.0);
    }
}

/// Two clients on streams 1 (A) and 2 (B), both streams created and idle; then a copy queued
/// on A that the mock defers until something waits for it. Returns the clients, A's buffer and
/// its contents.
fn a_stream_with_deferred_work(
    control: &Control,
) -> (ComputeClient<MacaRuntime>, ComputeClient<MacaRuntime>, cubecl_core::server::Handle, Vec<u8>) {
    let client = MacaRuntime::try_client(&MacaDevice::new(0)).expect("client");
    let mut a = client.clone();
    let mut b = client.clone();
    // SAFETY: test clients on explicit streams; every handle is used through the server, which
    // orders the streams.
    unsafe {
        a.set_stream(StreamId { value: 1 });
        b.set_stream(StreamId { value: 2 });
    }
    // Make sure both streams exist and every stream is idle: earlier tests may have left
    // deferred work, which reads under the all-streams rule wait for.
    {
        let _drain = Rule::set(StreamOrdering::AllStreams);
        b.read_one(b.create_from_slice(&[0])).expect("read b");
        a.read_one(a.create_from_slice(&[0])).expect("read a");
    }
    assert_eq!(control.total_pending_ops(), 0);

    let big = vec![9u8; 1 << 16];
    let on_a = a.create_from_slice(&big);
    a.flush().expect("flush a");
    assert!(control.total_pending_ops() > 0, "the copy on stream A is still queued");
    (a, b, on_a, big)
}

/// The all-streams rule (the one before ordering by need): a read on one stream first waits for
/// the work queued on every other stream, even for a buffer no other stream used.
#[test]
fn under_the_all_streams_rule_a_read_waits_for_every_stream() {
    let (_guard, control) = setup();
    let _rule = Rule::set(StreamOrdering::AllStreams);
    let (_a, b, on_a, big) = a_stream_with_deferred_work(&control);
    // A read of an unrelated buffer on stream B ...
    let on_b = b.create_from_slice(&[1, 2, 3, 4]);
    assert_eq!(&b.read_one(on_b).expect("read b")[..], &[1, 2, 3, 4]);
    // ... has waited for stream A's work too.
    assert_eq!(control.total_pending_ops(), 0, "a read must wait for every stream's queued work");
    assert_eq!(&b.read_one(on_a).expect("read a's buffer on b")[..], &big[..]);
}

/// Ordering by need (the default): a read of a buffer no other stream used does not wait for
/// other streams; a read of a buffer another stream wrote does.
#[test]
fn by_need_a_read_waits_only_for_the_streams_that_used_its_buffer() {
    let (_guard, control) = setup();
    let _rule = Rule::set(StreamOrdering::ByNeed);
    let (_a, b, on_a, big) = a_stream_with_deferred_work(&control);
    let on_b = b.create_from_slice(&[1, 2, 3, 4]);
    assert_eq!(&b.read_one(on_b).expect("read b")[..], &[1, 2, 3, 4]);
    assert!(control.total_pending_ops() > 0, "a read of B's own buffer waited for stream A's copy");
    // The mock runs A's deferred copy only when something waits for it: without the wait, this
    // read would return the allocator's filler.
    assert_eq!(&b.read_one(on_a).expect("read a's buffer on b")[..], &big[..]);
}

#[test]
fn a_burn_op_compiles_wave64_source_and_launches() {
    let (_guard, control) = setup();
    let device = MacaDevice::new(0);
    let compiles = control.global_compile_count();
    let launches = control.global_launch_count();

    let x = Tensor::<Metax, 1>::from_data(TensorData::from([1.0f32, 2.0, 3.0, 4.0, 5.0]), &device);
    let y = x.clone() * 2.0 + x;
    // The mock does not run kernels: the result is whatever the buffer held; only the
    // compile and the launch are checked.
    let result = y.try_into_data();

    let compiled = control.global_compile_count();
    if result.is_err() || std::env::var_os("MACA_DUMP_SOURCE").is_some() {
        eprintln!("{}", control.global_compile_source(compiled.saturating_sub(1)).unwrap_or_default());
    }
    result.expect("launch accepted");
    assert!(compiled > compiles, "the op compiled a kernel through mcrtc");
    let source = control.global_compile_source(compiled - 1).expect("source");
    if std::env::var_os("MACA_DUMP_SOURCE").is_some() {
        eprintln!("{source}");
    }
    assert!(source.contains("__global__"), "{source}");
    assert!(source.contains("MACA_WARP_SIZE = 64u"), "wave-64 source expected:\n{source}");
    assert!(!source.contains("__activemask"), "{source}");
    let launched = control.global_launch_count();
    assert!(launched > launches, "the op launched a kernel");
    let launch = control.global_launch(launched - 1).expect("launch");
    assert_eq!(launch.grid, [1, 1, 1], "5 elements fit one cube: {launch:?}");
    let threads: u32 = launch.block.iter().product();
    assert!((1..=1024).contains(&threads), "{launch:?}");

    // The same op again hits the kernel cache: a launch, no compile.
    let compiled = control.global_compile_count();
    let launched = control.global_launch_count();
    let z = Tensor::<Metax, 1>::from_data(TensorData::from([1.0f32, 2.0, 3.0, 4.0, 5.0]), &device);
    let _ = (z.clone() * 2.0 + z).into_data();
    assert_eq!(control.global_compile_count(), compiled, "cached kernel recompiled");
    assert!(control.global_launch_count() > launched);
}

#[test]
fn a_failing_compile_is_reported_with_the_log() {
    let (_guard, control) = setup();
    control.inject_global("mcrtcCompileProgram", 6, 0, 1);
    let device = MacaDevice::new(0);
    // A kernel not compiled yet in this process (exp of a 3-vector).
    let x = Tensor::<Metax, 1>::from_data(TensorData::from([0.5f32, 1.0, 2.0]), &device);
    let result = x.exp().try_into_data();
    control.clear_global();
    let err = result.expect_err("compilation failed");
    let message = format!("{err:?}");
    assert!(
        message.contains("mcrtcCompileProgram") || message.contains("MCRTC_ERROR_COMPILATION"),
        "{message}"
    );
}

#[test]
fn profiling_and_rejected_reads() {
    let (_guard, control) = setup();
    let client = MacaRuntime::try_client(&MacaDevice::new(0)).expect("client");
    // Profiling: host timing around stream synchronisation.
    let (bytes, duration) = client
        .profile(
            || client.read_one(client.create_from_slice(&[5u8; 4096])).expect("read"),
            "profiled round trip",
        )
        .expect("profile");
    assert_eq!(bytes.len(), 4096);
    assert_eq!(duration.timing_method(), cubecl_common::profile::TimingMethod::System);
    let ticks = cubecl_common::future::block_on(duration.resolve());
    assert!(ticks.duration() < std::time::Duration::from_secs(60), "{:?}", ticks.duration());

    // A read with strides the runtime cannot copy is an error, not a panic, and leaves no copy
    // in flight (work another test left deferred on other streams is not waited for).
    let before = control.total_pending_ops();
    let handle = client.create_from_slice(&[0u8; 16]);
    let descriptor =
        cubecl_core::server::CopyDescriptor::new(handle.binding(), [2, 2].into(), [1, 2].into(), 4);
    let err =
        cubecl_common::reader::read_sync(client.read_one_tensor_async(descriptor)).expect_err("strides");
    assert!(format!("{err:?}").contains("strides"), "{err:?}");
    assert_eq!(control.total_pending_ops(), before);
}
