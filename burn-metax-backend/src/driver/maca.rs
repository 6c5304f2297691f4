//! [`MacaDriver`]: the [`Driver`] over the MACA runtime (`libmcruntime.so`), its run-time
//! compiler (`mcrtc*`) and, optionally, the collectives library (`libmccl.so`), all opened at run
//! time with `libloading` from `$MACA_PATH/lib` (default `/opt/maca/lib`).
//!
//! # Which names and signatures are verified
//!
//! *Verified* means: the name, and the argument order/types used here, appear in public MetaX
//! sources (not a header: no MACA header is public). Sources:
//! - **[triton]** MetaX-MACA/mcTriton `third_party/metax/backend/driver.c`: `mcGetErrorString`,
//!   `mcDeviceGetAttribute(int*, attr, device)`, `mcModuleLoadData(mcModule_t*, const void*)`,
//!   `mcModuleGetFunction(mcFunction_t*, mcModule_t, const char*)`, the header name
//!   `mcr/mc_runtime.h`, warp size 64, and `mcModuleLaunchKernel(f, gx, gy, gz, bx, by, bz,
//!   shared, stream, params, extra)` (in the launcher it generates).
//! - **[tvm]** MetaX-MACA/mcTVM MACA device API / module: `mcSetDevice`,
//!   `mcStreamCreateWithFlags(&s, mcStreamNonBlocking)`, `mcDeviceAttributeWarpSize`,
//!   `mcGetErrorName(code)`, `mcModuleLaunchKernel` with `extra` args.
//! - **[samples]** MetaX-MACA samples and ports (vector-add driver sample, flagcx/sdccl MACA
//!   adaptors): `mcMalloc(void**, size)`, `mcMallocAsync(void**, size, stream)`, `mcFree`,
//!   `mcMallocHost(void**, size)`, `mcFreeHost`, `mcMemcpy(dst, src, size, kind)`,
//!   `mcMemcpyAsync(dst, src, size, kind, stream)`, `mcStreamWaitEvent(s, e, flags)`,
//!   `mcEventCreateWithFlags(&e, mcEventDisableTiming)`, `mcEventRecord(e, s)`,
//!   `mcEventSynchronize`, `mcStreamSynchronize`, `mcStreamDestroy`, `mcEventDestroy`,
//!   `mcGetDeviceCount`, `mcDeviceSynchronize`, `mcModuleUnload`.
//! - **[rtc]** public MCRTC users (TileLang-MetaX `mcrtc` ctypes wrapper, MACA CCCL bindings):
//!   `mcrtcCreateProgram(prog*, src, name, nheaders, headers, include_names)`,
//!   `mcrtcCompileProgram(prog, n, opts)`, `mcrtcGetProgramLogSize(prog, size_t*)`,
//!   `mcrtcGetProgramLog(prog, char*)`, `mcrtcGetBitcodeSize`, `mcrtcGetBitcode`,
//!   `mcrtcDestroyProgram(prog*)`; and that these symbols are exported by `libmcruntime.so`
//!   itself (so a separate `libmcrtc.so` is only a fallback).
//! - **[enums]** a public Cython mirror of `mcr/maca.h`: the `mcError_t` values and the order of
//!   `mcDeviceAttribute_t` (the ordinals below are inferred from declaration order).
//!
//! *Assumed by analogy with CUDA/HIP* (unverified): `mcMemcpyKind` values (H2D = 1, D2H = 2,
//! D2D = 3, as `cudaMemcpyKind`); `mcStreamNonBlocking = 1`; `mcEventDisableTiming = 2`;
//! `mcFreeAsync(ptr, stream)` (≈ `cudaFreeAsync`); `mcMemGetInfo(size_t*, size_t*)`
//! (≈ `cudaMemGetInfo`); `mcEventQuery`/`mcEventElapsedTime(float*, start, end)`;
//! `mcDeviceGetName(char*, int, device)` (≈ `hipDeviceGetName`; optional); the `mcrtcResult`
//! numbering (≈ `nvrtcResult`); the `mcDeviceAttribute_t` ordinals' starting value 0.

use super::{
    DeviceProperties, DevicePtr, Driver, DriverError, EventHandle, FunctionHandle, HostPtr, MacaError,
    ModuleHandle, ProgramHandle, Result, RtcError, StreamHandle,
};
use libloading::Library;
use std::cell::Cell;
use std::collections::HashMap;
use std::ffi::{CStr, CString, c_char, c_int, c_uint, c_void};
use std::fmt;
use std::path::{Path, PathBuf};
use std::sync::{Arc, Mutex, MutexGuard};

/// The MACA installation root used when `MACA_PATH` is not set.
pub const DEFAULT_MACA_PATH: &str = "/opt/maca";

/// The MACA installation root: `$MACA_PATH` if set and non-empty, else [`DEFAULT_MACA_PATH`].
pub fn maca_root() -> PathBuf {
    std::env::var_os("MACA_PATH")
        .filter(|p| !p.is_empty())
        .map_or_else(|| PathBuf::from(DEFAULT_MACA_PATH), PathBuf::from)
}

