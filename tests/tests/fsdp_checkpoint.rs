//! Sharded checkpoints: resume at the same and other world sizes, consolidated export,
//! and bad input.
#![allow(clippy::unwrap_used)]

use std::path::Path;
use std::time::Duration;

use burn::backend::autodiff::checkpoint::strategy::BalancedCheckpointing;
use burn::backend::{Autodiff, NdArray};
use burn::tensor::{Int, Tensor, TensorData};
use burn_fsdp::UnitPolicy;
use burn_fsdp::checkpoint::{INDEX_FILE, rank_file, read_index};
use burn_fsdp::{DeviceMesh, Fsdp, FsdpConfig, launch};
use qwen3_burn::checkpoint::SafetensorsFile;
use qwen3_burn::{Qwen3, Qwen3Config};
use tests::{fixture, max_rel_diff, train_args};

type FB = Autodiff<NdArray<f32>, BalancedCheckpointing>;

fn path(p: &Path) -> String {
    p.display().to_string()
}

fn losses(case: &str, extra: &[&str]) -> Vec<(usize, f64, f64)> {
    xtask::train::run(&train_args(case, extra))
        .unwrap()
        .iter()
        .map(|m| (m.step, m.loss, m.grad_norm))
        .collect()
}

fn err(case: &str, extra: &[&str]) -> String {
    format!("{:#}", xtask::train::run(&train_args(case, extra)).unwrap_err())
}

#[test]
fn resume_reproduces_the_uninterrupted_run_at_the_same_and_other_world_sizes() {
    let dir = tempfile::tempdir().unwrap();
    let save = path(dir.path());
    let full = losses("qwen3-tiny-a", &["--world-size", "4", "--save-dir", &save, "--save-every", "10"]);
    assert_eq!(full.len(), 20);
    let ckpt = dir.path().join("step-000010");
    let index = read_index(&ckpt).unwrap();
    assert_eq!((index.step, index.world_size), (10, 4));
    // Per-rank files hold only their own rows.
    for r in 0..4 {
        let f = SafetensorsFile::open(ckpt.join(rank_file(r, 4))).unwrap();
        let (shape, _) = f.info("param/model.layers.0.mlp.gate_proj.weight").unwrap();
        assert_eq!(shape, vec![32, 64], "rank {r} holds 128/4 rows");
        let (shape, _) = f.info("exp_avg/model.embed_tokens.weight").unwrap();
        assert_eq!(shape, vec![64, 64]);
    }
    let tail: Vec<_> = full[10..].to_vec();
    let ck = path(&ckpt);
    let same = losses("qwen3-tiny-a", &["--world-size", "4", "--resume", &ck]);
    assert_eq!(same, tail, "resuming at the same world size is bit-identical");
    for w in ["2", "1", "8"] {
        let other = losses("qwen3-tiny-a", &["--world-size", w, "--resume", &ck]);
        assert_eq!(other.iter().map(|m| m.0).collect::<Vec<_>>(), (10..20).collect::<Vec<_>>());
        let d = max_rel_diff(
            &other.iter().map(|m| m.1).collect::<Vec<_>>(),
            &tail.iter().map(|m| m.1).collect::<Vec<_>>(),
        );
        assert!(d <= 1e-5, "W = {w}: loss differs by {d:e}");
    }
}

#[test]
fn untied_checkpoint_reshards_from_4_to_3_and_6() {
    let dir = tempfile::tempdir().unwrap();
    let save = path(dir.path());
    let full = losses("qwen3-tiny-b", &["--world-size", "4", "--save-dir", &save, "--save-every", "6"]);
    let ck = path(&dir.path().join("step-000006"));
    for w in ["3", "6"] {
        let other = losses("qwen3-tiny-b", &["--world-size", w, "--resume", &ck, "--clip", "0"]);
        let d = max_rel_diff(
            &other.iter().map(|m| m.1).collect::<Vec<_>>(),
            &full[6..].iter().map(|m| m.1).collect::<Vec<_>>(),
        );
        assert!(d <= 1e-5, "W = {w}: {d:e}");
    }
}

