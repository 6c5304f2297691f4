//! Tier-3 tests: the MetaX server over the CUDA proxy on an NVIDIA GPU, checked against NdArray.
//!
//! They run only with `--features cuda-proxy` and `CUDA_PROXY_TESTS=1` at build time (see
//! `scripts/tier3-cuda-proxy.sh`); otherwise cargo lists them as ignored, with the reason.
#![cfg(feature = "cuda-proxy")]

mod gpu_checks;

use burn_metax_backend::runtime::CudaProxyPlatform;
use burn_metax_backend::{CudaProxy, CudaProxyDevice, CudaProxyRuntime};

/// The proxy device; the tests are enabled, so a missing device is a failure.
fn device() -> CudaProxyDevice {
    CudaProxyRuntime::first_device()
        .unwrap_or_else(|err| panic!("CUDA_PROXY_TESTS=1 but no CUDA device is usable: {err}"))
}

#[test]
#[cfg_attr(
    not(cuda_proxy_tests),
    ignore = "needs an NVIDIA GPU (build with --features cuda-proxy): set CUDA_PROXY_TESTS=1"
)]
fn ops_match_ndarray() {
    let device = device();
    gpu_checks::ops_match_ndarray::<CudaProxy>(&device);
}

#[test]
#[cfg_attr(
    not(cuda_proxy_tests),
    ignore = "needs an NVIDIA GPU (build with --features cuda-proxy): set CUDA_PROXY_TESTS=1"
)]
fn gradients_match_ndarray() {
    let device = device();
    gpu_checks::gradients_match_ndarray::<CudaProxy>(&device);
}

#[test]
#[cfg_attr(
    not(cuda_proxy_tests),
    ignore = "needs an NVIDIA GPU (build with --features cuda-proxy): set CUDA_PROXY_TESTS=1"
)]
fn copies_round_trip_and_streams_are_ordered() {
    let device = device();
    gpu_checks::copies_round_trip_and_streams_are_ordered::<CudaProxyPlatform>(&device);
}
