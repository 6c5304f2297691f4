//! Compiling a CubeCL kernel definition to MACA C++ source with [`MacaDialect`].

use cubecl_core::prelude::{AddressType, KernelDefinition};
use cubecl_core::{CompilationError, Compiler, ExecutionMode};
use cubecl_cpp::shared::{CompilationOptions, CppCompiler, CppSupportedFeatures};

use super::MacaDialect;

/// Lanes in a MetaX wave (C500 class). Also what `mcDeviceAttributeWarpSize` reports there.
pub const MACA_WARP_SIZE: u32 = 64;

/// Error from [`compile_kernel_source`].
#[derive(Debug, thiserror::Error)]
pub enum MacaCompileError {
    /// cubecl-cpp rejected the kernel (validation errors recorded while it was expanded).
    #[error("cubecl-cpp could not compile kernel `{kernel}`: {error}")]
    Compilation {
        /// The kernel name.
        kernel: String,
        /// The compiler's error (in the message, not repeated as a `source`).
        error: Box<CompilationError>,
    },
    /// The options asked for a plane size other than the MACA wave size.
    #[error("the MACA dialect is written for {MACA_WARP_SIZE}-lane waves, options ask for {0}")]
    WarpSize(u32),
}

/// The cubecl-cpp options for MACA: warp size 64 (cubecl's default is 32) and `elect_sync`,
/// so that `plane_elect` uses the dialect's 64-bit elect instead of the shared fallback built
/// on the 32-bit `__activemask()`. No grid constants (the info struct goes by pointer), no
/// clusters, no fast-math intrinsics.
pub fn maca_compilation_options() -> CompilationOptions {
    CompilationOptions {
        warp_size: MACA_WARP_SIZE,
        supports_features: CppSupportedFeatures {
            grid_constants: false,
            clusters: false,
            fast_math: false,
            fast_tanh: false,
            elect_sync: true,
        },
    }
}

/// Compiles `kernel` to MACA C++ source text (what `mcrtcCreateProgram` takes).
///
/// `options` defaults to [`maca_compilation_options`]; options with another warp size are
/// rejected because the dialect's shuffles and ballots are written for 64 lanes.
pub fn compile_kernel_source(
    kernel: KernelDefinition,
    options: Option<&CompilationOptions>,
    mode: ExecutionMode,
    address_type: AddressType,
) -> Result<String, MacaCompileError> {
    let default_options;
    let options = match options {
        Some(options) => options,
        None => {
            default_options = maca_compilation_options();
            &default_options
        }
    };
    if options.warp_size != MACA_WARP_SIZE {
        return Err(MacaCompileError::WarpSize(options.warp_size));
    }
    let name = kernel.options.kernel_name.clone();
    let mut compiler = CppCompiler::<MacaDialect>::default();
    let compiled = compiler
        .compile(kernel, options, mode, address_type.unsigned_type())
        .map_err(|error| MacaCompileError::Compilation { kernel: name, error: Box::new(error) })?;
    Ok(compiled.to_string())
}
