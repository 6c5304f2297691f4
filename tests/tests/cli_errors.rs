//! Bad flags and bad files give clear errors naming the flag or file, never a panic.
#![allow(clippy::unwrap_used)]

use tests::{fixture, parse_train, train_args};

fn run_err(args: xtask::train::TrainArgs) -> String {
    format!("{:#}", xtask::train::run(&args).expect_err("must fail"))
}

#[test]
fn betas_must_be_two_numbers() {
    for bad in ["0.9", "0.9,x", "0.9,1.5"] {
        let e = parse_train(&["train-qwen3", "--betas", bad]).unwrap_err();
        assert!(e.contains("--betas"), "{e}");
    }
    assert_eq!(parse_train(&["train-qwen3", "--betas", "0.8, 0.9"]).unwrap().betas, (0.8, 0.9));
}

#[test]
fn no_fsdp_conflicts_with_world_size() {
    let e = parse_train(&["train-qwen3", "--no-fsdp", "--world-size", "2"]).unwrap_err();
    assert!(e.contains("--world-size"), "{e}");
}

#[test]
fn no_fsdp_refuses_a_collective_timeout() {
    // One device runs no collective: a timeout given with --no-fsdp is a mistake, said so.
    let e = parse_train(&["train-qwen3", "--no-fsdp", "--timeout", "5"]).unwrap_err();
    assert!(e.contains("--timeout") && e.contains("--no-fsdp"), "{e}");
    // Without it the default timeout does not conflict.
    assert!(parse_train(&["train-qwen3", "--no-fsdp"]).unwrap().no_fsdp);
}

#[test]
fn missing_checkpoint_and_batches_are_named() {
    let e = run_err(parse_train(&["train-qwen3", "--no-fsdp", "--checkpoint", "/nonexistent/ckpt"]).unwrap());
    assert!(e.contains("/nonexistent/ckpt"), "{e}");
    let ckpt = fixture("qwen3-tiny-a").display().to_string();
    let e = run_err(
        parse_train(&[
            "train-qwen3",
            "--no-fsdp",
            "--checkpoint",
            &ckpt,
            "--batches",
            "/nonexistent/b.safetensors",
        ])
        .unwrap(),
    );
    assert!(e.contains("/nonexistent/b.safetensors"), "{e}");
}

#[test]
fn batches_that_do_not_fit_the_flags_are_refused() {
    let e = run_err(train_args("qwen3-tiny-a", &["--no-fsdp", "--steps", "21"]));
    assert!(e.contains("--steps"), "{e}");
    let e = run_err(train_args("qwen3-tiny-a", &["--no-fsdp", "--grad-accum", "3"]));
    assert!(e.contains("--grad-accum"), "{e}");
    let e = run_err(train_args("qwen3-tiny-a", &["--world-size", "3"]));
    assert!(e.contains("--world-size"), "{e}");
    let e = run_err(train_args("qwen3-tiny-a", &["--no-fsdp", "--grad-accum", "0"]));
    assert!(e.contains("--grad-accum"), "{e}");
}

#[test]
fn tokens_outside_the_vocabulary_are_refused() {
    // tiny-b's tokens go up to 202; tiny-a's vocabulary has 256 entries, so use the other way:
    // a model with a smaller vocabulary than the data.
    let dir = tempfile::tempdir().unwrap();
    let mut cfg = qwen3_burn::Qwen3Config::from_file(fixture("qwen3-tiny-a/config.json")).unwrap();
    cfg.vocab_size = 100;
    let model = cfg.init::<xtask::Backend>(&xtask::device());
    model.save(&cfg, dir.path()).unwrap();
    let ckpt = dir.path().display().to_string();
    let batches = fixture("qwen3-tiny-a/batches.safetensors").display().to_string();
    let e = run_err(
        parse_train(&["train-qwen3", "--no-fsdp", "--checkpoint", &ckpt, "--batches", &batches]).unwrap(),
    );
    assert!(e.contains("batches.safetensors") && e.contains("vocabulary"), "{e}");
}

#[test]
fn logits_command_checks_its_input() {
    let dir = tempfile::tempdir().unwrap();
    let args = xtask::logits::LogitsArgs {
        checkpoint: fixture("qwen3-tiny-a"),
        input: fixture("qwen3-tiny-a/batches.safetensors"),
        out: dir.path().join("out.safetensors"),
    };
    let e = format!("{:#}", xtask::logits::run(&args).unwrap_err());
    assert!(e.contains("input_ids") && e.contains("batches.safetensors"), "{e}");
}
