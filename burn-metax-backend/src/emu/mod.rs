//! The emulated MetaX device: a [`Driver`] that runs the kernels the MACA dialect generates on the
//! host CPU, with GPU semantics at wave size 64 (32 selectable per device).
//!
//! It is the third platform of the one server ([`crate::runtime::GpuServer`]), beside the MACA
//! runtime and the CUDA proxy: [`crate::MetaxEmu`] is `CubeBackend<MetaxEmuRuntime>`, with the same
//! dialect, compilation options and server as [`crate::Metax`]; only the driver differs.
//!
//! - **Compile** ([`compiler`]): the generated source, unchanged, is compiled by the system C++
//!   compiler into a shared object against the emulation header `emu/include/mcr/mc_runtime.h`
//!   (thread/block/grid indices, `__syncthreads`, shared memory, 64-lane shuffles, ballots and
//!   elections with 64-bit masks, atomics, math, `__half` and `__maca_bfloat16`, vector types).
//!   Images go through the persistent kernel cache ([`crate::runtime::compile_cache`]).
//! - **Launch** ([`module`]): the blocks of a grid run one after another on the stream's worker
//!   thread; in kernels with barriers or wave operations every lane is a fiber (its own stack,
//!   switched without system calls), so `__syncthreads` and wave operations have GPU semantics;
//!   other kernels run lane after lane as plain calls. Barriers in divergent control flow are
//!   faults reported with the source lines, not hangs.
//! - **Streams** ([`stream`]): one worker thread per stream executes copies, launches, event
//!   records and waits in order, asynchronously to the host; pinned host memory is host memory
//!   the workers read when they reach the copy. A missing wait gives wrong numbers, as on a GPU.
//! - **Devices**: [`EmuConfig`] (or `METAX_EMU_DEVICES`, `METAX_EMU_WARP_SIZE`,
//!   `METAX_EMU_MEMORY_GB`) sets how many devices there are, their wave size, memory and an
//!   optional per-launch delay (to make ordering bugs certain to show in tests).
//!
//! What it proves and what it cannot (MACA ABI values, `mcrtc` behaviour, performance): see
//! `docs/conformance.md`.

pub(crate) mod compiler;
mod memory;
pub(crate) mod module;
mod stream;

use std::collections::HashMap;
use std::ffi::c_void;
use std::path::PathBuf;
use std::sync::atomic::{AtomicU64, AtomicUsize, Ordering};
use std::sync::{Arc, Mutex, OnceLock};
use std::time::Duration;

pub use compiler::RUNTIME_HEADER;

use self::compiler::HostCompiler;
use self::memory::{DeviceMemory, HostMemory};
use self::module::{Launch, MAX_LANES, MAX_SHARED, Module};
use self::stream::{Event, Op, Stream, lock};
use crate::driver::{
    CompiledProgram, DeviceProperties, DevicePtr, Driver, DriverError, EventHandle, FunctionHandle, HostPtr,
    MacaError, ModuleHandle, ProgramHandle, Result, RtcError, StreamHandle,
};

/// One emulated device.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct EmuDeviceConfig {
    /// Lanes per wave: 64 (MetaX) or 32. Kernels are always generated for 64, so a 32-lane device
    /// runs them *wrongly* — which tests use to show that wave-size bugs are visible.
    pub warp_size: u32,
    /// Device memory, in bytes.
    pub memory_bytes: usize,
    /// Sleep before every kernel launch executes, to make a stream's work slow on purpose.
    pub launch_delay: Duration,
}

impl Default for EmuDeviceConfig {
    fn default() -> Self {
        Self { warp_size: 64, memory_bytes: 16 << 30, launch_delay: Duration::ZERO }
    }
}

/// The emulated devices of an [`EmuDriver`].
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct EmuConfig {
    /// One entry per device, by ordinal.
    pub devices: Vec<EmuDeviceConfig>,
    /// How long host-side waits (stream/event/device synchronisation) wait before giving up.
    pub wait_timeout: Duration,
}

impl Default for EmuConfig {
    fn default() -> Self {
        Self { devices: vec![EmuDeviceConfig::default(); 8], wait_timeout: Duration::from_secs(600) }
    }
}

fn env_number<T: std::str::FromStr>(name: &str) -> Result<Option<T>> {
    match std::env::var(name) {
        Ok(text) if !text.trim().is_empty() => text
            .trim()
            .parse()
            .map(Some)
            .map_err(|_| DriverError::InvalidArgument(format!("{name}={text:?} is not a valid number"))),
        _ => Ok(None),
    }
}

