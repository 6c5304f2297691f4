//! Fully sharded data parallelism for Burn, modelled on PyTorch FSDP2 (`fully_shard`).
//!
//! - [`Fsdp::wrap`] shards every trainable parameter of any Burn module on dim 0 across the
//!   ranks of a [`DeviceMesh`], grouped into units: each block the model marks with
//!   [`FsdpUnit`] (e.g. each decoder layer), the rest in the root unit; a model that marks
//!   nothing is one unit. Buffers and frozen parameters stay whole on every rank.
//! - [`Fsdp::wrap_deferred`] does the same for a model built with lazy parameters: each rank
//!   creates only its own shards from a [`init::ShardInit`] (a seed, a checkpoint's rows), so
//!   no rank ever holds a full copy of the model.
//! - [`Fsdp::forward`] runs the model's forward as written, all-gathering each unit just before
//!   it runs ([`FsdpUnit::run`], or the [`UnitRunner`] a model may take); the gather is a
//!   differentiable op whose backward reduce-scatters the gradient ([`op`]).
//! - [`Fsdp::step_with`] steps the shards with any elementwise Burn optimizer, [`TorchAdamW`]
//!   through [`Fsdp::step`] with PyTorch's arithmetic; [`Fsdp::clip_grad_norm`] clips by the
//!   global norm; [`Fsdp::set_requires_gradient_sync`] accumulates without communication.
//! - [`Fsdp::save_records`]/[`Fsdp::load_records`] checkpoint the shards, buffers and any Burn
//!   optimizer's state (resumable at another world size); [`Fsdp::full_module`] gives the whole
//!   model for Burn's own recorder. `learner::FsdpStrategy` (feature `learner`) runs a
//!   burn-train `Learner` over FSDP.
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
//!   group), `collectives` and [`prefetch`] (the unit's gathers and reduce-scatters, inline or
//!   on a communication thread), [`op`] (the autodiff hooks), `view` (the parameters cut out
//!   of a gathered unit), [`offload`], [`init`] (deferred, per-shard initialisation:
//!   [`Fsdp::wrap_deferred`]), rank 0's values broadcast at wrap, and the public API
//!   ([`Fsdp`]).
//! - The model's side, used by FSDP and by models: [`unit`](mod@unit) ([`FsdpUnit`], the mark of a
//!   block), [`runner`] (the runner a model may run its blocks through), [`hooks`] (module
//!   hooks, through which tensor parallelism inserts its collectives),
//!   [`activation_checkpointing`] and [`walk`] (module paths and parameter descriptions, shared
//!   with `tp`).
//! - burn-train: `learner::FsdpStrategy` (feature `learner`), FSDP inside burn-train's
//!   `Learner`; [`FsdpUnit`] marks a model's blocks as units without changing its forward.
//! - Beside FSDP: [`tp`] (tensor parallelism on a 2-D mesh), [`optim`] (AdamW on shards, clipping),
//!   [`checkpoint`] and [`io`] (sharded state on disk).
//!
//! Features: none by default — burn-fsdp depends on `burn` with `std` and `autodiff` only and
//! runs on any backend through Burn's tensor ops; `cpu` adds host fast paths for NdArray and
//! Flex (same bits, fewer copies); `mpi` adds `comm::mpi::MpiGroup`.
#![warn(missing_docs)]

pub mod activation_checkpointing;
pub mod checkpoint;
pub mod comm;
pub mod downcast;
mod fsdp;
pub mod hooks;
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
pub use fsdp::{init, offload, op, param, param_group, prefetch};

pub use comm::local::{LocalGroup, launch};
pub use comm::mesh::DeviceMesh;
pub use comm::{CollectiveFailure, CollectiveKind, CommError, CommStats, ProcessGroup, ReduceOp, Tag};
pub use fsdp::{
    Fsdp, FsdpConfig, FsdpError, FsdpEvalRunner, FsdpRunner, GradientsAndSqSum, MixedPrecisionPolicy,
    StepParts, StepReport, StepValue, UnitPolicy, catch_collective_failures, take_step,
};
pub use hooks::{ModuleHooks, NoHooks};
pub use host_memory::retain_host_memory;
pub use op::FsdpBackend;
pub use optim::{TorchAdamW, TorchAdamWConfig, clip_grad_norm, grad_norm};
pub use runner::{Direct, UnitRunner};
pub use unit::FsdpUnit;
pub use walk::PathStack;
