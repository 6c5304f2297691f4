//! [`CudaDriver`]: the [`Driver`] over the CUDA driver API and NVRTC, through `cudarc` with
//! run-time loading (`libcuda.so`, `libnvrtc.so`), so that the crate builds without CUDA. Used by
//! the `cuda-proxy` platform to run the MetaX server on NVIDIA GPUs.
//!
//! The trait's runtime-API shape (a current device per thread) maps to primary contexts: each
//! device's primary context is retained once and made current on the calling thread when needed.
//! `CUresult` codes are reported through the MACA code table ([`MacaError`]): the two numberings
//! coincide for the codes the server acts on (1 invalid value, 2 out of memory, 100 no device,
//! 600 not ready, and the sticky 700–719 range), so a sticky CUDA error poisons the device too.

use std::cell::Cell;
use std::collections::HashMap;
use std::ffi::{CString, c_void};
use std::fmt;
use std::sync::{Mutex, MutexGuard};

use cudarc::driver::{result as cu, sys};
use cudarc::nvrtc::{result as nvrtc, sys as nvrtc_sys};

use super::{
    DeviceProperties, DevicePtr, Driver, DriverError, EventHandle, FunctionHandle, HostPtr, MacaError,
    ModuleHandle, ProgramHandle, Result, RtcError, StreamHandle,
};

thread_local! {
    /// The calling thread's current device, and whether its context was made current here.
    static CURRENT: Cell<(usize, bool)> = const { Cell::new((0, false)) };
}

fn lock<T>(m: &Mutex<T>) -> MutexGuard<'_, T> {
    m.lock().unwrap_or_else(|e| e.into_inner())
}

/// The [`Driver`] over the CUDA driver API (`libcuda.so`) and NVRTC (`libnvrtc.so`).
pub struct CudaDriver {
    contexts: Mutex<HashMap<usize, usize>>,
    poisoned: Mutex<HashMap<usize, DriverError>>,
    nvrtc: bool,
}

impl fmt::Debug for CudaDriver {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("CudaDriver").field("nvrtc", &self.nvrtc).finish_non_exhaustive()
    }
}

impl CudaDriver {
    /// Opens `libcuda.so` (and `libnvrtc.so` if present) and initialises the driver API.
    ///
    /// Fails with [`DriverError::LibraryNotFound`] when the CUDA driver library is absent.
    pub fn load() -> Result<Self> {
        // SAFETY: only tries to open the library (no CUDA call is made).
        if !unsafe { sys::is_culib_present() } {
            return Err(DriverError::LibraryUnavailable {
                library: "libcuda.so".into(),
                reason: "the dynamic loader found no CUDA driver library (is an NVIDIA driver installed?)"
                    .into(),
            });
        }
        // SAFETY: as above, for NVRTC.
        let nvrtc = unsafe { nvrtc_sys::is_culib_present() };
        cu::init().map_err(|e| api("cuInit", e))?;
        Ok(Self { contexts: Mutex::new(HashMap::new()), poisoned: Mutex::new(HashMap::new()), nvrtc })
    }

    /// Whether NVRTC was found.
    pub fn has_rtc(&self) -> bool {
        self.nvrtc
    }

    fn context(&self, device: usize) -> Result<sys::CUcontext> {
        if let Some(ctx) = lock(&self.contexts).get(&device) {
            return Ok(*ctx as sys::CUcontext);
        }
        let ordinal =
            i32::try_from(device).map_err(|_| DriverError::InvalidArgument(format!("device {device}")))?;
        let dev = cu::device::get(ordinal).map_err(|e| api("cuDeviceGet", e))?;
        // SAFETY: `dev` is a device handle from `cuDeviceGet`; the primary context is retained
        // once per device for the life of the process.
        let ctx = unsafe { cu::primary_ctx::retain(dev) }.map_err(|e| api("cuDevicePrimaryCtxRetain", e))?;
        lock(&self.contexts).insert(device, ctx as usize);
        Ok(ctx)
    }