impl EmuConfig {
    /// `n` identical devices.
    pub fn uniform(n: usize, device: EmuDeviceConfig) -> Self {
        Self { devices: vec![device; n], ..Self::default() }
    }

    /// The default configuration (8 devices, wave 64, 16 GiB each) with the environment's
    /// overrides: `METAX_EMU_DEVICES`, `METAX_EMU_WARP_SIZE` (64 or 32), `METAX_EMU_MEMORY_GB`,
    /// `METAX_EMU_WAIT_TIMEOUT` (seconds).
    pub fn from_env() -> Result<Self> {
        let mut device = EmuDeviceConfig::default();
        if let Some(w) = env_number::<u32>("METAX_EMU_WARP_SIZE")? {
            device.warp_size = w;
        }
        if let Some(gb) = env_number::<usize>("METAX_EMU_MEMORY_GB")? {
            device.memory_bytes = gb << 30;
        }
        let mut config = Self::uniform(env_number::<usize>("METAX_EMU_DEVICES")?.unwrap_or(8), device);
        if let Some(s) = env_number::<u64>("METAX_EMU_WAIT_TIMEOUT")? {
            config.wait_timeout = Duration::from_secs(s);
        }
        config.validate()?;
        Ok(config)
    }

    fn validate(&self) -> Result<()> {
        for (i, d) in self.devices.iter().enumerate() {
            if d.warp_size != 32 && d.warp_size != 64 {
                return Err(DriverError::InvalidArgument(format!(
                    "emulated device {i}: wave size {} (METAX_EMU_WARP_SIZE): use 64 (MetaX) or 32",
                    d.warp_size
                )));
            }
        }
        Ok(())
    }
}

/// What one emulated device was asked to do, counted since the driver started: the figures of
/// `cargo xtask bench --device metax-emu --step-profile` (read them with
/// [`EmuDriver::counters`], subtract with [`EmuCounters::since`]).
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct EmuCounters {
    /// Kernel launches queued on the device's streams.
    pub launches: u64,
    /// Blocking host waits on the device: stream, event and device synchronisation, blocking
    /// copies and `mcFree` (which waits for the device). A read of device memory by the host is
    /// an asynchronous copy and one such wait.
    pub host_syncs: u64,
    /// Blocking waits on the device by a thread that queues no device work — CubeCL's collector
    /// of buffers shared between streams ([`in_background`]). They stall no stream and no thread
    /// that queues work, so they are counted apart from `host_syncs`.
    pub background_waits: u64,
    /// Waits of one of the device's streams for an event recorded on another stream.
    pub cross_stream_waits: u64,
    /// Bytes copied from the host to the device.
    pub host_to_device_bytes: u64,
    /// Bytes copied from the device to the host.
    pub device_to_host_bytes: u64,
}

impl EmuCounters {
    /// `self - earlier`, per counter.
    pub fn since(&self, earlier: &Self) -> Self {
        Self {
            launches: self.launches.saturating_sub(earlier.launches),
            host_syncs: self.host_syncs.saturating_sub(earlier.host_syncs),
            background_waits: self.background_waits.saturating_sub(earlier.background_waits),
            cross_stream_waits: self.cross_stream_waits.saturating_sub(earlier.cross_stream_waits),
            host_to_device_bytes: self.host_to_device_bytes.saturating_sub(earlier.host_to_device_bytes),
            device_to_host_bytes: self.device_to_host_bytes.saturating_sub(earlier.device_to_host_bytes),
        }
    }

    /// The sum of two devices' counters.
    pub fn plus(&self, other: &Self) -> Self {
        Self {
            launches: self.launches + other.launches,
            host_syncs: self.host_syncs + other.host_syncs,
            background_waits: self.background_waits + other.background_waits,
            cross_stream_waits: self.cross_stream_waits + other.cross_stream_waits,
            host_to_device_bytes: self.host_to_device_bytes + other.host_to_device_bytes,
            device_to_host_bytes: self.device_to_host_bytes + other.device_to_host_bytes,
        }
    }
}

/// The live counters of one device.
#[derive(Debug, Default)]
struct Counters {
    launches: AtomicU64,
    host_syncs: AtomicU64,
    background_waits: AtomicU64,
    cross_stream_waits: AtomicU64,
    host_to_device_bytes: AtomicU64,
    device_to_host_bytes: AtomicU64,
}

thread_local! {
    /// Whether this thread is inside [`in_background`].
    static BACKGROUND: std::cell::Cell<bool> = const { std::cell::Cell::new(false) };
}

