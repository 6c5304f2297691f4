//! Tier 1b: the emulated MetaX device (`metax-emu`) runs the kernels the MACA dialect generates,
//! compiled by the host C++ compiler, at wave size 64 — and the server's stream ordering with
//! really asynchronous streams.
//!
//! The process's emulated devices (installed once, before any client exists):
//! - 0: wave 64 (MetaX), the reference device;
//! - 1: wave **32**, to show that wave-64 code with plane operations goes wrong on it;
//! - 2: wave 64 with a 150 ms delay before every kernel, so a missing stream wait is certain to
//!   read stale data;
//! - 3: wave 64, for the kernel that faults (a fault poisons its device);
//! - 4–7: wave 64, one per stream-ordering test, each under the rule it tests (the rule is set
//!   per device: tests run in parallel);
//! - 8: wave 64, for a read queued behind a held stream;
//! - 9: wave 64 with a 40 ms delay before every kernel, and 10: wave 64, for the kernel timers
//!   (`runtime::set_kernel_timing`, per device).

mod gpu_checks;

use std::sync::Once;
use std::time::Duration;

use burn::tensor::{Tensor, TensorData};
use burn_metax_backend::driver::StreamHandle;
use burn_metax_backend::emu::{EmuConfig, EmuDeviceConfig, EmuDriver};
use burn_metax_backend::runtime::{
    KernelTime, MetaxEmuPlatform, Platform, StreamOrdering, emu_driver, install_emu_driver, registry,
    set_kernel_timing, set_stream_ordering, take_kernel_time,
};
use burn_metax_backend::{MetaxEmu, MetaxEmuDevice, MetaxEmuRuntime};
use cubecl_core as cubecl;
use cubecl_core::prelude::*;

const WAVE64: MetaxEmuDevice = MetaxEmuDevice::new(0);
const WAVE32: MetaxEmuDevice = MetaxEmuDevice::new(1);
const SLOW: MetaxEmuDevice = MetaxEmuDevice::new(2);
const FAULTY: MetaxEmuDevice = MetaxEmuDevice::new(3);
const LAUNCH_DELAY: Duration = Duration::from_millis(150);
/// Stream ordering by need: the needed wait.
const BY_NEED_WRITE: MetaxEmuDevice = MetaxEmuDevice::new(4);
/// The negative control: no wait.
const UNORDERED: MetaxEmuDevice = MetaxEmuDevice::new(5);
/// Stream ordering by need: no unneeded wait.
const BY_NEED_OVERLAP: MetaxEmuDevice = MetaxEmuDevice::new(6);
/// The all-streams rule (the earlier one).
const ALL_STREAMS: MetaxEmuDevice = MetaxEmuDevice::new(7);
/// A read queued behind a held stream.
const QUEUED_READ: MetaxEmuDevice = MetaxEmuDevice::new(8);
/// Kernel timing on a device whose kernels take 40 ms each.
const TIMED_SLOW: MetaxEmuDevice = MetaxEmuDevice::new(9);
const TIMED_DELAY: Duration = Duration::from_millis(40);
/// Kernel timing on a device that waits for the host.
const TIMED_IDLE: MetaxEmuDevice = MetaxEmuDevice::new(10);

fn setup() {
    static ONCE: Once = Once::new();
    ONCE.call_once(|| {
        let mut config =
            EmuConfig::uniform(11, EmuDeviceConfig { memory_bytes: 2 << 30, ..Default::default() });
        config.devices[1].warp_size = 32;
        config.devices[2].launch_delay = LAUNCH_DELAY;
        config.devices[TIMED_SLOW.index].launch_delay = TIMED_DELAY;
        config.wait_timeout = Duration::from_secs(120);
        let driver =
            EmuDriver::new(config).expect("the emulated device needs g++ or clang++ (scripts/setup.sh)");
        assert!(install_emu_driver(driver), "the emulated driver was built before this test's configuration");
    });
}

fn client(device: &MetaxEmuDevice) -> ComputeClient<MetaxEmuRuntime> {
    setup();
    MetaxEmuRuntime::try_client(device).expect("emulated device")
}