type Status = c_int;
type Raw = *mut c_void;

// `mcMemcpyKind` (assumed equal to `cudaMemcpyKind`).
const MEMCPY_HOST_TO_DEVICE: c_int = 1;
const MEMCPY_DEVICE_TO_HOST: c_int = 2;
const MEMCPY_DEVICE_TO_DEVICE: c_int = 3;
// Stream and event flags (assumed equal to CUDA's).
const STREAM_NON_BLOCKING: c_uint = 1;
const EVENT_DEFAULT: c_uint = 0;
const EVENT_DISABLE_TIMING: c_uint = 2;

/// `mcDeviceAttribute_t` ordinals (declaration order of the public mirror, starting at 0).
#[allow(dead_code)]
pub(crate) mod attr {
    pub const MAX_THREADS_PER_BLOCK: i32 = 0;
    pub const MAX_BLOCK_DIM_X: i32 = 1;
    pub const MAX_BLOCK_DIM_Y: i32 = 2;
    pub const MAX_BLOCK_DIM_Z: i32 = 3;
    pub const MAX_GRID_DIM_X: i32 = 4;
    pub const MAX_GRID_DIM_Y: i32 = 5;
    pub const MAX_GRID_DIM_Z: i32 = 6;
    pub const MAX_SHARED_MEMORY_PER_BLOCK: i32 = 7;
    pub const WARP_SIZE: i32 = 9;
    pub const WAVE_SIZE: i32 = 10;
    pub const MULTIPROCESSOR_COUNT: i32 = 16;
    pub const COMPUTE_CAPABILITY_MAJOR: i32 = 21;
    pub const COMPUTE_CAPABILITY_MINOR: i32 = 22;
}

/// Resolves `name` in `lib` as a value of type `T`.
///
/// # Safety
/// `T` must be the exact (function pointer) type of the exported symbol.
unsafe fn symbol<T: Copy>(lib: &Library, path: &Path, name: &'static str) -> Result<T> {
    // SAFETY: the caller guarantees that `T` matches the symbol's real type; the value is copied
    // out of the `Symbol`, and the library is kept alive by the driver as long as `T` is used.
    unsafe { lib.get::<T>(name.as_bytes()) }
        .map(|s| *s)
        .map_err(|_| DriverError::MissingSymbol { library: path.to_path_buf(), symbol: name })
}

