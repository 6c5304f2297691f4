//! `train-qwen3` as a tool: --out-dir, summary.json, --compare-to, --data.
#![allow(clippy::unwrap_used)]

use std::path::Path;

use tests::{fixture, parse_train, train_args};

fn summary(dir: &Path) -> serde_json::Value {
    serde_json::from_str(&std::fs::read_to_string(dir.join("summary.json")).unwrap()).unwrap()
}

#[test]
fn out_dir_holds_metrics_and_summary() {
    let dir = tempfile::tempdir().unwrap();
    let out = dir.path().join("run");
    let o = out.display().to_string();
    let m = xtask::train::run(&train_args(
        "qwen3-tiny-a",
        &["--world-size", "2", "--steps", "3", "--out-dir", &o],
    ))
    .unwrap();
    let lines = std::fs::read_to_string(out.join("metrics.jsonl")).unwrap().lines().count();
    assert_eq!(lines, 3);
    let s = summary(&out);
    assert_eq!(s["steps"], 3);
    assert_eq!(s["world_size"], 2);
    assert_eq!(s["first_loss"].as_f64().unwrap(), m[0].loss);
    assert_eq!(s["last_loss"].as_f64().unwrap(), m[2].loss);
    assert!(s["mean_tokens_per_sec"].as_f64().unwrap() > 0.0);
    assert!(s["comparison"].is_null());
    let png = std::fs::read(out.join("loss.png")).unwrap();
    assert_eq!(&png[..8], b"\x89PNG\r\n\x1a\n", "loss.png is a PNG");
    // profile.jsonl: one line per step, rank 0's phases adding up to the step's time (the
    // one `tokens_per_sec` is made of), the process's CPU time and its collectives.
    let profile: Vec<serde_json::Value> = std::fs::read_to_string(out.join("profile.jsonl"))
        .unwrap()
        .lines()
        .map(|l| serde_json::from_str(l).unwrap())
        .collect();
    assert_eq!(profile.len(), 3);
    for (i, (p, step)) in profile.iter().zip(&m).enumerate() {
        let f = |k: &str| p[k].as_f64().unwrap_or_else(|| panic!("line {i}: no {k} in {p}"));
        assert_eq!(p["step"], i);
        // Tokens per step = tokens/s × the step's seconds, the same every step.
        let tokens = step.tokens_per_sec * f("seconds");
        let first = m[0].tokens_per_sec * profile[0]["seconds"].as_f64().unwrap();
        assert!((tokens - first).abs() <= 1e-9 * first && tokens > 1.0, "{p}");
        assert!(f("forward_backward_seconds") > 0.0 && f("optimizer_seconds") >= 0.0, "{p}");
        assert!((f("forward_backward_seconds") + f("optimizer_seconds") - f("seconds")).abs() < 1e-9, "{p}");
        assert!(f("process_user_cpu_seconds") > 0.0 && f("process_system_cpu_seconds") >= 0.0, "{p}");
        assert!(p["process_minor_faults"].as_i64().unwrap() >= 0, "{p}");
        // Two ranks all-gather and reduce-scatter every step.
        assert!(f("collective_seconds") > 0.0, "{p}");
        assert!((0.0..=f("collective_seconds")).contains(&f("collective_wait_seconds")), "{p}");
    }
}

#[test]
fn default_out_dir_is_runs_timestamp() {
    let d = xtask::train::default_run_dir();
    let name = d.file_name().unwrap().to_string_lossy().into_owned();
    assert!(d.starts_with("runs"), "{d:?}");
    assert_eq!(name.len(), 15, "{name}");
    assert!(name[..8].chars().all(|c| c.is_ascii_digit()) && &name[8..9] == "-", "{name}");
}

