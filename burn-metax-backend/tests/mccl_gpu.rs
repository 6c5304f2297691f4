//! Tier-4 tests: `DeviceGroup` over MCCL on the `Metax` backend, on real MetaX GPUs (MACA SDK
//! and `libmccl.so` under `$MACA_PATH`): one rank driven through MCCL
//! (`communicate_at_size_one`), and one rank per GPU when there are several. They run only with
//! `METAX_TESTS=1`; otherwise each test prints why it is skipped and passes.

mod collective_checks;

use std::sync::Arc;
use std::time::Duration;

use burn_fsdp::comm::ProcessGroup;
use burn_metax_backend::collective::{MetaxGroup, mccl_unique_id};
use burn_metax_backend::mccl::Mccl;
use burn_metax_backend::{MacaDevice, MacaRuntime, Metax};
use collective_checks::{check_collectives, check_kernel_ordering};

const TIMEOUT: Duration = Duration::from_secs(120);

/// The first MetaX device and MCCL, or `None` (with the reason printed) when not enabled.
fn setup() -> Option<(MacaDevice, Arc<Mccl>)> {
    if std::env::var("METAX_TESTS").as_deref() != Ok("1") {
        eprintln!("skipped: set METAX_TESTS=1 on a MetaX host with the MACA SDK and MCCL (MACA_PATH)");
        return None;
    }
    let device = MacaRuntime::first_device()
        .unwrap_or_else(|err| panic!("METAX_TESTS=1 but no MetaX device is usable: {err}"));
    let mccl = Mccl::load().unwrap_or_else(|err| panic!("METAX_TESTS=1 but {err}"));
    Some((device, Arc::new(mccl)))
}

fn as_group(g: &MetaxGroup) -> &dyn ProcessGroup<Metax> {
    g
}

#[test]
fn one_rank_through_mccl_matches_the_host() {
    let Some((device, mccl)) = setup() else { return };
    let id = mccl_unique_id(&mccl).expect("unique id");
    let group =
        MetaxGroup::mccl(device, mccl, id, 0, 1, TIMEOUT).expect("group").communicate_at_size_one(true);
    check_collectives(as_group(&group), &device);
    check_kernel_ordering(as_group(&group), &device);
    group.synchronize().expect("synchronize");
}

/// One rank per visible MetaX GPU (threads of this process), when there are at least two.
#[test]
fn one_rank_per_gpu() {
    let Some((_, mccl)) = setup() else { return };
    let devices = MacaRuntime::devices();
    if devices.len() < 2 {
        eprintln!("skipped: {} MetaX device(s), two or more needed", devices.len());
        return;
    }
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
