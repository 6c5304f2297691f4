//! `cargo xtask qwen3-logits`: logits of a checkpoint for given input ids.

use std::path::PathBuf;

use anyhow::{Context, Result, bail};
use burn::tensor::{Int, Tensor, TensorData};
use qwen3_burn::Qwen3;
use qwen3_burn::checkpoint::{SafetensorsFile, TensorOut, write_safetensors};

use crate::{Backend, device};

/// Arguments of `qwen3-logits`.
#[derive(Debug, Clone, clap::Args)]
pub struct LogitsArgs {
    /// HF checkpoint directory (config.json + model.safetensors or a sharded index).
    #[arg(long)]
    pub checkpoint: PathBuf,
    /// Safetensors file with an integer tensor `input_ids` [B, T].
    #[arg(long)]
    pub input: PathBuf,
    /// Safetensors file to write f32 `logits` [B, T, V] to.
    #[arg(long)]
    pub out: PathBuf,
}

/// Runs the command.
pub fn run(args: &LogitsArgs) -> Result<()> {
    let device = device();
    let (model, config) = Qwen3::<Backend>::load(&args.checkpoint, &device)?;
    let file = SafetensorsFile::open(&args.input)?;
    let (ids, shape) = file.read_i64("input_ids")?;
    let [b, t] = shape[..] else {
        bail!("{}: tensor `input_ids` has shape {shape:?}, expected [batch, seq]", args.input.display());
    };
    if let Some(bad) = ids.iter().find(|&&i| i < 0 || i as usize >= config.vocab_size) {
        bail!(
            "{}: `input_ids` holds token {bad}, outside the vocabulary 0..{}",
            args.input.display(),
            config.vocab_size
        );
    }
    let ids = Tensor::<Backend, 2, Int>::from_data(TensorData::new(ids, [b, t]), &device);
    let logits = model.forward(ids);
    let dims = logits.dims().to_vec();
    let values = logits.into_data().convert::<f32>().to_vec::<f32>().map_err(|e| anyhow::anyhow!("{e:?}"))?;
    write_safetensors(&args.out, vec![("logits".into(), TensorOut::F32(dims, values))], None)
        .with_context(|| format!("writing {}", args.out.display()))?;
    Ok(())
}