/// Declares a table of C entry points: required ones fail the load when absent, optional ones
/// become `None`.
macro_rules! api_table {
    (
        $(#[$doc:meta])* struct $name:ident {
            required { $( $req:ident : fn( $($ra:ty),* ) $(-> $rr:ty)?; )* }
            optional { $( $opt:ident : fn( $($oa:ty),* ) $(-> $or:ty)?; )* }
        }
    ) => {
        $(#[$doc])*
        #[allow(non_snake_case)]
        #[derive(Clone, Copy)]
        struct $name {
            $( $req: unsafe extern "C" fn($($ra),*) $(-> $rr)?, )*
            $( $opt: Option<unsafe extern "C" fn($($oa),*) $(-> $or)?>, )*
        }

        impl $name {
            fn load(lib: &Library, path: &Path) -> Result<Self> {
                Ok(Self {
                    $(
                        // SAFETY: the field type is the C prototype of the symbol of that name,
                        // as documented at the top of this module.
                        $req: unsafe { symbol(lib, path, stringify!($req))? },
                    )*
                    $(
                        // SAFETY: as above.
                        $opt: unsafe { symbol(lib, path, stringify!($opt)).ok() },
                    )*
                })
            }
        }
    };
}

api_table! {
    /// Entry points of `libmcruntime.so`.
    struct RuntimeApi {
        required {
            mcGetDeviceCount: fn(*mut c_int) -> Status;
            mcSetDevice: fn(c_int) -> Status;
            mcDeviceGetAttribute: fn(*mut c_int, c_int, c_int) -> Status;
            mcDeviceSynchronize: fn() -> Status;
            mcMemGetInfo: fn(*mut usize, *mut usize) -> Status;
            mcMalloc: fn(*mut Raw, usize) -> Status;
            mcFree: fn(Raw) -> Status;
            mcMallocHost: fn(*mut Raw, usize) -> Status;
            mcFreeHost: fn(Raw) -> Status;
            mcMemcpy: fn(Raw, *const c_void, usize, c_int) -> Status;
            mcMemcpyAsync: fn(Raw, *const c_void, usize, c_int, Raw) -> Status;
            mcStreamCreateWithFlags: fn(*mut Raw, c_uint) -> Status;
            mcStreamDestroy: fn(Raw) -> Status;
            mcStreamSynchronize: fn(Raw) -> Status;
            mcStreamWaitEvent: fn(Raw, Raw, c_uint) -> Status;
            mcEventCreateWithFlags: fn(*mut Raw, c_uint) -> Status;
            mcEventDestroy: fn(Raw) -> Status;
            mcEventRecord: fn(Raw, Raw) -> Status;
            mcEventSynchronize: fn(Raw) -> Status;
            mcEventQuery: fn(Raw) -> Status;
            mcEventElapsedTime: fn(*mut f32, Raw, Raw) -> Status;
            mcModuleLoadData: fn(*mut Raw, *const c_void) -> Status;
            mcModuleUnload: fn(Raw) -> Status;
            mcModuleGetFunction: fn(*mut Raw, Raw, *const c_char) -> Status;
            mcModuleLaunchKernel: fn(
                Raw, c_uint, c_uint, c_uint, c_uint, c_uint, c_uint, c_uint, Raw, *mut Raw, *mut Raw
            ) -> Status;
        }
        optional {
            mcMallocAsync: fn(*mut Raw, usize, Raw) -> Status;
            mcFreeAsync: fn(Raw, Raw) -> Status;
            mcDeviceGetName: fn(*mut c_char, c_int, c_int) -> Status;
            mcGetErrorName: fn(Status) -> *const c_char;
            mcGetErrorString: fn(Status) -> *const c_char;
        }
    }
}

api_table! {
    /// Entry points of the run-time compiler (`mcrtc*`).
    struct RtcApi {
        required {
            mcrtcCreateProgram: fn(
                *mut Raw, *const c_char, *const c_char, c_int, *const *const c_char,
                *const *const c_char
            ) -> Status;
            mcrtcCompileProgram: fn(Raw, c_int, *const *const c_char) -> Status;
            mcrtcGetProgramLogSize: fn(Raw, *mut usize) -> Status;
            mcrtcGetProgramLog: fn(Raw, *mut c_char) -> Status;
            mcrtcGetBitcodeSize: fn(Raw, *mut usize) -> Status;
            mcrtcGetBitcode: fn(Raw, *mut c_char) -> Status;
            mcrtcDestroyProgram: fn(*mut Raw) -> Status;
        }
        optional {}
    }
}

thread_local! {
    /// The calling thread's current device, mirroring the runtime's own per-thread state.
    static CURRENT_DEVICE: Cell<usize> = const { Cell::new(0) };
}

/// The [`Driver`] over the MACA runtime libraries, opened at run time.
pub struct MacaDriver {
    runtime_path: PathBuf,
    rt: RuntimeApi,
    rtc: std::result::Result<RtcApi, String>,
    mccl: Option<Arc<Library>>,
    poisoned: Mutex<HashMap<usize, DriverError>>,
    // Kept last so that the libraries outlive every function pointer above.
    _libraries: Vec<Arc<Library>>,
}

impl fmt::Debug for MacaDriver {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("MacaDriver")
            .field("runtime", &self.runtime_path)
            .field("rtc", &self.rtc.as_ref().map(|_| "loaded"))
            .field("mccl", &self.mccl.is_some())
            .finish_non_exhaustive()
    }
}

fn open(path: &Path) -> Result<Library> {
    // SAFETY: opening a shared library runs its initialisers; the MACA runtime (or a mock of it)
    // is trusted code whose initialisers have no preconditions on this process.
    unsafe { Library::new(path) }
        .map_err(|e| DriverError::LibraryNotFound { path: path.to_path_buf(), reason: e.to_string() })
}

fn lock<T>(m: &Mutex<T>) -> MutexGuard<'_, T> {
    m.lock().unwrap_or_else(|e| e.into_inner())
}

fn c_string(what: &str, s: &str) -> Result<CString> {
    CString::new(s).map_err(|_| DriverError::InvalidArgument(format!("{what} contains a NUL byte: {s:?}")))
}

fn to_c_int(what: &str, v: usize) -> Result<c_int> {
    c_int::try_from(v).map_err(|_| DriverError::InvalidArgument(format!("{what} {v} out of range")))
}

impl MacaDriver {
    /// Opens the MACA libraries under [`maca_root()`] (`$MACA_PATH`, default `/opt/maca`).
    pub fn load() -> Result<Self> {
        Self::load_from(maca_root())
    }

    /// Opens the MACA libraries under `root` (`root/lib/libmcruntime.so`, the `mcrtc*` symbols
    /// from it or from `root/lib/libmcrtc.so`, and optionally `root/lib/libmccl.so`).
    ///
    /// Fails with [`DriverError::LibraryNotFound`] (naming the file looked for) when the runtime
    /// is absent, and with [`DriverError::MissingSymbol`] when a required entry point is.
    pub fn load_from(root: impl AsRef<Path>) -> Result<Self> {
        let lib_dir = root.as_ref().join("lib");
        let runtime_path = lib_dir.join("libmcruntime.so");
        let runtime = Arc::new(open(&runtime_path)?);
        let rt = RuntimeApi::load(&runtime, &runtime_path)?;
        let mut libraries = vec![runtime.clone()];

        let rtc = match RtcApi::load(&runtime, &runtime_path) {
            Ok(api) => Ok(api),
            Err(in_runtime) => {
                let rtc_path = lib_dir.join("libmcrtc.so");
                match open(&rtc_path) {
                    Ok(lib) => {
                        let lib = Arc::new(lib);
                        let api = RtcApi::load(&lib, &rtc_path);
                        libraries.push(lib);
                        api.map_err(|e| e.to_string())
                    }
                    Err(e) => Err(format!("{in_runtime}; {e}")),
                }
            }
        };
        let mccl = open(&lib_dir.join("libmccl.so")).ok().map(Arc::new);
        if let Some(lib) = &mccl {
            libraries.push(lib.clone());
        }
        Ok(Self { runtime_path, rt, rtc, mccl, poisoned: Mutex::new(HashMap::new()), _libraries: libraries })
    }