#[test]
fn compare_to_single_reruns_and_reports() {
    let dir = tempfile::tempdir().unwrap();
    let o = dir.path().display().to_string();
    xtask::train::run(&train_args(
        "qwen3-tiny-a",
        &["--world-size", "4", "--steps", "5", "--compare-to", "single", "--out-dir", &o],
    ))
    .unwrap();
    let c = &summary(dir.path())["comparison"];
    assert_eq!(c["reference"], "single device (no FSDP)");
    assert_eq!(c["losses"].as_array().unwrap().len(), 5);
    assert!(c["worst_loss_rel_diff"].as_f64().unwrap() < 1e-4, "{c}");
    assert!(c["worst_grad_norm_rel_diff"].as_f64().unwrap() < 1e-4, "{c}");
    assert!(c["throughput_ratio"].as_f64().unwrap() > 0.0);
}

#[test]
fn compare_to_a_pytorch_fixture_file() {
    let dir = tempfile::tempdir().unwrap();
    let o = dir.path().display().to_string();
    let f = fixture("qwen3-tiny-a/fsdp4.json").display().to_string();
    xtask::train::run(&train_args(
        "qwen3-tiny-a",
        &["--world-size", "4", "--compare-to", &f, "--out-dir", &o],
    ))
    .unwrap();
    let c = &summary(dir.path())["comparison"];
    assert!(c["worst_loss_rel_diff"].as_f64().unwrap() < 1e-4, "{c}");
    assert!(c["throughput_ratio"].is_null(), "the fixture has no tokens/s");
    // And a file that is neither format is named in the error.
    let bad = dir.path().join("bad.json");
    std::fs::write(&bad, "{\"nothing\": 1}").unwrap();
    let b = bad.display().to_string();
    let e = xtask::train::run(&train_args(
        "qwen3-tiny-a",
        &["--world-size", "4", "--steps", "1", "--compare-to", &b],
    ))
    .unwrap_err();
    assert!(format!("{e:#}").contains("bad.json"), "{e:#}");
}

/// A model small in everything but its vocabulary, which must cover the Qwen3 tokenizer.
fn text_model(dir: &Path) -> String {
    let config = tests::qwen3_vocab_config();
    let ckpt = dir.join("model");
    config.init::<xtask::Backend>(&xtask::device()).save(&config, &ckpt).unwrap();
    ckpt.display().to_string()
}

const TEXT: &str = "Fully sharded data parallelism shards every parameter across ranks, \
    gathers each unit before it runs and reduce-scatters its gradient afterwards. ";

#[test]
fn trains_on_text_and_jsonl() {
    let dir = tempfile::tempdir().unwrap();
    let ckpt = text_model(dir.path());
    let txt = dir.path().join("corpus.txt");
    std::fs::write(&txt, TEXT.repeat(20)).unwrap();
    let jsonl = dir.path().join("corpus.jsonl");
    let lines: Vec<String> =
        (0..20).map(|i| serde_json::json!({"text": format!("{i}: {TEXT}")}).to_string()).collect();
    std::fs::write(&jsonl, lines.join("\n")).unwrap();
    for data in [&txt, &jsonl] {
        let d = data.display().to_string();
        let argv = [
            "train-qwen3",
            "--checkpoint",
            &ckpt,
            "--data",
            &d,
            "--world-size",
            "2",
            "--batch",
            "2",
            "--seq",
            "16",
            "--steps",
            "3",
            "--quiet",
        ];
        let m = xtask::train::run(&parse_train(&argv).unwrap()).unwrap();
        assert_eq!(m.len(), 3);
        assert!(m.iter().all(|m| m.loss.is_finite() && m.loss > 5.0), "near ln(151936) ≈ 11.9 at the start");
    }
    // The same seed packs the same batches; another seed shuffles differently.
    let d = txt.display().to_string();
    let run = |seed: &str| {
        let argv = [
            "train-qwen3",
            "--checkpoint",
            &ckpt,
            "--data",
            &d,
            "--no-fsdp",
            "--batch",
            "2",
            "--seq",
            "16",
            "--steps",
            "1",
            "--seed",
            seed,
            "--quiet",
        ];
        xtask::train::run(&parse_train(&argv).unwrap()).unwrap()[0].loss
    };
    assert_eq!(run("1"), run("1"));
    assert_ne!(run("1"), run("2"));
}

