//! `cargo xtask generate`: continue a prompt with a trained or exported Qwen3.

use std::path::PathBuf;

use anyhow::{Result, bail};
use qwen3_burn::checkpoint::CONFIG_FILE;
use qwen3_burn::generate::Sampling;
use qwen3_burn::tokenizer::Tokenizer;
use qwen3_burn::{Qwen3, Qwen3Config};

use crate::{Backend, device};

/// Arguments of `generate`.
#[derive(Debug, Clone, clap::Args)]
pub struct GenerateArgs {
    /// HF checkpoint directory (config.json + model.safetensors), e.g. from --export.
    #[arg(long)]
    pub checkpoint: PathBuf,
    /// The text to continue.
    #[arg(long)]
    pub prompt: String,
    /// Most tokens to add.
    #[arg(long, default_value_t = 32)]
    pub max_new_tokens: usize,
    /// `tokenizer.json` (default: $QWEN3_TOKENIZER, else the checkpoint's own
    /// `tokenizer.json`, else the Qwen3 tokenizer of the repository's tests/fixtures).
    #[arg(long)]
    pub tokenizer: Option<PathBuf>,
    /// 0 for greedy decoding, otherwise the sampling temperature.
    #[arg(long, default_value_t = 0.0)]
    pub temperature: f64,
    /// Seed of the sampler.
    #[arg(long, default_value_t = 0)]
    pub seed: u64,
}

/// Runs the command and returns the generated text.
pub fn run(args: &GenerateArgs) -> Result<String> {
    if !(args.temperature >= 0.0 && args.temperature.is_finite()) {
        bail!("--temperature must be a non-negative number, got {}", args.temperature);
    }
    let device = device();
    if !args.checkpoint.is_dir() {
        bail!("--checkpoint {}: no such directory", args.checkpoint.display());
    }
    let config = Qwen3Config::from_file(args.checkpoint.join(CONFIG_FILE))?;
    let tok_path = crate::tokenizer::resolve(args.tokenizer.as_deref(), Some(&args.checkpoint))?;
    let tokenizer = Tokenizer::from_file(&tok_path)?;
    // Refused before the weights are read: a model whose vocabulary does not cover the
    // tokenizer's would sample ids the tokenizer reads as other tokens, or none.
    if tokenizer.vocab_size() > config.vocab_size {
        bail!(
            "the tokenizer {} has {} tokens but the model in {} has a vocabulary of {}: it was not trained \
             with this tokenizer (give the model's own with --tokenizer)",
            tok_path.display(),
            tokenizer.vocab_size(),
            args.checkpoint.display(),
            config.vocab_size
        );
    }
    let model = Qwen3::<Backend>::load_weights(&config, &args.checkpoint, &device)?;
    let prompt = tokenizer.encode(&args.prompt)?;
    if prompt.is_empty() {
        bail!("--prompt is empty after tokenization");
    }
    if let Some(&bad) = prompt.iter().find(|&&t| t as usize >= config.vocab_size) {
        bail!(
            "the prompt has token {bad}, outside the model's vocabulary of {} (is --tokenizer the model's?)",
            config.vocab_size
        );
    }
    let stop = tokenizer.token_id("<|endoftext|>").filter(|&t| (t as usize) < config.vocab_size);
    let sampling = Sampling { temperature: args.temperature, seed: args.seed };
    let out = model.generate(&prompt, args.max_new_tokens, sampling, stop, &device);
    Ok(tokenizer.decode(&out)?)
}