    /// Properties of every device under [`maca_root()`]; empty when the runtime is absent or
    /// reports no device (use [`MacaDriver::load`] to learn why).
    pub fn enumerate_devices() -> Vec<DeviceProperties> {
        Self::enumerate_devices_in(maca_root())
    }

    /// As [`MacaDriver::enumerate_devices`], for the installation at `root`.
    pub fn enumerate_devices_in(root: impl AsRef<Path>) -> Vec<DeviceProperties> {
        let Ok(driver) = Self::load_from(root) else { return Vec::new() };
        let count = driver.device_count().unwrap_or(0);
        (0..count).filter_map(|d| driver.device_properties(d).ok()).collect()
    }

    /// The runtime library this driver opened.
    pub fn runtime_path(&self) -> &Path {
        &self.runtime_path
    }

    /// Whether the run-time compiler was found.
    pub fn has_rtc(&self) -> bool {
        self.rtc.is_ok()
    }

    /// Whether `libmccl.so` (collectives) was found next to the runtime.
    pub fn has_mccl(&self) -> bool {
        self.mccl.is_some()
    }

    /// The runtime's own name for a status code (`mcGetErrorName`), when it exports one.
    pub fn runtime_error_name(&self, code: i32) -> Option<String> {
        Self::static_string(self.rt.mcGetErrorName?, code)
    }

    /// The runtime's own description of a status code (`mcGetErrorString`), when it exports one.
    pub fn runtime_error_string(&self, code: i32) -> Option<String> {
        Self::static_string(self.rt.mcGetErrorString?, code)
    }

    fn static_string(f: unsafe extern "C" fn(Status) -> *const c_char, code: i32) -> Option<String> {
        // SAFETY: `mcGetErrorName`/`mcGetErrorString` accept any status value and return a
        // static NUL-terminated string or null.
        let p = unsafe { f(code) };
        // SAFETY: `p` is non-null and points to a NUL-terminated string owned by the runtime.
        (!p.is_null()).then(|| unsafe { CStr::from_ptr(p) }.to_string_lossy().into_owned())
    }

    fn guard(&self) -> Result<()> {
        let device = CURRENT_DEVICE.with(Cell::get);
        match lock(&self.poisoned).get(&device) {
            Some(e) => Err(e.clone()),
            None => Ok(()),
        }
    }

    fn check(&self, call: &'static str, status: Status) -> Result<()> {
        let Some(error) = MacaError::from_code(status) else { return Ok(()) };
        if error.is_sticky() {
            let device = CURRENT_DEVICE.with(Cell::get);
            lock(&self.poisoned).entry(device).or_insert(DriverError::Poisoned { device, call, error });
        }
        Err(DriverError::Api { call, error })
    }

    fn rtc(&self) -> Result<&RtcApi> {
        self.rtc.as_ref().map_err(|e| DriverError::RtcUnavailable(e.clone()))
    }

    fn check_rtc(call: &'static str, status: Status) -> Result<()> {
        match RtcError::from_code(status) {
            None => Ok(()),
            Some(error) => Err(DriverError::Rtc { call, error }),
        }
    }

    fn attribute(&self, attribute: i32, device: c_int) -> Result<i32> {
        let mut value: c_int = 0;
        // SAFETY: `value` is a valid out-pointer; the runtime validates `attribute` and `device`.
        let status = unsafe { (self.rt.mcDeviceGetAttribute)(&mut value, attribute, device) };
        self.check("mcDeviceGetAttribute", status)?;
        Ok(value)
    }

    fn attribute_u32(&self, attribute: i32, device: c_int) -> Result<u32> {
        let v = self.attribute(attribute, device)?;
        u32::try_from(v)
            .map_err(|_| DriverError::UnexpectedValue(format!("device attribute {attribute} is {v}")))
    }
}

fn raw(h: usize) -> Raw {
    h as Raw
}

impl Driver for MacaDriver {
    fn name(&self) -> &str {
        "maca"
    }

    fn compiler_fingerprint(&self) -> String {
        // `mcrtc` lives in the runtime library (or beside it): a different SDK is a different
        // file, size or modification time.
        let meta = std::fs::metadata(&self.runtime_path).ok();
        let size = meta.as_ref().map_or(0, std::fs::Metadata::len);
        let modified = meta
            .and_then(|m| m.modified().ok())
            .and_then(|t| t.duration_since(std::time::UNIX_EPOCH).ok())
            .map_or(0, |d| d.as_nanos());
        format!("maca:{}:{size}:{modified}", self.runtime_path.display())
    }