#[test]
fn text_data_errors_are_clear() {
    let dir = tempfile::tempdir().unwrap();
    let txt = dir.path().join("small.txt");
    std::fs::write(&txt, TEXT).unwrap();
    let d = txt.display().to_string();
    // The tiny preset's 512-entry vocabulary cannot hold Qwen3 token ids.
    let e = xtask::train::run(
        &parse_train(&["train-qwen3", "--data", &d, "--no-fsdp", "--seq", "4", "--steps", "1", "--quiet"])
            .unwrap(),
    )
    .unwrap_err();
    let e = format!("{e:#}");
    assert!(e.contains("vocabulary") && e.contains("tokenizer"), "{e}");
    // Not enough text for the steps asked.
    let e = xtask::train::run(
        &parse_train(&["train-qwen3", "--data", &d, "--no-fsdp", "--steps", "50", "--quiet"]).unwrap(),
    )
    .unwrap_err();
    assert!(format!("{e:#}").contains("--steps"), "{e:#}");
    let bad = dir.path().join("bad.jsonl");
    std::fs::write(&bad, "{\"text\": \"ok\"}\n{\"txt\": 3}\n").unwrap();
    let b = bad.display().to_string();
    let e = xtask::train::run(&parse_train(&["train-qwen3", "--data", &b, "--no-fsdp", "--quiet"]).unwrap())
        .unwrap_err();
    assert!(format!("{e:#}").contains("line 2"), "{e:#}");
    // --data and --batches exclude each other; --tokenizer needs --data.
    assert!(parse_train(&["train-qwen3", "--data", "a.txt", "--batches", "b.safetensors"]).is_err());
    assert!(parse_train(&["train-qwen3", "--tokenizer", "t.json"]).unwrap_err().contains("--data"));
}

#[test]
fn preset_seed_batch_seq_and_quiet_flags() {
    let dir = tempfile::tempdir().unwrap();
    let o = dir.path().display().to_string();
    let argv = [
        "train-qwen3",
        "--preset",
        "tiny",
        "--world-size",
        "2",
        "--batch",
        "1",
        "--seq",
        "8",
        "--steps",
        "2",
        "--seed",
        "3",
        "--quiet",
        "--out-dir",
        &o,
    ];
    let args = parse_train(&argv).unwrap();
    assert_eq!((args.batch, args.seq, args.seed, args.quiet), (Some(1), Some(8), Some(3), true));
    let m = xtask::train::run(&args).unwrap();
    assert_eq!(m.len(), 2);
    // tiny's vocabulary has 512 entries: the first loss is near ln(512) ≈ 6.24.
    assert!((m[0].loss - 512f64.ln()).abs() < 0.3, "{}", m[0].loss);
    let s = summary(dir.path());
    assert_eq!(s["model_config"]["vocab_size"], 512);
    // Another seed, another model and data.
    let other = parse_train(&[
        "train-qwen3",
        "--preset",
        "tiny",
        "--world-size",
        "2",
        "--batch",
        "1",
        "--seq",
        "8",
        "--steps",
        "2",
        "--seed",
        "4",
        "--quiet",
    ])
    .unwrap();
    assert_ne!(xtask::train::run(&other).unwrap()[0].loss, m[0].loss);
    let e =
        xtask::train::run(&parse_train(&["train-qwen3", "--preset", "70b", "--quiet"]).unwrap()).unwrap_err();
    assert!(format!("{e:#}").contains("--preset"), "{e:#}");
    let e = xtask::train::run(&parse_train(&["train-qwen3", "--seq", "0", "--quiet"]).unwrap()).unwrap_err();
    assert!(format!("{e:#}").contains("--seq"), "{e:#}");
}

