//! `cargo xtask bench`: throughput and bandwidth ratios measured side by side in one run.
//!
//! Ends with one `name: value` line per headline figure.

use std::sync::Arc;
use std::time::{Duration, Instant};

use anyhow::Result;
use burn::tensor::{Tensor, TensorData};
use burn_fsdp::{LocalGroup, ProcessGroup, ReduceOp, Tag, launch};
use qwen3_burn::Qwen3Config;

use crate::Backend;
use crate::data::synthetic_batches;
use crate::train::{MetricsSink, Setup, TrainArgs, train_fsdp, train_single};

/// Arguments of `bench`.
#[derive(Debug, Clone, clap::Args)]
pub struct BenchArgs {
    /// Only the small model (skips the ~50M-parameter Qwen3, which takes minutes on 2 cores).
    #[arg(long)]
    pub quick: bool,
    /// Training steps timed per configuration (after one warm-up step).
    #[arg(long, default_value_t = 4)]
    pub steps: usize,
}

/// Tokens per second of `steps` timed steps (the first, warm-up step is excluded).
fn tokens_per_sec(
    config: &Qwen3Config,
    world: Option<usize>,
    rows: usize,
    seq: usize,
    steps: usize,
) -> Result<f64> {
    let device = crate::device();
    let model = config.init::<Backend>(&device).to_hf_tensors();
    let batches = synthetic_batches(steps + 1, rows, seq, config.vocab_size, 0);
    let argv: Vec<String> = match world {
        None => vec!["train-qwen3".into(), "--no-fsdp".into(), "--quiet".into()],
        Some(w) => vec!["train-qwen3".into(), "--world-size".into(), w.to_string(), "--quiet".into()],
    };
    let argv: Vec<&str> = argv.iter().map(String::as_str).collect();
    let args = TrainArgs::parse_from_args(&argv)?;
    let sink = MetricsSink::new(None, true)?;
    let setup = Setup { config: config.clone(), model, batches, steps: steps + 1, resume: None };
    let metrics = match world {
        None => train_single(&args, setup, &sink)?,
        Some(_) => train_fsdp::<Backend>(&args, setup, &sink)?,
    };
    // Harmonic mean over the timed steps = total tokens / total time.
    let tokens = (rows * seq) as f64;
    let secs: f64 = metrics.iter().skip(1).map(|m| tokens / m.tokens_per_sec).sum();
    Ok(tokens * steps as f64 / secs)
}

/// The ~50M-parameter Qwen3 of the benchmark (48.3M: 14 layers of width 512, vocab 8192).
pub fn qwen3_50m() -> Qwen3Config {
    Qwen3Config {
        vocab_size: 8192,
        hidden_size: 512,
        intermediate_size: 1536,
        num_hidden_layers: 14,
        num_attention_heads: 8,
        num_key_value_heads: 4,
        head_dim: 64,
        max_position_embeddings: 1024,
        rms_norm_eps: 1e-6,
        rope_theta: 1e6,
        tie_word_embeddings: true,
    }
}

/// GB/s of a plain memory copy of `bytes`.
fn memcpy_gbps(bytes: usize, reps: usize) -> f64 {
    let src = vec![1.0f32; bytes / 4];
    let mut dst = vec![0.0f32; bytes / 4];
    dst.copy_from_slice(&src);
    let start = Instant::now();
    for i in 0..reps {
        dst.copy_from_slice(&src);
        std::hint::black_box(&dst[i % dst.len()]);
    }
    (bytes * reps) as f64 / start.elapsed().as_secs_f64() / 1e9
}