/// The consolidated export gives the logits of the live FSDP model.
#[test]
fn consolidated_export_matches_the_live_fsdp_model() {
    let dir = tempfile::tempdir().unwrap();
    let (model, config) = Qwen3::<NdArray<f32>>::load(fixture("qwen3-tiny-a"), &Default::default()).unwrap();
    let weights = model.to_hf_tensors();
    let reference = SafetensorsFile::open(fixture("qwen3-tiny-a/reference.safetensors")).unwrap();
    let (ids, shape) = reference.read_i64("input_ids").unwrap();
    let out = dir.path().join("hf");
    let live = launch(4, Duration::from_secs(60), |group| {
        let device = Default::default();
        let replica = Qwen3::<FB>::from_weights(&config, weights.as_slice(), &device).unwrap();
        let mesh = DeviceMesh::new_1d(group.clone(), device);
        let mut fsdp = Fsdp::wrap(
            replica,
            &mesh,
            FsdpConfig { units: UnitPolicy::VecElements, ..FsdpConfig::default() },
        )?;
        // A few steps, so the export is not just the input checkpoint.
        let mut adam = burn_fsdp::TorchAdamWConfig { lr: 0.01, ..Default::default() }.init();
        let x = Tensor::<FB, 2, Int>::from_data(TensorData::new(ids.clone(), [shape[0], shape[1]]), &device);
        for _ in 0..2 {
            let loss = fsdp.forward(|m, r| m.forward_with(x.clone(), r)).mean();
            let g = fsdp.gradients(loss.backward());
            fsdp.step(&mut adam, g);
        }
        let logits = fsdp.forward(|m, r| m.forward_with(x.clone(), r));
        let params = fsdp.full_parameters()?;
        if group.rank() == 0 {
            xtask::train::export_hf(&config, params, &out).unwrap();
        }
        Ok::<_, burn_fsdp::FsdpError>(logits.into_data().to_vec::<f32>().unwrap())
    })
    .unwrap()
    .remove(0);
    let args = xtask::logits::LogitsArgs {
        checkpoint: out.clone(),
        input: fixture("qwen3-tiny-a/reference.safetensors"),
        out: dir.path().join("logits.safetensors"),
    };
    xtask::logits::run(&args).unwrap();
    let (exported, _) = SafetensorsFile::open(&args.out).unwrap().read_f32("logits").unwrap();
    let num: f64 = exported.iter().zip(&live).map(|(a, b)| ((a - b) as f64).powi(2)).sum();
    let den: f64 = live.iter().map(|b| (*b as f64).powi(2)).sum();
    assert!((num / den).sqrt() < 1e-6, "‖Δ‖/‖live‖ = {:e}", (num / den).sqrt());
    // The model did change: the exported logits are not the original checkpoint's.
    let (orig, _) = reference.read_f32("logits").unwrap();
    assert!(orig.iter().zip(&exported).any(|(a, b)| (a - b).abs() > 1e-3));
}

#[test]
fn consolidate_command_writes_a_loadable_hf_checkpoint() {
    let dir = tempfile::tempdir().unwrap();
    let save = path(dir.path());
    let export = dir.path().join("export");
    let full = xtask::train::run(&train_args(
        "qwen3-tiny-a",
        &["--world-size", "2", "--steps", "3", "--save-dir", &save, "--export", &path(&export)],
    ))
    .unwrap();
    assert_eq!(full.len(), 3);
    let cons = dir.path().join("cons");
    xtask::consolidate::run(&xtask::consolidate::ConsolidateArgs {
        sharded: dir.path().join("step-000003"),
        out: cons.clone(),
    })
    .unwrap();
    let (a, ca) = Qwen3::<NdArray<f32>>::load(&cons, &Default::default()).unwrap();
    let (b, cb) = Qwen3::<NdArray<f32>>::load(&export, &Default::default()).unwrap();
    assert_eq!(ca, cb);
    assert_eq!(ca, Qwen3Config::from_file(fixture("qwen3-tiny-a/config.json")).unwrap());
    for ((na, ta), (nb, tb)) in a.to_hf_tensors().iter().zip(b.to_hf_tensors().iter()) {
        assert_eq!(na, nb);
        assert!(format!("{ta:?}") == format!("{tb:?}"), "{na} differs");
    }
}

