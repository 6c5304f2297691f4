//! Qwen3 FSDP over in-process ranks on a **fused** CubeCL backend — what `train-qwen3 --device
//! cuda` runs on Burn's CUDA backend (`burn_cuda::Cuda` = `Fusion<CubeBackend<…>>`, every rank
//! on one device), here on the emulated MetaX device under the same fusion
//! (`MetaxEmuFused`), so it runs without a GPU. Feature `burn-cuda` (the fused backends).
#![cfg(feature = "burn-cuda")]
#![allow(clippy::unwrap_used)]

use burn_metax_backend::{MetaxEmuDevice, MetaxEmuFused};
use tests::{max_rel_diff, reference, train_args};

#[test]
fn fsdp_w4_on_one_fused_device_reproduces_pytorch() {
    let steps = 3;
    let args = train_args("qwen3-tiny-a", &["--world-size", "4", "--steps", "3"]);
    let setup = xtask::train::setup(&args).unwrap();
    let sink = xtask::train::MetricsSink::new(None, true).unwrap();
    let t = std::time::Instant::now();
    let metrics =
        xtask::train::train_fsdp_on::<MetaxEmuFused<f32>>(&args, setup, &sink, |_| MetaxEmuDevice::new(0))
            .unwrap();
    let r = reference("qwen3-tiny-a", "fsdp4");
    let losses: Vec<f64> = metrics.iter().map(|m| m.loss).collect();
    let norms: Vec<f64> = metrics.iter().map(|m| m.grad_norm).collect();
    let (dl, dn) = (max_rel_diff(&losses, &r.losses[..steps]), max_rel_diff(&norms, &r.grad_norms[..steps]));
    println!(
        "fused emu FSDP W=4, {steps} steps in {:.1} s: loss {dl:.2e}, grad norm {dn:.2e}",
        t.elapsed().as_secs_f64()
    );
    assert!(dl < 1e-4 && dn < 1e-4, "loss {dl:e}, grad norm {dn:e}");
}