// ---------------------------------------------------------------------------------------------
// Burn operations and autodiff against NdArray, on the wave-64 device

#[test]
fn burn_ops_match_ndarray() {
    setup();
    gpu_checks::ops_match_ndarray::<MetaxEmu>(&WAVE64);
}

#[test]
fn burn_gradients_match_ndarray() {
    setup();
    gpu_checks::gradients_match_ndarray::<MetaxEmu>(&WAVE64);
}

#[test]
fn copies_round_trip_and_streams_are_ordered() {
    setup();
    gpu_checks::copies_round_trip_and_streams_are_ordered::<MetaxEmuPlatform>(&WAVE64);
}

#[test]
fn tensors_move_between_devices() {
    setup();
    // From the slow device, whose kernels start 150 ms late: the copy must wait for them.
    gpu_checks::to_device_between_devices::<MetaxEmu>(&SLOW, &WAVE64);
}

// ---------------------------------------------------------------------------------------------
// Wave size

/// One result per plane: sum and max of the plane's values, the ballot of positive values, and
/// the lane the plane elected.
#[cube(launch)]
fn plane_reduce(
    input: &Array<f32>,
    sums: &mut Array<f32>,
    maxes: &mut Array<f32>,
    ballots: &mut Array<Vector<u32, Const<4>>>,
    elected: &mut Array<u32>,
) {
    let value = input[ABSOLUTE_POS];
    let sum = plane_sum(value);
    let max = plane_max(value);
    let ballot = plane_ballot(value > 0.0);
    let plane = ABSOLUTE_POS / 64usize;
    if plane_elect() {
        sums[plane] = sum;
        maxes[plane] = max;
        ballots[plane] = ballot;
        elected[plane] = UNIT_POS_PLANE;
    }
}

/// What `plane_reduce` computes on `input` with planes of 64 lanes.
struct PlaneResults {
    sums: Vec<f32>,
    maxes: Vec<f32>,
    ballots: Vec<u32>,
    elected: Vec<u32>,
}

const BLOCK: u32 = 256;
const BLOCKS: u32 = 3;

fn plane_input() -> Vec<f32> {
    // Small integers: every sum is exact in any order. About half the values are positive.
    (0..BLOCK * BLOCKS).map(|i| ((i * 37 + 11) % 23) as f32 - 11.0).collect()
}

fn plane_reference(input: &[f32]) -> PlaneResults {
    let planes: Vec<&[f32]> = input.chunks(64).collect();
    PlaneResults {
        sums: planes.iter().map(|p| p.iter().sum()).collect(),
        maxes: planes.iter().map(|p| p.iter().copied().fold(f32::MIN, f32::max)).collect(),
        ballots: planes
            .iter()
            .flat_map(|p| {
                let bits =
                    p.iter().enumerate().fold(0u64, |b, (i, v)| if *v > 0.0 { b | (1 << i) } else { b });
                [bits as u32, (bits >> 32) as u32, 0, 0]
            })
            .collect(),
        elected: vec![0; planes.len()],
    }
}

fn f32s(bytes: &[u8]) -> Vec<f32> {
    bytes.chunks_exact(4).map(|c| f32::from_le_bytes([c[0], c[1], c[2], c[3]])).collect()
}

fn u32s(bytes: &[u8]) -> Vec<u32> {
    bytes.chunks_exact(4).map(|c| u32::from_le_bytes([c[0], c[1], c[2], c[3]])).collect()
}

fn run_plane_reduce(device: &MetaxEmuDevice) -> PlaneResults {
    let client = client(device);
    let input = plane_input();
    let planes = input.len() / 64;
    let sentinel = |n: usize| client.create_from_slice(&vec![0xA5u8; n * 4]);
    let input_handle = client.create_from_slice(bytemuck_f32(&input));
    let (sums, maxes, ballots, elected) =
        (sentinel(planes), sentinel(planes), sentinel(planes * 4), sentinel(planes));
    // SAFETY: every array argument is a live handle of at least `length` elements of its type
    // (`planes` f32s/u32s, `planes` 4-vectors of u32 = `planes * 4` u32s, and the input).
    unsafe {
        plane_reduce::launch::<MetaxEmuRuntime>(
            &client,
            CubeCount::Static(BLOCKS, 1, 1),
            CubeDim::new_1d(BLOCK),
            ArrayArg::from_raw_parts(input_handle, input.len()),
            ArrayArg::from_raw_parts(sums.clone(), planes),
            ArrayArg::from_raw_parts(maxes.clone(), planes),
            ArrayArg::from_raw_parts(ballots.clone(), planes),
            ArrayArg::from_raw_parts(elected.clone(), planes),
        );
    }
    let read = |h| client.read_one(h).expect("read");
    PlaneResults {
        sums: f32s(&read(sums)),
        maxes: f32s(&read(maxes)),
        ballots: u32s(&read(ballots)),
        elected: u32s(&read(elected)),
    }
}

