//! The driver layer: a Rust trait over the GPU runtime calls the CubeCL server needs, so that the
//! same server can run over the MACA runtime ([`MacaDriver`]), over a mock of it (tests), or —
//! later — over the CUDA driver API as a proxy on NVIDIA hardware.
//!
//! The trait follows the MACA/CUDA *runtime* API shape: a per-thread current device chosen with
//! [`Driver::set_device`], streams, events, device pointers as integers, modules loaded from a
//! binary image, and a run-time compiler (`mcrtc`) producing the image from C++ source.
//!
//! Calls that make the runtime read or write host memory asynchronously, or that free memory
//! queued work may still use, are `unsafe`: their contracts are stated on each method.

#[cfg(feature = "cuda-proxy")]
mod cuda;
mod error;
mod maca;

#[cfg(feature = "cuda-proxy")]
pub use cuda::CudaDriver;
pub use error::{DriverError, MacaError, Result, RtcError};
pub use maca::{DEFAULT_MACA_PATH, MacaDriver, maca_root};

use std::ffi::c_void;
use std::fmt;

macro_rules! handle {
    ($(#[$doc:meta])* $name:ident) => {
        $(#[$doc])*
        #[derive(Clone, Copy, PartialEq, Eq, Hash)]
        pub struct $name(usize);

        impl $name {
            /// Wraps a raw handle value returned by the runtime.
            pub const fn from_raw(raw: usize) -> Self {
                Self(raw)
            }

            /// The raw handle value, as passed to the runtime.
            pub const fn as_raw(self) -> usize {
                self.0
            }
        }

        impl fmt::Debug for $name {
            fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
                write!(f, concat!(stringify!($name), "({:#x})"), self.0)
            }
        }
    };
}

handle!(
    /// A device memory address (`mcDeviceptr_t` / `void*` in device address space).
    DevicePtr
);
handle!(
    /// Page-locked host memory allocated with [`Driver::malloc_host`].
    HostPtr
);
handle!(
    /// A stream (`mcStream_t`); [`StreamHandle::DEFAULT`] is the legacy default stream.
    StreamHandle
);
handle!(
    /// An event (`mcEvent_t`).
    EventHandle
);
handle!(
    /// A loaded module (`mcModule_t`).
    ModuleHandle
);
handle!(
    /// A kernel in a loaded module (`mcFunction_t`).
    FunctionHandle
);
handle!(
    /// A run-time compiler program (`mcrtcProgram`).
    ProgramHandle
);

impl StreamHandle {
    /// The legacy default (null) stream. It synchronises with blocking streams but not with
    /// streams created non-blocking.
    pub const DEFAULT: StreamHandle = StreamHandle(0);
}

impl DevicePtr {
    /// The address `bytes` further on (wrapping: the result is only meaningful inside the
    /// allocation, which the runtime checks).
    pub const fn offset(self, bytes: usize) -> Self {
        Self(self.0.wrapping_add(bytes))
    }
}

impl HostPtr {
    /// The address as a byte pointer.
    pub fn as_mut_ptr(self) -> *mut u8 {
        self.0 as *mut u8
    }
}

/// Properties of one device, as the CubeCL runtime needs them.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct DeviceProperties {
    /// Marketing name (e.g. "MetaX C500"), or a generic name where the runtime does not tell.
    pub name: String,
    /// Threads per wave ("warp"): 64 on MetaX C500/C550.
    pub warp_size: u32,
    /// Maximum threads per block.
    pub max_threads_per_block: u32,
    /// Maximum block dimensions.
    pub max_block_dim: [u32; 3],
    /// Maximum grid dimensions.
    pub max_grid_dim: [u32; 3],
    /// Shared memory per block, in bytes.
    pub max_shared_memory_per_block: usize,
    /// Number of multiprocessors (compute units).
    pub multiprocessor_count: u32,
    /// Compute capability `(major, minor)` as the runtime reports it.
    pub compute_capability: (u32, u32),
    /// Total device memory, in bytes.
    pub total_memory: usize,
}

/// The result of compiling one program with the run-time compiler.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct CompiledProgram {
    /// The binary image to pass to [`Driver::module_load_data`].
    pub image: Vec<u8>,
    /// The compiler's log (warnings), possibly empty.
    pub log: String,
}

/// The driver calls a CubeCL MACA (or MACA-like) runtime is built on.
///
/// Every method may fail with [`DriverError::Poisoned`] once a sticky error has been seen on
/// the current device.
pub trait Driver: Send + Sync + fmt::Debug {
    /// A short name for messages ("maca", "mock", "cuda").
    fn name(&self) -> &str;