    fn device_count(&self) -> Result<usize> {
        let mut count: c_int = 0;
        // SAFETY: `count` is a valid out-pointer.
        let status = unsafe { (self.rt.mcGetDeviceCount)(&mut count) };
        match MacaError::from_code(status) {
            // No device is an empty list, not an error.
            Some(e) if e == MacaError::NO_DEVICE => Ok(0),
            _ => {
                self.check("mcGetDeviceCount", status)?;
                Ok(usize::try_from(count).unwrap_or(0))
            }
        }
    }

    fn device_properties(&self, device: usize) -> Result<DeviceProperties> {
        let ordinal = to_c_int("device", device)?;
        let warp_size = self.attribute_u32(attr::WARP_SIZE, ordinal)?;
        if warp_size != 32 && warp_size != 64 {
            return Err(DriverError::UnexpectedValue(format!(
                "device {device} reports a warp size of {warp_size}; the mcDeviceAttribute \
                 numbering of this SDK may differ from the one this crate assumes"
            )));
        }
        let name = match self.rt.mcDeviceGetName {
            Some(f) => {
                let mut buf = [0 as c_char; 256];
                // SAFETY: `buf` is writable for its full length, which is passed as the limit.
                let status = unsafe { f(buf.as_mut_ptr(), buf.len() as c_int, ordinal) };
                self.check("mcDeviceGetName", status)?;
                // Guarantee termination even if the runtime filled the whole buffer.
                buf[buf.len() - 1] = 0;
                // SAFETY: `buf` now holds a NUL-terminated string.
                unsafe { CStr::from_ptr(buf.as_ptr()) }.to_string_lossy().into_owned()
            }
            None => format!("MetaX device {device}"),
        };
        let previous = self.current_device();
        self.set_device(device)?;
        let memory = self.memory_info();
        self.set_device(previous)?;
        let (_, total_memory) = memory?;
        Ok(DeviceProperties {
            name,
            warp_size,
            max_threads_per_block: self.attribute_u32(attr::MAX_THREADS_PER_BLOCK, ordinal)?,
            max_block_dim: [
                self.attribute_u32(attr::MAX_BLOCK_DIM_X, ordinal)?,
                self.attribute_u32(attr::MAX_BLOCK_DIM_Y, ordinal)?,
                self.attribute_u32(attr::MAX_BLOCK_DIM_Z, ordinal)?,
            ],
            max_grid_dim: [
                self.attribute_u32(attr::MAX_GRID_DIM_X, ordinal)?,
                self.attribute_u32(attr::MAX_GRID_DIM_Y, ordinal)?,
                self.attribute_u32(attr::MAX_GRID_DIM_Z, ordinal)?,
            ],
            max_shared_memory_per_block: self.attribute_u32(attr::MAX_SHARED_MEMORY_PER_BLOCK, ordinal)?
                as usize,
            multiprocessor_count: self.attribute_u32(attr::MULTIPROCESSOR_COUNT, ordinal)?,
            compute_capability: (
                self.attribute_u32(attr::COMPUTE_CAPABILITY_MAJOR, ordinal)?,
                self.attribute_u32(attr::COMPUTE_CAPABILITY_MINOR, ordinal)?,
            ),
            total_memory,
        })
    }

    fn set_device(&self, device: usize) -> Result<()> {
        let ordinal = to_c_int("device", device)?;
        // SAFETY: plain value argument; the runtime validates the ordinal.
        let status = unsafe { (self.rt.mcSetDevice)(ordinal) };
        self.check("mcSetDevice", status)?;
        CURRENT_DEVICE.with(|c| c.set(device));
        Ok(())
    }

    fn current_device(&self) -> usize {
        CURRENT_DEVICE.with(Cell::get)
    }

    fn device_synchronize(&self) -> Result<()> {
        self.guard()?;
        // SAFETY: no arguments.
        let status = unsafe { (self.rt.mcDeviceSynchronize)() };
        self.check("mcDeviceSynchronize", status)
    }

    fn memory_info(&self) -> Result<(usize, usize)> {
        self.guard()?;
        let (mut free, mut total) = (0usize, 0usize);
        // SAFETY: both are valid out-pointers.
        let status = unsafe { (self.rt.mcMemGetInfo)(&mut free, &mut total) };
        self.check("mcMemGetInfo", status)?;
        Ok((free, total))
    }

    fn poisoned(&self, device: usize) -> Option<DriverError> {
        lock(&self.poisoned).get(&device).cloned()
    }

    fn malloc(&self, size: usize) -> Result<DevicePtr> {
        self.guard()?;
        let mut ptr: Raw = std::ptr::null_mut();
        // SAFETY: `ptr` is a valid out-pointer.
        let status = unsafe { (self.rt.mcMalloc)(&mut ptr, size) };
        self.check("mcMalloc", status)?;
        Ok(DevicePtr::from_raw(ptr as usize))
    }

