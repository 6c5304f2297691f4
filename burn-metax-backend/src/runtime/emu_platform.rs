//! The `metax-emu` platform: the MetaX server, dialect and options over the emulated device
//! ([`crate::emu::EmuDriver`]), which runs the generated kernels on the host CPU.

use std::sync::{Arc, OnceLock};

use cubecl_common::device::{Device, DeviceId};
use cubecl_core::ir::TargetProperties;
use cubecl_cpp::shared::CompilationOptions;

use super::platform::{GpuDevice, MacaPlatform, Platform};
use crate::dialect::{MacaDialect, maca_compilation_options};
use crate::driver::{DeviceProperties, Driver, DriverError};
use crate::emu::EmuDriver;

/// The emulated MetaX platform.
#[derive(Clone, Copy, Debug, Default)]
pub struct MetaxEmuPlatform;

/// An emulated MetaX device, by ordinal (8 by default, `METAX_EMU_DEVICES`).
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Hash)]
pub struct MetaxEmuDevice {
    /// The device ordinal.
    pub index: usize,
}

impl MetaxEmuDevice {
    /// The emulated device with ordinal `index`.
    pub const fn new(index: usize) -> Self {
        Self { index }
    }
}

/// `DeviceId::type_id` of [`MetaxEmuDevice`].
pub const METAX_EMU_DEVICE_TYPE_ID: u16 = 0;

impl Device for MetaxEmuDevice {
    fn from_id(device_id: DeviceId) -> Self {
        Self { index: usize::from(device_id.index_id) }
    }

    fn to_id(&self) -> DeviceId {
        DeviceId {
            type_id: METAX_EMU_DEVICE_TYPE_ID,
            index_id: u16::try_from(self.index).unwrap_or(u16::MAX),
        }
    }
}

impl burn::tensor::backend::DeviceOps for MetaxEmuDevice {}

impl GpuDevice for MetaxEmuDevice {
    fn index(&self) -> usize {
        self.index
    }

    fn with_index(index: usize) -> Self {
        Self { index }
    }
}

static EMU_DRIVER: OnceLock<Result<Arc<EmuDriver>, DriverError>> = OnceLock::new();

/// Makes `driver` the process-wide emulated-device driver, instead of the one
/// [`EmuDriver::from_env`] would build. Returns `false` (and leaves the driver in place) if one was
/// already installed or built. Tests use it to configure devices (wave size, launch delay).
pub fn install_emu_driver(driver: EmuDriver) -> bool {
    EMU_DRIVER.set(Ok(Arc::new(driver))).is_ok()
}

/// The process-wide emulated-device driver, built from the environment on first use
/// ([`EmuDriver::from_env`]) unless [`install_emu_driver`] was called before.
pub fn emu_driver() -> Result<Arc<EmuDriver>, DriverError> {
    EMU_DRIVER.get_or_init(|| EmuDriver::from_env().map(Arc::new)).clone()
}

impl Platform for MetaxEmuPlatform {
    type Dialect = MacaDialect;
    type Device = MetaxEmuDevice;
    const NAME: &'static str = "metax-emu";
    /// As the MACA platform: the emulator runs the same kernels.
    const F64: bool = MacaPlatform::F64;

    fn driver() -> Result<Arc<dyn Driver>, DriverError> {
        emu_driver().map(|d| d as Arc<dyn Driver>)
    }

    /// Always the MACA options (wave 64), whatever the emulated device's wave size: the kernels
    /// are MetaX kernels, and a 32-lane device exists to show that they then go wrong.
    fn compilation_options(_properties: &DeviceProperties) -> CompilationOptions {
        maca_compilation_options()
    }

    /// Extra host-compiler flags from `$METAX_EMU_CXXFLAGS` (space separated), e.g. `-O0 -g`.
    fn rtc_options(_properties: &DeviceProperties) -> Vec<String> {
        std::env::var("METAX_EMU_CXXFLAGS")
            .map(|flags| flags.split_whitespace().map(str::to_string).collect())
            .unwrap_or_default()
    }

    fn target_properties() -> TargetProperties {
        MacaPlatform::target_properties()
    }

    fn unavailable_reason(driver_error: Option<&DriverError>) -> String {
        match driver_error {
            Some(err) => format!("the emulated MetaX device is unavailable: {err}"),
            None => {
                "the emulated MetaX device is configured with no devices (METAX_EMU_DEVICES=0)".to_string()
            }
        }
    }
}