/// Runs `f` as a background waiter: the emulated devices count its blocking waits as
/// `background_waits`, not `host_syncs` ([`EmuCounters`]). For threads that queue no device work
/// and only wait to release memory (the runtime's collector of buffers shared between streams).
pub(crate) fn in_background<T>(f: impl FnOnce() -> T) -> T {
    let before = BACKGROUND.with(|b| b.replace(true));
    let out = f();
    BACKGROUND.with(|b| b.set(before));
    out
}

impl Counters {
    fn add(counter: &AtomicU64, n: u64) {
        counter.fetch_add(n, Ordering::Relaxed);
    }

    /// One blocking host wait by the calling thread: a host sync, or a background wait inside
    /// [`in_background`].
    fn host_sync(&self) {
        let background = BACKGROUND.with(std::cell::Cell::get);
        Self::add(if background { &self.background_waits } else { &self.host_syncs }, 1);
    }

    fn snapshot(&self) -> EmuCounters {
        EmuCounters {
            launches: self.launches.load(Ordering::Relaxed),
            host_syncs: self.host_syncs.load(Ordering::Relaxed),
            background_waits: self.background_waits.load(Ordering::Relaxed),
            cross_stream_waits: self.cross_stream_waits.load(Ordering::Relaxed),
            host_to_device_bytes: self.host_to_device_bytes.load(Ordering::Relaxed),
            device_to_host_bytes: self.device_to_host_bytes.load(Ordering::Relaxed),
        }
    }
}

/// A stream held back by [`EmuDriver::hold_stream`]: the work queued on it after the hold waits
/// until [`StreamHold::release`] (or the hold is dropped).
#[derive(Debug)]
pub struct StreamHold {
    event: Arc<Event>,
    generation: u64,
}

impl StreamHold {
    /// Lets the stream go on.
    pub fn release(self) {}
}

impl Drop for StreamHold {
    fn drop(&mut self) {
        self.event.complete(self.generation);
    }
}

/// What made a device's kernel fault.
#[derive(Debug, Clone)]
pub(crate) struct FaultReport {
    kernel: String,
    reason: String,
}

/// The state of one emulated device.
#[derive(Debug)]
pub(crate) struct DeviceState {
    index: usize,
    config: EmuDeviceConfig,
    memory: DeviceMemory,
    fault: Mutex<Option<FaultReport>>,
    streams: Mutex<Vec<std::sync::Weak<Stream>>>,
    default_stream: OnceLock<Arc<Stream>>,
    counters: Counters,
}

impl DeviceState {
    fn fault(&self) -> Option<FaultReport> {
        lock(&self.fault).clone()
    }

    fn set_fault(&self, report: FaultReport) {
        lock(&self.fault).get_or_insert(report);
    }

    fn error(&self) -> Option<DriverError> {
        self.fault().map(|f| DriverError::KernelFault {
            device: self.index,
            kernel: f.kernel,
            reason: f.reason,
        })
    }
}

struct Program {
    source: String,
    name: String,
    log: String,
    image: Option<Vec<u8>>,
}

thread_local! {
    static CURRENT_DEVICE: std::cell::Cell<usize> = const { std::cell::Cell::new(0) };
}

/// The emulated MetaX device's [`Driver`].
pub struct EmuDriver {
    config: EmuConfig,
    compiler: HostCompiler,
    devices: Vec<Arc<DeviceState>>,
    host: HostMemory,
    next: AtomicUsize,
    streams: Mutex<HashMap<usize, Arc<Stream>>>,
    events: Mutex<HashMap<usize, Arc<Event>>>,
    modules: Mutex<HashMap<usize, Arc<Module>>>,
    programs: Mutex<HashMap<usize, Program>>,
}

impl std::fmt::Debug for EmuDriver {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("EmuDriver")
            .field("devices", &self.config.devices.len())
            .field("compiler", &self.compiler.version())
            .finish_non_exhaustive()
    }
}

fn api(call: &'static str, code: i32) -> DriverError {
    DriverError::Api { call, error: MacaError::from_code(code).unwrap_or(MacaError::INVALID_VALUE) }
}

/// `mcErrorInvalidResourceHandle`.
const INVALID_HANDLE: i32 = 400;
/// `mcErrorInvalidConfiguration`.
const INVALID_CONFIGURATION: i32 = 9;