    fn malloc_async(&self, size: usize, stream: StreamHandle) -> Result<DevicePtr> {
        let Some(f) = self.rt.mcMallocAsync else { return self.malloc(size) };
        self.guard()?;
        let mut ptr: Raw = std::ptr::null_mut();
        // SAFETY: `ptr` is a valid out-pointer; `stream` is a handle from this runtime (or null).
        let status = unsafe { f(&mut ptr, size, raw(stream.as_raw())) };
        self.check("mcMallocAsync", status)?;
        Ok(DevicePtr::from_raw(ptr as usize))
    }

    unsafe fn free(&self, ptr: DevicePtr) -> Result<()> {
        self.guard()?;
        // SAFETY: the caller guarantees `ptr` is a live allocation no work still uses.
        let status = unsafe { (self.rt.mcFree)(raw(ptr.as_raw())) };
        self.check("mcFree", status)
    }

    unsafe fn free_async(&self, ptr: DevicePtr, stream: StreamHandle) -> Result<()> {
        let Some(f) = self.rt.mcFreeAsync else {
            self.stream_synchronize(stream)?;
            // SAFETY: the stream's earlier work has completed, so the caller's contract for
            // `free_async` implies the one of `free`.
            return unsafe { self.free(ptr) };
        };
        self.guard()?;
        // SAFETY: the caller guarantees only work queued on `stream` before this call uses `ptr`.
        let status = unsafe { f(raw(ptr.as_raw()), raw(stream.as_raw())) };
        self.check("mcFreeAsync", status)
    }

    fn malloc_host(&self, size: usize) -> Result<HostPtr> {
        self.guard()?;
        let mut ptr: Raw = std::ptr::null_mut();
        // SAFETY: `ptr` is a valid out-pointer.
        let status = unsafe { (self.rt.mcMallocHost)(&mut ptr, size) };
        self.check("mcMallocHost", status)?;
        Ok(HostPtr::from_raw(ptr as usize))
    }

    unsafe fn free_host(&self, ptr: HostPtr) -> Result<()> {
        self.guard()?;
        // SAFETY: the caller guarantees `ptr` came from `mcMallocHost` and is unused.
        let status = unsafe { (self.rt.mcFreeHost)(raw(ptr.as_raw())) };
        self.check("mcFreeHost", status)
    }

    unsafe fn memcpy_htod_async(
        &self,
        dst: DevicePtr,
        src: *const u8,
        len: usize,
        stream: StreamHandle,
    ) -> Result<()> {
        self.guard()?;
        // SAFETY: the caller guarantees `src` stays readable and `dst` in bounds until the copy
        // completes.
        let status = unsafe {
            (self.rt.mcMemcpyAsync)(
                raw(dst.as_raw()),
                src.cast(),
                len,
                MEMCPY_HOST_TO_DEVICE,
                raw(stream.as_raw()),
            )
        };
        self.check("mcMemcpyAsync", status)
    }

    unsafe fn memcpy_dtoh_async(
        &self,
        dst: *mut u8,
        src: DevicePtr,
        len: usize,
        stream: StreamHandle,
    ) -> Result<()> {
        self.guard()?;
        // SAFETY: the caller guarantees `dst` stays writable and `src` in bounds until the copy
        // completes.
        let status = unsafe {
            (self.rt.mcMemcpyAsync)(
                dst.cast(),
                raw(src.as_raw()),
                len,
                MEMCPY_DEVICE_TO_HOST,
                raw(stream.as_raw()),
            )
        };
        self.check("mcMemcpyAsync", status)
    }

    unsafe fn memcpy_dtod_async(
        &self,
        dst: DevicePtr,
        src: DevicePtr,
        len: usize,
        stream: StreamHandle,
    ) -> Result<()> {
        self.guard()?;
        // SAFETY: the caller guarantees both ranges are live device memory until completion.
        let status = unsafe {
            (self.rt.mcMemcpyAsync)(
                raw(dst.as_raw()),
                raw(src.as_raw()),
                len,
                MEMCPY_DEVICE_TO_DEVICE,
                raw(stream.as_raw()),
            )
        };
        self.check("mcMemcpyAsync", status)
    }

    unsafe fn memcpy_htod(&self, dst: DevicePtr, src: &[u8]) -> Result<()> {
        self.guard()?;
        // SAFETY: `src` is a live slice for the whole (blocking) call; the caller guarantees the
        // device range.
        let status = unsafe {
            (self.rt.mcMemcpy)(raw(dst.as_raw()), src.as_ptr().cast(), src.len(), MEMCPY_HOST_TO_DEVICE)
        };
        self.check("mcMemcpy", status)
    }

    unsafe fn memcpy_dtoh(&self, dst: &mut [u8], src: DevicePtr) -> Result<()> {
        self.guard()?;
        // SAFETY: `dst` is exclusively borrowed for the whole (blocking) call; the caller
        // guarantees the device range.
        let status = unsafe {
            (self.rt.mcMemcpy)(dst.as_mut_ptr().cast(), raw(src.as_raw()), dst.len(), MEMCPY_DEVICE_TO_HOST)
        };
        self.check("mcMemcpy", status)
    }