fn bytemuck_f32(values: &[f32]) -> &[u8] {
    bytemuck::cast_slice(values)
}

/// Counts the entries that differ from the 64-lane reference.
fn wrong_entries(got: &PlaneResults, want: &PlaneResults) -> usize {
    fn diff<T: PartialEq>(a: &[T], b: &[T]) -> usize {
        a.iter().zip(b).filter(|(x, y)| x != y).count() + a.len().abs_diff(b.len())
    }
    diff(&got.sums, &want.sums)
        + diff(&got.maxes, &want.maxes)
        + diff(&got.ballots, &want.ballots)
        + diff(&got.elected, &want.elected)
}

#[test]
fn plane_operations_are_right_at_wave_64() {
    let want = plane_reference(&plane_input());
    let got = run_plane_reduce(&WAVE64);
    assert_eq!(got.sums, want.sums, "plane sums");
    assert_eq!(got.maxes, want.maxes, "plane maxima");
    assert_eq!(got.ballots, want.ballots, "64-bit ballots");
    assert_eq!(got.elected, want.elected, "elected lanes");
}

/// The dialect's wave-64 code (64-bit masks, width-64 shuffles) on a device whose waves have 32
/// lanes gives wrong numbers: wave bugs are visible to the suite.
#[test]
fn wave_64_code_is_wrong_on_a_32_lane_device() {
    let want = plane_reference(&plane_input());
    let got = run_plane_reduce(&WAVE32);
    let wrong = wrong_entries(&got, &want);
    let total = want.sums.len() * 3 + want.ballots.len();
    eprintln!("wave-64 kernel on a 32-lane device: {wrong} of {total} results wrong");
    assert!(wrong > 0, "the 32-lane device computed the 64-lane results: wave size has no effect");
    // And element-wise kernels (no plane operations) are still right there.
    let x = Tensor::<MetaxEmu, 1>::from_floats([1.0, 2.0, 3.0], &WAVE32);
    assert_eq!((x * 2.0).into_data().to_vec::<f32>().expect("f32"), vec![2.0, 4.0, 6.0]);
}

// ---------------------------------------------------------------------------------------------
// Faults

/// The two halves of a block wait at two different barriers.
#[cube(launch)]
fn divergent_barrier(out: &mut Array<f32>) {
    if UNIT_POS < 32 {
        sync_cube();
        out[ABSOLUTE_POS] = 1.0;
    } else {
        sync_cube();
        out[ABSOLUTE_POS] = 2.0;
    }
}

/// Barriers in divergent control flow are undefined on a GPU (a hang, or lanes released at the
/// wrong barrier): the emulator reports a kernel fault naming the kernel and the source lines,
/// and the read fails instead of hanging.
#[test]
fn a_divergent_barrier_is_an_error_not_a_hang() {
    let client = client(&FAULTY);
    let out = client.create_from_slice(&[0u8; 128 * 4]);
    // SAFETY: `out` holds 128 f32s, one per unit of the single 128-unit cube.
    unsafe {
        divergent_barrier::launch::<MetaxEmuRuntime>(
            &client,
            CubeCount::Static(1, 1, 1),
            CubeDim::new_1d(128),
            ArrayArg::from_raw_parts(out.clone(), 128),
        );
    }
    let err = client.read_one(out).expect_err("a kernel with a divergent barrier must fail");
    let text = format!("{err:?}");
    assert!(text.contains("barrier") && text.contains("divergent_barrier"), "{text}");
}