    // ---- devices -----------------------------------------------------------------------------

    /// Number of visible devices.
    fn device_count(&self) -> Result<usize>;
    /// Properties of device `device`.
    fn device_properties(&self, device: usize) -> Result<DeviceProperties>;
    /// Makes `device` the calling thread's current device.
    fn set_device(&self, device: usize) -> Result<()>;
    /// The calling thread's current device.
    fn current_device(&self) -> usize;
    /// Waits for all work on the current device.
    fn device_synchronize(&self) -> Result<()>;
    /// `(free, total)` memory of the current device, in bytes.
    fn memory_info(&self) -> Result<(usize, usize)>;
    /// The sticky error that poisoned `device`, if any.
    fn poisoned(&self, device: usize) -> Option<DriverError>;

    // ---- memory ------------------------------------------------------------------------------

    /// Allocates `size` bytes on the current device.
    fn malloc(&self, size: usize) -> Result<DevicePtr>;
    /// Allocates `size` bytes on the current device, ordered on `stream` (falls back to
    /// [`Driver::malloc`] where the runtime has no stream-ordered allocator).
    fn malloc_async(&self, size: usize, stream: StreamHandle) -> Result<DevicePtr>;
    /// Frees device memory.
    ///
    /// # Safety
    /// `ptr` came from [`Driver::malloc`]/[`Driver::malloc_async`] of this driver, is freed
    /// once, and no queued or later work uses it.
    unsafe fn free(&self, ptr: DevicePtr) -> Result<()>;
    /// Frees device memory, ordered on `stream`.
    ///
    /// # Safety
    /// As for [`Driver::free`], except that work queued on `stream` before this call may still
    /// use `ptr`.
    unsafe fn free_async(&self, ptr: DevicePtr, stream: StreamHandle) -> Result<()>;
    /// Allocates `size` bytes of page-locked host memory.
    fn malloc_host(&self, size: usize) -> Result<HostPtr>;
    /// Frees page-locked host memory.
    ///
    /// # Safety
    /// `ptr` came from [`Driver::malloc_host`], is freed once, and no queued work uses it.
    unsafe fn free_host(&self, ptr: HostPtr) -> Result<()>;

    // ---- copies ------------------------------------------------------------------------------

    /// Queues a host → device copy of `len` bytes on `stream`.
    ///
    /// # Safety
    /// `src` is valid for reads of `len` bytes until the copy has completed (the stream was
    /// synchronised); `dst..dst+len` lies in one live device allocation.
    unsafe fn memcpy_htod_async(
        &self,
        dst: DevicePtr,
        src: *const u8,
        len: usize,
        stream: StreamHandle,
    ) -> Result<()>;
    /// Queues a device → host copy of `len` bytes on `stream`.
    ///
    /// # Safety
    /// `dst` is valid for writes of `len` bytes, and not otherwise accessed, until the copy has
    /// completed; `src..src+len` lies in one live device allocation.
    unsafe fn memcpy_dtoh_async(
        &self,
        dst: *mut u8,
        src: DevicePtr,
        len: usize,
        stream: StreamHandle,
    ) -> Result<()>;
    /// Queues a device → device copy of `len` bytes on `stream`.
    ///
    /// # Safety
    /// Both ranges lie in live device allocations until the copy has completed.
    unsafe fn memcpy_dtod_async(
        &self,
        dst: DevicePtr,
        src: DevicePtr,
        len: usize,
        stream: StreamHandle,
    ) -> Result<()>;
    /// Blocking host → device copy (legacy default-stream semantics: it does **not** wait for
    /// work queued on non-blocking streams).
    ///
    /// # Safety
    /// `dst..dst+src.len()` lies in one live device allocation.
    unsafe fn memcpy_htod(&self, dst: DevicePtr, src: &[u8]) -> Result<()>;
    /// Blocking device → host copy (legacy default-stream semantics, as for
    /// [`Driver::memcpy_htod`]).
    ///
    /// # Safety
    /// `src..src+dst.len()` lies in one live device allocation.
    unsafe fn memcpy_dtoh(&self, dst: &mut [u8], src: DevicePtr) -> Result<()>;

    // ---- streams and events ------------------------------------------------------------------