/// GB/s of in-process all-gather and reduce-scatter over `world` ranks, counted as the bytes
/// each rank receives into its output (all-gather) or reads from its input (reduce-scatter).
fn collective_gbps(world: usize, bytes_per_rank: usize, reps: usize) -> Result<(f64, f64)> {
    let n = bytes_per_rank / 4;
    let times = launch(world, Duration::from_secs(120), |group: Arc<LocalGroup>| {
        let device = crate::device();
        let shard = Tensor::<Backend, 1>::from_data(TensorData::new(vec![1.0f32; n], [n]), &device);
        let full =
            Tensor::<Backend, 1>::from_data(TensorData::new(vec![1.0f32; n * world], [n * world]), &device);
        let tag = Tag::new("bench");
        ProcessGroup::<Backend>::barrier(&*group, &tag)?;
        let start = Instant::now();
        for _ in 0..reps {
            std::hint::black_box(ProcessGroup::<Backend>::all_gather(&*group, shard.clone(), &tag)?);
        }
        let ag = start.elapsed().as_secs_f64();
        ProcessGroup::<Backend>::barrier(&*group, &tag)?;
        let start = Instant::now();
        for _ in 0..reps {
            std::hint::black_box(ProcessGroup::<Backend>::reduce_scatter(
                &*group,
                full.clone(),
                ReduceOp::Avg,
                &tag,
            )?);
        }
        Ok::<_, burn_fsdp::CommError>((ag, start.elapsed().as_secs_f64()))
    })
    .map_err(|e| anyhow::anyhow!("{e}"))?;
    let (ag, rs) = times.iter().fold((0.0f64, 0.0f64), |acc, t| (acc.0.max(t.0), acc.1.max(t.1)));
    let moved = (bytes_per_rank * world * reps) as f64;
    Ok((moved / ag / 1e9, moved / rs / 1e9))
}

/// Runs every benchmark and prints the headline figures.
pub fn run(args: &BenchArgs) -> Result<Vec<(String, f64)>> {
    let mut figures: Vec<(String, f64)> = Vec::new();
    let tiny = Qwen3Config::from_json_str(
        r#"{"vocab_size": 256, "hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 2,
            "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 16, "rms_norm_eps": 1e-6,
            "rope_theta": 1000000.0, "tie_word_embeddings": true}"#,
        "<qwen3-tiny-a shapes>".as_ref(),
    )?;
    let mut models = vec![("qwen3_tiny_a", tiny, 8, 32)];
    if !args.quick {
        models.push(("qwen3_50m", qwen3_50m(), 8, 128));
    }
    for (name, config, rows, seq) in models {
        println!(
            "[{name}] {} parameters, global batch {rows} × {seq} tokens, {} timed steps",
            config.num_params(),
            args.steps
        );
        let single = tokens_per_sec(&config, None, rows, seq, args.steps)?;
        let fsdp = tokens_per_sec(&config, Some(4), rows, seq, args.steps)?;
        println!("  single device: {single:.0} tokens/s; FSDP W=4 (in-process): {fsdp:.0} tokens/s");
        figures.push((format!("{name}_fsdp_w4_vs_single_tokens_per_sec_ratio"), fsdp / single));
    }
    let bytes = 16 << 20;
    let memcpy = memcpy_gbps(bytes * 4, 20);
    let (ag, rs) = collective_gbps(4, bytes, 10)?;
    println!(
        "[collectives] 4 ranks × 16 MiB: all-gather {ag:.2} GB/s, reduce-scatter {rs:.2} GB/s, memcpy {memcpy:.2} GB/s"
    );
    figures.push(("allgather_vs_memcpy_bandwidth_ratio".into(), ag / memcpy));
    figures.push(("reducescatter_vs_memcpy_bandwidth_ratio".into(), rs / memcpy));
    let torch = std::process::Command::new("python3").args(["-c", "import torch"]).output();
    if !torch.map(|o| o.status.success()).unwrap_or(false) {
        println!(
            "[pytorch] skipped: PyTorch is not installed (pip install torch==2.15.0 transformers; see docs/performance.md)"
        );
    } else {
        println!("[pytorch] PyTorch found, but the side-by-side PyTorch benchmark is not implemented yet");
    }
    // The headline figure of the issue: the larger model when it ran, else the small one.
    let headline = figures
        .iter()
        .rev()
        .find(|(n, _)| n.ends_with("_fsdp_w4_vs_single_tokens_per_sec_ratio"))
        .map(|(_, v)| *v)
        .unwrap_or(f64::NAN);
    figures.push(("fsdp_w4_vs_single_tokens_per_sec_ratio".into(), headline));
    for (name, value) in &figures {
        println!("{name}: {value:.3}");
    }
    Ok(figures)
}