// ---------------------------------------------------------------------------------------------
// Stream ordering: the seed's root cause

/// FSDP's scenario in miniature: a gradient buffer is allocated on the training thread's stream
/// (A); the communication thread reduces into it *in place* on its own stream (B — a side-stream
/// reduce-scatter, here made slow by the device's launch delay); then the training thread
/// offloads it to the host (a device-to-host copy on A). The buffer's stream is A, so CubeCL's
/// per-binding stream tracking sees nothing to wait for: only the server's rule that a read waits
/// for every stream's queued work (`GpuServer::read_inner`) makes A's copy see B's result.
/// Without that wait the copy runs while B's kernel sleeps and reads the stale values.
#[test]
fn an_offload_copy_waits_for_a_side_stream_reduce_scatter() {
    setup();
    let n = 4096;
    for round in 0..3 {
        // Stream A: the gradient buffer, zeros.
        let grad = Tensor::<MetaxEmu, 1>::zeros([n], &SLOW);
        // Stream B: the "reduce-scatter" adds the other ranks' contributions in place (the tensor
        // is moved to the thread, so Burn reuses its buffer).
        let reduced = std::thread::spawn(move || grad.add_scalar(3.0).mul_scalar(2.0))
            .join()
            .expect("communication thread");
        // Stream A again: the offload copy.
        let offloaded: TensorData = reduced.into_data();
        let values = offloaded.to_vec::<f32>().expect("f32");
        let stale = values.iter().filter(|v| **v != 6.0).count();
        assert_eq!(stale, 0, "round {round}: {stale} of {n} offloaded values are stale (e.g. {})", values[0]);
    }
}

// ---------------------------------------------------------------------------------------------
// Compile cache across processes

/// Run in a child process by `kernels_compile_once_across_processes`: a few operations on the
/// emulated device, then the cache counters.
#[test]
#[ignore = "child process of kernels_compile_once_across_processes (needs METAX_KERNEL_CACHE)"]
fn compile_cache_child() {
    let x = Tensor::<MetaxEmu, 2>::from_floats([[1.0, -2.0], [3.0, 4.0]], &MetaxEmuDevice::new(0));
    let y = burn::tensor::activation::softmax(x.clone().matmul(x).exp(), 1).sum();
    let _ = y.into_data();
    let stats = burn_metax_backend::runtime::compile_cache::stats();
    println!("CACHE compiled={} disk_hits={}", stats.compiled, stats.disk_hits);
}

#[test]
fn kernels_compile_once_across_processes() {
    let dir = tempfile::tempdir().expect("temporary directory");
    let run = || {
        let out = std::process::Command::new(std::env::current_exe().expect("test binary"))
            .args(["--exact", "compile_cache_child", "--ignored", "--nocapture", "--test-threads=1"])
            .env("METAX_KERNEL_CACHE", dir.path())
            .env("METAX_EMU_DEVICES", "1")
            .output()
            .expect("child test process");
        let stdout = String::from_utf8_lossy(&out.stdout).to_string();
        assert!(out.status.success(), "child failed:\n{stdout}\n{}", String::from_utf8_lossy(&out.stderr));
        let line = stdout
            .lines()
            .find_map(|l| l.find("CACHE ").map(|at| &l[at..]))
            .unwrap_or_else(|| panic!("no counters:\n{stdout}"));
        let field = |name: &str| -> u64 {
            line.split_whitespace()
                .find_map(|kv| kv.strip_prefix(name).and_then(|v| v.strip_prefix('=')))
                .and_then(|v| v.parse().ok())
                .unwrap_or_else(|| panic!("{name} in {line:?}"))
        };
        (field("compiled"), field("disk_hits"))
    };
    let (compiled, hits) = run();
    assert!(compiled > 0 && hits == 0, "first run: compiled {compiled}, disk hits {hits}");
    let files = std::fs::read_dir(dir.path())
        .expect("cache directory")
        .filter(|e| e.as_ref().is_ok_and(|e| e.path().extension().is_some_and(|x| x == "kernel")))
        .count() as u64;
    assert_eq!(files, compiled, "one cache file per compiled kernel");
    // cubecl-cpp declares some locals and lays out shared arrays in hash-map order, which differs
    // from process to process: such kernels have a new source, hence a new key, in a new process
    // (the key is the exact source; see `compile_cache`). Every other kernel comes from disk.
    let (again, hits) = run();
    assert!(
        hits > 0 && again + hits == compiled,
        "second run: compiled {again}, disk hits {hits} (first: {compiled})"
    );
}

