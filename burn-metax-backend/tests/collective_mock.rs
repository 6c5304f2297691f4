//! Tier-2 tests: `DeviceGroup` over MCCL on the `Metax` backend, against the mock runtime and
//! mock `libmccl.so`, with 1, 2 and 4 ranks as threads of this process, each on its own mock
//! device (the mock's ranks rendezvous on the unique id and compute real collectives on its
//! device memory).
//!
//! The mock defers queued work until something waits for it, so a collective that was not
//! ordered after the upload of its input would read the allocator's 0xCD filler, and a read not
//! ordered after the collective would see the output's filler: the value checks also check the
//! event ordering. Devices are process-wide, so the tests run one at a time (`SERIAL`).

mod collective_checks;
mod common;

use std::sync::{Arc, Barrier, Mutex, MutexGuard};
use std::time::{Duration, Instant};

use burn::tensor::{DType, Tensor};
use burn_fsdp::comm::{CollectiveKind, CommError, ProcessGroup, ReduceOp, Tag};
use burn_metax_backend::collective::{MetaxGroup, mccl_unique_id};
use burn_metax_backend::mccl::Mccl;
use burn_metax_backend::{MacaDevice, Metax};
use collective_checks::{check_collectives, tensor, values};
use common::{Control, OrderEntry, install_mock_runtime, mock_root_with_mccl};

static SERIAL: Mutex<()> = Mutex::new(());

fn setup() -> (MutexGuard<'static, ()>, Control) {
    let guard = SERIAL.lock().unwrap_or_else(|e| e.into_inner());
    install_mock_runtime();
    let control = Control::open();
    control.set_device_count(4);
    // Event queries run queued work, as a real device runs it on its own (the groups poll
    // events to enforce their timeout).
    control.set_query_progress(true);
    control.clear_global();
    (guard, control)
}

/// Runs `f` on `world` threads; rank `r` gets a group on mock device `r`. Every rank's result,
/// in rank order.
fn run_ranks<T: Send>(
    world: usize,
    timeout: Duration,
    communicate_at_size_one: bool,
    f: impl Fn(&MetaxGroup, MacaDevice) -> T + Sync,
) -> Vec<T> {
    let mccl = Arc::new(Mccl::load_from(mock_root_with_mccl()).expect("load the mock MCCL"));
    let id = mccl_unique_id(&mccl).expect("unique id");
    let join = |rank: usize| {
        let device = MacaDevice::new(rank);
        let group = MetaxGroup::mccl(device, mccl.clone(), id, rank, world, timeout)
            .expect("join the group")
            .communicate_at_size_one(communicate_at_size_one);
        (group, device)
    };
    collective_checks::run_ranks(world, join, f)
}

fn as_group(g: &MetaxGroup) -> &dyn ProcessGroup<Metax> {
    g
}

#[test]
fn every_collective_at_world_sizes_1_2_4() {
    let (_guard, _control) = setup();
    for world in [1, 2, 4] {
        run_ranks(world, Duration::from_secs(30), false, |g, device| check_collectives(as_group(g), &device));
    }
    // A group of one driven through the library anyway.
    run_ranks(1, Duration::from_secs(30), true, |g, device| check_collectives(as_group(g), &device));
}

#[test]
fn a_group_of_one_returns_its_input_without_calling_the_library() {
    let (_guard, control) = setup();
    control.clear_order_log();
    run_ranks(1, Duration::from_secs(30), false, |g, device| {
        let g = as_group(g);
        let x = tensor::<Metax>(&[1.0, 2.0, 3.0], DType::F32, &device);
        let out = g.all_reduce(x, ReduceOp::Sum, &Tag::new("one")).expect("all_reduce");
        assert_eq!(values(out, DType::F32), vec![1.0, 2.0, 3.0]);
        g.barrier(&Tag::new("one")).expect("barrier");
        assert_eq!(g.stats().calls(CollectiveKind::AllReduce), 0);
    });
    let collectives =
        control.order_log().iter().filter(|e| matches!(e, OrderEntry::Collective { .. })).count();
    assert_eq!(collectives, 0, "no MCCL call for a group of one");
}