#[test]
fn explicit_tokenizer_flag_is_used_and_checked() {
    let dir = tempfile::tempdir().unwrap();
    let ckpt = text_model(dir.path());
    let txt = dir.path().join("c.txt");
    std::fs::write(&txt, TEXT.repeat(10)).unwrap();
    let (d, tok) =
        (txt.display().to_string(), fixture("qwen3-tokenizer/tokenizer.json").display().to_string());
    let argv = [
        "train-qwen3",
        "--checkpoint",
        &ckpt,
        "--data",
        &d,
        "--tokenizer",
        &tok,
        "--no-fsdp",
        "--batch",
        "2",
        "--seq",
        "8",
        "--steps",
        "1",
        "--quiet",
    ];
    assert_eq!(xtask::train::run(&parse_train(&argv).unwrap()).unwrap().len(), 1);
    let argv = [
        "train-qwen3",
        "--checkpoint",
        &ckpt,
        "--data",
        &d,
        "--tokenizer",
        "/nonexistent/tok.json",
        "--no-fsdp",
        "--quiet",
    ];
    let e = xtask::train::run(&parse_train(&argv).unwrap()).unwrap_err();
    assert!(format!("{e:#}").contains("/nonexistent/tok.json"), "{e:#}");
}

#[test]
fn lr_schedule_and_warmup_flags() {
    let dir = tempfile::tempdir().unwrap();
    let o = dir.path().display().to_string();
    let flags = ["--world-size", "2", "--steps", "5", "--lr-schedule", "cosine", "--warmup", "2"];
    let mut argv = flags.to_vec();
    argv.extend(["--compare-to", "single", "--out-dir", &o]);
    let args = train_args("qwen3-tiny-a", &argv);
    let m = xtask::train::run(&args).unwrap();
    // Warmup lr·1/3, lr·2/3, then half a cosine over the last three steps.
    let base = args.lr;
    let pi = std::f64::consts::PI;
    let want = [base / 3.0, base * 2.0 / 3.0, base, base * 0.5 * (1.0 + (pi / 3.0).cos()), base * 0.25];
    for (s, w) in m.iter().zip(want) {
        assert!((s.lr - w).abs() <= 1e-12 * base, "step {}: lr {} vs {w}", s.step, s.lr);
    }
    let lines = std::fs::read_to_string(dir.path().join("metrics.jsonl")).unwrap();
    let first: serde_json::Value = serde_json::from_str(lines.lines().next().unwrap()).unwrap();
    assert!((first["lr"].as_f64().unwrap() - base / 3.0).abs() < 1e-12, "{first}");
    // The single-device rerun follows the same schedule.
    let c = &summary(dir.path())["comparison"];
    assert!(c["worst_loss_rel_diff"].as_f64().unwrap() < 1e-4, "{c}");
    // And the schedule changes training: the constant run's second loss differs.
    let constant =
        xtask::train::run(&train_args("qwen3-tiny-a", &["--world-size", "2", "--steps", "2"])).unwrap();
    assert_eq!(constant[0].lr, base);
    assert!((constant[1].loss - m[1].loss).abs() > 1e-6, "{} vs {}", constant[1].loss, m[1].loss);
    let e = parse_train(&["train-qwen3", "--lr-schedule", "exp"]).unwrap_err();
    assert!(e.contains("--lr-schedule"), "{e}");
}

/// A copy of the qwen3-tiny-a checkpoint with one NaN in `name`.
fn checkpoint_with_a_nan(dir: &Path, name: &str) -> String {
    use burn_fsdp::io::TensorOut;
    let (model, config) =
        qwen3_burn::Qwen3::<burn::backend::NdArray<f32>>::load(fixture("qwen3-tiny-a"), &Default::default())
            .unwrap();
    let mut tensors = model.to_hf_tensors();
    let (_, t) = tensors.iter_mut().find(|(n, _)| n == name).unwrap();
    let TensorOut::F32(_, values) = t else { panic!("{name} is not f32") };
    values[3] = f32::NAN;
    burn_fsdp::io::write_safetensors(dir.join("model.safetensors"), tensors, None).unwrap();
    config.save(dir).unwrap();
    dir.display().to_string()
}