// ---------------------------------------------------------------------------------------------
// Stream ordering by need (`runtime::order`): each half, and a negative control for each

/// The driver streams of `device`'s server.
fn server_streams(device: MetaxEmuDevice) -> Vec<StreamHandle> {
    registry::device_streams(MetaxEmuPlatform::NAME, device.index).map(|d| d.streams()).unwrap_or_default()
}

/// Runs one small operation on the calling thread (so that CubeCL gives the thread its own
/// stream on `device`) and returns that stream: the one the server created for it.
fn this_threads_stream(device: MetaxEmuDevice) -> StreamHandle {
    let before = server_streams(device);
    let _ = Tensor::<MetaxEmu, 1>::zeros([1], &device).add_scalar(1.0).into_data();
    let new: Vec<StreamHandle> = server_streams(device).into_iter().filter(|s| !before.contains(s)).collect();
    assert_eq!(new.len(), 1, "one new stream for this thread on {device:?}: {new:?}");
    new[0]
}

/// Sets `device`'s ordering rule (the rule is per device, so tests on other devices are not
/// affected).
fn rule(device: MetaxEmuDevice, rule: StreamOrdering) {
    setup();
    set_stream_ordering(MetaxEmuPlatform::NAME, device.index, rule);
}

/// What a reader saw of a buffer that another stream wrote in place while held back.
#[derive(Debug)]
struct HeldWrite {
    /// The read returned while the writing stream was still held.
    read_while_held: bool,
    /// Values that are not the written ones.
    stale: usize,
}

/// FSDP's pattern (see `an_offload_copy_waits_for_a_side_stream_reduce_scatter`): a buffer made
/// on stream A is written in place by a second thread's stream B, then read on a third stream.
/// B is held back (`EmuDriver::hold_stream`) before its write is queued, so the write certainly
/// comes late; the read must wait for it, and nothing else links them (the buffer was made on
/// A, which CubeCL's own tracking orders the reader after).
fn read_after_a_held_side_stream_write(device: MetaxEmuDevice) -> HeldWrite {
    let n = 4096;
    let grad = Tensor::<MetaxEmu, 1>::zeros([n], &device);
    // The zeros are written (and the only other reference dropped): B's write is in place.
    let _ = grad.clone().into_data();
    let (reduced, hold) = std::thread::spawn(move || {
        let stream = this_threads_stream(device);
        let hold = emu_driver().expect("driver").hold_stream(stream).expect("hold B");
        (grad.add_scalar(3.0).mul_scalar(2.0), hold)
    })
    .join()
    .expect("writer thread");
    let (tx, rx) = std::sync::mpsc::channel();
    let reader = std::thread::spawn(move || tx.send(reduced.into_data()));
    // Long enough for an unordered read to finish many times over on an idle machine.
    let early = rx.recv_timeout(Duration::from_millis(500));
    let read_while_held = early.is_ok();
    hold.release();
    let data =
        early.unwrap_or_else(|_| rx.recv_timeout(Duration::from_secs(60)).expect("the read, once B goes on"));
    reader.join().expect("reader thread").expect("send");
    let values = data.to_vec::<f32>().expect("f32");
    HeldWrite { read_while_held, stale: values.iter().filter(|v| **v != 6.0).count() }
}

