//! Tier-2 test: without a MACA SDK, device enumeration returns nothing and asking for a device
//! gives an error naming the library looked for and `MACA_PATH`. Its own test binary: it points
//! `MACA_PATH` at an empty directory before the process-wide driver is loaded.

use burn_metax_backend::runtime::BackendError;
use burn_metax_backend::{MacaDevice, MacaRuntime};

#[test]
fn no_sdk_means_no_device_and_a_clear_error() {
    let empty = tempfile::tempdir().expect("temp dir");
    let root = empty.path().join("maca");
    // SAFETY: this binary holds this single test, and nothing else in the process reads or
    // writes the environment while it runs.
    unsafe { std::env::set_var("MACA_PATH", &root) };

    assert!(MacaRuntime::devices().is_empty());
    let err = MacaRuntime::first_device().expect_err("no SDK");
    let message = err.to_string();
    assert!(matches!(err, BackendError::Unavailable { platform: "metax", .. }), "{err:?}");
    let expected =
        format!("libmcruntime.so not found under {}/lib (MACA_PATH={})", root.display(), root.display());
    assert!(message.contains(&expected), "{message}");
    assert!(message.starts_with("no metax device available: "), "{message}");
    assert!(MacaRuntime::try_client(&MacaDevice::new(0)).is_err());
}
