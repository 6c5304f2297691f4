//! FSDP proper, on top of the communication layer ([`crate::comm`]), after PyTorch's
//! `_fully_shard/` package: one concept per file.
//!
//! | file | what | FSDP2 |
//! |---|---|---|
//! | `api.rs` | [`Fsdp`], [`FsdpConfig`], [`MixedPrecisionPolicy`], [`UnitPolicy`], [`FsdpError`]: the types and accessors; split by concern into `api/wrap.rs` (sharding a model), `api/forward.rs` (the forward and its runner), `api/step.rs` (gradients, clipping, the optimizer step), `api/state.rs` (full parameters, shard values), `api/eval.rs` ([`FsdpEvalRunner`], without autodiff) | `fully_shard.py`, `_fsdp_state.py` |
//! | [`param`] | the sharded parameter: a rank's rows of one parameter | `_fsdp_param.py` |
//! | [`param_group`] | the parameter group: the parameters gathered together | `_fsdp_param_group.py` |
//! | `collectives.rs` | a unit's all-gather and reduce-scatter | `_fsdp_collectives.py` |
//! | [`prefetch`] | the same on a communication thread, one unit ahead | (streams and events) |
//! | [`op`] | the differentiable gather: the autodiff hooks whose backward reduce-scatters | (autograd hooks) |
//! | `view.rs` | each parameter cut out of a gathered unit | (`_fsdp_param.py` views) |
//! | [`offload`] | shards, gradients and AdamW state on the host | `CPUOffloadPolicy` |
//! | [`init`] | deferred, per-shard initialisation ([`Fsdp::wrap_deferred`]) | meta-device init |
//! | `rank0_broadcast.rs` | rank 0's values broadcast at wrap | `_init_sharded_param` |
//! | `scope.rs` | how a block marked [`FsdpUnit`](crate::FsdpUnit) finds the forward of its thread | (module hooks) |
//!
//! None of these files imports another in a circle, and none of them is imported by
//! [`crate::comm`].

mod api;
pub(crate) mod collectives;
pub mod init;
pub mod offload;
pub mod op;
pub mod param;
pub mod param_group;
pub mod prefetch;
pub(crate) mod rank0_broadcast;
pub(crate) mod scope;
pub(crate) mod view;

pub use api::*;
