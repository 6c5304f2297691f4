//! Fully sharded data parallelism for Burn, modelled on PyTorch FSDP2 (`fully_shard`).
//!
//! - [`Fsdp::wrap`] shards every parameter of any Burn module on dim 0 across the ranks of a
//!   [`DeviceMesh`], grouped into units (by default one per element of a `Vec` of modules,
//!   e.g. per decoder layer, plus the root unit).
//! - [`Fsdp::wrap_deferred`] does the same for a model built with lazy parameters: each rank
//!   creates only its own shards from a [`init::ShardInit`] (a seed, a checkpoint's rows), so
//!   no rank ever holds a full copy of the model.
//! - [`Fsdp::forward`] all-gathers each unit just before it runs (through the model's
//!   [`UnitRunner`] hook); the gather is a differentiable op whose backward reduce-scatters
//!   the gradient ([`op`]).
//! - [`TorchAdamW`] steps the shards with PyTorch semantics; [`Fsdp::clip_grad_norm`] clips by the
//!   global norm; [`Fsdp::set_requires_gradient_sync`] accumulates without communication.
//! - Ranks talk through a [`ProcessGroup`]; [`LocalGroup`]/[`launch`] run ranks as threads.
//!
//! Module layout follows PyTorch's `_fully_shard/`: one concept per file — [`param`] (the
//! sharded parameter), [`unit`] (the parameter group), [`collectives`], [`op`] (the autodiff
//! hooks), [`view`] (the parameters cut out of a gathered unit), `replicas` (rank 0's values broadcast at wrap), [`init`] (deferred, per-shard
//! initialisation: [`Fsdp::wrap_deferred`]), [`fsdp`] (the public API).
#![warn(missing_docs)]

pub mod activation;
pub mod checkpoint;
pub mod collectives;
pub mod comm;
pub mod fsdp;
pub mod host;
pub mod init;
pub mod io;
pub mod local;
pub mod mesh;
#[cfg(feature = "mpi")]
pub mod mpi;
pub mod offload;
pub mod op;
pub mod optim;
pub mod param;
pub mod prefetch;
mod replicas;
pub mod runner;
pub mod tcp;
pub mod tp;
pub mod unit;
pub mod view;

pub use comm::{CollectiveFailure, CollectiveKind, CommError, CommStats, ProcessGroup, ReduceOp, Tag};
pub use fsdp::{
    Fsdp, FsdpConfig, FsdpError, FsdpEvalRunner, FsdpRunner, MixedPrecisionPolicy, PathStack, UnitPolicy,
};
pub use local::{LocalGroup, launch};
pub use mesh::DeviceMesh;
pub use op::FsdpBackend;
pub use optim::{TorchAdamW, TorchAdamWConfig, clip_grad_norm, grad_norm};
pub use runner::{Direct, ModuleHooks, NoHooks, UnitRunner};
