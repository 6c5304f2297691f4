//! [`Platform`]: what differs between the GPUs the one server runs on — the driver, the
//! cubecl-cpp dialect and its options, the run-time compiler options, the device type.

use std::fmt;
use std::path::Path;
use std::sync::{Arc, OnceLock};

use cubecl_common::device::{Device, DeviceId};
use cubecl_core::ir::{ContiguousElements, MatrixLayout, MmaProperties, TargetProperties};
use cubecl_cpp::shared::{CompilationOptions, Dialect};

use crate::dialect::{MACA_WARP_SIZE, MacaDialect, maca_compilation_options};
use crate::driver::{DeviceProperties, Driver, DriverError, MacaDriver, maca_root};

/// A device of a [`Platform`]: a CubeCL device with an ordinal.
pub trait GpuDevice: Device + Copy + Eq + std::hash::Hash {
    /// The device ordinal as the driver numbers it.
    fn index(&self) -> usize;
    /// The device with ordinal `index`.
    fn with_index(index: usize) -> Self;
}

/// What the generic server needs to know about a GPU platform.
pub trait Platform: Clone + fmt::Debug + Send + Sync + 'static {
    /// The cubecl-cpp dialect kernels are compiled with.
    type Dialect: Dialect;
    /// The device type.
    type Device: GpuDevice;
    /// Short name ("metax", "cuda-proxy").
    const NAME: &'static str;

    /// The process-wide driver (loaded on first use).
    fn driver() -> Result<Arc<dyn Driver>, DriverError>;
    /// cubecl-cpp options for a device with these properties.
    fn compilation_options(properties: &DeviceProperties) -> CompilationOptions;
    /// Options for the run-time compiler.
    fn rtc_options(properties: &DeviceProperties) -> Vec<String>;
    /// CubeCL target properties (matrix-multiply layout hints).
    fn target_properties() -> TargetProperties;
    /// A sentence explaining why no device is available, for errors (`driver_error` is why the
    /// driver did not load, if it did not).
    fn unavailable_reason(driver_error: Option<&DriverError>) -> String;

    /// Registers what the platform adds to CubeCL's view of a device beyond the common
    /// properties (e.g. the tensor-core matrix shapes the CUDA proxy's dialect emits). Default:
    /// nothing — MetaX MMA stays off until it has been verified on the hardware.
    fn register_features(_properties: &DeviceProperties, _cube: &mut cubecl_core::ir::DeviceProperties) {}

    /// Whether the device computes in f64 (registered as a supported CubeCL type). CubeCL's C++
    /// runtimes leave f64 out on CUDA (`cubecl_cpp::register_supported_types`: a matmul failure
    /// there); MetaX C500-class GPUs have FP64 units, and the MACA platform enables it.
    const F64: bool = false;
}

/// The MetaX platform: [`MacaDriver`] (MACA runtime + `mcrtc`) and [`MacaDialect`] (wave 64).
#[derive(Clone, Copy, Debug, Default)]
pub struct MacaPlatform;

/// A MetaX GPU, by ordinal.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Hash)]
pub struct MacaDevice {
    /// The device ordinal (`mcSetDevice` numbering).
    pub index: usize,
}

impl MacaDevice {
    /// The device with ordinal `index` (whether it exists is checked when it is first used, or
    /// up front with [`super::DriverRuntime::check_device`]).
    pub const fn new(index: usize) -> Self {
        Self { index }
    }
}

/// `DeviceId::type_id` of [`MacaDevice`].
pub const MACA_DEVICE_TYPE_ID: u16 = 0;

impl Device for MacaDevice {
    fn from_id(device_id: DeviceId) -> Self {
        Self { index: usize::from(device_id.index_id) }
    }

    fn to_id(&self) -> DeviceId {
        DeviceId { type_id: MACA_DEVICE_TYPE_ID, index_id: u16::try_from(self.index).unwrap_or(u16::MAX) }
    }
}

impl burn::tensor::backend::DeviceOps for MacaDevice {}

impl GpuDevice for MacaDevice {
    fn index(&self) -> usize {
        self.index
    }

    fn with_index(index: usize) -> Self {
        Self { index }
    }
}

