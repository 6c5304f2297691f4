//! The CubeCL runtime over the [`crate::driver::Driver`] layer: one generic compute server
//! ([`GpuServer`]) with memory pools (cubecl-runtime's memory management over [`GpuStorage`] and
//! [`PinnedStorage`]), streams ([`GpuStreamBackend`] for cubecl-runtime's `MultiStream`), a kernel
//! cache (cubecl-cpp + the platform's dialect → the platform's run-time compiler → module →
//! function), launches, profiling (host timing around stream synchronisation; the device's own
//! timers around each launch with [`set_kernel_timing`]) and the ordering rule for blocking
//! copies (see [`server`]).
//!
//! What differs between GPUs is a [`Platform`]: [`MacaPlatform`] (MetaX: MACA runtime, `mcrtc`,
//! [`crate::dialect::MacaDialect`]), and with the `cuda-proxy` feature `CudaProxyPlatform`
//! (NVIDIA: CUDA driver API, NVRTC, cubecl-cpp's CUDA dialect).

mod autotune_log;
pub mod compile_cache;
#[cfg(feature = "cuda-proxy")]
mod cuda_platform;
mod emu_platform;
mod error;
mod fence;
mod host_bytes;
mod kernel;
mod kernel_time;
mod order;
mod platform;
pub mod registry;
pub mod server;
mod staging;
mod storage;
mod stream;
mod transfer;

pub use autotune_log::log_autotune_choices;
#[cfg(feature = "cuda-proxy")]
pub use cuda_platform::{CUDA_PROXY_DEVICE_TYPE_ID, CudaProxyDevice, CudaProxyPlatform, cuda_driver};
pub use emu_platform::{
    METAX_EMU_DEVICE_TYPE_ID, MetaxEmuDevice, MetaxEmuPlatform, emu_driver, install_emu_driver,
};
pub use error::BackendError;
pub use fence::Fence;
pub use host_bytes::{host_bytes_of_device, host_bytes_of_stream, host_bytes_of_this_thread};
pub use kernel_time::{KernelTime, set_kernel_timing, take_kernel_time};
pub use order::{StreamOrdering, set_stream_ordering, stream_ordering};
pub use platform::{
    GpuDevice, MACA_DEVICE_TYPE_ID, MacaDevice, MacaPlatform, Platform, install_maca_driver, maca_driver,
    maca_rtc_options,
};
pub use server::GpuServer;
pub use storage::{
    DEVICE_MEMORY_ALIGNMENT, GpuResource, GpuStorage, PINNED_MEMORY_ALIGNMENT, PinnedResource, PinnedStorage,
};
pub use stream::{GpuStream, GpuStreamBackend};

use std::marker::PhantomData;

use cubecl_common::device::{Device, DeviceId};
use cubecl_core::ir::TargetProperties;
use cubecl_core::zspace::striding::has_contiguous_row_major_strides;
use cubecl_core::zspace::{Shape, Strides};
use cubecl_cpp::shared::CppCompiler;
use cubecl_runtime::client::ComputeClient;
use cubecl_runtime::runtime::Runtime;

/// The CubeCL runtime of platform `P`.
pub struct DriverRuntime<P: Platform> {
    _platform: PhantomData<P>,
}

impl<P: Platform> Clone for DriverRuntime<P> {
    fn clone(&self) -> Self {
        Self { _platform: PhantomData }
    }
}

impl<P: Platform> std::fmt::Debug for DriverRuntime<P> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "DriverRuntime<{}>", P::NAME)
    }
}

/// The CubeCL runtime for MetaX GPUs.
pub type MacaRuntime = DriverRuntime<MacaPlatform>;

/// The CubeCL runtime of the emulated MetaX device ([`crate::emu`]): the same server and MACA
/// dialect as [`MacaRuntime`], over the host-CPU emulator instead of the MACA runtime.
pub type MetaxEmuRuntime = DriverRuntime<MetaxEmuPlatform>;

/// The CubeCL runtime of the CUDA proxy (the MetaX server on NVIDIA GPUs).
#[cfg(feature = "cuda-proxy")]
pub type CudaProxyRuntime = DriverRuntime<CudaProxyPlatform>;

impl<P: Platform> DriverRuntime<P> {
    /// The devices the platform's driver reports; empty when the driver is missing (use
    /// [`DriverRuntime::first_device`] or [`DriverRuntime::check_device`] to learn why).
    pub fn devices() -> Vec<P::Device> {
        let Ok(driver) = P::driver() else { return Vec::new() };
        (0..driver.device_count().unwrap_or(0)).map(P::Device::with_index).collect()
    }

    /// Checks that `device` can be used: the driver loads, the ordinal exists and the device is
    /// not poisoned. Returns the device's properties.
    pub fn check_device(device: &P::Device) -> Result<crate::driver::DeviceProperties, BackendError> {
        server::check_device::<P>(device.index())
    }

    /// The first device, or an error saying why there is none (e.g. "libmcruntime.so not found
    /// under /opt/maca/lib (MACA_PATH=…)").
    pub fn first_device() -> Result<P::Device, BackendError> {
        let device = P::Device::with_index(0);
        Self::check_device(&device)?;
        Ok(device)
    }

    /// The compute client of `device`, after [`DriverRuntime::check_device`]: an error instead of
    /// the panic `Runtime::client` gives for an unusable device.
    pub fn try_client(device: &P::Device) -> Result<ComputeClient<Self>, BackendError> {
        Self::check_device(device)?;
        Ok(ComputeClient::load(device))
    }
}

impl<P: Platform> Runtime for DriverRuntime<P> {
    type Compiler = CppCompiler<P::Dialect>;
    type Server = GpuServer<P>;
    type Device = P::Device;

    fn client(device: &Self::Device) -> ComputeClient<Self> {
        ComputeClient::load(device)
    }

    fn name(_client: &ComputeClient<Self>) -> &'static str {
        P::NAME
    }

    fn require_array_lengths() -> bool {
        true
    }

    fn max_cube_count() -> (u32, u32, u32) {
        (i32::MAX as u32, u16::MAX as u32, u16::MAX as u32)
    }

    fn can_read_tensor(shape: &Shape, strides: &Strides) -> bool {
        shape.is_empty() || has_contiguous_row_major_strides(shape, strides)
    }

    fn target_properties() -> TargetProperties {
        P::target_properties()
    }

    fn enumerate_devices(type_id: u16, _info: &()) -> Vec<DeviceId> {
        Self::devices().iter().map(Device::to_id).filter(|id| id.type_id == type_id).collect()
    }
}
