//! Training and forward throughput of one configuration.

use std::time::Instant;

use anyhow::Result;
use burn::tensor::{Int, Tensor};
use burn_fsdp::comm::local::CollectiveTime;
use qwen3_burn::Qwen3Config;
use qwen3_burn::train::inputs_and_labels;

use crate::Backend;
use crate::data::synthetic_batches;
use crate::train::{MetricsSink, Setup, TrainArgs, train_fsdp_cpu, train_single};

/// Throughput of one training configuration.
pub(crate) struct Throughput {
    /// Tokens per second of the timed steps (the first, warm-up step is excluded).
    pub(crate) tokens_per_sec: f64,
    /// Wall time of all steps, warm-up included.
    pub(crate) total_secs: f64,
    /// Collective time over the same steps (all ranks summed).
    pub(crate) collectives: CollectiveTime,
    /// FSDP with overlap: the share of rank 0's last step spent waiting for communication
    /// results (the exposed communication).
    pub(crate) exposed_wait: Option<f64>,
}

pub(crate) fn train_throughput(
    config: &Qwen3Config,
    world: Option<usize>,
    rows: usize,
    seq: usize,
    steps: usize,
    extra: &[&str],
) -> Result<Throughput> {
    let model = qwen3_burn::trainer::InitialWeights::Seeded(qwen3_burn::Qwen3Init::new(0));
    let batches = synthetic_batches(steps + 1, rows, seq, config.vocab_size, 0);
    let argv: Vec<String> = match world {
        None => vec!["train-qwen3".into(), "--no-fsdp".into(), "--quiet".into()],
        Some(w) => vec!["train-qwen3".into(), "--world-size".into(), w.to_string(), "--quiet".into()],
    };
    let mut argv: Vec<&str> = argv.iter().map(String::as_str).collect();
    argv.extend(extra);
    let args = TrainArgs::parse_from_args(&argv)?;
    let sink = MetricsSink::new(None, true)?;
    let setup = Setup { config: config.clone(), model, batches, steps: steps + 1, resume: None };
    let before = CollectiveTime::now();
    let metrics = match world {
        None => train_single(&args, setup, &sink)?,
        Some(_) => train_fsdp_cpu(&args, setup, &sink)?,
    };
    let collectives = CollectiveTime::now().since(&before);
    let exposed_wait = sink
        .collectives()
        .and_then(|c| c["overlap"]["wait_seconds"].as_f64())
        .zip(metrics.last())
        .map(|(wait, last)| wait * last.tokens_per_sec / (rows * seq) as f64);
    // Harmonic mean over the timed steps = total tokens / total time.
    let tokens = (rows * seq) as f64;
    let secs: f64 = metrics.iter().skip(1).map(|m| tokens / m.tokens_per_sec).sum();
    let total_secs: f64 = metrics.iter().map(|m| tokens / m.tokens_per_sec).sum();
    Ok(Throughput { tokens_per_sec: tokens * steps as f64 / secs, total_secs, collectives, exposed_wait })
}

/// Tokens per second of the single-device forward (logits of `rows × seq` tokens, no autodiff),
/// over `steps` timed forwards after one warm-up.
pub(super) fn forward_tokens_per_sec(config: &Qwen3Config, rows: usize, seq: usize, steps: usize) -> f64 {
    let device = crate::device();
    let model = config.init::<Backend>(&device);
    let batches = synthetic_batches(1, rows, seq, config.vocab_size, 0);
    let (inputs, _) = inputs_and_labels(batches.rows::<Backend>(0, 0..rows, &device));
    let run = |ids: Tensor<Backend, 2, Int>| std::hint::black_box(model.forward(ids).into_data());
    run(inputs.clone());
    let start = Instant::now();
    for _ in 0..steps {
        run(inputs.clone());
    }
    (rows * seq * steps) as f64 / start.elapsed().as_secs_f64()
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