static MACA_DRIVER: OnceLock<Result<Arc<MacaDriver>, DriverError>> = OnceLock::new();

/// Makes `driver` the process-wide MACA driver used by [`crate::MacaRuntime`], instead of the one
/// [`MacaDriver::load`] would open from `$MACA_PATH`. Returns `false` (and leaves the driver in
/// place) if a driver was already installed or loaded.
///
/// Tests use this to run the runtime over the mock `libmcruntime.so`.
pub fn install_maca_driver(driver: MacaDriver) -> bool {
    MACA_DRIVER.set(Ok(Arc::new(driver))).is_ok()
}

/// The process-wide MACA driver: loaded from `$MACA_PATH/lib` (default `/opt/maca/lib`) on first
/// use, unless [`install_maca_driver`] was called before. A failed load is remembered.
pub fn maca_driver() -> Result<Arc<MacaDriver>, DriverError> {
    MACA_DRIVER.get_or_init(|| MacaDriver::load().map(Arc::new)).clone()
}

impl Platform for MacaPlatform {
    type Dialect = MacaDialect;
    type Device = MacaDevice;
    const NAME: &'static str = "metax";
    const F64: bool = true;

    fn driver() -> Result<Arc<dyn Driver>, DriverError> {
        maca_driver().map(|d| d as Arc<dyn Driver>)
    }

    fn compilation_options(_properties: &DeviceProperties) -> CompilationOptions {
        maca_compilation_options()
    }

    fn rtc_options(_properties: &DeviceProperties) -> Vec<String> {
        maca_rtc_options(&maca_root())
    }

    fn target_properties() -> TargetProperties {
        // No matrix-multiply instructions are emitted for MACA (the dialect reports none), so
        // these only matter as defaults; the plane size is the wave size.
        TargetProperties {
            mma: MmaProperties {
                register_size_bits: 32,
                const_plane_size: MACA_WARP_SIZE,
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
        let root = maca_root();
        let env = std::env::var("MACA_PATH").unwrap_or_else(|_| "unset, default /opt/maca".to_string());
        match driver_error {
            Some(err @ DriverError::LibraryNotFound { .. }) => {
                format!("libmcruntime.so not found under {}/lib (MACA_PATH={env}): {err}", root.display())
            }
            Some(err) => {
                format!("the MACA runtime under {} is unusable (MACA_PATH={env}): {err}", root.display())
            }
            None => {
                format!("the MACA runtime under {} reports no MetaX device (MACA_PATH={env})", root.display())
            }
        }
    }
}

/// The `mcrtc` options: extra include directories when the SDK has them (the dialect includes
/// `mcr/mc_runtime.h`, `common/maca_fp16.h`, … only when `__has_include` finds them), plus the
/// space-separated options in `$METAX_RTC_OPTIONS` (e.g. `-O3`; none are passed by default
/// because the option set `mcrtc` accepts is not verified).
pub fn maca_rtc_options(root: &Path) -> Vec<String> {
    let mut options = Vec::new();
    let include = root.join("include");
    if include.is_dir() {
        options.push(format!("--include-path={}", include.display()));
    }
    if let Ok(extra) = std::env::var("METAX_RTC_OPTIONS") {
        options.extend(extra.split_whitespace().map(str::to_string));
    }
    options
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn rtc_options_add_the_sdk_include_dir_when_present() {
        let root = tempfile::tempdir().expect("temp dir");
        let extra = std::env::var("METAX_RTC_OPTIONS").map(|v| v.split_whitespace().count()).unwrap_or(0);
        assert_eq!(maca_rtc_options(root.path()).len(), extra);
        std::fs::create_dir(root.path().join("include")).expect("include dir");
        let options = maca_rtc_options(root.path());
        assert_eq!(options[0], format!("--include-path={}", root.path().join("include").display()));
    }

    #[test]
    fn device_ids_round_trip() {
        let device = MacaDevice::new(3);
        assert_eq!(MacaDevice::from_id(device.to_id()), device);
        assert_eq!(device.to_id().type_id, MACA_DEVICE_TYPE_ID);
        assert_eq!(<MacaDevice as GpuDevice>::with_index(3).index(), 3);
    }
}