    fn stream_create(&self, non_blocking: bool) -> Result<StreamHandle> {
        self.guard()?;
        let mut stream: Raw = std::ptr::null_mut();
        let flags = if non_blocking { STREAM_NON_BLOCKING } else { 0 };
        // SAFETY: `stream` is a valid out-pointer.
        let status = unsafe { (self.rt.mcStreamCreateWithFlags)(&mut stream, flags) };
        self.check("mcStreamCreateWithFlags", status)?;
        Ok(StreamHandle::from_raw(stream as usize))
    }

    fn stream_destroy(&self, stream: StreamHandle) -> Result<()> {
        self.guard()?;
        // SAFETY: the runtime validates the handle.
        let status = unsafe { (self.rt.mcStreamDestroy)(raw(stream.as_raw())) };
        self.check("mcStreamDestroy", status)
    }

    fn stream_synchronize(&self, stream: StreamHandle) -> Result<()> {
        self.guard()?;
        // SAFETY: the runtime validates the handle.
        let status = unsafe { (self.rt.mcStreamSynchronize)(raw(stream.as_raw())) };
        self.check("mcStreamSynchronize", status)
    }

    fn stream_wait_event(&self, stream: StreamHandle, event: EventHandle) -> Result<()> {
        self.guard()?;
        // SAFETY: the runtime validates both handles; flags 0 is the default wait.
        let status = unsafe { (self.rt.mcStreamWaitEvent)(raw(stream.as_raw()), raw(event.as_raw()), 0) };
        self.check("mcStreamWaitEvent", status)
    }

    fn event_create(&self, timing: bool) -> Result<EventHandle> {
        self.guard()?;
        let mut event: Raw = std::ptr::null_mut();
        let flags = if timing { EVENT_DEFAULT } else { EVENT_DISABLE_TIMING };
        // SAFETY: `event` is a valid out-pointer.
        let status = unsafe { (self.rt.mcEventCreateWithFlags)(&mut event, flags) };
        self.check("mcEventCreateWithFlags", status)?;
        Ok(EventHandle::from_raw(event as usize))
    }

    fn event_destroy(&self, event: EventHandle) -> Result<()> {
        self.guard()?;
        // SAFETY: the runtime validates the handle.
        let status = unsafe { (self.rt.mcEventDestroy)(raw(event.as_raw())) };
        self.check("mcEventDestroy", status)
    }

    fn event_record(&self, event: EventHandle, stream: StreamHandle) -> Result<()> {
        self.guard()?;
        // SAFETY: the runtime validates both handles.
        let status = unsafe { (self.rt.mcEventRecord)(raw(event.as_raw()), raw(stream.as_raw())) };
        self.check("mcEventRecord", status)
    }

    fn event_synchronize(&self, event: EventHandle) -> Result<()> {
        self.guard()?;
        // SAFETY: the runtime validates the handle.
        let status = unsafe { (self.rt.mcEventSynchronize)(raw(event.as_raw())) };
        self.check("mcEventSynchronize", status)
    }

    fn event_query(&self, event: EventHandle) -> Result<bool> {
        self.guard()?;
        // SAFETY: the runtime validates the handle.
        let status = unsafe { (self.rt.mcEventQuery)(raw(event.as_raw())) };
        if status == MacaError::NOT_READY.code() {
            return Ok(false);
        }
        self.check("mcEventQuery", status)?;
        Ok(true)
    }

    fn event_elapsed_ms(&self, start: EventHandle, end: EventHandle) -> Result<f32> {
        self.guard()?;
        let mut ms = 0f32;
        // SAFETY: `ms` is a valid out-pointer; the runtime validates the handles.
        let status = unsafe { (self.rt.mcEventElapsedTime)(&mut ms, raw(start.as_raw()), raw(end.as_raw())) };
        self.check("mcEventElapsedTime", status)?;
        Ok(ms)
    }

    fn module_load_data(&self, image: &[u8]) -> Result<ModuleHandle> {
        if image.is_empty() {
            return Err(DriverError::InvalidArgument("empty module image".into()));
        }
        self.guard()?;
        let mut module: Raw = std::ptr::null_mut();
        // SAFETY: `module` is a valid out-pointer; `image` is live for the call (the runtime
        // copies what it needs, as `cuModuleLoadData` does).
        let status = unsafe { (self.rt.mcModuleLoadData)(&mut module, image.as_ptr().cast()) };
        self.check("mcModuleLoadData", status)?;
        Ok(ModuleHandle::from_raw(module as usize))
    }

    fn module_unload(&self, module: ModuleHandle) -> Result<()> {
        self.guard()?;
        // SAFETY: the runtime validates the handle.
        let status = unsafe { (self.rt.mcModuleUnload)(raw(module.as_raw())) };
        self.check("mcModuleUnload", status)
    }