impl EmuDriver {
    /// Emulated devices as `config` says; fails when no host C++ compiler is found.
    pub fn new(config: EmuConfig) -> Result<Self> {
        config.validate()?;
        let compiler = HostCompiler::find()?;
        let devices = config
            .devices
            .iter()
            .enumerate()
            .map(|(index, c)| {
                Arc::new(DeviceState {
                    index,
                    config: c.clone(),
                    memory: DeviceMemory::new(c.memory_bytes),
                    fault: Mutex::new(None),
                    streams: Mutex::new(Vec::new()),
                    default_stream: OnceLock::new(),
                    counters: Counters::default(),
                })
            })
            .collect();
        Ok(Self {
            config,
            compiler,
            devices,
            host: HostMemory::default(),
            next: AtomicUsize::new(1),
            streams: Mutex::new(HashMap::new()),
            events: Mutex::new(HashMap::new()),
            modules: Mutex::new(HashMap::new()),
            programs: Mutex::new(HashMap::new()),
        })
    }

    /// Devices as the environment says ([`EmuConfig::from_env`]).
    pub fn from_env() -> Result<Self> {
        Self::new(EmuConfig::from_env()?)
    }

    /// The configuration.
    pub fn config(&self) -> &EmuConfig {
        &self.config
    }

    /// What device `index` was asked to do so far (zeros for a device that does not exist).
    pub fn counters(&self, index: usize) -> EmuCounters {
        self.devices.get(index).map(|d| d.counters.snapshot()).unwrap_or_default()
    }

    /// Holds `stream` back: work queued on it from now on waits until the returned hold is
    /// released or dropped, as if an earlier kernel on it were still running. Tests use it to
    /// make a stream's work certainly late, and so to show which other streams wait for it.
    pub fn hold_stream(&self, stream: StreamHandle) -> Result<StreamHold> {
        let stream = self.stream(stream)?;
        let event = Arc::new(Event::new());
        let generation = event.next_record();
        stream.push(Op::Wait(event.clone(), generation));
        Ok(StreamHold { event, generation })
    }

    /// Queues `function` on `stream`: the stream's worker runs it once the work queued before it
    /// is done, and the work queued after it waits for it to return (`mcLaunchHostFunc`).
    pub fn launch_host_function(
        &self,
        stream: StreamHandle,
        function: Box<dyn FnOnce() + Send>,
    ) -> Result<()> {
        self.stream(stream)?.push(Op::Host(function));
        Ok(())
    }

    fn id(&self) -> usize {
        self.next.fetch_add(1, Ordering::Relaxed)
    }

    fn device(&self, index: usize) -> Result<&Arc<DeviceState>> {
        self.devices.get(index).ok_or_else(|| api("mcSetDevice", 101))
    }

    fn current(&self) -> Result<&Arc<DeviceState>> {
        self.device(self.current_device())
    }

    /// Fails when the current device is poisoned.
    fn guard(&self) -> Result<&Arc<DeviceState>> {
        let device = self.current()?;
        match device.error() {
            Some(err) => Err(err),
            None => Ok(device),
        }
    }

    fn stream(&self, handle: StreamHandle) -> Result<Arc<Stream>> {
        if handle == StreamHandle::DEFAULT {
            let device = self.current()?.clone();
            let stream = device.default_stream.get_or_init(|| {
                Stream::spawn(device.clone(), format!("metax-emu-{}-default", device.index))
                    .expect("spawning the default stream's worker thread")
            });
            return Ok(stream.clone());
        }
        lock(&self.streams).get(&handle.as_raw()).cloned().ok_or_else(|| api("mcStream", INVALID_HANDLE))
    }

    fn event(&self, handle: EventHandle) -> Result<Arc<Event>> {
        lock(&self.events).get(&handle.as_raw()).cloned().ok_or_else(|| api("mcEvent", INVALID_HANDLE))
    }

    /// Waits until `stream` has executed everything queued so far.
    fn drain(&self, stream: &Stream, call: &'static str) -> Result<()> {
        let event = Arc::new(Event::new());
        let generation = event.next_record();
        stream.push(Op::Record(event.clone(), generation));
        if !event.wait(generation, self.config.wait_timeout) {
            return Err(DriverError::Timeout { call, seconds: self.config.wait_timeout.as_secs() });
        }
        match stream.device.error() {
            Some(err) => Err(err),
            None => Ok(()),
        }
    }

    /// Waits for every stream of `device`.
    fn drain_device(&self, device: &Arc<DeviceState>, call: &'static str) -> Result<()> {
        let streams: Vec<Arc<Stream>> =
            lock(&device.streams).iter().filter_map(std::sync::Weak::upgrade).collect();
        for stream in streams.iter().chain(device.default_stream.get()) {
            self.drain(stream, call)?;
        }
        Ok(())
    }