#[test]
fn a_non_finite_loss_stops_training_with_the_step_and_still_writes_the_summary() {
    let ckpt = tempfile::tempdir().unwrap();
    let c = checkpoint_with_a_nan(ckpt.path(), "model.layers.0.mlp.down_proj.weight");
    let batches = fixture("qwen3-tiny-a/batches.safetensors").display().to_string();
    for mode in [&["--world-size", "2"][..], &["--no-fsdp"][..]] {
        let out = tempfile::tempdir().unwrap();
        let o = out.path().display().to_string();
        let mut argv =
            vec!["train-qwen3", "--checkpoint", &c, "--batches", &batches, "--steps", "5", "--quiet"];
        argv.extend_from_slice(mode);
        argv.extend(["--out-dir", &o]);
        let e = format!("{:#}", xtask::train::run(&parse_train(&argv).unwrap()).unwrap_err());
        assert!(e.contains("step 0") && e.contains("loss NaN") && e.contains("stopped"), "{mode:?}: {e}");
        if mode[0] == "--world-size" {
            assert!(e.contains("rank 0"), "{e}");
        }
        let s = summary(out.path());
        assert_eq!(s["steps"], 1, "{s}");
        assert!(s["stopped"].as_str().unwrap().contains("step 0"), "{s}");
        assert!(s["loss_plot"].is_null(), "nothing finite to plot: {s}");
        let lines = std::fs::read_to_string(out.path().join("metrics.jsonl")).unwrap();
        assert_eq!(lines.lines().count(), 1);
    }
}

/// The error of a run that must be refused (a panic if it trains).
fn refused(argv: &[&str]) -> String {
    match xtask::train::run(&parse_train(argv).unwrap()) {
        Ok(_) => panic!("{argv:?} trained"),
        Err(e) => format!("{e:#}"),
    }
}

/// `--device cuda-proxy` in this process (no `--launcher`) needs the `cuda-proxy` build: without
/// it the run is refused with that said, never trained on the CPU instead; `--launcher mpi` is
/// refused in any build.
#[test]
fn cuda_proxy_in_process_needs_its_build_and_no_mpi() {
    #[cfg(not(feature = "cuda-proxy"))]
    for extra in [&["--no-fsdp"][..], &["--world-size", "2"][..]] {
        let mut argv = vec!["train-qwen3", "--device", "cuda-proxy", "--steps", "1", "--quiet"];
        argv.extend(extra);
        let e = refused(&argv);
        assert!(e.contains("--features cuda-proxy"), "{e}");
    }
    let e =
        refused(&["train-qwen3", "--device", "cuda-proxy", "--launcher", "mpi", "--steps", "1", "--quiet"]);
    assert!(e.contains("--launcher env"), "{e}");
}

/// `--device cuda` (Burn's own CUDA backend) trains in this process only, and only in a build
/// with `burn-cuda`.
#[test]
fn burn_cuda_device_needs_its_build_and_no_launcher() {
    #[cfg(not(feature = "burn-cuda"))]
    for extra in [&["--no-fsdp"][..], &["--world-size", "2"][..]] {
        let mut argv = vec!["train-qwen3", "--device", "cuda", "--steps", "1", "--quiet"];
        argv.extend(extra);
        let e = refused(&argv);
        assert!(e.contains("--features burn-cuda"), "{e}");
    }
    for launcher in ["mpi", "env"] {
        let e =
            refused(&["train-qwen3", "--device", "cuda", "--launcher", launcher, "--steps", "1", "--quiet"]);
        assert!(e.contains("--device cuda") && e.contains("in this process"), "{launcher}: {e}");
    }
}
