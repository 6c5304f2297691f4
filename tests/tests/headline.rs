//! `cargo xtask headline`'s comparison, on the tiny-a fixture and its PyTorch FSDP2 trajectory
//! (no Python needed: `--skip-torch` with the fixture's `fsdp4.json` as `torch_fsdp4.json`).
#![allow(clippy::unwrap_used)]

use std::path::Path;

use xtask::headline::{HeadlineArgs, Stage, run};

fn args(dir: &Path) -> HeadlineArgs {
    HeadlineArgs {
        dir: dir.to_path_buf(),
        preset: "tiny".into(),
        world_size: 4,
        batch: 2,
        seq: 32,
        steps: 20,
        lr: 3e-3,
        seed: 0,
        python: "python-that-must-not-run".into(),
        skip_torch: true,
        only: None,
    }
}

fn fixture_dir(torch: Option<&str>) -> tempfile::TempDir {
    let dir = tempfile::tempdir().unwrap();
    for f in ["config.json", "model.safetensors", "batches.safetensors"] {
        std::fs::copy(tests::fixture(&format!("qwen3-tiny-a/{f}")), dir.path().join(f)).unwrap();
    }
    if let Some(json) = torch {
        std::fs::write(dir.path().join("torch_fsdp4.json"), json).unwrap();
    }
    dir
}

#[test]
fn headline_reports_burn_fsdp_against_pytorch_fsdp2_and_single_device() {
    let torch = std::fs::read_to_string(tests::fixture("qwen3-tiny-a/fsdp4.json")).unwrap();
    let dir = fixture_dir(Some(&torch));
    let report = run(&args(dir.path())).unwrap().unwrap();
    assert_eq!(report.rows.len(), 20);
    let vs_torch = report.vs_torch.unwrap();
    assert!(vs_torch <= 1e-5, "vs PyTorch FSDP2: {vs_torch:e}");
    assert!(report.vs_single <= 1e-5, "vs single device: {:e}", report.vs_single);
    let text = std::fs::read_to_string(dir.path().join("report.txt")).unwrap();
    assert!(text.contains("burn FSDP vs PyTorch FSDP2"), "{text}");
    assert!(dir.path().join("burn_fsdp/metrics.jsonl").is_file());

    // The comparison can fail: PyTorch's step 7 loss moved by 1e-4 relative.
    let mut v: serde_json::Value = serde_json::from_str(&torch).unwrap();
    let l = v["losses"][7].as_f64().unwrap();
    v["losses"][7] = serde_json::json!(l * (1.0 + 1e-4));
    let dir = fixture_dir(Some(&v.to_string()));
    let worse = run(&args(dir.path())).unwrap().unwrap().vs_torch.unwrap();
    assert!(worse > 9e-5, "{worse:e}");
}

#[test]
fn headline_stages_run_one_at_a_time_and_a_finished_stage_is_read_back() {
    let torch = std::fs::read_to_string(tests::fixture("qwen3-tiny-a/fsdp4.json")).unwrap();
    let dir = fixture_dir(Some(&torch));
    let only = |stage| HeadlineArgs { only: Some(stage), ..args(dir.path()) };
    assert!(run(&only(Stage::Fsdp)).unwrap().is_none(), "no report before the single-device stage");
    assert!(dir.path().join("burn_fsdp.json").is_file());
    assert!(!dir.path().join("burn_single.json").exists());
    let report = run(&only(Stage::Single)).unwrap().unwrap();
    assert!(report.vs_single <= 1e-5 && report.vs_torch.unwrap() <= 1e-5, "{report:?}");
    let timings: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(dir.path().join("timings.json")).unwrap()).unwrap();
    assert!(timings["burn_fsdp.json"].as_f64().unwrap() > 0.0, "{timings}");

    // A finished stage is not run again: its file is what the report compares.
    let path = dir.path().join("burn_fsdp.json");
    let mut v: serde_json::Value = serde_json::from_str(&std::fs::read_to_string(&path).unwrap()).unwrap();
    let l = v["losses"][3].as_f64().unwrap();
    v["losses"][3] = serde_json::json!(l * (1.0 + 1e-3));
    std::fs::write(&path, v.to_string()).unwrap();
    let report = run(&args(dir.path())).unwrap().unwrap();
    assert!(report.vs_single > 9e-4 && report.vs_torch.unwrap() > 9e-4, "{report:?}");

    // A stage's trajectory that is shorter than the others' is a failed comparison, not a pass.
    let short = v["losses"].as_array().unwrap()[..10].to_vec();
    v["losses"] = serde_json::json!(short);
    std::fs::write(dir.path().join("burn_single.json"), v.to_string()).unwrap();
    assert_eq!(run(&args(dir.path())).unwrap().unwrap().vs_single, f64::INFINITY);
}

#[test]
fn headline_without_torch_and_without_a_checkpoint_says_so() {
    let dir = tempfile::tempdir().unwrap();
    let e = run(&args(dir.path())).unwrap_err().to_string();
    assert!(e.contains("--skip-torch") && e.contains("model.safetensors"), "{e}");
}
