//! `cargo xtask consolidate`: a sharded FSDP checkpoint → one HF checkpoint.

use std::path::PathBuf;

use anyhow::{Context, Result};
use burn_fsdp::checkpoint::CheckpointReader;
use qwen3_burn::Qwen3Config;
use qwen3_burn::checkpoint::{TensorOut, WEIGHTS_FILE, write_safetensors};

/// Arguments of `consolidate`.
#[derive(Debug, Clone, clap::Args)]
pub struct ConsolidateArgs {
    /// Sharded checkpoint directory (holding `index.json`), saved at any world size.
    #[arg(long)]
    pub sharded: PathBuf,
    /// Directory to write `config.json` + `model.safetensors` to.
    #[arg(long)]
    pub out: PathBuf,
}

/// Runs the command: no ranks needed, each parameter's rows are read from the rank files.
pub fn run(args: &ConsolidateArgs) -> Result<()> {
    let reader = CheckpointReader::open(&args.sharded)?;
    let config: Qwen3Config =
        serde_json::from_value(reader.index().model_config.clone()).with_context(|| {
            format!("{}: model_config is not a Qwen3 config", args.sharded.join("index.json").display())
        })?;
    let tensors = reader
        .full_parameters()?
        .into_iter()
        .map(|(name, shape, values)| (name, TensorOut::F32(shape, values)))
        .collect();
    std::fs::create_dir_all(&args.out).with_context(|| format!("creating {}", args.out.display()))?;
    let meta = std::collections::HashMap::from([("format".to_owned(), "pt".to_owned())]);
    write_safetensors(args.out.join(WEIGHTS_FILE), tensors, Some(meta))?;
    config.save(&args.out)?;
    Ok(())
}