    /// Makes the current device's context current on this thread (once per thread), then checks
    /// the device is not poisoned.
    fn guard(&self) -> Result<()> {
        let (device, bound) = CURRENT.with(Cell::get);
        if !bound {
            let ctx = self.context(device)?;
            // SAFETY: `ctx` is a retained primary context.
            unsafe { cu::ctx::set_current(ctx) }.map_err(|e| api("cuCtxSetCurrent", e))?;
            CURRENT.with(|c| c.set((device, true)));
        }
        match lock(&self.poisoned).get(&device) {
            Some(e) => Err(e.clone()),
            None => Ok(()),
        }
    }

    fn check(&self, call: &'static str, result: std::result::Result<(), cu::DriverError>) -> Result<()> {
        let Err(e) = result else { return Ok(()) };
        let error = api(call, e);
        if let DriverError::Api { error: code, .. } = &error
            && code.is_sticky()
        {
            let device = CURRENT.with(Cell::get).0;
            lock(&self.poisoned).entry(device).or_insert(DriverError::Poisoned {
                device,
                call,
                error: *code,
            });
        }
        Err(error)
    }

    fn rtc(&self) -> Result<()> {
        if self.nvrtc {
            Ok(())
        } else {
            Err(DriverError::RtcUnavailable("libnvrtc.so not found by the dynamic loader".into()))
        }
    }

    fn attribute(dev: sys::CUdevice, attribute: sys::CUdevice_attribute) -> Result<u32> {
        // SAFETY: `dev` comes from `cuDeviceGet`.
        let v = unsafe { cu::device::get_attribute(dev, attribute) }
            .map_err(|e| api("cuDeviceGetAttribute", e))?;
        u32::try_from(v)
            .map_err(|_| DriverError::UnexpectedValue(format!("device attribute {attribute:?} is {v}")))
    }
}

fn api(call: &'static str, e: cu::DriverError) -> DriverError {
    let code = e.0 as i32;
    DriverError::Api { call, error: MacaError::from_code(code).unwrap_or(MacaError::INVALID_VALUE) }
}

fn rtc_error(call: &'static str, e: nvrtc::NvrtcError) -> DriverError {
    let code = e.0 as i32;
    match RtcError::from_code(code) {
        Some(error) => DriverError::Rtc { call, error },
        None => DriverError::UnexpectedValue(format!("{call} failed with status 0")),
    }
}

fn stream(s: StreamHandle) -> sys::CUstream {
    s.as_raw() as sys::CUstream
}

fn event(e: EventHandle) -> sys::CUevent {
    e.as_raw() as sys::CUevent
}

fn c_chars_to_string(chars: &[std::ffi::c_char]) -> String {
    let bytes: Vec<u8> = chars.iter().map(|&c| c as u8).take_while(|&b| b != 0).collect();
    String::from_utf8_lossy(&bytes).into_owned()
}

impl Driver for CudaDriver {
    fn name(&self) -> &str {
        "cuda"
    }

    fn device_count(&self) -> Result<usize> {
        match cu::device::get_count() {
            Ok(n) => Ok(usize::try_from(n).unwrap_or(0)),
            Err(e) if e.0 == sys::CUresult::CUDA_ERROR_NO_DEVICE => Ok(0),
            Err(e) => Err(api("cuDeviceGetCount", e)),
        }
    }

