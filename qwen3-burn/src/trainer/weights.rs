//! Where a run's initial weights come from, and how each rank makes its copy of them.
//!
//! A single device builds the whole model; an FSDP rank creates only its own shards
//! ([`Fsdp::wrap_deferred`](burn_fsdp::Fsdp::wrap_deferred)), from the same source, so no
//! rank — and no in-process job — ever holds a full copy of the model.

use std::sync::Arc;

use burn::tensor::backend::Backend;
use burn_fsdp::init::ShardInit;

use crate::checkpoint::HfWeights;
use crate::{Qwen3, Qwen3Config, Qwen3Init, Result};

/// The initial weights of a run.
#[derive(Clone)]
pub enum InitialWeights {
    /// HF's initialisation drawn from a seed ([`Qwen3Init`]): the same values on one device and
    /// sharded over any number of ranks.
    Seeded(Qwen3Init),
    /// An HF checkpoint, already checked against the model's config; its files are
    /// memory-mapped and shared by in-process ranks, each reading only its rows.
    Checkpoint(Arc<HfWeights>),
}

impl InitialWeights {
    /// Opens the checkpoint at `path` (directory or `.safetensors` file) and checks, without
    /// reading tensor data, that it holds exactly the parameters of `config`.
    pub fn checkpoint(config: &Qwen3Config, path: &std::path::Path) -> Result<Self> {
        let weights = HfWeights::open(path)?;
        Qwen3::<burn::backend::NdArray>::check_weights(config, &weights)?;
        Ok(Self::Checkpoint(Arc::new(weights)))
    }

    /// The whole model on one device.
    pub fn model<B: Backend>(&self, config: &Qwen3Config, device: &B::Device) -> Result<Qwen3<B>> {
        Ok(match self {
            Self::Seeded(init) => Qwen3::new_seeded(config, *init, device),
            Self::Checkpoint(weights) => Qwen3::from_weights(config, weights.as_ref(), device)?,
        })
    }

    /// A model whose parameters are all lazy (nothing allocated), for
    /// [`Fsdp::wrap_deferred`](burn_fsdp::Fsdp::wrap_deferred) with [`shards`](Self::shards).
    pub fn skeleton<B: Backend>(&self, config: &Qwen3Config, device: &B::Device) -> Qwen3<B> {
        let init = match self {
            Self::Seeded(init) => *init,
            Self::Checkpoint(_) => Qwen3Init::new(0),
        };
        Qwen3::new_seeded(config, init, device)
    }

    /// After the model or its shards are made: a checkpoint's mapped pages go back to the
    /// kernel ([`HfWeights::release_pages`]); nothing for a seeded initialisation.
    pub fn release_pages(&self) {
        if let Self::Checkpoint(weights) = self {
            weights.release_pages();
        }
    }

    /// The source of each rank's shards.
    pub fn shards(&self) -> &dyn ShardInit {
        match self {
            Self::Seeded(init) => init,
            Self::Checkpoint(weights) => weights.as_ref(),
        }
    }

    /// A digest of the weights, equal on ranks that start from the same values: the seed, or
    /// every byte of the checkpoint's files.
    pub fn digest(&self) -> u64 {
        match self {
            Self::Seeded(init) => init.seed,
            Self::Checkpoint(weights) => weights.digest(),
        }
    }
}
