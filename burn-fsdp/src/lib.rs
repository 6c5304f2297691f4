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
//! - FSDP proper, on top, after PyTorch's `_fully_shard/`, one concept per file
//!   under `src/fsdp/` (each at the crate root, one path per item): [`param`] (the sharded parameter), [`param_group`] (the parameter
//!   group), [`collectives`] and [`prefetch`] (the unit's gathers and reduce-scatters, inline or
//!   on a communication thread), [`op`] (the autodiff hooks), [`view`] (the parameters cut out
//!   of a gathered unit), [`offload`], [`init`] (deferred, per-shard initialisation:
//!   [`Fsdp::wrap_deferred`]), rank 0's values broadcast at wrap, and the public API
//!   ([`Fsdp`]).
//! - The model's side, used by FSDP and by models: [`runner`] and [`activation`] (the hooks a
//!   model runs its blocks through, activation checkpointing) and [`walk`] (module paths and
//!   parameter descriptions, shared with `tp`).
//! - burn-train: `learner::FsdpStrategy` (feature `learner`), FSDP inside burn-train's
//!   `Learner`; [`FsdpUnit`] marks a model's blocks as units without changing its forward.
//! - Beside FSDP: [`tp`] (tensor parallelism on a 2-D mesh), [`optim`] (AdamW on shards, clipping),
//!   [`checkpoint`] and [`io`] (sharded state on disk).
//!
//! Features: none by default — burn-fsdp depends on `burn` with `std` and `autodiff` only and
//! runs on any backend through Burn's tensor ops; `cpu` adds host fast paths for NdArray and
//! Flex (same bits, fewer copies); `mpi` adds `comm::mpi::MpiGroup`.
#![warn(missing_docs)]

pub mod activation;
pub mod checkpoint;
pub mod comm;
mod downcast;
mod fsdp;
pub mod host_memory;
pub mod io;
#[cfg(feature = "learner")]
pub mod learner;
pub mod optim;
mod records;
pub mod runner;
pub mod tp;
#[cfg(feature = "cpu")]
mod transpose;
pub mod unit;
pub mod walk;

// FSDP's parts, at the crate root (`burn_fsdp::param`, `burn_fsdp::offload`, …): their one path.
pub use fsdp::{collectives, init, offload, op, param, param_group, prefetch, view};

pub use comm::local::{LocalGroup, launch};
pub use comm::mesh::DeviceMesh;
pub use comm::{CollectiveFailure, CollectiveKind, CommError, CommStats, ProcessGroup, ReduceOp, Tag};
pub use fsdp::{Fsdp, FsdpConfig, FsdpError, FsdpEvalRunner, FsdpRunner, MixedPrecisionPolicy, UnitPolicy};
pub use host_memory::retain_host_memory;
pub use op::FsdpBackend;
pub use optim::{TorchAdamW, TorchAdamWConfig, clip_grad_norm, grad_norm};
pub use runner::{Direct, ModuleHooks, NoHooks, UnitRunner};
pub use unit::FsdpUnit;
pub use walk::PathStack;
