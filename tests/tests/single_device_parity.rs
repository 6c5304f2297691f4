//! Qwen3 port and single-device training against the PyTorch fixtures.
#![allow(clippy::unwrap_used)]

use burn::backend::{Autodiff, NdArray};
use burn::module::{Param, ParamId};
use burn::optim::GradientsParams;
use burn::tensor::{Tensor, TensorData};
use qwen3_burn::checkpoint::SafetensorsFile;
use tests::{fixture, max_rel_diff, reference, train_args};

type B = NdArray<f32>;
type AB = Autodiff<B>;

fn logits_rel_err(case: &str) -> f64 {
    let dir = tempfile::tempdir().unwrap();
    let out = dir.path().join("logits.safetensors");
    let args = xtask::logits::LogitsArgs {
        checkpoint: fixture(case),
        input: fixture(&format!("{case}/reference.safetensors")),
        out: out.clone(),
    };
    xtask::logits::run(&args).unwrap();
    let (got, got_shape) = SafetensorsFile::open(&out).unwrap().read_f32("logits").unwrap();
    let reference = SafetensorsFile::open(fixture(&format!("{case}/reference.safetensors"))).unwrap();
    let (want, want_shape) = reference.read_f32("logits").unwrap();
    assert_eq!(got_shape, want_shape);
    let num: f64 = got.iter().zip(&want).map(|(a, b)| ((a - b) as f64).powi(2)).sum();
    let den: f64 = want.iter().map(|b| (*b as f64).powi(2)).sum();
    (num / den).sqrt()
}

#[test]
fn logits_match_pytorch_tied_head() {
    let err = logits_rel_err("qwen3-tiny-a");
    assert!(err <= 1e-5, "‖Δ‖/‖ref‖ = {err}");
}

#[test]
fn logits_match_pytorch_untied_head_gqa3_odd_shapes() {
    let err = logits_rel_err("qwen3-tiny-b");
    assert!(err <= 1e-5, "‖Δ‖/‖ref‖ = {err}");
}

fn check_run(case: &str, reference_name: &str, extra: &[&str]) {
    let args = train_args(case, extra);
    let metrics = xtask::train::run(&args).unwrap();
    let r = reference(case, reference_name);
    let losses: Vec<f64> = metrics.iter().map(|m| m.loss).collect();
    let norms: Vec<f64> = metrics.iter().map(|m| m.grad_norm).collect();
    let (dl, dn) = (max_rel_diff(&losses, &r.losses), max_rel_diff(&norms, &r.grad_norms));
    eprintln!("{case} {reference_name}: max rel diff loss {dl:.3e}, grad norm {dn:.3e}");
    assert!(dl <= 1e-4 && dn <= 1e-4, "{case}/{reference_name}: loss {dl:e}, grad norm {dn:e}");
}

#[test]
fn single_device_training_matches_pytorch() {
    check_run("qwen3-tiny-a", "single", &["--no-fsdp", "--steps", "20"]);
}

#[test]
fn single_device_clip_and_accumulation_match_pytorch() {
    check_run("qwen3-tiny-a", "single_clip_accum", &["--no-fsdp", "--clip", "1.0", "--grad-accum", "2"]);
}

#[test]
fn single_device_untied_case_matches_pytorch() {
    check_run("qwen3-tiny-b", "single", &["--no-fsdp"]);
    check_run("qwen3-tiny-b", "single_clip_accum", &["--no-fsdp", "--clip", "1.0", "--grad-accum", "3"]);
}

#[test]
fn metrics_file_has_one_json_object_per_step() {
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("sub/metrics.jsonl");
    let p = path.display().to_string();
    let args = train_args("qwen3-tiny-a", &["--no-fsdp", "--steps", "3", "--metrics", &p]);
    xtask::train::run(&args).unwrap();
    let lines: Vec<serde_json::Value> =
        std::fs::read_to_string(&path).unwrap().lines().map(|l| serde_json::from_str(l).unwrap()).collect();
    assert_eq!(lines.len(), 3);
    for (i, l) in lines.iter().enumerate() {
        assert_eq!(l["step"].as_u64(), Some(i as u64));
        for k in ["loss", "grad_norm", "tokens_per_sec"] {
            assert!(l[k].as_f64().is_some_and(f64::is_finite), "{k} in {l}");
        }
    }
    let r = reference("qwen3-tiny-a", "single");
    assert!((lines[0]["loss"].as_f64().unwrap() - r.losses[0]).abs() / r.losses[0] < 1e-5);
}

/// `burn_fsdp::TorchAdamW` and `clip_grad_norm` against `torch.optim.AdamW` / `clip_grad_norm_`
/// (tests/fixtures/optim/make_adamw.py).
#[test]
fn adamw_and_clipping_match_pytorch_on_raw_tensors() {
    let device = Default::default();
    let f = SafetensorsFile::open(fixture("optim/adamw_reference.safetensors")).unwrap();
    let t = |name: &str| -> Tensor<AB, 1> {
        let (v, _) = f.read_f32(name).unwrap();
        let n = v.len();
        Tensor::from_data(TensorData::new(v, [n]), &device)
    };
    let keys = ["a", "b", "c"];
    let mut params: Vec<Param<Tensor<AB, 1>>> = keys
        .iter()
        .map(|k| Param::initialized(ParamId::new(), t(&format!("init.{k}")).require_grad()))
        .collect();
    let mut adam =
        burn_fsdp::TorchAdamWConfig { lr: 0.01, betas: (0.9, 0.95), eps: 1e-8, weight_decay: 0.1 }.init();
    for step in 0..3 {
        let mut grads = GradientsParams::new();
        for (p, k) in params.iter().zip(keys) {
            grads.register(p.id, t(&format!("grad{step}.{k}")).inner());
        }
        params = adam.step(params, grads);
        for (p, k) in params.iter().zip(keys) {
            let got = p.val().into_data().to_vec::<f32>().unwrap();
            let want = f.read_f32(&format!("param{step}.{k}")).unwrap().0;
            for (g, w) in got.iter().zip(&want) {
                assert!((g - w).abs() <= 1e-6 * w.abs().max(1e-3), "step {step} {k}: {g} vs {w}");
            }
        }
    }
    // Global-norm clipping of three tensors at once.
    let module: Vec<Param<Tensor<AB, 1>>> = params;
    let mut grads = GradientsParams::new();
    for (p, k) in module.iter().zip(keys) {
        grads.register(p.id, t(&format!("clipgrad.{k}")).inner());
    }
    let norm = burn_fsdp::clip_grad_norm(&module, &mut grads, 1.0);
    let want_norm = f.read_f32("clip.norm").unwrap().0[0] as f64;
    assert!((norm - want_norm).abs() / want_norm < 1e-6, "{norm} vs {want_norm}");
    for (p, k) in module.iter().zip(keys) {
        let got = grads.get::<B, 1>(p.id).unwrap().into_data().to_vec::<f32>().unwrap();
        let want = f.read_f32(&format!("clipped.{k}")).unwrap().0;
        for (g, w) in got.iter().zip(&want) {
            assert!((g - w).abs() <= 1e-6 * w.abs().max(1e-3), "clipped {k}: {g} vs {w}");
        }
    }
}
