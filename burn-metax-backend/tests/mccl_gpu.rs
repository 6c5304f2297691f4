//! Tier-4 tests: `DeviceGroup` over MCCL on the `Metax` backend, on real MetaX GPUs (MACA SDK
//! and `libmccl.so` under `$MACA_PATH`): one rank driven through MCCL
//! (`communicate_at_size_one`), and one rank per GPU (`MULTI_GPU_TESTS=1`, two or more GPUs).
//! They run only when `METAX_TESTS=1` at build time; otherwise cargo lists them as ignored, with
//! the reason.

mod collective_checks;

use std::sync::Arc;
use std::time::Duration;

use burn_fsdp::comm::ProcessGroup;
use burn_metax_backend::collective::{MetaxGroup, mccl_unique_id};
use burn_metax_backend::mccl::Mccl;
use burn_metax_backend::{MacaDevice, MacaRuntime, Metax};
use collective_checks::{check_collectives, check_kernel_ordering};

const TIMEOUT: Duration = Duration::from_secs(120);

/// The first MetaX device and MCCL; the tests are enabled, so a missing one is a failure.
fn setup() -> (MacaDevice, Arc<Mccl>) {
    let device = MacaRuntime::first_device()
        .unwrap_or_else(|err| panic!("METAX_TESTS=1 but no MetaX device is usable: {err}"));
    let mccl = Mccl::load().unwrap_or_else(|err| panic!("METAX_TESTS=1 but {err}"));
    (device, Arc::new(mccl))
}

fn as_group(g: &MetaxGroup) -> &dyn ProcessGroup<Metax> {
    g
}

#[test]
#[cfg_attr(not(metax_tests), ignore = "needs a MetaX GPU and the MACA SDK (MACA_PATH): set METAX_TESTS=1")]
fn one_rank_through_mccl_matches_the_host() {
    let (device, mccl) = setup();
    let id = mccl_unique_id(&mccl).expect("unique id");
    let group =
        MetaxGroup::mccl(device, mccl, id, 0, 1, TIMEOUT).expect("group").communicate_at_size_one(true);
    check_collectives(as_group(&group), &device);
    check_kernel_ordering(as_group(&group), &device);
    group.synchronize().expect("synchronize");
}

/// One rank per visible MetaX GPU (threads of this process); needs at least two.
#[test]
#[cfg_attr(
    not(all(metax_tests, multi_gpu_tests)),
    ignore = "needs two or more MetaX GPUs: set METAX_TESTS=1 and MULTI_GPU_TESTS=1"
)]
fn one_rank_per_gpu() {
    let (_, mccl) = setup();
    let devices = MacaRuntime::devices();
    assert!(devices.len() >= 2, "MULTI_GPU_TESTS=1 but only {} MetaX device(s)", devices.len());
    let world = devices.len();
    let id = mccl_unique_id(&mccl).expect("unique id");
    std::thread::scope(|s| {
        let handles: Vec<_> = devices
            .iter()
            .enumerate()
            .map(|(rank, &device)| {
                let mccl = mccl.clone();
                s.spawn(move || {
                    let group = MetaxGroup::mccl(device, mccl, id, rank, world, TIMEOUT).expect("group");
                    check_collectives(as_group(&group), &device);
                    check_kernel_ordering(as_group(&group), &device);
                })
            })
            .collect();
        for h in handles {
            h.join().unwrap_or_else(|p| std::panic::resume_unwind(p));
        }
    });
}
