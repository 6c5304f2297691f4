//! burn-metax-backend: a Burn backend for MetaX GPUs through the MACA runtime and CubeCL 0.10.
//!
//! - [`Metax`]: `CubeBackend<MacaRuntime, F, I, u8>`, the Burn backend (use
//!   `burn::backend::Autodiff<Metax>` for training); get a device with
//!   [`MacaRuntime::first_device`](runtime::DriverRuntime::first_device), which explains why
//!   there is none (e.g. `libmcruntime.so not found under /opt/maca/lib (MACA_PATH=…)`).
//! - [`runtime`]: the CubeCL runtime — one compute server ([`runtime::GpuServer`]) generic over a
//!   [`runtime::Platform`] (driver + cubecl-cpp dialect + run-time compiler): memory pools,
//!   streams, kernel cache, launches, profiling, and the rule that a blocking read first waits for
//!   every stream's queued work.
//! - [`driver`]: the [`driver::Driver`] trait over the GPU runtime calls, its error type with the
//!   MACA status-code table, and [`driver::MacaDriver`], which opens `libmcruntime.so` at run
//!   time from `$MACA_PATH/lib` (default `/opt/maca/lib`). With the `cuda-proxy` feature,
//!   `driver::CudaDriver` (CUDA driver API + NVRTC through cudarc, loaded at run time) runs the
//!   same server on NVIDIA GPUs as the `CudaProxy` backend.
//! - [`dialect`]: [`dialect::MacaDialect`], the cubecl-cpp dialect for MACA (64-lane waves,
//!   64-bit ballots and shuffle masks, no inline assembly, no MMA), and
//!   [`dialect::compile_kernel_source`], which compiles a CubeCL kernel to MACA C++ source.
//! - [`emu`]: the emulated MetaX device — the dialect's kernels compiled by the host C++ compiler
//!   and run on the CPU with wave-64 semantics, asynchronous streams and events — and
//!   [`MetaxEmu`], the backend over it (`CubeBackend<MetaxEmuRuntime>`: the same server and
//!   dialect as [`Metax`]). Every kernel the backend generates runs in CI this way.
//! - [`mccl`]: MCCL collectives (`libmccl.so`, loaded at run time): [`mccl::Mccl`] and
//!   [`mccl::MacaCommunicator`].
//! - `collective` (feature `collectives`): device-buffer communicators for burn-fsdp — the
//!   `DeviceCommunicator` trait (MCCL; NCCL with the `cuda` feature) and `DeviceGroup`, a
//!   `burn_fsdp::comm::ProcessGroup` whose collectives run on a communication stream ordered
//!   against the compute streams by events.
//!
//! The tests build a mock `libmcruntime.so`/`libmccl.so` (`mock-mcruntime/`, a standalone crate)
//! and run the driver, the server and the backend against it.
#![warn(missing_docs)]
#![warn(clippy::undocumented_unsafe_blocks)]

mod backend;
#[cfg(feature = "collectives")]
pub mod collective;
pub mod dialect;
pub mod driver;
pub mod emu;
pub mod mccl;
pub mod runtime;

#[cfg(feature = "cuda-proxy")]
pub use backend::CudaProxy;
#[cfg(all(feature = "cuda-proxy", feature = "fusion"))]
pub use backend::CudaProxyFused;
pub use backend::{Metax, MetaxDevice, MetaxEmu};
#[cfg(feature = "fusion")]
pub use backend::{MetaxEmuFused, MetaxFused};
pub use runtime::{BackendError, MacaDevice, MacaRuntime, MetaxEmuDevice, MetaxEmuRuntime};
#[cfg(feature = "cuda-proxy")]
pub use runtime::{CudaProxyDevice, CudaProxyRuntime};
