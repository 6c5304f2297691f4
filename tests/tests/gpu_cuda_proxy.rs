//! Tier 3 (NVIDIA GPU): Qwen3 FSDP training steps on the MetaX runtime's CUDA proxy.
//!
//! Runs only with `--features cuda-proxy` and `CUDA_PROXY_TESTS=1` on a machine with an NVIDIA
//! driver (`burn-metax-backend/scripts/tier3-cuda-proxy.sh` does both); elsewhere cargo lists it
//! as ignored, with the reason.
#![cfg(feature = "cuda-proxy")]
#![allow(clippy::unwrap_used)]

use tests::{max_rel_diff, reference, train_args};

#[test]
#[cfg_attr(not(cuda_proxy_tests), ignore = "needs an NVIDIA GPU: set CUDA_PROXY_TESTS=1")]
fn qwen3_fsdp_steps_on_the_cuda_proxy_reproduce_pytorch() {
    if let Err(e) = burn_metax_backend::CudaProxyRuntime::first_device() {
        panic!("CUDA_PROXY_TESTS=1 but no CUDA device: {e}");
    }
    let steps = 5;
    let args = train_args("qwen3-tiny-a", &["--world-size", "2", "--steps", "5"]);
    let setup = xtask::train::setup(&args).unwrap();
    let sink = xtask::train::MetricsSink::new(None, true).unwrap();
    let metrics = xtask::train::train_fsdp::<burn_metax_backend::CudaProxy>(&args, setup, &sink).unwrap();
    let r = reference("qwen3-tiny-a", "single");
    let losses: Vec<f64> = metrics.iter().map(|m| m.loss).collect();
    let norms: Vec<f64> = metrics.iter().map(|m| m.grad_norm).collect();
    let (dl, dn) = (max_rel_diff(&losses, &r.losses[..steps]), max_rel_diff(&norms, &r.grad_norms[..steps]));
    println!("cuda-proxy FSDP W=2, {steps} steps vs single.json: loss {dl:.2e}, grad norm {dn:.2e}");
    // f32 on a GPU: reduction order and (if enabled) TF32 matmuls differ from the CPU.
    assert!(dl < 1e-3 && dn < 1e-2, "loss {dl:e}, grad norm {dn:e}");
}