    fn device_properties(&self, device: usize) -> Result<DeviceProperties> {
        use sys::CUdevice_attribute::*;
        let ordinal =
            i32::try_from(device).map_err(|_| DriverError::InvalidArgument(format!("device {device}")))?;
        let dev = cu::device::get(ordinal).map_err(|e| api("cuDeviceGet", e))?;
        let name = cu::device::get_name(dev).map_err(|e| api("cuDeviceGetName", e))?;
        // SAFETY: `dev` comes from `cuDeviceGet`.
        let total_memory = unsafe { cu::device::total_mem(dev) }.map_err(|e| api("cuDeviceTotalMem", e))?;
        let a = |attribute| Self::attribute(dev, attribute);
        Ok(DeviceProperties {
            name,
            warp_size: a(CU_DEVICE_ATTRIBUTE_WARP_SIZE)?,
            max_threads_per_block: a(CU_DEVICE_ATTRIBUTE_MAX_THREADS_PER_BLOCK)?,
            max_block_dim: [
                a(CU_DEVICE_ATTRIBUTE_MAX_BLOCK_DIM_X)?,
                a(CU_DEVICE_ATTRIBUTE_MAX_BLOCK_DIM_Y)?,
                a(CU_DEVICE_ATTRIBUTE_MAX_BLOCK_DIM_Z)?,
            ],
            max_grid_dim: [
                a(CU_DEVICE_ATTRIBUTE_MAX_GRID_DIM_X)?,
                a(CU_DEVICE_ATTRIBUTE_MAX_GRID_DIM_Y)?,
                a(CU_DEVICE_ATTRIBUTE_MAX_GRID_DIM_Z)?,
            ],
            max_shared_memory_per_block: a(CU_DEVICE_ATTRIBUTE_MAX_SHARED_MEMORY_PER_BLOCK)? as usize,
            multiprocessor_count: a(CU_DEVICE_ATTRIBUTE_MULTIPROCESSOR_COUNT)?,
            compute_capability: (
                a(CU_DEVICE_ATTRIBUTE_COMPUTE_CAPABILITY_MAJOR)?,
                a(CU_DEVICE_ATTRIBUTE_COMPUTE_CAPABILITY_MINOR)?,
            ),
            total_memory,
        })
    }

    fn set_device(&self, device: usize) -> Result<()> {
        let ctx = self.context(device)?;
        // SAFETY: `ctx` is a retained primary context.
        unsafe { cu::ctx::set_current(ctx) }.map_err(|e| api("cuCtxSetCurrent", e))?;
        CURRENT.with(|c| c.set((device, true)));
        Ok(())
    }

    fn current_device(&self) -> usize {
        CURRENT.with(Cell::get).0
    }

    fn device_synchronize(&self) -> Result<()> {
        self.guard()?;
        self.check("cuCtxSynchronize", cu::ctx::synchronize())
    }

    fn memory_info(&self) -> Result<(usize, usize)> {
        self.guard()?;
        cu::mem_get_info().map_err(|e| api("cuMemGetInfo", e))
    }

    fn poisoned(&self, device: usize) -> Option<DriverError> {
        lock(&self.poisoned).get(&device).cloned()
    }

    fn malloc(&self, size: usize) -> Result<DevicePtr> {
        self.guard()?;
        // SAFETY: plain allocation in the current context.
        let ptr = unsafe { cu::malloc_sync(size) }.map_err(|e| api("cuMemAlloc", e))?;
        Ok(DevicePtr::from_raw(ptr as usize))
    }

    fn malloc_async(&self, size: usize, s: StreamHandle) -> Result<DevicePtr> {
        self.guard()?;
        // SAFETY: `s` is a stream of this context (or null).
        let ptr = unsafe { cu::malloc_async(stream(s), size) }.map_err(|e| api("cuMemAllocAsync", e))?;
        Ok(DevicePtr::from_raw(ptr as usize))
    }

    unsafe fn free(&self, ptr: DevicePtr) -> Result<()> {
        self.guard()?;
        // SAFETY: the caller guarantees `ptr` is a live allocation no work still uses.
        let result = unsafe { cu::free_sync(ptr.as_raw() as sys::CUdeviceptr) };
        self.check("cuMemFree", result)
    }

