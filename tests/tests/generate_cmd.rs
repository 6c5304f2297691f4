//! `cargo xtask generate`: KV-cache generation with the Qwen3 tokenizer.
#![allow(clippy::unwrap_used)]

use tests::fixture;

fn args(checkpoint: &std::path::Path, temperature: f64) -> xtask::generate::GenerateArgs {
    xtask::generate::GenerateArgs {
        checkpoint: checkpoint.to_path_buf(),
        prompt: "FSDP shards every parameter".into(),
        max_new_tokens: 5,
        tokenizer: None,
        temperature,
        seed: 1,
    }
}

#[test]
fn generates_text_reproducibly_with_the_qwen3_tokenizer() {
    let dir = tempfile::tempdir().unwrap();
    // Qwen3's real vocabulary, tiny everything else.
    let config = tests::qwen3_vocab_config();
    config.init::<xtask::Backend>(&xtask::device()).save(&config, dir.path()).unwrap();
    let a = xtask::generate::run(&args(dir.path(), 0.0)).unwrap();
    assert_eq!(a, xtask::generate::run(&args(dir.path(), 0.0)).unwrap(), "greedy is deterministic");
    let s = xtask::generate::run(&args(dir.path(), 1.0)).unwrap();
    assert_eq!(s, xtask::generate::run(&args(dir.path(), 1.0)).unwrap(), "seeded sampling is reproducible");
}

#[test]
fn a_tokenizer_that_does_not_fit_the_model_is_refused() {
    let e = xtask::generate::run(&args(&fixture("qwen3-tiny-a"), 0.0)).unwrap_err().to_string();
    assert!(e.contains("vocabulary"), "{e}");
    let mut bad = args(&fixture("qwen3-tiny-a"), -1.0);
    bad.tokenizer = Some(fixture("qwen3-tokenizer/tokenizer.json"));
    assert!(xtask::generate::run(&bad).unwrap_err().to_string().contains("--temperature"));
}

#[test]
fn generate_flags_parse() {
    use clap::Parser;
    #[derive(clap::Parser)]
    struct Wrap {
        #[command(flatten)]
        args: xtask::generate::GenerateArgs,
    }
    let w = Wrap::try_parse_from([
        "generate",
        "--checkpoint",
        "d",
        "--prompt",
        "hi",
        "--max-new-tokens",
        "7",
        "--temperature",
        "0.5",
        "--seed",
        "9",
    ])
    .unwrap();
    assert_eq!((w.args.max_new_tokens, w.args.temperature, w.args.seed), (7, 0.5, 9));
    assert!(Wrap::try_parse_from(["generate", "--checkpoint", "d"]).is_err(), "--prompt is required");
}