    /// Checks that `ptr..ptr+len` is device memory of any device (the emulated devices share one
    /// address space, as devices with unified addressing do).
    fn check_device_range(&self, call: &'static str, ptr: usize, len: usize) -> Result<()> {
        if len == 0 || self.devices.iter().any(|d| d.memory.check(call, ptr, len).is_ok()) {
            Ok(())
        } else {
            Err(api(call, 17))
        }
    }

    fn device_owning(&self, ptr: usize) -> Option<&Arc<DeviceState>> {
        self.devices.iter().find(|d| d.memory.owns(ptr))
    }

    /// Counts with `count` on the counters of the device that owns `ptr`.
    fn count_on_owner(&self, ptr: usize, count: impl FnOnce(&Counters)) {
        if let Some(device) = self.device_owning(ptr) {
            count(&device.counters);
        }
    }

    fn queue_copy(&self, dst: usize, src: usize, len: usize, stream: StreamHandle) -> Result<()> {
        self.guard()?;
        let stream = self.stream(stream)?;
        if len > 0 {
            stream.push(Op::Copy { dst, src, len });
        }
        Ok(())
    }
}

impl Driver for EmuDriver {
    fn name(&self) -> &str {
        "metax-emu"
    }

    fn compiler_fingerprint(&self) -> String {
        self.compiler.fingerprint()
    }

    fn device_count(&self) -> Result<usize> {
        Ok(self.devices.len())
    }

    fn device_properties(&self, device: usize) -> Result<DeviceProperties> {
        let state = self.device(device)?;
        Ok(DeviceProperties {
            name: format!("MetaX emulated device {device} (host CPU, wave {})", state.config.warp_size),
            warp_size: state.config.warp_size,
            max_threads_per_block: MAX_LANES as u32,
            max_block_dim: [MAX_LANES as u32, MAX_LANES as u32, 64],
            max_grid_dim: [i32::MAX as u32, 65535, 65535],
            max_shared_memory_per_block: MAX_SHARED,
            multiprocessor_count: std::thread::available_parallelism().map_or(1, |n| n.get() as u32),
            compute_capability: (1, 0),
            total_memory: state.config.memory_bytes,
        })
    }

    fn set_device(&self, device: usize) -> Result<()> {
        self.device(device)?;
        CURRENT_DEVICE.with(|c| c.set(device));
        Ok(())
    }

    fn current_device(&self) -> usize {
        CURRENT_DEVICE.with(std::cell::Cell::get)
    }

    fn device_synchronize(&self) -> Result<()> {
        let device = self.current()?.clone();
        device.counters.host_sync();
        self.drain_device(&device, "mcDeviceSynchronize")
    }

    fn memory_info(&self) -> Result<(usize, usize)> {
        let device = self.guard()?;
        let total = device.memory.capacity();
        Ok((total.saturating_sub(device.memory.used()), total))
    }

    fn poisoned(&self, device: usize) -> Option<DriverError> {
        self.devices.get(device).and_then(|d| d.error())
    }

    fn malloc(&self, size: usize) -> Result<DevicePtr> {
        self.guard()?.memory.alloc(size).map(DevicePtr::from_raw)
    }

    fn malloc_async(&self, size: usize, _stream: StreamHandle) -> Result<DevicePtr> {
        // Usable at once: a stricter guarantee than stream ordering needs.
        self.malloc(size)
    }

    unsafe fn free(&self, ptr: DevicePtr) -> Result<()> {
        // Like `mcFree`, freeing first waits for the device, so no queued work can still use it.
        let device = self.device_owning(ptr.as_raw()).ok_or_else(|| api("mcFree", 17))?.clone();
        device.counters.host_sync();
        let _ = self.drain_device(&device, "mcFree");
        // SAFETY: every stream of the device has passed the work queued before this call, and
        // the caller guarantees no later work uses `ptr`.
        unsafe { device.memory.free(ptr.as_raw()) }
    }

    unsafe fn free_async(&self, ptr: DevicePtr, stream: StreamHandle) -> Result<()> {
        if !self.devices.iter().any(|d| d.memory.owns(ptr.as_raw())) {
            return Err(api("mcFreeAsync", 17));
        }
        let stream = self.stream(stream)?;
        let owner = self.device_owning(ptr.as_raw()).map(|d| d.index);
        if owner != Some(stream.device.index) {
            return Err(api("mcFreeAsync", 1));
        }
        stream.push(Op::Free(ptr.as_raw()));
        Ok(())
    }