    unsafe fn free_async(&self, ptr: DevicePtr, s: StreamHandle) -> Result<()> {
        self.guard()?;
        // SAFETY: the caller guarantees only work queued on `s` before this call uses `ptr`.
        let result = unsafe { cu::free_async(ptr.as_raw() as sys::CUdeviceptr, stream(s)) };
        self.check("cuMemFreeAsync", result)
    }

    fn malloc_host(&self, size: usize) -> Result<HostPtr> {
        self.guard()?;
        // SAFETY: plain page-locked allocation (no flags).
        let ptr = unsafe { cu::malloc_host(size.max(1), 0) }.map_err(|e| api("cuMemAllocHost", e))?;
        Ok(HostPtr::from_raw(ptr as usize))
    }

    unsafe fn free_host(&self, ptr: HostPtr) -> Result<()> {
        self.guard()?;
        // SAFETY: the caller guarantees `ptr` came from `malloc_host` and is unused.
        let result = unsafe { cu::free_host(ptr.as_raw() as *mut c_void) };
        self.check("cuMemFreeHost", result)
    }

    unsafe fn memcpy_htod_async(
        &self,
        dst: DevicePtr,
        src: *const u8,
        len: usize,
        s: StreamHandle,
    ) -> Result<()> {
        self.guard()?;
        // SAFETY: the caller guarantees `src` stays readable and `dst` in bounds until completion.
        let result = unsafe {
            sys::cuMemcpyHtoDAsync_v2(dst.as_raw() as sys::CUdeviceptr, src.cast(), len, stream(s))
        }
        .result();
        self.check("cuMemcpyHtoDAsync", result)
    }

    unsafe fn memcpy_dtoh_async(
        &self,
        dst: *mut u8,
        src: DevicePtr,
        len: usize,
        s: StreamHandle,
    ) -> Result<()> {
        self.guard()?;
        // SAFETY: the caller guarantees `dst` stays writable and `src` in bounds until completion.
        let result = unsafe {
            sys::cuMemcpyDtoHAsync_v2(dst.cast(), src.as_raw() as sys::CUdeviceptr, len, stream(s))
        }
        .result();
        self.check("cuMemcpyDtoHAsync", result)
    }

    unsafe fn memcpy_dtod_async(
        &self,
        dst: DevicePtr,
        src: DevicePtr,
        len: usize,
        s: StreamHandle,
    ) -> Result<()> {
        self.guard()?;
        // SAFETY: the caller guarantees both ranges are live device memory until completion.
        let result = unsafe {
            sys::cuMemcpyDtoDAsync_v2(
                dst.as_raw() as sys::CUdeviceptr,
                src.as_raw() as sys::CUdeviceptr,
                len,
                stream(s),
            )
        }
        .result();
        self.check("cuMemcpyDtoDAsync", result)
    }

    unsafe fn memcpy_htod(&self, dst: DevicePtr, src: &[u8]) -> Result<()> {
        self.guard()?;
        // SAFETY: `src` is live for the blocking call; the caller guarantees the device range.
        let result =
            unsafe { sys::cuMemcpyHtoD_v2(dst.as_raw() as sys::CUdeviceptr, src.as_ptr().cast(), src.len()) }
                .result();
        self.check("cuMemcpyHtoD", result)
    }

    unsafe fn memcpy_dtoh(&self, dst: &mut [u8], src: DevicePtr) -> Result<()> {
        self.guard()?;
        // SAFETY: `dst` is exclusively borrowed for the blocking call; the caller guarantees the
        // device range.
        let result = unsafe {
            sys::cuMemcpyDtoH_v2(dst.as_mut_ptr().cast(), src.as_raw() as sys::CUdeviceptr, dst.len())
        }
        .result();
        self.check("cuMemcpyDtoH", result)
    }

    fn stream_create(&self, non_blocking: bool) -> Result<StreamHandle> {
        self.guard()?;
        let kind =
            if non_blocking { cu::stream::StreamKind::NonBlocking } else { cu::stream::StreamKind::Default };
        let s = cu::stream::create(kind).map_err(|e| api("cuStreamCreate", e))?;
        Ok(StreamHandle::from_raw(s as usize))
    }

