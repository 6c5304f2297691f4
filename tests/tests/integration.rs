//! The cross-crate integration and conformance tests, one module per file of this folder, in
//! one test binary: each binary of its own compiled and linked the same Burn, FSDP and Qwen3
//! code again, and the test command spent most of its build doing so.
//!
//! Run one file's tests with a filter: `cargo test -p tests --test integration fsdp_core::`.
//! The tests that count memory are in the `memory` binary (`memory.rs`).

mod cli_errors;
mod conformance_cli;
mod conformance_ndarray;
mod emu_metax;
mod fsdp_checkpoint;
mod fsdp_core;
mod fsdp_deferred_init;
mod fsdp_offload;
mod fsdp_precision;
mod fused_emu_fsdp;
mod generate_cmd;
mod gpu_check_script;
mod gpu_cuda_proxy;
mod headline;
mod mesh_2d;
mod plan;
mod single_device_parity;
mod train_cli;