    fn module_get_function(&self, module: ModuleHandle, name: &str) -> Result<FunctionHandle> {
        let name = c_string("kernel name", name)?;
        self.guard()?;
        let mut function: Raw = std::ptr::null_mut();
        // SAFETY: `function` is a valid out-pointer and `name` a NUL-terminated string live for
        // the call.
        let status =
            unsafe { (self.rt.mcModuleGetFunction)(&mut function, raw(module.as_raw()), name.as_ptr()) };
        self.check("mcModuleGetFunction", status)?;
        Ok(FunctionHandle::from_raw(function as usize))
    }

    unsafe fn launch_kernel(
        &self,
        function: FunctionHandle,
        grid: [u32; 3],
        block: [u32; 3],
        shared_memory: u32,
        stream: StreamHandle,
        params: &mut [*mut c_void],
    ) -> Result<()> {
        self.guard()?;
        let params_ptr = if params.is_empty() { std::ptr::null_mut() } else { params.as_mut_ptr() };
        // SAFETY: the caller guarantees `params` matches the kernel's parameter list and that the
        // buffers it uses stay live; no `extra` configuration is passed.
        let status = unsafe {
            (self.rt.mcModuleLaunchKernel)(
                raw(function.as_raw()),
                grid[0],
                grid[1],
                grid[2],
                block[0],
                block[1],
                block[2],
                shared_memory,
                raw(stream.as_raw()),
                params_ptr,
                std::ptr::null_mut(),
            )
        };
        self.check("mcModuleLaunchKernel", status)
    }

    fn rtc_create_program(&self, source: &str, name: &str) -> Result<ProgramHandle> {
        let rtc = self.rtc()?;
        let source = c_string("kernel source", source)?;
        let name = c_string("program name", name)?;
        let mut program: Raw = std::ptr::null_mut();
        // SAFETY: out-pointer valid; both strings NUL-terminated and live for the call; no headers
        // (count 0 with null arrays, as public callers do).
        let status = unsafe {
            (rtc.mcrtcCreateProgram)(
                &mut program,
                source.as_ptr(),
                name.as_ptr(),
                0,
                std::ptr::null(),
                std::ptr::null(),
            )
        };
        Self::check_rtc("mcrtcCreateProgram", status)?;
        Ok(ProgramHandle::from_raw(program as usize))
    }

    fn rtc_compile_program(&self, program: ProgramHandle, options: &[&str]) -> Result<()> {
        let rtc = self.rtc()?;
        let owned = options.iter().map(|o| c_string("compile option", o)).collect::<Result<Vec<_>>>()?;
        let pointers: Vec<*const c_char> = owned.iter().map(|o| o.as_ptr()).collect();
        let count = to_c_int("option count", pointers.len())?;
        let array = if pointers.is_empty() { std::ptr::null() } else { pointers.as_ptr() };
        // SAFETY: `array` holds `count` NUL-terminated strings kept alive by `owned`.
        let status = unsafe { (rtc.mcrtcCompileProgram)(raw(program.as_raw()), count, array) };
        Self::check_rtc("mcrtcCompileProgram", status)
    }

    fn rtc_program_log(&self, program: ProgramHandle) -> Result<String> {
        let rtc = self.rtc()?;
        let mut size = 0usize;
        // SAFETY: `size` is a valid out-pointer.
        let status = unsafe { (rtc.mcrtcGetProgramLogSize)(raw(program.as_raw()), &mut size) };
        Self::check_rtc("mcrtcGetProgramLogSize", status)?;
        if size == 0 {
            return Ok(String::new());
        }
        let mut buf = vec![0u8; size];
        // SAFETY: `buf` is writable for the `size` bytes the compiler said it needs.
        let status = unsafe { (rtc.mcrtcGetProgramLog)(raw(program.as_raw()), buf.as_mut_ptr().cast()) };
        Self::check_rtc("mcrtcGetProgramLog", status)?;
        let end = buf.iter().position(|&b| b == 0).unwrap_or(buf.len());
        Ok(String::from_utf8_lossy(&buf[..end]).into_owned())
    }

    fn rtc_bitcode(&self, program: ProgramHandle) -> Result<Vec<u8>> {
        let rtc = self.rtc()?;
        let mut size = 0usize;
        // SAFETY: `size` is a valid out-pointer.
        let status = unsafe { (rtc.mcrtcGetBitcodeSize)(raw(program.as_raw()), &mut size) };
        Self::check_rtc("mcrtcGetBitcodeSize", status)?;
        let mut buf = vec![0u8; size];
        if size > 0 {
            // SAFETY: `buf` is writable for the `size` bytes the compiler said it needs.
            let status = unsafe { (rtc.mcrtcGetBitcode)(raw(program.as_raw()), buf.as_mut_ptr().cast()) };
            Self::check_rtc("mcrtcGetBitcode", status)?;
        }
        Ok(buf)
    }

    fn rtc_destroy_program(&self, program: ProgramHandle) -> Result<()> {
        let rtc = self.rtc()?;
        let mut handle = raw(program.as_raw());
        // SAFETY: `handle` is a program from `mcrtcCreateProgram`, passed by pointer as the API
        // takes it.
        let status = unsafe { (rtc.mcrtcDestroyProgram)(&mut handle) };
        Self::check_rtc("mcrtcDestroyProgram", status)
    }
}