    fn stream_destroy(&self, s: StreamHandle) -> Result<()> {
        self.guard()?;
        // SAFETY: the handle came from `stream_create`; the driver validates it.
        let result = unsafe { cu::stream::destroy(stream(s)) };
        self.check("cuStreamDestroy", result)
    }

    fn stream_synchronize(&self, s: StreamHandle) -> Result<()> {
        self.guard()?;
        // SAFETY: the driver validates the handle.
        let result = unsafe { cu::stream::synchronize(stream(s)) };
        self.check("cuStreamSynchronize", result)
    }

    fn stream_wait_event(&self, s: StreamHandle, e: EventHandle) -> Result<()> {
        self.guard()?;
        // SAFETY: the driver validates both handles.
        let result = unsafe {
            cu::stream::wait_event(stream(s), event(e), sys::CUevent_wait_flags::CU_EVENT_WAIT_DEFAULT)
        };
        self.check("cuStreamWaitEvent", result)
    }

    fn event_create(&self, timing: bool) -> Result<EventHandle> {
        self.guard()?;
        let flags = if timing {
            sys::CUevent_flags::CU_EVENT_DEFAULT
        } else {
            sys::CUevent_flags::CU_EVENT_DISABLE_TIMING
        };
        let e = cu::event::create(flags).map_err(|e| api("cuEventCreate", e))?;
        Ok(EventHandle::from_raw(e as usize))
    }

    fn event_destroy(&self, e: EventHandle) -> Result<()> {
        self.guard()?;
        // SAFETY: the driver validates the handle.
        let result = unsafe { cu::event::destroy(event(e)) };
        self.check("cuEventDestroy", result)
    }

    fn event_record(&self, e: EventHandle, s: StreamHandle) -> Result<()> {
        self.guard()?;
        // SAFETY: the driver validates both handles.
        let result = unsafe { cu::event::record(event(e), stream(s)) };
        self.check("cuEventRecord", result)
    }

    fn event_synchronize(&self, e: EventHandle) -> Result<()> {
        self.guard()?;
        // SAFETY: the driver validates the handle.
        let result = unsafe { cu::event::synchronize(event(e)) };
        self.check("cuEventSynchronize", result)
    }

    fn event_query(&self, e: EventHandle) -> Result<bool> {
        self.guard()?;
        // SAFETY: the driver validates the handle.
        match unsafe { cu::event::query(event(e)) } {
            Ok(()) => Ok(true),
            Err(err) if err.0 == sys::CUresult::CUDA_ERROR_NOT_READY => Ok(false),
            Err(err) => self.check("cuEventQuery", Err(err)).map(|_| false),
        }
    }

    fn event_elapsed_ms(&self, start: EventHandle, end: EventHandle) -> Result<f32> {
        self.guard()?;
        // SAFETY: the driver validates both handles.
        unsafe { cu::event::elapsed(event(start), event(end)) }.map_err(|e| api("cuEventElapsedTime", e))
    }

    fn module_load_data(&self, image: &[u8]) -> Result<ModuleHandle> {
        if image.last() != Some(&0) {
            return Err(DriverError::InvalidArgument("the PTX image is not NUL-terminated".into()));
        }
        self.guard()?;
        // SAFETY: `image` is NUL-terminated PTX (checked above), live for the call.
        let module = unsafe { cu::module::load_data(image.as_ptr().cast()) };
        let module = module.map_err(|e| api("cuModuleLoadData", e))?;
        Ok(ModuleHandle::from_raw(module as usize))
    }

    fn module_unload(&self, module: ModuleHandle) -> Result<()> {
        self.guard()?;
        // SAFETY: the handle came from `module_load_data`.
        let result = unsafe { cu::module::unload(module.as_raw() as sys::CUmodule) };
        self.check("cuModuleUnload", result)
    }