/// A read's first poll does not wait: with the stream held back, polling Burn's
/// `into_data_async` once queues the copy and returns `Pending` at once (burn-fsdp's CPU offload
/// queues each unit's gradient copy so, in backward); blocking on the future afterwards gives
/// the values once the stream goes on.
#[test]
fn a_read_is_queued_by_its_first_poll_without_waiting() {
    use std::future::Future;
    use std::task::{Context, Waker};

    setup();
    let device = QUEUED_READ;
    let stream = this_threads_stream(device);
    let x = Tensor::<MetaxEmu, 1>::from_floats([1.0, 2.0, 3.0, 4.0], &device);
    let _ = x.clone().into_data();
    let hold = emu_driver().expect("driver").hold_stream(stream).expect("hold");
    let mut read = Box::pin(x.mul_scalar(2.0).into_data_async());
    let (tx, rx) = std::sync::mpsc::channel();
    let poller = std::thread::spawn(move || {
        let first = read.as_mut().poll(&mut Context::from_waker(Waker::noop())).is_pending();
        let _ = tx.send(first);
        read
    });
    // A poll that waited would wait for the held stream, i.e. until the release below.
    let first = rx.recv_timeout(Duration::from_secs(60));
    hold.release();
    let read = poller.join().expect("poller thread");
    assert_eq!(first, Ok(true), "the first poll of a read behind a held stream must return Pending at once");
    let data = burn::tensor::read_sync(read).expect("the read, once the stream goes on");
    assert_eq!(data.to_vec::<f32>().expect("f32"), vec![2.0, 4.0, 6.0, 8.0]);
}

/// By need: the read waits for the stream that wrote its buffer in place.
#[test]
fn a_read_waits_for_the_stream_that_wrote_its_buffer() {
    rule(BY_NEED_WRITE, StreamOrdering::ByNeed);
    let seen = read_after_a_held_side_stream_write(BY_NEED_WRITE);
    assert!(!seen.read_while_held && seen.stale == 0, "{seen:?}");
}

/// The negative control of `a_read_waits_for_the_stream_that_wrote_its_buffer`: without the
/// server's waits (`StreamOrdering::Unordered`), the same check fails — the read returns at once
/// with the values from before the write.
#[test]
fn without_the_wait_the_reader_sees_stale_values() {
    rule(UNORDERED, StreamOrdering::Unordered);
    let seen = read_after_a_held_side_stream_write(UNORDERED);
    assert!(seen.read_while_held && seen.stale == 4096, "{seen:?}");
}

/// While a second thread's stream is held back with work queued on its own buffer, a third
/// thread computes on its own buffers and reads the result. Returns whether that read came back
/// within `patience` (while the other stream was still held).
fn compute_beside_a_held_stream(device: MetaxEmuDevice, patience: Duration) -> bool {
    let (held_tx, held_rx) = std::sync::mpsc::channel();
    let (done_tx, done_rx) = std::sync::mpsc::channel::<()>();
    let side = std::thread::spawn(move || {
        let x = Tensor::<MetaxEmu, 1>::ones([4096], &device);
        let stream = this_threads_stream(device);
        let hold = emu_driver().expect("driver").hold_stream(stream).expect("hold the side stream");
        let y = x.mul_scalar(2.0);
        held_tx.send(hold).expect("send the hold");
        // Keep the side stream's buffers until the test is done.
        let _ = done_rx.recv();
        y
    });
    let hold = held_rx.recv().expect("the side stream is held");
    let (tx, rx) = std::sync::mpsc::channel();
    let compute = std::thread::spawn(move || {
        let a = Tensor::<MetaxEmu, 1>::from_floats([1.0, 2.0, 3.0, 4.0], &device);
        tx.send((a.clone() * a).sum().into_data())
    });
    let result = rx.recv_timeout(patience);
    let finished_while_held = result.is_ok();
    hold.release();
    let data = result
        .unwrap_or_else(|_| rx.recv_timeout(Duration::from_secs(60)).expect("the compute, once released"));
    compute.join().expect("compute thread").expect("send");
    assert_eq!(data.to_vec::<f32>().expect("f32"), vec![30.0]);
    done_tx.send(()).expect("side thread");
    let y = side.join().expect("side thread");
    assert_eq!(y.into_data().to_vec::<f32>().expect("f32"), vec![2.0; 4096]);
    finished_while_held
}

/// By need: work that shares no memory with a held stream does not wait for it (a communication
/// stream can overlap compute).
#[test]
fn compute_does_not_wait_for_an_unrelated_stream() {
    rule(BY_NEED_OVERLAP, StreamOrdering::ByNeed);
    assert!(
        compute_beside_a_held_stream(BY_NEED_OVERLAP, Duration::from_secs(60)),
        "the compute waited for an unrelated stream that was held back"
    );
}

