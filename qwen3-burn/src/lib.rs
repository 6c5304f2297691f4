//! Qwen3 for [Burn](https://burn.dev): the model, Hugging Face `config.json` + safetensors
//! in and out (tied and untied heads, sharded checkpoints), the tokenizer, generation with a
//! KV cache, the training loss, Qwen3's parallelisation plan (FSDP units, tensor
//! parallelism: [`parallelize`]) beside the model, which knows nothing of it, and the
//! training loop ([`trainer`]: one device, FSDP, HSDP, FSDP × tensor parallelism, offload).
#![warn(missing_docs)]

pub mod checkpoint;
pub mod config;
pub mod error;
pub mod generate;
pub mod init;
mod lookup;
pub mod model;
pub mod parallelize;
pub mod tokenizer;
pub mod train;
pub mod trainer;

pub use config::Qwen3Config;
pub use error::{Qwen3Error, Result};
pub use init::Qwen3Init;
pub use model::{KvCache, Qwen3, RopeCache};
