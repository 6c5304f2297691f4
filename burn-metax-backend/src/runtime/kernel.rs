//! The kernel cache: CubeCL kernel → C++ source (cubecl-cpp with the platform's dialect) →
//! binary (the platform's run-time compiler, through the [`Driver`] and the persistent
//! [`super::compile_cache`]) → loaded module and function, cached by kernel id; and the launch.

use std::collections::HashMap;
use std::ffi::c_void;
use std::sync::Arc;

use cubecl_common::backtrace::BackTrace;
use cubecl_core::ExecutionMode;
use cubecl_core::ir::DeviceProperties;
use cubecl_core::server::{LaunchError, ResourceLimitError};
use cubecl_cpp::shared::{CompilationOptions, CppCompiler};
use cubecl_runtime::compiler::{CompilationError, CubeTask};
use cubecl_runtime::id::KernelId;
use cubecl_runtime::logging::ServerLogger;
use cubecl_runtime::validation::{validate_cube_dim, validate_units};

use super::platform::Platform;
use super::storage::GpuResource;
use crate::driver::{Driver, DriverError, FunctionHandle, MacaError, ModuleHandle, StreamHandle};

/// A kernel compiled, loaded and ready to launch.
#[derive(Debug, Clone)]
pub(crate) struct LoadedKernel {
    pub(crate) module: ModuleHandle,
    pub(crate) function: FunctionHandle,
    pub(crate) block: [u32; 3],
    pub(crate) shared_memory: u32,
}

/// Compiles kernels on first use and keeps them, per device.
#[derive(Debug)]
pub(crate) struct KernelCache {
    driver: Arc<dyn Driver>,
    kernels: HashMap<KernelId, LoadedKernel>,
    options: CompilationOptions,
    rtc_options: Vec<String>,
    properties: DeviceProperties,
}

fn compilation_error(reason: String) -> LaunchError {
    LaunchError::CompilationError(CompilationError::Generic { reason, backtrace: BackTrace::capture() })
}

impl KernelCache {
    pub(crate) fn new(
        driver: Arc<dyn Driver>,
        options: CompilationOptions,
        rtc_options: Vec<String>,
        properties: DeviceProperties,
    ) -> Self {
        Self { driver, kernels: HashMap::new(), options, rtc_options, properties }
    }

    /// The loaded kernel for `id`, compiling `kernel` first if needed.
    pub(crate) fn get_or_compile<P: Platform>(
        &mut self,
        id: &KernelId,
        kernel: &dyn CubeTask<CppCompiler<P::Dialect>>,
        mode: ExecutionMode,
        logger: &ServerLogger,
    ) -> Result<LoadedKernel, LaunchError> {
        if let Some(loaded) = self.kernels.get(id) {
            return Ok(loaded.clone());
        }
        validate_cube_dim(&self.properties, id)?;
        validate_units(&self.properties, id)?;

        let compiled = kernel.compile(&mut Default::default(), &self.options, mode, kernel.address_type())?;
        let shared_memory = compiled.repr.as_ref().map_or(0, |repr| repr.shared_memory_size());
        let max_shared = self.properties.hardware.max_shared_memory_size;
        if shared_memory > max_shared {
            return Err(ResourceLimitError::SharedMemory {
                requested: shared_memory,
                max: max_shared,
                backtrace: BackTrace::capture(),
            }
            .into());
        }
        logger.log_compilation(&compiled);

        let options: Vec<&str> = self.rtc_options.iter().map(String::as_str).collect();
        let program = super::compile_cache::compile(
            self.driver.as_ref(),
            &compiled.source,
            &compiled.entrypoint_name,
            &options,
        )
        .map_err(|err| match err {
            DriverError::Compilation { .. } => {
                compilation_error(format!("{err}\n[source]\n{}", compiled.source))
            }
            other => compilation_error(other.to_string()),
        })?;
        let module =
            self.driver.module_load_data(&program.image).map_err(|e| compilation_error(e.to_string()))?;
        let function = match self.driver.module_get_function(module, &compiled.entrypoint_name) {
            Ok(function) => function,
            Err(err) => {
                let _ = self.driver.module_unload(module);
                return Err(compilation_error(err.to_string()));
            }
        };
        let cube_dim = compiled.cube_dim;
        let loaded = LoadedKernel {
            module,
            function,
            block: [cube_dim.x, cube_dim.y, cube_dim.z],
            shared_memory: u32::try_from(shared_memory).unwrap_or(u32::MAX),
        };
        self.kernels.insert(id.clone(), loaded.clone());
        Ok(loaded)
    }

    /// Number of kernels compiled and loaded so far.
    pub(crate) fn len(&self) -> usize {
        self.kernels.len()
    }

    /// Queues `kernel` on `stream` with one pointer argument per resource (buffers first, the
    /// info buffer last, as cubecl-cpp declares them when grid constants are off).
    ///
    /// # Safety
    /// Every resource is a live device allocation that stays live until the launch has completed
    /// (the caller keeps the bindings in the stream's memory pools), and the resources match the
    /// kernel's parameter list.
    pub(crate) unsafe fn launch(
        &self,
        kernel: &LoadedKernel,
        grid: [u32; 3],
        stream: StreamHandle,
        resources: &[GpuResource],
    ) -> Result<(), LaunchError> {
        // Each kernel parameter is a device pointer: the launch takes a pointer to each value.
        let mut addresses: Vec<u64> = resources.iter().map(|r| r.ptr.as_raw() as u64).collect();
        let mut params: Vec<*mut c_void> =
            addresses.iter_mut().map(|a| std::ptr::from_mut(a).cast()).collect();
        // SAFETY: `params[i]` points at `addresses[i]`, both alive until this call returns; the
        // caller guarantees the buffers and the parameter list (see above).
        let launched = unsafe {
            self.driver.launch_kernel(
                kernel.function,
                grid,
                kernel.block,
                kernel.shared_memory,
                stream,
                &mut params,
            )
        };
        launched.map_err(|err| match err {
            DriverError::Api { error, .. } if error == MacaError::MEMORY_ALLOCATION => {
                LaunchError::OutOfMemory { reason: err.to_string(), backtrace: BackTrace::capture() }
            }
            other => LaunchError::Unknown { reason: other.to_string(), backtrace: BackTrace::capture() },
        })
    }
}

impl Drop for KernelCache {
    fn drop(&mut self) {
        for (_, kernel) in self.kernels.drain() {
            let _ = self.driver.module_unload(kernel.module);
        }
    }
}
