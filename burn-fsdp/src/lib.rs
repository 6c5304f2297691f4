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
//! Layout, by layer:
//!
//! - [`comm`] — the communication layer (PyTorch's c10d), which knows nothing of FSDP:
//!   [`ProcessGroup`] and its transports ([`comm::local`] threads, [`comm::tcp`] processes,
//!   `comm::mpi` with the `mpi` feature), the host reductions they share ([`comm::host`]) and
//!   [`DeviceMesh`] ([`comm::mesh`]). Nothing in it imports from the files below.
//! - FSDP proper, on top, after PyTorch's `_fully_shard/`, one concept per file: [`param`] (the
//!   sharded parameter), [`unit`](mod@unit) (the parameter group), [`collectives`] and [`prefetch`] (the
//!   unit's gathers and reduce-scatters, inline or on a communication thread), [`op`] (the
//!   autodiff hooks), [`view`] (the parameters cut out of a gathered unit), [`offload`],
//!   `replicas` (rank 0's values broadcast at wrap), [`init`] (deferred, per-shard
//!   initialisation: [`Fsdp::wrap_deferred`]), [`runner`] and [`activation`] (the model's
//!   hooks, activation checkpointing), [`walk`] (module paths and parameter descriptions, shared
//!   with `tp`), [`fsdp`] (the public API).
//! - Beside it: [`tp`] (tensor parallelism on a 2-D mesh), [`optim`] (AdamW on shards, clipping),
//!   [`checkpoint`] and [`io`] (sharded state on disk).
#![warn(missing_docs)]

pub mod activation;
pub mod checkpoint;
pub mod collectives;
pub mod comm;
pub mod fsdp;
pub mod init;
pub mod io;
pub mod offload;
pub mod op;
pub mod optim;
pub mod param;
pub mod prefetch;
mod replicas;
pub mod runner;
pub mod tp;
pub mod unit;
pub mod view;
pub mod walk;

pub use comm::local::{LocalGroup, launch};
pub use comm::mesh::DeviceMesh;
pub use comm::{CollectiveFailure, CollectiveKind, CommError, CommStats, ProcessGroup, ReduceOp, Tag};
pub use fsdp::{Fsdp, FsdpConfig, FsdpError, FsdpEvalRunner, FsdpRunner, MixedPrecisionPolicy, UnitPolicy};
pub use op::FsdpBackend;
pub use optim::{TorchAdamW, TorchAdamWConfig, clip_grad_norm, grad_norm};
pub use runner::{Direct, ModuleHooks, NoHooks, UnitRunner};
pub use walk::PathStack;
