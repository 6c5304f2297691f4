//! `DeviceGroup` over [`EmuCommunicator`]: in-process ranks on emulated MetaX devices whose
//! collectives run on the devices' streams, device memory to device memory.
//!
//! The emulated devices' streams are really asynchronous (one worker thread each), so a
//! collective not ordered after the kernel that wrote its input, or a kernel not ordered after
//! the collective, reads wrong values: the value checks also check the ordering. Rank `r` uses
//! emulated device `r`; every test uses its own process-wide driver, so they run one at a time
//! (`SERIAL`).

mod collective_checks;

use std::sync::{Mutex, MutexGuard, Once};
use std::time::Duration;

use burn::tensor::{DType, Tensor};
use burn_fsdp::comm::{ProcessGroup, ReduceOp, Tag};
use burn_metax_backend::collective::{EmuCommunicator, MetaxEmuGroup};
use burn_metax_backend::emu::{EmuConfig, EmuCounters, EmuDeviceConfig, EmuDriver};
use burn_metax_backend::runtime::{emu_driver, install_emu_driver};
use burn_metax_backend::{MetaxEmu, MetaxEmuDevice};
use collective_checks::{check_collectives, check_kernel_ordering, tensor, value, values};

static SERIAL: Mutex<()> = Mutex::new(());

fn setup() -> MutexGuard<'static, ()> {
    static ONCE: Once = Once::new();
    ONCE.call_once(|| {
        let config = EmuConfig::uniform(4, EmuDeviceConfig { memory_bytes: 1 << 30, ..Default::default() });
        let driver =
            EmuDriver::new(config).expect("the emulated device needs g++ or clang++ (scripts/setup.sh)");
        assert!(install_emu_driver(driver), "the emulated driver was built before this test's configuration");
    });
    SERIAL.lock().unwrap_or_else(|e| e.into_inner())
}

/// Runs `f` on `world` threads; rank `r` gets a group on emulated device `r`. Every rank's
/// result, in rank order.
fn run_ranks<T: Send>(
    world: usize,
    communicate_at_size_one: bool,
    f: impl Fn(&MetaxEmuGroup, MetaxEmuDevice) -> T + Sync,
) -> Vec<T> {
    let comms: Vec<Mutex<Option<EmuCommunicator>>> = EmuCommunicator::group(world)
        .expect("communicators")
        .into_iter()
        .map(|c| Mutex::new(Some(c)))
        .collect();
    let join = |rank: usize| {
        let comm =
            comms[rank].lock().unwrap_or_else(|e| e.into_inner()).take().expect("one communicator per rank");
        let device = MetaxEmuDevice::new(rank);
        let group = MetaxEmuGroup::new(device, comm, Duration::from_secs(60))
            .expect("join the group")
            .communicate_at_size_one(communicate_at_size_one);
        (group, device)
    };
    collective_checks::run_ranks(world, join, f)
}

fn as_group(g: &MetaxEmuGroup) -> &dyn ProcessGroup<MetaxEmu> {
    g
}

/// Every collective in f32, bf16, f16 and f64, at 1, 2 and 4 ranks, gives `LocalGroup`'s results
/// (rank-order sums, sub-f32 types accumulated in f32): the checks compare exactly.
#[test]
fn every_collective_at_world_sizes_1_2_4() {
    let _guard = setup();
    for world in [1, 2, 4] {
        run_ranks(world, false, |g, device| check_collectives(as_group(g), &device));
    }
    run_ranks(1, true, |g, device| check_collectives(as_group(g), &device));
}

/// A kernel writes the input just before the collective, another reads the output just after.
#[test]
fn kernels_and_collectives_are_ordered() {
    let _guard = setup();
    run_ranks(4, false, |g, device| check_kernel_ordering(as_group(g), &device));
}

/// A chain of collectives, each one's input the previous one's output: no byte goes through
/// the host, no kernel runs, and each collective makes at most two cross-stream waits (the
/// communication stream waits for the last writer of its input; the next reader waits for it).
#[test]
fn collectives_stay_on_the_device() {
    let _guard = setup();
    let n = 4096;
    let per_rank = run_ranks(4, false, |g, device| {
        let g = as_group(g);
        let rank = g.rank();
        let host: Vec<f64> = (0..4 * n).map(|i| value(rank, i)).collect();
        let x = tensor::<MetaxEmu>(&host, DType::F32, &device);
        // The upload is done before counting starts.
        let _ = x.clone().into_data();
        let driver = emu_driver().expect("driver");
        let before = driver.counters(device.index);
        let tag = Tag::new("chain");
        let reduced = g.reduce_scatter(x, ReduceOp::Sum, &tag).expect("reduce_scatter");
        let gathered = g.all_gather(reduced, &tag).expect("all_gather");
        let summed = g.all_reduce(gathered, ReduceOp::Avg, &tag).expect("all_reduce");
        let broadcast = g.broadcast(summed, 2, &tag).expect("broadcast");
        let counted = driver.counters(device.index).since(&before);
        let got = values::<MetaxEmu>(broadcast, DType::F32);
        (counted, got)
    });
    // Every rank holds the rank-order sum of the four inputs (an average of four equal
    // gathered vectors is the vector itself, exactly: the values are multiples of 1/4).
    let want: Vec<f64> = (0..4 * n).map(|i| (0..4).map(|r| value(r, i) as f32).sum::<f32>() as f64).collect();
    for (rank, (counted, got)) in per_rank.iter().enumerate() {
        assert_eq!(got, &want, "rank {rank}");
        let EmuCounters { launches, host_to_device_bytes, device_to_host_bytes, cross_stream_waits, .. } =
            *counted;
        assert_eq!((host_to_device_bytes, device_to_host_bytes), (0, 0), "rank {rank}: {counted:?}");
        assert_eq!(launches, 0, "rank {rank}: {counted:?}");
        assert!(
            cross_stream_waits <= 2 * 4,
            "rank {rank}: {cross_stream_waits} cross-stream waits for 4 collectives: {counted:?}"
        );
    }
}

/// A rank that never joins a collective leaves the others' streams waiting; the group's
/// timeout then fails them with an error naming the stalled collective, and no thread hangs.
#[test]
fn a_missing_rank_is_a_timeout_not_a_hang() {
    let _guard = setup();
    let comms = EmuCommunicator::group(2).expect("communicators");
    let mut comms = comms.into_iter();
    let (first, second) = (comms.next().expect("rank 0"), comms.next().expect("rank 1"));
    let device = MetaxEmuDevice::new(0);
    let joined = MetaxEmuGroup::new(device, first, Duration::from_millis(500)).expect("rank 0 joins");
    let x: Tensor<MetaxEmu, 1> = tensor::<MetaxEmu>(&[1.0, 2.0], DType::F32, &device);
    let group = as_group(&joined);
    let out = group.all_reduce(x, ReduceOp::Sum, &Tag::new("alone"));
    // Queued; the barrier waits on the host and must give up after the timeout.
    let waited = out.and_then(|_| group.barrier(&Tag::new("after")));
    let err = waited.expect_err("rank 1 never came");
    let message = err.to_string();
    assert!(
        message.contains("alone") || message.contains("timed out") || message.contains("stall"),
        "{message}"
    );
    drop(second);
}