/// The ordering rule, as the mock recorded it: before its collective, the communication stream
/// waits on an event of a compute stream; after it, an event is recorded on the communication
/// stream and that compute stream waits on it. And nothing waits on the host: when the call
/// returns, the collective is still queued.
#[test]
fn collectives_are_ordered_against_compute_by_events() {
    let (_guard, control) = setup();
    control.clear_order_log();
    let world = 2;
    let all_queued = Barrier::new(world);
    let comm_streams = run_ranks(world, Duration::from_secs(30), false, |g, device| {
        let comm = g.comm_stream().as_raw();
        let x = tensor::<Metax>(&[g_rank(g) as f64; 4], DType::F32, &device);
        let out = as_group(g).all_gather(x, &Tag::new("ordered")).expect("all_gather");
        assert!(control.pending_ops(comm) > 0, "the collective is queued, not run, when the call returns");
        all_queued.wait();
        assert_eq!(values(out, DType::F32), vec![0.0, 0.0, 0.0, 0.0, 1.0, 1.0, 1.0, 1.0]);
        comm
    });
    let log = control.order_log();
    for comm in comm_streams {
        let at = log
            .iter()
            .position(|e| *e == OrderEntry::Collective { stream: comm })
            .expect("the collective is on the group's stream");
        let waited: Vec<usize> = log[..at]
            .iter()
            .filter_map(|e| match *e {
                OrderEntry::Wait { stream, on } if stream == comm && on != comm => Some(on),
                _ => None,
            })
            .collect();
        assert!(!waited.is_empty(), "the communication stream waited on a compute stream first: {log:?}");
        let recorded = log[at..]
            .iter()
            .position(|e| *e == OrderEntry::Record { stream: comm })
            .expect("an event recorded on the communication stream after the collective")
            + at;
        for compute in waited {
            assert!(
                log[recorded..].contains(&OrderEntry::Wait { stream: compute, on: comm }),
                "compute stream {compute:#x} waits on the communication stream after the collective: {log:?}"
            );
        }
    }
}

fn g_rank(g: &MetaxGroup) -> usize {
    as_group(g).rank()
}

#[test]
fn bad_inputs_are_refused_on_every_rank_without_breaking_the_group() {
    let (_guard, _control) = setup();
    run_ranks(2, Duration::from_secs(30), false, |g, device| {
        let g = as_group(g);
        let odd = tensor::<Metax>(&[1.0, 2.0, 3.0], DType::F32, &device);
        match g.reduce_scatter(odd, ReduceOp::Sum, &Tag::new("odd")) {
            Err(CommError::BadInput { kind: CollectiveKind::ReduceScatter, msg, .. }) => {
                assert!(msg.contains("3 elements do not split into 2 chunks"), "{msg}")
            }
            other => panic!("expected BadInput, got {:?}", other.map(|t| t.dims())),
        }
        let x = tensor::<Metax>(&[1.0], DType::F32, &device);
        let err = g.broadcast(x.clone(), 2, &Tag::new("root")).map(|_| ()).expect_err("root 2 of 2");
        assert!(matches!(err, CommError::BadInput { .. }), "{err}");
        // Still usable: the refused calls reached no rank's library.
        let sum = g.all_reduce(x, ReduceOp::Sum, &Tag::new("after")).expect("all_reduce");
        assert_eq!(values(sum, DType::F32), vec![2.0]);
    });
}

