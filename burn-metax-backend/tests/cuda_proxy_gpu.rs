//! Tier-3 tests: the MetaX server over the CUDA proxy on an NVIDIA GPU, checked against NdArray.
//!
//! They run only with `--features cuda-proxy` and `CUDA_PROXY_TESTS=1` (see
//! `scripts/tier3-cuda-proxy.sh`); otherwise each test prints why it is skipped and passes.
#![cfg(feature = "cuda-proxy")]

mod gpu_checks;

use burn_metax_backend::runtime::CudaProxyPlatform;
use burn_metax_backend::{CudaProxy, CudaProxyDevice, CudaProxyRuntime};

/// The proxy device, or `None` (with the reason printed) when the tests are not enabled.
fn device() -> Option<CudaProxyDevice> {
    if std::env::var("CUDA_PROXY_TESTS").as_deref() != Ok("1") {
        eprintln!(
            "skipped: set CUDA_PROXY_TESTS=1 (and build with --features cuda-proxy) on an NVIDIA GPU machine"
        );
        return None;
    }
    match CudaProxyRuntime::first_device() {
        Ok(device) => Some(device),
        Err(err) => panic!("CUDA_PROXY_TESTS=1 but no CUDA device is usable: {err}"),
    }
}

#[test]
fn ops_match_ndarray() {
    let Some(device) = device() else { return };
    gpu_checks::ops_match_ndarray::<CudaProxy>(&device);
}

#[test]
fn gradients_match_ndarray() {
    let Some(device) = device() else { return };
    gpu_checks::gradients_match_ndarray::<CudaProxy>(&device);
}

#[test]
fn copies_round_trip_and_streams_are_ordered() {
    let Some(device) = device() else { return };
    gpu_checks::copies_round_trip_and_streams_are_ordered::<CudaProxyPlatform>(&device);
}
