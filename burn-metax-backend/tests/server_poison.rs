//! Tier-2 test: a sticky error (illegal address) in a launch poisons the device; every later
//! operation on it fails with a "poisoned" error. Its own test binary, because poisoning is
//! process-wide (the driver is shared by every client of the device).

mod common;

use burn::tensor::{Tensor, TensorData};
use burn_metax_backend::driver::{Driver, DriverError, MacaError};
use burn_metax_backend::runtime::{BackendError, maca_driver};
use burn_metax_backend::{MacaDevice, MacaRuntime, Metax};
use common::{Control, install_mock_runtime};

#[test]
fn a_sticky_launch_error_poisons_the_device() {
    install_mock_runtime();
    let control = Control::open();
    let device = MacaDevice::new(0);
    let client = MacaRuntime::try_client(&device).expect("client");
    let handle = client.create_from_slice(&[1, 2, 3]);
    assert_eq!(&client.read_one(handle.clone()).expect("healthy read")[..], &[1, 2, 3]);

    control.inject_global("mcModuleLaunchKernel", MacaError::ILLEGAL_ADDRESS.code(), 0, 1);
    let x = Tensor::<Metax, 1>::from_data(TensorData::from([1.0f32, 2.0]), &device);
    let err = (x.clone() + x).try_into_data().expect_err("the launch failed");
    let message = format!("{err:?}");
    assert!(message.contains("mcErrorIllegalAddress"), "{message}");

    // The driver remembers the sticky error for device 0 ...
    let driver = maca_driver().expect("driver");
    match driver.poisoned(0) {
        Some(DriverError::Poisoned { device: 0, call: "mcModuleLaunchKernel", error }) => {
            assert_eq!(error, MacaError::ILLEGAL_ADDRESS)
        }
        other => panic!("device not poisoned: {other:?}"),
    }
    // ... the runtime refuses the device ...
    match MacaRuntime::check_device(&device) {
        Err(BackendError::Driver { index: 0, error: DriverError::Poisoned { .. }, .. }) => {}
        other => panic!("expected a poisoned-device error, got {other:?}"),
    }
    // ... and later operations fail instead of reaching the runtime.
    let err = client.read_one(handle).expect_err("read on a poisoned device");
    assert!(format!("{err:?}").contains("poisoned"), "{err:?}");
    control.clear_global();
}
