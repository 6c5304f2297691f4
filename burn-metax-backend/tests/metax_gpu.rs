//! Tier-4 tests: the `Metax` backend on a real MetaX GPU (MACA SDK under `$MACA_PATH`), checked
//! against NdArray. They run only with `METAX_TESTS=1`; otherwise each test prints why it is
//! skipped and passes. See `docs/metax-install.md`.

mod gpu_checks;

use burn_metax_backend::runtime::MacaPlatform;
use burn_metax_backend::{MacaDevice, MacaRuntime, Metax};

/// The MetaX device, or `None` (with the reason printed) when the tests are not enabled.
fn device() -> Option<MacaDevice> {
    if std::env::var("METAX_TESTS").as_deref() != Ok("1") {
        eprintln!("skipped: set METAX_TESTS=1 on a MetaX host with the MACA SDK (MACA_PATH)");
        return None;
    }
    match MacaRuntime::first_device() {
        Ok(device) => Some(device),
        Err(err) => panic!("METAX_TESTS=1 but no MetaX device is usable: {err}"),
    }
}

#[test]
fn device_reports_64_lane_waves() {
    let Some(device) = device() else { return };
    let props = MacaRuntime::check_device(&device).expect("device");
    eprintln!("{props:?}");
    assert_eq!(props.warp_size, 64, "C500-class GPUs run 64-lane waves");
}

#[test]
fn ops_match_ndarray() {
    let Some(device) = device() else { return };
    gpu_checks::ops_match_ndarray::<Metax>(&device);
}

#[test]
fn gradients_match_ndarray() {
    let Some(device) = device() else { return };
    gpu_checks::gradients_match_ndarray::<Metax>(&device);
}

#[test]
fn copies_round_trip_and_streams_are_ordered() {
    let Some(device) = device() else { return };
    gpu_checks::copies_round_trip_and_streams_are_ordered::<MacaPlatform>(&device);
}