fn saved_checkpoint() -> (tempfile::TempDir, std::path::PathBuf) {
    let dir = tempfile::tempdir().unwrap();
    let save = path(dir.path());
    xtask::train::run(&train_args(
        "qwen3-tiny-a",
        &["--world-size", "2", "--steps", "2", "--save-dir", &save],
    ))
    .unwrap();
    let ck = dir.path().join("step-000002");
    (dir, ck)
}

#[test]
fn truncated_or_missing_shard_files_are_named() {
    let (_d, ck) = saved_checkpoint();
    let file = ck.join(rank_file(1, 2));
    let bytes = std::fs::read(&file).unwrap();
    std::fs::write(&file, &bytes[..bytes.len() / 2]).unwrap();
    let e = err("qwen3-tiny-a", &["--world-size", "2", "--resume", &path(&ck)]);
    assert!(e.contains("rank-00001-of-00002.safetensors") && e.contains("truncated"), "{e}");
    std::fs::remove_file(&file).unwrap();
    let e = err("qwen3-tiny-a", &["--world-size", "2", "--resume", &path(&ck)]);
    assert!(e.contains("rank-00001-of-00002.safetensors"), "{e}");
}

#[test]
fn a_shard_corrupted_in_place_is_refused_by_resume_and_consolidate() {
    let (d, ck) = saved_checkpoint();
    let index = read_index(&ck).unwrap();
    assert!(index.files.iter().all(|f| f.xxh3.as_ref().is_some_and(|h| h.len() == 16)), "{:?}", index.files);
    // Flip one bit of a weight in the middle of rank 1's file: same size, still valid
    // safetensors, different numbers.
    let file = ck.join(rank_file(1, 2));
    let mut bytes = std::fs::read(&file).unwrap();
    let mid = bytes.len() / 2;
    bytes[mid] ^= 0x40;
    std::fs::write(&file, &bytes).unwrap();
    let e = err("qwen3-tiny-a", &["--world-size", "2", "--resume", &path(&ck)]);
    assert!(e.contains("rank-00001-of-00002.safetensors") && e.contains("checksum"), "{e}");
    let e = xtask::consolidate::run(&xtask::consolidate::ConsolidateArgs {
        sharded: ck.clone(),
        out: d.path().join("cons"),
    })
    .unwrap_err();
    let e = format!("{e:#}");
    assert!(e.contains("rank-00001-of-00002.safetensors") && e.contains("checksum"), "{e}");
    assert!(!d.path().join("cons").join("model.safetensors").exists());
}

#[test]
fn a_save_without_index_never_loads() {
    let (_d, ck) = saved_checkpoint();
    std::fs::remove_file(ck.join(INDEX_FILE)).unwrap();
    let e = err("qwen3-tiny-a", &["--world-size", "2", "--resume", &path(&ck)]);
    assert!(e.contains("step-000002"), "{e}");
}

#[test]
fn index_and_shards_that_disagree_are_refused() {
    let (_d, ck) = saved_checkpoint();
    let index_path = ck.join(INDEX_FILE);
    let text = std::fs::read_to_string(&index_path).unwrap();
    let mut v: serde_json::Value = serde_json::from_str(&text).unwrap();
    // Claim rank 0 holds one row fewer of the first parameter than it does.
    v["params"][0]["rows"][0][1] = serde_json::json!(127);
    v["params"][0]["rows"][1][0] = serde_json::json!(127);
    std::fs::write(&index_path, v.to_string()).unwrap();
    let e = err("qwen3-tiny-a", &["--world-size", "2", "--resume", &path(&ck)]);
    assert!(e.contains("rank-00000-of-00002.safetensors") && e.contains("model.embed_tokens.weight"), "{e}");
    std::fs::write(&index_path, "{ not json").unwrap();
    let e = err("qwen3-tiny-a", &["--world-size", "2", "--resume", &path(&ck)]);
    assert!(e.contains("index.json") && e.contains("malformed"), "{e}");
}

