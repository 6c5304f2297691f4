//! The `cuda-proxy` platform: the same server over [`CudaDriver`] (CUDA driver API + NVRTC) with
//! cubecl-cpp's CUDA dialect (warp 32), to run the MetaX backend's server on NVIDIA GPUs.

use std::path::PathBuf;
use std::sync::{Arc, OnceLock};

use cubecl_common::device::{Device, DeviceId};
use cubecl_core::ir::{ContiguousElements, MatrixLayout, MmaProperties, TargetProperties};
use cubecl_cpp::DialectWmmaCompiler;
use cubecl_cpp::cuda::CudaDialect;
use cubecl_cpp::cuda::arch::CudaArchitecture;
use cubecl_cpp::cuda::mma::{CudaWmmaCompiler, contiguous_elements_cuda};
use cubecl_cpp::shared::{
    CompilationOptions, CppSupportedFeatures, register_mma_features, register_wmma_features,
};

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

/// The CUDA include directory for NVRTC: `$CUDA_INCLUDE` (set by `scripts/gpu-check.sh`), else
/// `include` under `$CUDA_PATH`, `$CUDA_HOME` or `/usr/local/cuda`, the first that exists.
fn cuda_include_dir() -> Option<PathBuf> {
    std::env::var_os("CUDA_INCLUDE")
        .filter(|v| !v.is_empty())
        .map(PathBuf::from)
        .into_iter()
        .chain(
            ["CUDA_PATH", "CUDA_HOME"]
                .iter()
                .filter_map(|v| std::env::var_os(v).map(PathBuf::from))
                .chain(std::iter::once(PathBuf::from("/usr/local/cuda")))
                .map(|root| root.join("include")),
        )
        .find(|dir| dir.is_dir())
}

/// NVRTC's include options for the CUDA include directory `include`: the directory itself and,
/// where present, its `cccl` subdirectory — CUDA 13 moved the `cuda/std` headers that
/// `cuda_fp16.h`/`cuda_bf16.h` include there, so f16/bf16 kernels do not compile without it.
fn include_options(include: &std::path::Path) -> Vec<String> {
    let mut options = vec![format!("--include-path={}", include.display())];
    let cccl = include.join("cccl");
    if cccl.is_dir() {
        options.push(format!("--include-path={}", cccl.display()));
    }
    options
}

/// Whether the proxy registers tensor-core matrix products with CubeCL: yes unless
/// `CUDA_PROXY_TENSOR_CORES` is `0`, `off` or `false` (to compare with the plain kernels, or to
/// rule them out when a result is wrong).
fn tensor_cores_enabled() -> bool {
    !matches!(
        std::env::var("CUDA_PROXY_TENSOR_CORES").as_deref().map(str::to_ascii_lowercase).as_deref(),
        Ok("0" | "off" | "false")
    )
}

/// Registers the WMMA and MMA shapes cubecl-cpp's CUDA WMMA compiler (`CudaWmmaCompiler`, the one
/// cubecl-cuda uses by default) emits for compute capability
/// `version` (`major * 10 + minor`), and the tensor-core hardware figures CubeCL's matmul
/// selection reads. Nothing below Volta (7.0).
fn register_tensor_cores(version: u32, cube: &mut cubecl_core::ir::DeviceProperties) {
    let arch = CudaArchitecture { version };
    let wmma =
        <CudaWmmaCompiler as DialectWmmaCompiler<CudaDialect<CudaWmmaCompiler>>>::supported_wmma_combinations(
            &arch,
        );
    let mma =
        <CudaWmmaCompiler as DialectWmmaCompiler<CudaDialect<CudaWmmaCompiler>>>::supported_mma_combinations(
            &arch,
        );
    if !wmma.is_empty() {
        cube.hardware.min_tensor_cores_dim = Some(8);
        cube.hardware.num_tensor_cores = tensor_cores_per_sm(version);
    }
    register_wmma_features(wmma, cube);
    register_mma_features(mma, cube);
}

/// Tensor cores per multiprocessor by compute capability (`major * 10 + minor`), where known.
fn tensor_cores_per_sm(version: u32) -> Option<u32> {
    match version {
        70 | 75 => Some(8),
        80 | 86 | 87 | 89 | 90 | 100 | 120 => Some(4),
        _ => None,
    }
}

