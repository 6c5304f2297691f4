//! Tier-4 tests: the `Metax` backend on a real MetaX GPU (MACA SDK under `$MACA_PATH`), checked
//! against NdArray. They run only when `METAX_TESTS=1` at build time; otherwise cargo lists them as
//! ignored, with the reason. See `docs/metax-install.md`.

mod gpu_checks;

use burn_metax_backend::runtime::MacaPlatform;
use burn_metax_backend::{MacaDevice, MacaRuntime, Metax};

/// The MetaX device; the tests are enabled, so a missing device is a failure.
fn device() -> MacaDevice {
    MacaRuntime::first_device()
        .unwrap_or_else(|err| panic!("METAX_TESTS=1 but no MetaX device is usable: {err}"))
}

#[test]
#[cfg_attr(not(metax_tests), ignore = "needs a MetaX GPU and the MACA SDK (MACA_PATH): set METAX_TESTS=1")]
fn device_reports_64_lane_waves() {
    let device = device();
    let props = MacaRuntime::check_device(&device).expect("device");
    eprintln!("{props:?}");
    assert_eq!(props.warp_size, 64, "C500-class GPUs run 64-lane waves");
}

#[test]
#[cfg_attr(not(metax_tests), ignore = "needs a MetaX GPU and the MACA SDK (MACA_PATH): set METAX_TESTS=1")]
fn ops_match_ndarray() {
    let device = device();
    gpu_checks::ops_match_ndarray::<Metax>(&device);
}

#[test]
#[cfg_attr(not(metax_tests), ignore = "needs a MetaX GPU and the MACA SDK (MACA_PATH): set METAX_TESTS=1")]
fn gradients_match_ndarray() {
    let device = device();
    gpu_checks::gradients_match_ndarray::<Metax>(&device);
}

#[test]
#[cfg_attr(not(metax_tests), ignore = "needs a MetaX GPU and the MACA SDK (MACA_PATH): set METAX_TESTS=1")]
fn copies_round_trip_and_streams_are_ordered() {
    let device = device();
    gpu_checks::copies_round_trip_and_streams_are_ordered::<MacaPlatform>(&device);
}