/// The control of `compute_does_not_wait_for_an_unrelated_stream`: under the all-streams rule
/// (the server's rule before ordering by need) the same compute waits for the held stream.
#[test]
fn under_the_all_streams_rule_compute_waits_for_every_stream() {
    rule(ALL_STREAMS, StreamOrdering::AllStreams);
    assert!(
        !compute_beside_a_held_stream(ALL_STREAMS, Duration::from_secs(1)),
        "under the all-streams rule, the compute did not wait for the held stream"
    );
}

// ---------------------------------------------------------------------------------------------
// Kernel time by the device's timers (`runtime::set_kernel_timing`)

/// Launches `n` element-wise kernels on `device` with kernel timing on, `pause` of host time
/// after each, then reads the result. Returns what the timers measured, the launches the
/// device ran meanwhile, and the wall time from the first launch to the end of the read.
fn timed_launches(device: MetaxEmuDevice, n: usize, pause: Duration) -> (KernelTime, u64, Duration) {
    setup();
    let driver = emu_driver().expect("driver");
    let x = Tensor::<MetaxEmu, 1>::ones([1024], &device);
    // Compiled and on the device before the timers start.
    let _ = x.clone().add_scalar(1.0).into_data();
    assert!(!set_kernel_timing(MetaxEmuPlatform::NAME, device.index, true));
    let before = driver.counters(device.index);
    let start = std::time::Instant::now();
    let mut y = x;
    for _ in 0..n {
        y = y.add_scalar(1.0);
        std::thread::sleep(pause);
    }
    let values = y.into_data().to_vec::<f32>().expect("f32");
    let wall = start.elapsed();
    assert_eq!(values, vec![1.0 + n as f32; 1024]);
    let launched = driver.counters(device.index).since(&before).launches;
    let time = take_kernel_time(MetaxEmuPlatform::NAME, device.index).expect("kernel time");
    assert!(set_kernel_timing(MetaxEmuPlatform::NAME, device.index, false));
    (time, launched, wall)
}

/// Every launch is timed, and its time is the device's: on a device whose kernels take 40 ms
/// each, the kernel time of n launches is at least n × 40 ms, and at most the wall time.
/// With the switch off, nothing more is timed.
#[test]
fn kernel_time_counts_each_launch_and_its_device_time() {
    let (time, launched, wall) = timed_launches(TIMED_SLOW, 5, Duration::ZERO);
    assert!(launched >= 5, "{launched} launches");
    assert_eq!((time.launches, time.untimed), (launched, 0), "{time:?}");
    let floor = launched as f64 * TIMED_DELAY.as_secs_f64() * 1e3;
    assert!(
        time.busy_ms >= floor && time.busy_ms <= wall.as_secs_f64() * 1e3,
        "kernel time {time:?}: expected between {floor} ms and the wall time {wall:?}"
    );
    // Off: launches go untimed and uncounted.
    let _ = Tensor::<MetaxEmu, 1>::ones([16], &TIMED_SLOW).add_scalar(1.0).into_data();
    let after = take_kernel_time(MetaxEmuPlatform::NAME, TIMED_SLOW.index).expect("kernel time");
    assert_eq!(after, KernelTime::default());
}

/// The time the device waits for the host is not kernel time: with 100 ms of host time after
/// each of 5 short launches, the device is busy for a small part of the wall time (a timer
/// pair around the whole sequence would give more than 400 ms).
#[test]
fn kernel_time_leaves_out_the_time_the_device_waits_for_the_host() {
    let (time, launched, wall) = timed_launches(TIMED_IDLE, 5, Duration::from_millis(100));
    assert_eq!((time.launches, time.untimed), (launched, 0), "{time:?}");
    assert!(wall >= Duration::from_millis(500), "{wall:?}");
    assert!(time.busy_ms > 0.0, "{time:?}");
    assert!(
        time.busy_ms < 0.2 * wall.as_secs_f64() * 1e3,
        "kernel time {time:?} of a device idle most of {wall:?}"
    );
}
