//! `cargo xtask train-qwen3`: the flags of Qwen3 training, turned into a call of the library's
//! training loop ([`qwen3_burn::trainer`]) — single device (`--no-fsdp`), FSDP, HSDP, FSDP ×
//! tensor parallelism, offload, over in-process ranks or MPI/env processes.
//!
//! | file | what |
//! |---|---|
//! | `args.rs` | the flags ([`TrainArgs`]) |
//! | `setup.rs` | the model, weights and data they name, every flag checked ([`setup()`]) |
//! | `ranks.rs` | the loop's options and backend per kind of run, one rank's share of a job |
//! | `report.rs` | metrics file and terminal ([`MetricsSink`]), comparison, `summary.json` |
//! | `run.rs` | the entry point: launching or joining a job, running, reporting ([`run()`]) |
//!
//! The files import in one direction: `run` → the launchers (`crate::launch`,
//! `crate::env_launch`) → `ranks` → `setup`, `report` → `args`.

pub(crate) mod args;
pub(crate) mod ranks;
pub(crate) mod report;
mod run;
pub(crate) mod setup;

pub(crate) use args::parse_mesh;
pub use args::{
    ActivationCheckpointing, CpuBackend, DeviceKind, InProcessCollectives, Launcher, Precision, TrainArgs,
};
pub use qwen3_burn::trainer::{LOSS_CHUNK_BYTES, RankGroups, StepMetrics, Topology, export_hf};
#[cfg(feature = "metax")]
pub use ranks::train_fsdp_emu;
pub use ranks::{
    FsdpTrainBackend, cpu_rank, fsdp_config, fsdp_rank, options, regathers, train_fsdp, train_fsdp_cpu,
    train_fsdp_on, train_single,
};
pub use report::{Comparison, MetricsSink, compare, default_run_dir, read_reference};
pub use run::{run, train_entry};
pub use setup::{DEFAULT_STEPS, Setup, resolve_checkpoint, setup};