#[test]
fn a_checkpoint_of_another_model_is_refused_and_nothing_is_half_loaded() {
    let (_d, ck) = saved_checkpoint();
    // tiny-b's model with tiny-a's checkpoint.
    let e = err("qwen3-tiny-b", &["--world-size", "2", "--resume", &path(&ck)]);
    assert!(e.contains("qwen3-tiny-b is another model than the one saved in --resume"), "{e}");
    assert!(e.contains("given vs saved:") && e.contains("hidden_size"), "names the difference: {e}");
    // Direct API: a failed load leaves the shards untouched.
    let (model, config) = Qwen3::<NdArray<f32>>::load(fixture("qwen3-tiny-a"), &Default::default()).unwrap();
    let weights = model.to_hf_tensors();
    launch(2, Duration::from_secs(60), |group| {
        let device = Default::default();
        let mesh = DeviceMesh::new_1d(group, device);
        let replica = Qwen3::<FB>::from_weights(&config, weights.as_slice(), &device).unwrap();
        let mut fsdp = Fsdp::wrap(
            replica,
            &mesh,
            FsdpConfig { units: UnitPolicy::VecElements, ..FsdpConfig::default() },
        )?;
        let before = fsdp.module().model.norm.weight.val().into_data();
        let mut adam = burn_fsdp::TorchAdamWConfig::default().init();
        let mut wrong = serde_json::to_value(&config).unwrap();
        wrong["rms_norm_eps"] = serde_json::json!(1e-5);
        assert!(fsdp.load_sharded(&ck, &mut adam, &wrong).is_err());
        assert_eq!(fsdp.module().model.norm.weight.val().into_data(), before);
        assert_eq!(adam.state_len(), 0);
        // The right config loads, and changes the model.
        fsdp.load_sharded(&ck, &mut adam, &serde_json::to_value(&config).unwrap()).unwrap();
        assert!(adam.state_len() > 0);
        Ok::<_, burn_fsdp::FsdpError>(())
    })
    .unwrap();
}

#[test]
fn resume_flag_checks() {
    let (_d, ck) = saved_checkpoint();
    let e = err("qwen3-tiny-a", &["--no-fsdp", "--resume", &path(&ck)]);
    assert!(e.contains("--no-fsdp"), "{e}");
    let e = err("qwen3-tiny-a", &["--world-size", "2", "--steps", "2", "--resume", &path(&ck)]);
    assert!(e.contains("nothing left"), "{e}");
    let e = tests::parse_train(&["train-qwen3", "--save-every", "3"]).unwrap_err();
    assert!(e.contains("--save-dir"), "{e}");
    let e = err("qwen3-tiny-a", &["--world-size", "2", "--resume", "/nonexistent/ckpt"]);
    assert!(e.contains("/nonexistent/ckpt"), "{e}");
}

/// `--export` puts the tokenizer beside the exported model (the input checkpoint's), so that
/// `generate` on the export uses it rather than falling back to another one.
#[test]
fn export_carries_the_checkpoints_tokenizer() {
    let dir = tempfile::tempdir().unwrap();
    let checkpoint = dir.path().join("with-tokenizer");
    std::fs::create_dir_all(&checkpoint).unwrap();
    for f in ["config.json", "model.safetensors"] {
        std::fs::copy(fixture(&format!("qwen3-tiny-a/{f}")), checkpoint.join(f)).unwrap();
    }
    let tokenizer = fixture("qwen3-tokenizer/tokenizer.json");
    std::fs::copy(&tokenizer, checkpoint.join("tokenizer.json")).unwrap();
    let export = dir.path().join("export");
    let mut args =
        train_args("qwen3-tiny-a", &["--world-size", "2", "--steps", "1", "--export", &path(&export)]);
    args.checkpoint = Some(checkpoint);
    xtask::train::run(&args).unwrap();
    let copied = std::fs::read(export.join("tokenizer.json")).unwrap();
    assert_eq!(copied, std::fs::read(&tokenizer).unwrap(), "the export's tokenizer is the checkpoint's");
    assert!(export.join("model.safetensors").is_file());
}
