//! Shared helpers of the integration tests: fixture paths and reference trajectories.
#![warn(missing_docs)]

use std::path::PathBuf;

pub mod alloc;
pub mod toy;

/// Path of a file or directory under `tests/fixtures/`.
pub fn fixture(rel: &str) -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("fixtures").join(rel)
}

/// A PyTorch reference run (`single.json`, `fsdp4.json`, …).
#[derive(Debug, Clone)]
pub struct Reference {
    /// Loss per step.
    pub losses: Vec<f64>,
    /// Global gradient norm per step, before clipping.
    pub grad_norms: Vec<f64>,
}

/// Reads `tests/fixtures/<case>/<name>.json`.
pub fn reference(case: &str, name: &str) -> Reference {
    let path = fixture(&format!("{case}/{name}.json"));
    let text = std::fs::read_to_string(&path).unwrap_or_else(|e| panic!("{}: {e}", path.display()));
    let v: serde_json::Value =
        serde_json::from_str(&text).unwrap_or_else(|e| panic!("{}: {e}", path.display()));
    let list = |k: &str| -> Vec<f64> {
        v[k].as_array()
            .unwrap_or_else(|| panic!("{}: no `{k}`", path.display()))
            .iter()
            .filter_map(|x| x.as_f64())
            .collect()
    };
    Reference { losses: list("losses"), grad_norms: list("grad_norms") }
}

/// Largest `|a - b| / |b|` over two equally long series.
pub fn max_rel_diff(a: &[f64], b: &[f64]) -> f64 {
    assert_eq!(a.len(), b.len(), "series lengths differ");
    a.iter().zip(b).map(|(x, y)| (x - y).abs() / y.abs().max(f64::MIN_POSITIVE)).fold(0.0, f64::max)
}

/// The optimizer flags of the fixtures' `train.json`, as `train-qwen3` arguments.
pub fn train_args(case: &str, extra: &[&str]) -> xtask::train::TrainArgs {
    let train = fixture(&format!("{case}/train.json"));
    let v: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(&train).unwrap_or_default()).unwrap_or_default();
    let betas = format!("{},{}", v["betas"][0], v["betas"][1]);
    let (lr, eps, wd) = (v["lr"].to_string(), v["eps"].to_string(), v["weight_decay"].to_string());
    let checkpoint = fixture(case).display().to_string();
    let batches = fixture(&format!("{case}/batches.safetensors")).display().to_string();
    let mut argv: Vec<&str> = vec![
        "train-qwen3",
        "--checkpoint",
        &checkpoint,
        "--batches",
        &batches,
        "--lr",
        &lr,
        "--betas",
        &betas,
        "--eps",
        &eps,
        "--weight-decay",
        &wd,
        "--quiet",
    ];
    argv.extend_from_slice(extra);
    parse_train(&argv).unwrap_or_else(|e| panic!("{e}"))
}

/// Parses a `train-qwen3` command line (first element: the command name). Without
/// `--out-dir`, the run's files go to a fresh directory under the system temp dir.
pub fn parse_train(argv: &[&str]) -> Result<xtask::train::TrainArgs, String> {
    let mut args = xtask::train::TrainArgs::parse_from_args(argv).map_err(|e| e.to_string())?;
    if args.out_dir.is_none() {
        args.out_dir = Some(scratch_dir());
    }
    Ok(args)
}

/// A fresh directory under the system temp dir (not removed: the OS cleans it).
pub fn scratch_dir() -> PathBuf {
    use std::sync::atomic::{AtomicUsize, Ordering};
    static NEXT: AtomicUsize = AtomicUsize::new(0);
    let n = NEXT.fetch_add(1, Ordering::Relaxed);
    std::env::temp_dir().join(format!("burn-fsdp-tests/{}-{n}", std::process::id()))
}

/// A Qwen3 whose vocabulary covers the real Qwen3 tokenizer, tiny in everything else (for
/// text training and generation tests).
pub fn qwen3_vocab_config() -> qwen3_burn::Qwen3Config {
    qwen3_burn::Qwen3Config {
        vocab_size: 151_936,
        hidden_size: 16,
        intermediate_size: 32,
        num_hidden_layers: 1,
        num_attention_heads: 2,
        num_key_value_heads: 1,
        head_dim: 8,
        max_position_embeddings: 64,
        rms_norm_eps: 1e-6,
        rope_theta: 1e6,
        tie_word_embeddings: true,
    }
}