impl Platform for CudaProxyPlatform {
    type Dialect = CudaDialect<CudaWmmaCompiler>;
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
            options.extend(include_options(&include));
        }
        if let Ok(extra) = std::env::var("CUDA_PROXY_RTC_OPTIONS") {
            options.extend(extra.split_whitespace().map(str::to_string));
        }
        options
    }

    fn target_properties() -> TargetProperties {
        // CUDA's warp-32 fragment layout, as cubecl-cuda declares it: it only matters once
        // `register_features` has registered the tensor-core products.
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
                contiguous_elements: ContiguousElements::new(contiguous_elements_cuda),
            },
        }
    }

    fn unavailable_reason(driver_error: Option<&DriverError>) -> String {
        match driver_error {
            Some(err) => format!("the CUDA driver could not be loaded: {err}"),
            None => "the CUDA driver reports no device".to_string(),
        }
    }

    /// Tensor cores: the WMMA and MMA shapes cubecl-cpp's CUDA WMMA compiler emits for the
    /// device's compute capability — what cubecl-cuda registers for Burn's own CUDA backend, with
    /// the same compiler (not the PTX one: on an H200 its fragment casts panicked, `casting
    /// fragment to float not supported`, for autotune's f16 tensor-core candidates) — so that
    /// cubek's matrix products (autotune's tensor-core candidates) may use them. Off with
    /// `CUDA_PROXY_TENSOR_CORES=0`.
    fn register_features(properties: &DeviceProperties, cube: &mut cubecl_core::ir::DeviceProperties) {
        if tensor_cores_enabled() {
            let (major, minor) = properties.compute_capability;
            register_tensor_cores(major * 10 + minor, cube);
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::runtime::server::cube_properties;

    fn h200() -> DeviceProperties {
        DeviceProperties {
            name: "stand-in for an H200".into(),
            warp_size: 32,
            max_threads_per_block: 1024,
            max_block_dim: [1024, 1024, 64],
            max_grid_dim: [i32::MAX as u32, 65535, 65535],
            max_shared_memory_per_block: 227 << 10,
            multiprocessor_count: 132,
            compute_capability: (9, 0),
            total_memory: 141 << 30,
        }
    }

    #[test]
    fn tensor_cores_are_registered_from_volta_on_only() {
        let mut hopper = cube_properties::<CudaProxyPlatform>(&h200());
        hopper.features.matmul.cmma.clear();
        hopper.features.matmul.mma.clear();
        register_tensor_cores(90, &mut hopper);
        assert!(!hopper.features.matmul.cmma.is_empty(), "sm_90: WMMA shapes");
        assert!(!hopper.features.matmul.mma.is_empty(), "sm_90: MMA shapes");
        assert_eq!(hopper.hardware.min_tensor_cores_dim, Some(8));
        assert_eq!(hopper.hardware.num_tensor_cores, Some(4));

        let mut pascal = cube_properties::<CudaProxyPlatform>(&h200());
        pascal.features.matmul.cmma.clear();
        pascal.features.matmul.mma.clear();
        pascal.hardware.min_tensor_cores_dim = None;
        register_tensor_cores(61, &mut pascal);
        assert!(pascal.features.matmul.cmma.is_empty() && pascal.features.matmul.mma.is_empty());
        assert_eq!(pascal.hardware.min_tensor_cores_dim, None);
    }

    #[test]
    fn the_maca_platform_registers_no_tensor_cores() {
        let mut props = h200();
        props.warp_size = 64;
        let maca = cube_properties::<crate::runtime::platform::MacaPlatform>(&props);
        assert!(maca.features.matmul.cmma.is_empty() && maca.features.matmul.mma.is_empty());
        assert_eq!(maca.hardware.min_tensor_cores_dim, None);
    }

    #[test]
    fn nvrtc_sees_cccl_when_the_include_directory_has_it() {
        let dir = tempfile::tempdir().expect("temporary directory");
        let plain = include_options(dir.path());
        assert_eq!(plain, vec![format!("--include-path={}", dir.path().display())]);
        std::fs::create_dir(dir.path().join("cccl")).expect("cccl directory");
        let cuda13 = include_options(dir.path());
        assert_eq!(cuda13.len(), 2);
        assert_eq!(cuda13[1], format!("--include-path={}", dir.path().join("cccl").display()));
    }
}