/// A failed MCCL call names the call and MCCL's message, and fails the group.
#[test]
fn a_failed_library_call_is_reported_and_fails_the_group() {
    let (_guard, control) = setup();
    run_ranks(1, Duration::from_secs(30), true, |g, device| {
        let g = as_group(g);
        // The call runs on the device's server thread: inject for every thread.
        control.inject_global("mcclAllReduce", 3, 0, 1);
        let x = tensor::<Metax>(&[1.0, 2.0], DType::F32, &device);
        let err =
            g.all_reduce(x.clone(), ReduceOp::Sum, &Tag::new("injected")).map(|_| ()).expect_err("injected");
        control.clear_global();
        let text = err.to_string();
        assert!(text.contains("mcclAllReduce failed: mcclInternalError (3): internal error"), "{text}");
        let err = g.all_gather(x, &Tag::new("later")).map(|_| ()).expect_err("the group failed");
        assert!(matches!(err, CommError::PeerFailed { failed_rank: 0, .. }), "{err}");
    });
}

/// Rank 0 aborts; the others' collectives with it stall and fail after the timeout instead of
/// hanging — whether the rank waits in the group (barrier) or in a device read of the output
/// (the watchdog aborts the communicator so the read returns).
#[test]
fn abort_fails_every_rank_instead_of_hanging() {
    let (_guard, _control) = setup();
    let world = 4;
    let timeout = Duration::from_secs(2);
    let started = Instant::now();
    let joined = Barrier::new(world);
    run_ranks(world, timeout, false, |group, device| {
        let g = as_group(group);
        let rank = g.rank();
        let x = tensor::<Metax>(&[rank as f64 + 1.0; 3], DType::F32, &device);
        let sum = g.all_reduce(x.clone(), ReduceOp::Sum, &Tag::new("before")).expect("all_reduce");
        assert_eq!(values(sum, DType::F32), vec![10.0; 3]);
        joined.wait();
        if rank == 0 {
            g.abort("rank 0 gave up");
            match g.all_reduce(x, ReduceOp::Sum, &Tag::new("after")) {
                Err(CommError::PeerFailed { failed_rank: 0, reason, .. }) => {
                    assert_eq!(reason, "rank 0 gave up")
                }
                other => panic!("expected PeerFailed, got {:?}", other.map(|t| t.dims())),
            }
            return;
        }
        let out = g.all_reduce(x.clone(), ReduceOp::Sum, &Tag::new("after")).expect("queued");
        if rank == 3 {
            // Blocked in a device read of the stalled output: the watchdog releases it.
            let _ = out.into_data();
            let err =
                g.all_reduce(x.clone(), ReduceOp::Sum, &Tag::new("later")).map(|_| ()).expect_err("stalled");
            assert!(
                matches!(&err, CommError::Stalled { kind: CollectiveKind::AllReduce, tag, .. } if tag.0 == "after"),
                "{err}"
            );
        } else {
            // Waiting in the group.
            let err = g.barrier(&Tag::new("wait")).expect_err("stalled");
            assert!(
                matches!(&err, CommError::Stalled { kind: CollectiveKind::AllReduce, tag, .. } if tag.0 == "after"),
                "{err}"
            );
            drop(out);
        }
        let err = g.all_gather(x, &Tag::new("dead")).map(|_| ()).expect_err("failed group");
        assert!(matches!(err, CommError::PeerFailed { failed_rank, .. } if failed_rank == rank), "{err}");
    });
    let elapsed = started.elapsed();
    assert!(elapsed < Duration::from_secs(20), "took {elapsed:?}");
}

/// Tensors whose storage is a slice of a larger buffer (a view: burn-cubecl makes one when the
/// offsets are aligned) are communicated from the right offset.
#[test]
fn sliced_inputs_use_their_offset() {
    let (_guard, _control) = setup();
    run_ranks(2, Duration::from_secs(30), false, |g, device| {
        let g = as_group(g);
        let whole_values = |r: usize| (0..256).map(move |i| (r * 1000 + i) as f64);
        let mine: Vec<f64> = whole_values(g.rank()).collect();
        let whole = tensor::<Metax>(&mine, DType::F32, &device);
        let part: Tensor<Metax, 1> = whole.slice(64..128);
        let gathered = g.all_gather(part, &Tag::new("slice")).expect("all_gather");
        let want: Vec<f64> = (0..2).flat_map(|r| whole_values(r).skip(64).take(64)).collect();
        assert_eq!(values(gathered, DType::F32), want);
    });
}
