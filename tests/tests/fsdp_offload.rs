//! CPU offload: shards, gradients and AdamW state in a host store.
#![allow(clippy::unwrap_used)]

use std::time::Duration;

use burn::backend::autodiff::checkpoint::strategy::BalancedCheckpointing;
use burn::backend::{Autodiff, NdArray};
use burn::module::{Module, ModuleVisitor, Param};
use burn::tensor::{Int, Tensor, TensorData};
use burn_fsdp::offload::OffloadPolicy;
use burn_fsdp::{DeviceMesh, Fsdp, FsdpConfig, launch};
use qwen3_burn::Qwen3;
use qwen3_burn::checkpoint::SafetensorsFile;
use tests::{fixture, max_rel_diff, train_args};

type FB = Autodiff<NdArray<f32>, BalancedCheckpointing>;

fn run(extra: &[&str]) -> (Vec<f64>, Vec<f64>) {
    let m = xtask::train::run(&train_args("qwen3-tiny-a", extra)).unwrap();
    (m.iter().map(|m| m.loss).collect(), m.iter().map(|m| m.grad_norm).collect())
}

#[test]
fn offloaded_training_matches_on_device_training() {
    for extra in [
        &["--world-size", "4"][..],
        &["--world-size", "4", "--clip", "1.0", "--grad-accum", "2"],
        &["--world-size", "1"],
    ] {
        let (l0, n0) = run(extra);
        let (l1, n1) = run(&[extra, &["--offload"]].concat());
        let (dl, dn) = (max_rel_diff(&l1, &l0), max_rel_diff(&n1, &n0));
        eprintln!("{extra:?}: offload vs on-device: loss {dl:.2e}, grad norm {dn:.2e}");
        assert!(dl <= 1e-6 && dn <= 1e-6, "{extra:?}: loss {dl:e}, grad norm {dn:e}");
    }
}

#[test]
fn offloaded_checkpoints_resume_on_device_and_back() {
    let dir = tempfile::tempdir().unwrap();
    let save = dir.path().display().to_string();
    let (full, _) = run(&["--world-size", "4", "--offload", "--save-dir", &save, "--save-every", "10"]);
    let ck = dir.path().join("step-000010").display().to_string();
    let (on_device, _) = run(&["--world-size", "4", "--resume", &ck]);
    assert_eq!(on_device, full[10..].to_vec(), "offload → on-device resume is bit-identical");
    let (offloaded, _) = run(&["--world-size", "2", "--offload", "--resume", &ck]);
    assert!(max_rel_diff(&offloaded, &full[10..]) <= 1e-5);
}

/// Bytes of the module's parameter tensors (what the compute device holds between steps).
fn param_bytes<B: burn::tensor::backend::Backend, M: Module<B>>(m: &M) -> usize {
    struct Count(usize);
    impl<B: burn::tensor::backend::Backend> ModuleVisitor<B> for Count {
        fn visit_float<const D: usize>(&mut self, p: &Param<Tensor<B, D>>) {
            self.0 += 4 * p.val().shape().num_elements();
        }
    }
    let mut c = Count(0);
    m.visit(&mut c);
    c.0
}

/// Per-rank steady-state bytes (params + grads + AdamW state) against the 16Ψ/W model, and
/// what stays on the device with offload.
#[test]
fn memory_per_rank_against_16_psi_over_w() {
    let (model, config) = Qwen3::<NdArray<f32>>::load(fixture("qwen3-tiny-a"), &Default::default()).unwrap();
    let weights = model.to_hf_tensors();
    let psi = config.num_params();
    let reference = SafetensorsFile::open(fixture("qwen3-tiny-a/reference.safetensors")).unwrap();
    let (ids, shape) = reference.read_i64("input_ids").unwrap();
    for world in [1usize, 2, 4] {
        let report = launch(world, Duration::from_secs(60), |group| {
            let device = Default::default();
            let rank = group.rank();
            let mesh = DeviceMesh::new_1d(group, device);
            let replica = Qwen3::<FB>::from_weights(&config, weights.as_slice(), &device).unwrap();
            let config = FsdpConfig {
                offload: OffloadPolicy { enabled: true },
                units: qwen3_burn::parallelize::fsdp_units(),
                ..Default::default()
            };
            let mut fsdp = Fsdp::wrap(replica, &mesh, config)?;
            let rows = shape[0] / world;
            let x = Tensor::<FB, 2, Int>::from_data(
                TensorData::new(
                    ids[rank * rows * shape[1]..(rank + 1) * rows * shape[1]].to_vec(),
                    [rows, shape[1]],
                ),
                &device,
            );
            let mut adam = burn_fsdp::TorchAdamWConfig::default().init();
            // Two steps: the second measures steady state (AdamW state exists).
            let mut with_grads = Default::default();
            for _ in 0..2 {
                let loss = fsdp.forward(|m, r| m.forward_with(x.clone(), r)).mean();
                let g = fsdp.gradients(loss.backward());
                with_grads = fsdp.offloaded_bytes().unwrap();
                fsdp.step(&mut adam, g);
            }
            let after = fsdp.offloaded_bytes().unwrap();
            let largest_unit = fsdp.units().iter().map(|u| 4 * u.numel()).max().unwrap();
            Ok::<_, burn_fsdp::FsdpError>((
                with_grads,
                after,
                param_bytes(fsdp.module()),
                adam.state_len(),
                largest_unit,
            ))
        })
        .unwrap();
        let model_bytes = 16.0 * psi as f64 / world as f64;
        for (rank, (with_grads, after, device_params, device_optim, unit)) in report.into_iter().enumerate() {
            let steady = (with_grads.params + with_grads.grads + after.optimizer) as f64;
            if rank == 0 {
                eprintln!(
                    "W = {world}: host params {} + grads {} + AdamW {} = {steady} bytes per rank; 16Ψ/W = {model_bytes:.0} \
                 ({:.3}×); on device between steps: {device_params} bytes of parameters, {device_optim} optimizer \
                 states; largest unit gathered during a step: {unit} bytes",
                    with_grads.params,
                    with_grads.grads,
                    after.optimizer,
                    steady / model_bytes
                );
            }
            // Padding to equal rows makes shards slightly larger than Ψ/W, never smaller.
            assert!(steady >= model_bytes && steady <= 1.1 * model_bytes, "{steady} vs {model_bytes}");
            assert_eq!(after.grads, 0, "gradients are dropped by the step");
            assert_eq!((device_params, device_optim), (0, 0), "nothing of the model stays on the device");
        }
    }
}
