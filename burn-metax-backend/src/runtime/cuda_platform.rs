//! The `cuda-proxy` platform: the same server over [`CudaDriver`] (CUDA driver API + NVRTC) with
//! cubecl-cpp's CUDA dialect (warp 32), to run the MetaX backend's server on NVIDIA GPUs.

use std::path::PathBuf;
use std::sync::{Arc, OnceLock};

use cubecl_common::device::{Device, DeviceId};
use cubecl_core::ir::{ContiguousElements, MatrixLayout, MmaProperties, TargetProperties};
use cubecl_cpp::cuda::CudaDialect;
use cubecl_cpp::cuda::mma::PtxWmmaCompiler;
use cubecl_cpp::shared::{CompilationOptions, CppSupportedFeatures};

use super::platform::{GpuDevice, Platform};
use crate::driver::{CudaDriver, DeviceProperties, Driver, DriverError};

/// The CUDA proxy platform.
#[derive(Clone, Copy, Debug, Default)]
pub struct CudaProxyPlatform;

/// An NVIDIA GPU driven by the proxy, by ordinal.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Hash)]
pub struct CudaProxyDevice {
    /// The CUDA device ordinal.
    pub index: usize,
}

impl CudaProxyDevice {
    /// The device with ordinal `index`.
    pub const fn new(index: usize) -> Self {
        Self { index }
    }
}

/// `DeviceId::type_id` of [`CudaProxyDevice`].
pub const CUDA_PROXY_DEVICE_TYPE_ID: u16 = 0;

impl Device for CudaProxyDevice {
    fn from_id(device_id: DeviceId) -> Self {
        Self { index: usize::from(device_id.index_id) }
    }

    fn to_id(&self) -> DeviceId {
        DeviceId {
            type_id: CUDA_PROXY_DEVICE_TYPE_ID,
            index_id: u16::try_from(self.index).unwrap_or(u16::MAX),
        }
    }
}

impl burn::tensor::backend::DeviceOps for CudaProxyDevice {}

impl GpuDevice for CudaProxyDevice {
    fn index(&self) -> usize {
        self.index
    }

    fn with_index(index: usize) -> Self {
        Self { index }
    }
}

static CUDA_DRIVER: OnceLock<Result<Arc<CudaDriver>, DriverError>> = OnceLock::new();

/// The process-wide CUDA driver of the proxy (loaded on first use).
pub fn cuda_driver() -> Result<Arc<CudaDriver>, DriverError> {
    CUDA_DRIVER.get_or_init(|| CudaDriver::load().map(Arc::new)).clone()
}

/// The CUDA include directory for NVRTC: `$CUDA_PATH/include`, `$CUDA_HOME/include` or
/// `/usr/local/cuda/include`, the first that exists.
fn cuda_include_dir() -> Option<PathBuf> {
    ["CUDA_PATH", "CUDA_HOME"]
        .iter()
        .filter_map(|v| std::env::var_os(v).map(PathBuf::from))
        .chain(std::iter::once(PathBuf::from("/usr/local/cuda")))
        .map(|root| root.join("include"))
        .find(|dir| dir.is_dir())
}

impl Platform for CudaProxyPlatform {
    type Dialect = CudaDialect<PtxWmmaCompiler>;
    type Device = CudaProxyDevice;
    const NAME: &'static str = "cuda-proxy";

    fn driver() -> Result<Arc<dyn Driver>, DriverError> {
        cuda_driver().map(|d| d as Arc<dyn Driver>)
    }

    fn compilation_options(properties: &DeviceProperties) -> CompilationOptions {
        CompilationOptions {
            warp_size: properties.warp_size,
            // The info buffer goes by pointer (no grid constants), as for MACA.
            supports_features: CppSupportedFeatures {
                grid_constants: false,
                clusters: false,
                fast_math: false,
                fast_tanh: false,
                elect_sync: false,
            },
        }
    }

    fn rtc_options(properties: &DeviceProperties) -> Vec<String> {
        let (major, minor) = properties.compute_capability;
        let mut options =
            vec![format!("--gpu-architecture=compute_{major}{minor}"), "--std=c++17".to_string()];
        if let Some(include) = cuda_include_dir() {
            options.push(format!("--include-path={}", include.display()));
        }
        if let Ok(extra) = std::env::var("CUDA_PROXY_RTC_OPTIONS") {
            options.extend(extra.split_whitespace().map(str::to_string));
        }
        options
    }

    fn target_properties() -> TargetProperties {
        // No MMA features are registered by this server; plain defaults for warp 32.
        TargetProperties {
            mma: MmaProperties {
                register_size_bits: 32,
                const_plane_size: 32,
                register_layout_a: MatrixLayout::RowMajor,
                register_layout_b: MatrixLayout::ColMajor,
                register_layout_acc: MatrixLayout::RowMajor,
                register_duplication_a: 1,
                register_duplication_b: 1,
                register_duplication_acc: 1,
                contiguous_elements: ContiguousElements::new(|_, _| 1),
            },
        }
    }

    fn unavailable_reason(driver_error: Option<&DriverError>) -> String {
        match driver_error {
            Some(err) => format!("the CUDA driver could not be loaded: {err}"),
            None => "the CUDA driver reports no device".to_string(),
        }
    }
}