    /// Creates a stream; `non_blocking` streams do not synchronise with the default stream.
    fn stream_create(&self, non_blocking: bool) -> Result<StreamHandle>;
    /// Destroys a stream (its queued work still completes).
    fn stream_destroy(&self, stream: StreamHandle) -> Result<()>;
    /// Waits for all work queued on `stream`.
    fn stream_synchronize(&self, stream: StreamHandle) -> Result<()>;
    /// Makes later work on `stream` wait for `event`'s recorded work.
    fn stream_wait_event(&self, stream: StreamHandle, event: EventHandle) -> Result<()>;
    /// Creates an event; `timing` enables [`Driver::event_elapsed_ms`].
    fn event_create(&self, timing: bool) -> Result<EventHandle>;
    /// Destroys an event.
    fn event_destroy(&self, event: EventHandle) -> Result<()>;
    /// Records `event` after the work queued so far on `stream`.
    fn event_record(&self, event: EventHandle, stream: StreamHandle) -> Result<()>;
    /// Waits for `event`'s recorded work.
    fn event_synchronize(&self, event: EventHandle) -> Result<()>;
    /// Whether `event`'s recorded work has completed.
    fn event_query(&self, event: EventHandle) -> Result<bool>;
    /// Milliseconds between two completed timing events.
    fn event_elapsed_ms(&self, start: EventHandle, end: EventHandle) -> Result<f32>;

    // ---- modules and launches ----------------------------------------------------------------

    /// Loads a module from a binary image (the output of the run-time compiler).
    fn module_load_data(&self, image: &[u8]) -> Result<ModuleHandle>;
    /// Unloads a module.
    fn module_unload(&self, module: ModuleHandle) -> Result<()>;
    /// Looks up the kernel `name` in `module`.
    fn module_get_function(&self, module: ModuleHandle, name: &str) -> Result<FunctionHandle>;
    /// Queues a kernel launch on `stream`.
    ///
    /// # Safety
    /// `params` holds one pointer per kernel parameter, each to a value of the parameter's type,
    /// valid until this call returns; every buffer the kernel accesses is live until the launch
    /// has completed.
    unsafe fn launch_kernel(
        &self,
        function: FunctionHandle,
        grid: [u32; 3],
        block: [u32; 3],
        shared_memory: u32,
        stream: StreamHandle,
        params: &mut [*mut c_void],
    ) -> Result<()>;

    // ---- run-time compiler -------------------------------------------------------------------

    /// Creates a program from C++ source (`mcrtcCreateProgram`, no extra headers).
    fn rtc_create_program(&self, source: &str, name: &str) -> Result<ProgramHandle>;
    /// Compiles a program (`mcrtcCompileProgram`); the status is returned as
    /// [`DriverError::Rtc`] with the compiler's code, and the log stays readable.
    fn rtc_compile_program(&self, program: ProgramHandle, options: &[&str]) -> Result<()>;
    /// The compiler's log for a program.
    fn rtc_program_log(&self, program: ProgramHandle) -> Result<String>;
    /// The compiled binary (`mcrtcGetBitcode`).
    fn rtc_bitcode(&self, program: ProgramHandle) -> Result<Vec<u8>>;
    /// Destroys a program.
    fn rtc_destroy_program(&self, program: ProgramHandle) -> Result<()>;

    /// What identifies the run-time compiler's output for the persistent kernel cache
    /// ([`crate::runtime::compile_cache`]): two drivers with the same fingerprint produce
    /// interchangeable images for the same source and options. The default is the driver's name;
    /// drivers add their compiler's version or library identity.
    fn compiler_fingerprint(&self) -> String {
        self.name().to_string()
    }

    /// Compiles `source` into a loadable image: create, compile, read the log and the binary,
    /// destroy. A rejected program gives [`DriverError::Compilation`] with the log.
    fn compile(&self, source: &str, name: &str, options: &[&str]) -> Result<CompiledProgram> {
        let program = self.rtc_create_program(source, name)?;
        let outcome = (|| {
            let compiled = self.rtc_compile_program(program, options);
            let log = self.rtc_program_log(program).unwrap_or_default();
            match compiled {
                Ok(()) => Ok(CompiledProgram { image: self.rtc_bitcode(program)?, log }),
                Err(DriverError::Rtc { error, .. }) => {
                    Err(DriverError::Compilation { program: name.to_string(), error, log })
                }
                Err(other) => Err(other),
            }
        })();
        let destroyed = self.rtc_destroy_program(program);
        let compiled = outcome?;
        destroyed?;
        Ok(compiled)
    }
}