    fn module_get_function(&self, module: ModuleHandle, name: &str) -> Result<FunctionHandle> {
        let name =
            CString::new(name).map_err(|_| DriverError::InvalidArgument(format!("kernel name {name:?}")))?;
        self.guard()?;
        // SAFETY: the handle came from `module_load_data`.
        let f = unsafe { cu::module::get_function(module.as_raw() as sys::CUmodule, name) }
            .map_err(|e| api("cuModuleGetFunction", e))?;
        Ok(FunctionHandle::from_raw(f as usize))
    }

    unsafe fn launch_kernel(
        &self,
        function: FunctionHandle,
        grid: [u32; 3],
        block: [u32; 3],
        shared_memory: u32,
        s: StreamHandle,
        params: &mut [*mut c_void],
    ) -> Result<()> {
        self.guard()?;
        // SAFETY: the caller guarantees `params` matches the kernel's parameters and that the
        // buffers stay live.
        let result = unsafe {
            cu::launch_kernel(
                function.as_raw() as sys::CUfunction,
                (grid[0], grid[1], grid[2]),
                (block[0], block[1], block[2]),
                shared_memory,
                stream(s),
                params,
            )
        };
        self.check("cuLaunchKernel", result)
    }

    fn rtc_create_program(&self, source: &str, name: &str) -> Result<ProgramHandle> {
        self.rtc()?;
        let source =
            CString::new(source).map_err(|_| DriverError::InvalidArgument("NUL in kernel source".into()))?;
        let name =
            CString::new(name).map_err(|_| DriverError::InvalidArgument(format!("program name {name:?}")))?;
        let program = nvrtc::create_program(&source, Some(name.as_c_str()))
            .map_err(|e| rtc_error("nvrtcCreateProgram", e))?;
        Ok(ProgramHandle::from_raw(program as usize))
    }

    fn rtc_compile_program(&self, program: ProgramHandle, options: &[&str]) -> Result<()> {
        self.rtc()?;
        if options.iter().any(|o| o.contains('\0')) {
            return Err(DriverError::InvalidArgument("NUL in a compile option".into()));
        }
        // SAFETY: the handle came from `rtc_create_program`; options have no NUL (checked).
        unsafe { nvrtc::compile_program(program.as_raw() as nvrtc_sys::nvrtcProgram, options) }
            .map_err(|e| rtc_error("nvrtcCompileProgram", e))
    }

    fn rtc_program_log(&self, program: ProgramHandle) -> Result<String> {
        self.rtc()?;
        // SAFETY: the handle came from `rtc_create_program`.
        let log = unsafe { nvrtc::get_program_log(program.as_raw() as nvrtc_sys::nvrtcProgram) }
            .map_err(|e| rtc_error("nvrtcGetProgramLog", e))?;
        Ok(c_chars_to_string(&log))
    }

    fn rtc_bitcode(&self, program: ProgramHandle) -> Result<Vec<u8>> {
        self.rtc()?;
        // SAFETY: the handle came from `rtc_create_program` and was compiled.
        let ptx = unsafe { nvrtc::get_ptx(program.as_raw() as nvrtc_sys::nvrtcProgram) }
            .map_err(|e| rtc_error("nvrtcGetPTX", e))?;
        let mut image: Vec<u8> = ptx.iter().map(|&c| c as u8).collect();
        if image.last() != Some(&0) {
            image.push(0);
        }
        Ok(image)
    }

    fn rtc_destroy_program(&self, program: ProgramHandle) -> Result<()> {
        self.rtc()?;
        // SAFETY: the handle came from `rtc_create_program` and is destroyed once.
        unsafe { nvrtc::destroy_program(program.as_raw() as nvrtc_sys::nvrtcProgram) }
            .map_err(|e| rtc_error("nvrtcDestroyProgram", e))
    }
}