    fn malloc_host(&self, size: usize) -> Result<HostPtr> {
        self.host.alloc(size).map(HostPtr::from_raw)
    }

    unsafe fn free_host(&self, ptr: HostPtr) -> Result<()> {
        // SAFETY: the caller guarantees no queued work uses `ptr`.
        unsafe { self.host.free(ptr.as_raw()) }
    }

    unsafe fn memcpy_htod_async(
        &self,
        dst: DevicePtr,
        src: *const u8,
        len: usize,
        stream: StreamHandle,
    ) -> Result<()> {
        self.check_device_range("mcMemcpyAsync", dst.as_raw(), len)?;
        self.count_on_owner(dst.as_raw(), |c| Counters::add(&c.host_to_device_bytes, len as u64));
        self.queue_copy(dst.as_raw(), src as usize, len, stream)
    }

    unsafe fn memcpy_dtoh_async(
        &self,
        dst: *mut u8,
        src: DevicePtr,
        len: usize,
        stream: StreamHandle,
    ) -> Result<()> {
        self.check_device_range("mcMemcpyAsync", src.as_raw(), len)?;
        self.count_on_owner(src.as_raw(), |c| Counters::add(&c.device_to_host_bytes, len as u64));
        self.queue_copy(dst as usize, src.as_raw(), len, stream)
    }

    unsafe fn memcpy_dtod_async(
        &self,
        dst: DevicePtr,
        src: DevicePtr,
        len: usize,
        stream: StreamHandle,
    ) -> Result<()> {
        self.check_device_range("mcMemcpyAsync", src.as_raw(), len)?;
        self.check_device_range("mcMemcpyAsync", dst.as_raw(), len)?;
        self.queue_copy(dst.as_raw(), src.as_raw(), len, stream)
    }

    unsafe fn memcpy_htod(&self, dst: DevicePtr, src: &[u8]) -> Result<()> {
        // Legacy default stream: ordered after that stream's own work only, not after the
        // non-blocking streams'.
        self.check_device_range("mcMemcpy", dst.as_raw(), src.len())?;
        self.count_on_owner(dst.as_raw(), |c| Counters::add(&c.host_to_device_bytes, src.len() as u64));
        self.count_on_owner(dst.as_raw(), Counters::host_sync);
        self.queue_copy(dst.as_raw(), src.as_ptr() as usize, src.len(), StreamHandle::DEFAULT)?;
        self.drain(&*self.stream(StreamHandle::DEFAULT)?, "mcMemcpy")
    }

    unsafe fn memcpy_dtoh(&self, dst: &mut [u8], src: DevicePtr) -> Result<()> {
        self.check_device_range("mcMemcpy", src.as_raw(), dst.len())?;
        self.count_on_owner(src.as_raw(), |c| Counters::add(&c.device_to_host_bytes, dst.len() as u64));
        self.count_on_owner(src.as_raw(), Counters::host_sync);
        self.queue_copy(dst.as_mut_ptr() as usize, src.as_raw(), dst.len(), StreamHandle::DEFAULT)?;
        self.drain(&*self.stream(StreamHandle::DEFAULT)?, "mcMemcpy")
    }

    fn stream_create(&self, _non_blocking: bool) -> Result<StreamHandle> {
        // Every stream behaves as a non-blocking one (the legacy stream synchronises with
        // nothing); the server only creates non-blocking streams.
        let device = self.guard()?.clone();
        let id = self.id();
        let stream = Stream::spawn(device.clone(), format!("metax-emu-{}-s{id}", device.index))
            .map_err(|_| api("mcStreamCreateWithFlags", 2))?;
        lock(&device.streams).push(Arc::downgrade(&stream));
        lock(&self.streams).insert(id, stream);
        Ok(StreamHandle::from_raw(id))
    }

    fn stream_destroy(&self, stream: StreamHandle) -> Result<()> {
        let stream = lock(&self.streams)
            .remove(&stream.as_raw())
            .ok_or_else(|| api("mcStreamDestroy", INVALID_HANDLE))?;
        stream.close();
        Ok(())
    }

    fn stream_synchronize(&self, stream: StreamHandle) -> Result<()> {
        let stream = self.stream(stream)?;
        stream.device.counters.host_sync();
        self.drain(&stream, "mcStreamSynchronize")
    }

