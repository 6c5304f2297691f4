//! `cargo xtask generate`: continue a prompt with a trained or exported Qwen3.

use std::path::PathBuf;

use anyhow::{Result, bail};
use qwen3_burn::Qwen3;
use qwen3_burn::generate::Sampling;
use qwen3_burn::tokenizer::Tokenizer;

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
    /// `tokenizer.json` (default: the Qwen3 tokenizer shipped in tests/fixtures).
    #[arg(long)]
    pub tokenizer: Option<PathBuf>,
    /// 0 for greedy decoding, otherwise the sampling temperature.
    #[arg(long, default_value_t = 0.0)]
    pub temperature: f64,
    /// Seed of the sampler.
    #[arg(long, default_value_t = 0)]
    pub seed: u64,
}

/// The Qwen3 tokenizer bundled with the repository.
pub fn default_tokenizer() -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../tests/fixtures/qwen3-tokenizer/tokenizer.json")
}

/// Runs the command and returns the generated text.
pub fn run(args: &GenerateArgs) -> Result<String> {
    if !(args.temperature >= 0.0 && args.temperature.is_finite()) {
        bail!("--temperature must be a non-negative number, got {}", args.temperature);
    }
    let device = device();
    let (model, config) = Qwen3::<Backend>::load(&args.checkpoint, &device)?;
    let tokenizer = Tokenizer::from_file(args.tokenizer.clone().unwrap_or_else(default_tokenizer))?;
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
