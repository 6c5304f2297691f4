//! The project's commands (`cargo xtask …`), as a library so that tests run exactly what
//! users run.

pub mod bench;
pub mod conformance;
pub mod consolidate;
pub mod data;
pub mod env_launch;
pub mod generate;
#[cfg(feature = "metax")]
pub mod gpu_bench;
pub mod gpu_pack;
pub mod headline;
pub mod launch;
pub mod logits;
#[cfg(feature = "mpi")]
pub mod mpi_tools;
pub mod plan;
pub mod plot;
pub mod schedule;
pub mod tokenizer;
pub mod train;

/// The reference CPU backend (NdArray): `train-qwen3 --cpu-backend ndarray`, the logits and
/// conformance commands, the parity tests' own tensors. `train-qwen3` trains on burn's Flex by
/// default (`--cpu-backend flex`).
pub type Backend = burn::backend::NdArray<f32>;
/// Its autodiff decorator, for single-device training.
pub type TrainBackend = burn::backend::Autodiff<Backend>;

/// The default device of [`Backend`].
pub fn device() -> burn::backend::ndarray::NdArrayDevice {
    burn::backend::ndarray::NdArrayDevice::Cpu
}