    fn stream_wait_event(&self, stream: StreamHandle, event: EventHandle) -> Result<()> {
        let waiting = stream.as_raw();
        let stream = self.stream(stream)?;
        let event = self.event(event)?;
        let generation = event.latest();
        if generation > 0 {
            if event.stream() != Some(waiting) {
                Counters::add(&stream.device.counters.cross_stream_waits, 1);
            }
            stream.push(Op::Wait(event, generation));
        }
        Ok(())
    }

    fn event_create(&self, _timing: bool) -> Result<EventHandle> {
        let id = self.id();
        lock(&self.events).insert(id, Arc::new(Event::new()));
        Ok(EventHandle::from_raw(id))
    }

    fn event_destroy(&self, event: EventHandle) -> Result<()> {
        // Queued records and waits hold their own reference to the event.
        lock(&self.events)
            .remove(&event.as_raw())
            .map(|_| ())
            .ok_or_else(|| api("mcEventDestroy", INVALID_HANDLE))
    }

    fn event_record(&self, event: EventHandle, stream: StreamHandle) -> Result<()> {
        let handle = stream.as_raw();
        let stream = self.stream(stream)?;
        let event = self.event(event)?;
        let generation = event.next_record_on(stream.device.index, handle);
        stream.push(Op::Record(event, generation));
        Ok(())
    }

    fn event_synchronize(&self, event: EventHandle) -> Result<()> {
        let event = self.event(event)?;
        let device = event.device().unwrap_or_else(|| self.current_device());
        if let Some(device) = self.devices.get(device) {
            device.counters.host_sync();
        }
        if !event.wait(event.latest(), self.config.wait_timeout) {
            return Err(DriverError::Timeout {
                call: "mcEventSynchronize",
                seconds: self.config.wait_timeout.as_secs(),
            });
        }
        match event.device().and_then(|d| self.devices.get(d)).and_then(|d| d.error()) {
            Some(err) => Err(err),
            None => Ok(()),
        }
    }

    fn event_query(&self, event: EventHandle) -> Result<bool> {
        let event = self.event(event)?;
        Ok(event.reached(event.latest()))
    }

    fn event_elapsed_ms(&self, start: EventHandle, end: EventHandle) -> Result<f32> {
        let (start, end) = (self.event(start)?, self.event(end)?);
        match (start.completed_at(), end.completed_at()) {
            (Some(a), Some(b)) => Ok(b.saturating_duration_since(a).as_secs_f32() * 1e3),
            _ => Err(api("mcEventElapsedTime", 600)),
        }
    }

    fn module_load_data(&self, image: &[u8]) -> Result<ModuleHandle> {
        if !image.starts_with(b"\x7fELF") {
            return Err(DriverError::InvalidArgument(
                "not a kernel module of the MetaX emulator (no shared object)".to_string(),
            ));
        }
        let path = module_file(image)?;
        let module = Arc::new(Module::load(&path)?);
        let id = self.id();
        lock(&self.modules).insert(id, module);
        Ok(ModuleHandle::from_raw(id))
    }

    fn module_unload(&self, module: ModuleHandle) -> Result<()> {
        // Launches still queued hold their own reference to the module.
        lock(&self.modules)
            .remove(&module.as_raw())
            .map(|_| ())
            .ok_or_else(|| api("mcModuleUnload", INVALID_HANDLE))
    }

    fn module_get_function(&self, module: ModuleHandle, name: &str) -> Result<FunctionHandle> {
        let loaded = lock(&self.modules)
            .get(&module.as_raw())
            .cloned()
            .ok_or_else(|| api("mcModuleGetFunction", INVALID_HANDLE))?;
        if loaded.name != name {
            return Err(api("mcModuleGetFunction", 500));
        }
        Ok(FunctionHandle::from_raw(module.as_raw()))
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
        let device = self.guard()?.clone();
        let module = lock(&self.modules)
            .get(&function.as_raw())
            .cloned()
            .ok_or_else(|| api("mcModuleLaunchKernel", INVALID_HANDLE))?;
        let lanes = u64::from(block[0]) * u64::from(block[1]) * u64::from(block[2]);
        if lanes == 0
            || lanes > MAX_LANES as u64
            || block[2] > 64
            || grid.contains(&0)
            || grid[1] > 65535
            || grid[2] > 65535
            || shared_memory as usize > MAX_SHARED
            || params.len() != module.param_sizes.len()
        {
            return Err(api("mcModuleLaunchKernel", INVALID_CONFIGURATION));
        }
        let stream = self.stream(stream)?;
        Counters::add(&stream.device.counters.launches, 1);
        // SAFETY: the caller guarantees one pointer per parameter, each to a value of the
        // parameter's type, whose size the module reports.
        let launch =
            unsafe { Launch::new(module, grid, block, shared_memory, device.config.warp_size, params) };
        stream.push(Op::Launch(Box::new(launch)));
        Ok(())
    }

