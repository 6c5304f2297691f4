//! Fully sharded data parallelism for Burn, modelled on PyTorch FSDP2 (`fully_shard`).
#![warn(missing_docs)]

pub mod optim;
pub mod runner;

pub use optim::{AdamW, AdamWConfig, clip_grad_norm, grad_norm};
pub use runner::{Direct, UnitRunner};