    fn rtc_create_program(&self, source: &str, name: &str) -> Result<ProgramHandle> {
        let id = self.id();
        lock(&self.programs).insert(
            id,
            Program { source: source.to_string(), name: name.to_string(), log: String::new(), image: None },
        );
        Ok(ProgramHandle::from_raw(id))
    }

    fn rtc_compile_program(&self, program: ProgramHandle, options: &[&str]) -> Result<()> {
        let (source, name) = {
            let programs = lock(&self.programs);
            let p = programs.get(&program.as_raw()).ok_or_else(|| rtc("metax_emu_compile", 4))?;
            (p.source.clone(), p.name.clone())
        };
        let options: Vec<String> = options.iter().map(|s| s.to_string()).collect();
        let result = self.compiler.compile(&source, &name, &options);
        let mut programs = lock(&self.programs);
        let p = programs.get_mut(&program.as_raw()).ok_or_else(|| rtc("metax_emu_compile", 4))?;
        match result {
            Ok(image) => {
                p.image = Some(image);
                Ok(())
            }
            Err(log) => {
                p.log = log;
                Err(rtc("metax_emu_compile", 6))
            }
        }
    }

    fn rtc_program_log(&self, program: ProgramHandle) -> Result<String> {
        lock(&self.programs)
            .get(&program.as_raw())
            .map(|p| p.log.clone())
            .ok_or_else(|| rtc("metax_emu_log", 4))
    }

    fn rtc_bitcode(&self, program: ProgramHandle) -> Result<Vec<u8>> {
        lock(&self.programs)
            .get(&program.as_raw())
            .and_then(|p| p.image.clone())
            .ok_or_else(|| rtc("metax_emu_image", 4))
    }

    fn rtc_destroy_program(&self, program: ProgramHandle) -> Result<()> {
        lock(&self.programs).remove(&program.as_raw()).map(|_| ()).ok_or_else(|| rtc("metax_emu_destroy", 4))
    }

    fn compile(&self, source: &str, name: &str, options: &[&str]) -> Result<CompiledProgram> {
        let options: Vec<String> = options.iter().map(|s| s.to_string()).collect();
        match self.compiler.compile(source, name, &options) {
            Ok(image) => Ok(CompiledProgram { image, log: String::new() }),
            Err(log) => Err(DriverError::Compilation {
                program: name.to_string(),
                error: RtcError::from_code(6).unwrap_or_else(|| unreachable!("6 is not success")),
                log,
            }),
        }
    }
}

fn rtc(call: &'static str, code: i32) -> DriverError {
    match RtcError::from_code(code) {
        Some(error) => DriverError::Rtc { call, error },
        None => DriverError::UnexpectedValue(format!("{call}: status {code}")),
    }
}

impl Drop for EmuDriver {
    fn drop(&mut self) {
        for stream in lock(&self.streams).drain().map(|(_, s)| s) {
            stream.close();
        }
        for device in &self.devices {
            if let Some(stream) = device.default_stream.get() {
                stream.close();
            }
        }
    }
}

/// The file a module image is loaded from: content-addressed under the emulator's work directory,
/// written once (atomically), so that the dynamic loader never sees a half-written file and two
/// different images never share a path.
fn module_file(image: &[u8]) -> Result<PathBuf> {
    use sha2::{Digest, Sha256};
    let hash: String = Sha256::digest(image).iter().take(16).map(|b| format!("{b:02x}")).collect();
    let dir = compiler::work_root().join("modules");
    let path = dir.join(format!("{hash}.so"));
    if std::fs::metadata(&path).is_ok_and(|m| m.len() == image.len() as u64) {
        return Ok(path);
    }
    let io = |e: std::io::Error| {
        DriverError::InvalidArgument(format!("writing kernel module {}: {e}", path.display()))
    };
    std::fs::create_dir_all(&dir).map_err(io)?;
    let scratch = compiler::scratch_dir(&compiler::work_root(), "module").map_err(io)?;
    let tmp = scratch.join("module.so");
    let written = std::fs::write(&tmp, image).and_then(|()| std::fs::rename(&tmp, &path));
    let _ = std::fs::remove_dir_all(&scratch);
    written.map_err(io)?;
    Ok(path)
}
