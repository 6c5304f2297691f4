//! [`GpuServer`]: the CubeCL compute server over a [`Driver`].
//!
//! # The ordering rule
//!
//! CubeCL runs work on several streams (one per client thread, by default). CubeCL's per-binding
//! tracking (`MultiStream::resolve`) orders a stream after the stream a buffer was *created* on,
//! but not after another stream that wrote the buffer in place, nor — once the streams have
//! synced past the buffer's creation — before memory freed on one stream is reused by another
//! while a kernel queued elsewhere still reads it. FSDP hits both (its communication thread is a
//! second stream): on the emulated device, whose streams are really asynchronous, Qwen3 W = 4
//! with prefetch trained on stale gradients (loss 6.9e-2, grad norm 2e2× off) until the server
//! ordered them itself.
//!
//! So every launch, read (device → host, which is also how tensors are offloaded) and write
//! (host → device) first makes its stream wait, on the device, for the last use of each memory
//! range it touches by any **other** stream, and then records one event after itself as the
//! ranges' new last use: ordering by need ([`super::order`]). Streams whose work shares no
//! memory run side by side — a communication stream overlaps compute. A page given back to the
//! driver waits the same way.
//!
//! [`super::StreamOrdering`] selects the rule per device ([`super::set_stream_ordering`]): the
//! earlier rule, where every operation waited for the work queued on every other stream
//! (`AllStreams`, one event per other stream per operation), is kept to measure against, and
//! `Unordered` exists only so that tests can show their checks fail without the waits.

use std::marker::PhantomData;
use std::sync::Arc;

use cubecl_common::backtrace::BackTrace;
use cubecl_common::bytes::{AllocationProperty, Bytes};
use cubecl_common::device::{Device, DeviceId};
use cubecl_common::future::DynFut;
use cubecl_common::profile::{ProfileDuration, TimingMethod};
use cubecl_common::stream_id::StreamId;
use cubecl_core::device::{DeviceService, ServerUtilitiesHandle};
use cubecl_core::ir::{
    DeviceProperties as CubeDeviceProperties, ElemType, FloatKind, HardwareProperties,
    MemoryDeviceProperties, VectorSize,
    features::{Plane, TypeUsage},
};
use cubecl_core::server::{
    Binding, CopyDescriptor, Handle, IoError, KernelArguments, LaunchError, ProfileError, ProfilingToken,
    ServerCommunication, ServerError, ServerUtilities,
};
use cubecl_core::zspace::striding::has_contiguous_row_major_strides;
use cubecl_core::{CubeCount, ExecutionMode, MemoryConfiguration};
use cubecl_cpp::register_supported_types;
use cubecl_cpp::shared::CppCompiler;
use cubecl_runtime::allocator::ContiguousMemoryLayoutPolicy;
use cubecl_runtime::compiler::CubeTask;
use cubecl_runtime::config::{CubeClRuntimeConfig, RuntimeConfig};
use cubecl_runtime::logging::ServerLogger;
use cubecl_runtime::memory_management::{MemoryAllocationMode, MemoryHandle, MemoryUsage};
use cubecl_runtime::server::ComputeServer;
use cubecl_runtime::storage::{ComputeStorage, ManagedResource};
use cubecl_runtime::stream::MultiStream;
use cubecl_runtime::timestamp_profiler::TimestampProfiler;

use super::error::BackendError;
use super::fence::{Fence, server_error};
use super::kernel::KernelCache;
use super::kernel_time;
use super::order::{DeviceOrder, Range, StreamOrdering};
use super::platform::{GpuDevice, Platform};
use super::storage::{DEVICE_MEMORY_ALIGNMENT, GpuResource, PinnedBytesController};
use super::stream::{GpuStream, GpuStreamBackend, StreamRegistry};
use crate::driver::{DevicePtr, Driver, StreamHandle};

/// Maximum number of buffers bound to one kernel.
const MAX_BINDINGS: u32 = 1024;

/// The CubeCL compute server of one device of platform `P`.
pub struct GpuServer<P: Platform> {
    driver: Arc<dyn Driver>,
    device: usize,
    kernels: KernelCache,
    timestamps: TimestampProfiler,
    streams: MultiStream<GpuStreamBackend>,
    registry: StreamRegistry,
    order: Arc<DeviceOrder>,
    utilities: Arc<ServerUtilities<Self>>,
    _platform: PhantomData<P>,
}

impl<P: Platform> std::fmt::Debug for GpuServer<P> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("GpuServer")
            .field("platform", &P::NAME)
            .field("device", &self.device)
            .field("driver", &self.driver)
            .field("kernels", &self.kernels.len())
            .finish_non_exhaustive()
    }
}

/// Checks that device `index` of platform `P` can be used, without starting a server.
pub(crate) fn check_device<P: Platform>(
    index: usize,
) -> Result<crate::driver::DeviceProperties, BackendError> {
    let driver = P::driver().map_err(|e| BackendError::Unavailable {
        platform: P::NAME,
        reason: P::unavailable_reason(Some(&e)),
    })?;
    let count = driver
        .device_count()
        .map_err(|error| BackendError::Unavailable { platform: P::NAME, reason: error.to_string() })?;
    if count == 0 {
        return Err(BackendError::Unavailable { platform: P::NAME, reason: P::unavailable_reason(None) });
    }
    if index >= count {
        return Err(BackendError::NoSuchDevice { platform: P::NAME, index, count });
    }
    if let Some(error) = driver.poisoned(index) {
        return Err(BackendError::Driver { platform: P::NAME, index, error });
    }
    driver.device_properties(index).map_err(|error| BackendError::Driver { platform: P::NAME, index, error })
}

/// The widest vector CubeCL may use on the device.
///
/// At wave 64, cubek's unit matmul (the one Burn's matmul uses without tensor cores) sizes its
/// stage as 8 planes × 64 lanes × tiles whose side is the vector width; with 8-wide f16/bf16
/// vectors (128-bit loads) that stage needs 128 KiB of shared memory, twice a 64 KiB block's
/// budget, and the launch fails (found on the emulated device: `conformance --backend
/// metax-emu`, `…/f16/matmul.*`). Four-wide vectors keep f32 as it is and give f16/bf16 the
/// f32 stage size (32 KiB).
fn max_vector_size(props: &crate::driver::DeviceProperties) -> VectorSize {
    if props.warp_size >= 64 && props.max_shared_memory_per_block <= 64 << 10 { 4 } else { VectorSize::MAX }
}

/// CubeCL's view of a device.
pub(crate) fn cube_properties<P: Platform>(props: &crate::driver::DeviceProperties) -> CubeDeviceProperties {
    let memory = MemoryDeviceProperties {
        max_page_size: (props.total_memory as u64 / 4).max(64 << 20),
        alignment: DEVICE_MEMORY_ALIGNMENT as u64,
    };
    let hardware = HardwareProperties {
        load_width: 128,
        plane_size_min: props.warp_size,
        plane_size_max: props.warp_size,
        max_bindings: MAX_BINDINGS,
        max_shared_memory_size: props.max_shared_memory_per_block,
        max_cube_count: (props.max_grid_dim[0], props.max_grid_dim[1], props.max_grid_dim[2]),
        max_units_per_cube: props.max_threads_per_block,
        max_cube_dim: (props.max_block_dim[0], props.max_block_dim[1], props.max_block_dim[2]),
        num_streaming_multiprocessors: Some(props.multiprocessor_count),
        num_tensor_cores: None,
        min_tensor_cores_dim: None,
        num_cpu_cores: None,
        max_vector_size: max_vector_size(props),
    };
    // Profiling measures host time around stream synchronisation (as cubecl-hip does); the
    // driver's timing events are not used for it.
    let mut properties =
        CubeDeviceProperties::new(Default::default(), memory, hardware, TimingMethod::System);
    register_supported_types(&mut properties);
    if P::F64 {
        properties.register_type_usage(ElemType::Float(FloatKind::F64), TypeUsage::all());
    }
    properties.features.memory_reinterpret = true;
    properties.features.alignment = true;
    // Plane (wave) operations in uniform control flow only: the dialects use full-wave masks.
    properties.features.plane.insert(Plane::Ops);
    P::register_features(props, &mut properties);
    properties
}

impl<P: Platform> GpuServer<P> {
    /// Starts the server of device `index`: makes it current on the calling thread (the server
    /// thread), reads its properties and sets up streams and memory pools.
    pub(crate) fn try_new(index: usize) -> Result<Self, BackendError> {
        let props = check_device::<P>(index)?;
        let driver = P::driver().map_err(|e| BackendError::Unavailable {
            platform: P::NAME,
            reason: P::unavailable_reason(Some(&e)),
        })?;
        driver.set_device(index).map_err(|error| BackendError::Driver { platform: P::NAME, index, error })?;

        let properties = cube_properties::<P>(&props);
        let logger = Arc::new(ServerLogger::default());
        let registry = StreamRegistry::default();
        let order = Arc::new(DeviceOrder::new(P::NAME, index, driver.clone()));
        let backend = GpuStreamBackend::new(
            driver.clone(),
            properties.memory.clone(),
            MemoryConfiguration::default(),
            logger.clone(),
            registry.clone(),
            order.clone(),
        );
        let max_streams = CubeClRuntimeConfig::get().streaming.max_streams;
        let kernels = KernelCache::new(
            driver.clone(),
            P::compilation_options(&props),
            P::rtc_options(&props),
            properties.clone(),
        );
        super::registry::register(P::NAME, index, driver.clone(), registry.clone(), order.clone());
        let policy = ContiguousMemoryLayoutPolicy::new(DEVICE_MEMORY_ALIGNMENT);
        let utilities = ServerUtilities::new(properties, logger.clone(), (), policy);
        Ok(Self {
            driver,
            device: index,
            kernels,
            timestamps: TimestampProfiler::default(),
            streams: MultiStream::new(logger, backend, max_streams),
            registry,
            order,
            utilities: Arc::new(utilities),
            _platform: PhantomData,
        })
    }

    /// The device ordinal.
    pub fn device_index(&self) -> usize {
        self.device
    }

    /// Errors recorded on `stream_id` since the last call (they are cleared).
    fn take_errors(&mut self, stream_id: StreamId) -> Vec<ServerError> {
        let Ok(mut streams) = self.streams.resolve(stream_id, [].into_iter(), false) else {
            return Vec::new();
        };
        let stream = streams.current();
        let errors = std::mem::take(&mut stream.errors);
        if !errors.is_empty() {
            stream.memory_gpu.cleanup(false);
            self.timestamps.error(ProfileError::Unknown {
                reason: format!("{errors:?}"),
                backtrace: BackTrace::capture(),
            });
        }
        errors
    }

    /// Fails with the stream's pending errors, if any.
    fn check_errors(&mut self, stream_id: StreamId) -> Result<(), ServerError> {
        let errors = self.take_errors(stream_id);
        if errors.is_empty() {
            Ok(())
        } else {
            Err(ServerError::ServerUnhealthy { errors, backtrace: BackTrace::capture() })
        }
    }

    fn launch_checked(
        &mut self,
        kernel: Box<dyn CubeTask<CppCompiler<P::Dialect>>>,
        count: CubeCount,
        arguments: KernelArguments,
        mode: ExecutionMode,
        stream_id: StreamId,
    ) -> Result<(), ServerError> {
        let mut kernel_id = kernel.id();
        kernel_id.mode(mode);
        let logger = self.streams.logger.clone();
        // The dynamic cube-count buffer is read by this launch too: order it like the buffers.
        let dynamic = match &count {
            CubeCount::Dynamic(binding) => Some(binding),
            CubeCount::Static(..) => None,
        };
        let mut streams = self.streams.resolve(stream_id, arguments.buffers.iter().chain(dynamic), false)?;
        let KernelArguments { buffers, info, tensor_maps } = arguments;
        if !tensor_maps.is_empty() {
            return Err(LaunchError::Unknown {
                reason: format!("{} does not support tensor maps (TMA)", P::NAME),
                backtrace: BackTrace::capture(),
            }
            .into());
        }
        let mut resources = Vec::with_capacity(buffers.len() + 1);
        for binding in &buffers {
            resources.push(resource_of(streams.get(&binding.stream), binding)?);
        }
        let dynamic = match &count {
            CubeCount::Dynamic(binding) => Some(resource_of(streams.get(&binding.stream), binding)?),
            CubeCount::Static(..) => None,
        };
        let mut ranges: Vec<Range> = resources.iter().chain(&dynamic).map(range_of).collect();
        // The ordering rule (module docs).
        let handle = streams.current().handle;
        order_before(&self.order, &self.registry, handle, &ranges);

        let grid = match (count, dynamic) {
            (CubeCount::Dynamic(_), Some(resource)) => {
                let current = streams.current();
                let mut counts = [0u8; 12];
                if resource.size < counts.len() as u64 {
                    return Err(IoError::Unknown {
                        description: "dynamic cube count buffer holds fewer than 3 u32".into(),
                        backtrace: BackTrace::capture(),
                    }
                    .into());
                }
                // SAFETY: `counts` outlives the copy: the stream is synchronised before it is
                // read or dropped; the source range lies in the binding's live allocation.
                unsafe {
                    self.driver
                        .memcpy_dtoh_async(counts.as_mut_ptr(), resource.ptr, counts.len(), current.handle)
                        .map_err(server_error)?;
                }
                self.driver.stream_synchronize(current.handle).map_err(server_error)?;
                let word =
                    |i: usize| u32::from_le_bytes([counts[i], counts[i + 1], counts[i + 2], counts[i + 3]]);
                [word(0), word(4), word(8)]
            }
            (CubeCount::Static(x, y, z), _) => [x, y, z],
            (CubeCount::Dynamic(_), None) => unreachable!("a dynamic count's resource is read above"),
        };
        // A grid with no cube does nothing; MACA (like CUDA) rejects it as an invalid
        // configuration, and CubeCL issues such launches for empty tensors (an empty shard).
        if grid.contains(&0) {
            return Ok(());
        }

        // The info (scalars + metadata) buffer goes last, by pointer. It is never empty, so the
        // kernel always gets a valid address even if it declares the parameter and reads nothing.
        let mut info_bytes: Vec<u8> = bytemuck::cast_slice(&info.data).to_vec();
        if info_bytes.is_empty() {
            info_bytes.resize(8, 0);
        }
        let cursor = streams.cursor;
        let current = streams.current();
        let info_handle =
            create_on_stream(&self.driver, &self.order, current, cursor, stream_id, &info_bytes)?;
        let info_resource = resource_of(current, &info_handle.binding())?;
        ranges.push(range_of(&info_resource));
        resources.push(info_resource);

        let loaded = self.kernels.get_or_compile::<P>(&kernel_id, kernel.as_ref(), mode, &logger)?;
        let current = streams.current();
        // Device timers around the launch, where profiling asked for them (`kernel_time`).
        let timed = kernel_time::before_launch(P::NAME, self.device, &self.driver, current.handle);
        // SAFETY: every resource comes from a binding held by the caller or by `info_handle`,
        // whose memory stays reserved in the stream's pools until work queued on this stream
        // (which includes the launch) is done with it; cubecl-cpp declares one pointer per buffer
        // and the info pointer last, matching `resources`.
        let launched = unsafe { self.kernels.launch(&loaded, grid, current.handle, &resources) };
        if let Some(timed) = timed {
            timed.after_launch(&self.driver, current.handle, launched.is_ok());
        }
        launched?;
        order_after(&self.order, current.handle, &ranges);
        if current.staging.batch_full() {
            current.staging.seal();
        }
        Ok(())
    }
}

/// The device memory range of a resource.
fn range_of(resource: &GpuResource) -> Range {
    let start = resource.ptr.as_raw() as u64;
    (start, start + resource.size)
}

/// Orders `stream` before work that touches `ranges`, by the device's rule (module docs).
fn order_before(order: &DeviceOrder, registry: &StreamRegistry, stream: StreamHandle, ranges: &[Range]) {
    match order.rule() {
        StreamOrdering::ByNeed => {
            order.uses().wait_for(stream, ranges);
        }
        StreamOrdering::AllStreams => wait_for_all_streams(order.driver(), registry, stream),
        StreamOrdering::Unordered => {}
    }
}

/// Records, under the by-need rule, that the work just queued on `stream` touched `ranges`.
fn order_after(order: &DeviceOrder, stream: StreamHandle, ranges: &[Range]) {
    if order.rule() == StreamOrdering::ByNeed {
        order.uses().mark(order.driver(), stream, ranges);
    }
}

/// Makes `stream` wait (device side) for the work queued so far on every other stream.
fn wait_for_all_streams(driver: &Arc<dyn Driver>, registry: &StreamRegistry, stream: StreamHandle) {
    let others: Vec<StreamHandle> =
        registry.lock().unwrap_or_else(|e| e.into_inner()).iter().copied().filter(|s| *s != stream).collect();
    for other in others {
        Fence::new(driver.clone(), other).wait_async(stream);
    }
}

/// The device slice of `binding`, from the pools of the stream that created it.
fn resource_of(stream: &mut GpuStream, binding: &Binding) -> Result<GpuResource, IoError> {
    stream.memory_gpu.get_resource(binding.memory.clone(), binding.offset_start, binding.offset_end)
}

/// Page-locked staging of `size` bytes from `stream`'s pinned pools (plain host memory if those
/// are exhausted).
fn reserve_pinned(stream: &mut GpuStream, size: usize) -> Bytes {
    if size == 0 {
        return Bytes::from_bytes_vec(Vec::new());
    }
    let pinned = (|| {
        let handle = stream.memory_cpu.reserve(size as u64).ok()?;
        let binding = MemoryHandle::binding(handle);
        let resource = stream.memory_cpu.get_resource(binding.clone(), None, None).ok()?;
        let controller = Box::new(PinnedBytesController::new(binding, resource));
        // SAFETY: the controller's memory is `size` bytes of a live pinned allocation (the pool
        // reserved at least `size`); `Bytes` only exposes the first `size` bytes.
        Some(unsafe { Bytes::from_controller(controller, size) })
    })();
    pinned.unwrap_or_else(|| Bytes::from_bytes_vec(vec![0; size]))
}

/// Allocates a buffer on `stream` and queues a copy of `data` into it (through pinned staging,
/// kept alive by the stream's drop queue).
fn create_on_stream(
    driver: &Arc<dyn Driver>,
    order: &DeviceOrder,
    stream: &mut GpuStream,
    cursor: u64,
    stream_id: StreamId,
    data: &[u8],
) -> Result<Handle, IoError> {
    let handle = Handle::new(stream_id, data.len() as u64);
    let reserved = stream.memory_gpu.reserve(data.len() as u64)?;
    stream.memory_gpu.bind(reserved, handle.memory.clone(), cursor)?;
    let mut staging = reserve_pinned(stream, data.len());
    staging.copy_from_slice(data);
    let resource = resource_of(stream, &handle.clone().binding())?;
    // Fresh memory of this stream's pool may have been used by another stream before it was
    // freed; the caller marks the range once its own work is queued.
    if order.rule() == StreamOrdering::ByNeed {
        order.uses().wait_for(stream.handle, &[range_of(&resource)]);
    }
    queue_htod(driver, stream, resource.ptr, resource.size, staging)?;
    Ok(handle)
}

/// Queues a host → device copy of `data` on `stream`; `data` is kept alive by the stream's drop
/// queue until a fence after the copy has been reached.
fn queue_htod(
    driver: &Arc<dyn Driver>,
    stream: &mut GpuStream,
    dst: DevicePtr,
    capacity: u64,
    data: Bytes,
) -> Result<(), IoError> {
    if data.len() as u64 > capacity {
        return Err(IoError::Unknown {
            description: format!("writing {} bytes into a {capacity}-byte buffer", data.len()),
            backtrace: BackTrace::capture(),
        });
    }
    if !data.is_empty() {
        // SAFETY: `data` stays alive (owned by the drop queue) until a fence recorded after this
        // copy has been reached; `dst..dst+len` lies in the live destination slice (checked above
        // against its size).
        unsafe { driver.memcpy_htod_async(dst, data.as_ptr(), data.len(), stream.handle) }
            .map_err(|e| IoError::Execution(Box::new(server_error(e))))?;
    }
    stream.staging.push(data);
    Ok(())
}

/// The host buffers of a read in flight: if the read's future is dropped before completion, the
/// buffers are only released once the copies into them are done.
struct PendingRead {
    fence: Option<Fence>,
    bytes: Vec<Bytes>,
    _bindings: Vec<Binding>,
}

impl PendingRead {
    fn finish(mut self) -> Result<Vec<Bytes>, ServerError> {
        if let Some(fence) = self.fence.take() {
            fence.wait_sync()?;
        }
        Ok(std::mem::take(&mut self.bytes))
    }

    /// Whether the copies have completed, without waiting.
    fn reached(&self) -> bool {
        self.fence.as_ref().is_none_or(Fence::reached)
    }

    /// The bytes of a read that [`PendingRead::reached`] its end (no wait).
    fn take(mut self) -> Vec<Bytes> {
        if let Some(fence) = self.fence.take() {
            fence.release();
        }
        std::mem::take(&mut self.bytes)
    }
}

/// The future of a read, whose copies [`GpuServer::read`] has already queued.
///
/// Its first poll does not wait: it returns the bytes if the copies have completed (a
/// non-blocking event query), else `Pending` (waking its task at once). Later polls wait on the
/// host. So a caller can queue a read and collect it later — poll Burn's `into_data_async`
/// once, as burn-fsdp's CPU offload does with each unit's gradient in backward, and block on it
/// when the host needs the values — while `into_data` (which blocks on the future) waits as it
/// always did, with one more poll.
struct ReadFuture {
    pending: Option<PendingRead>,
    polled: bool,
}

impl std::future::Future for ReadFuture {
    type Output = Result<Vec<Bytes>, ServerError>;

    fn poll(
        mut self: std::pin::Pin<&mut Self>,
        cx: &mut std::task::Context<'_>,
    ) -> std::task::Poll<Self::Output> {
        use std::task::Poll;
        let Some(pending) = self.pending.take() else {
            return Poll::Ready(Err(ServerError::Generic {
                reason: "a read polled after it completed".into(),
                backtrace: BackTrace::capture(),
            }));
        };
        if pending.reached() {
            return Poll::Ready(Ok(pending.take()));
        }
        if !self.polled {
            self.polled = true;
            self.pending = Some(pending);
            cx.waker().wake_by_ref();
            return Poll::Pending;
        }
        Poll::Ready(pending.finish())
    }
}

impl Drop for PendingRead {
    fn drop(&mut self) {
        if let Some(fence) = self.fence.take() {
            let _ = fence.wait_sync();
        }
    }
}

impl<P: Platform> GpuServer<P> {
    fn read_inner(
        &mut self,
        descriptors: Vec<CopyDescriptor>,
        stream_id: StreamId,
    ) -> Result<PendingRead, ServerError> {
        self.check_errors(stream_id)?;
        let mut streams = self.streams.resolve(stream_id, descriptors.iter().map(|d| &d.handle), true)?;
        let current_handle = streams.current().handle;
        // The ordering rule (module docs): first wait for the streams that used the buffers.
        let mut ranges = Vec::with_capacity(descriptors.len());
        for descriptor in &descriptors {
            ranges.push(range_of(&resource_of(streams.get(&descriptor.handle.stream), &descriptor.handle)?));
        }
        order_before(&self.order, &self.registry, current_handle, &ranges);

        // Copies already queued write into `pending`'s buffers: on an error below, a fence is
        // recorded before returning, so that dropping `pending` waits for them.
        let mut pending = PendingRead {
            fence: None,
            bytes: Vec::with_capacity(descriptors.len()),
            _bindings: Vec::with_capacity(descriptors.len()),
        };
        for CopyDescriptor { handle: binding, shape, strides, elem_size } in descriptors {
            let queued = (|| {
                if !has_contiguous_row_major_strides(&shape, &strides) {
                    return Err(ServerError::from(IoError::UnsupportedStrides {
                        backtrace: BackTrace::capture(),
                    }));
                }
                let len = shape.iter().product::<usize>() * elem_size;
                let resource = resource_of(streams.get(&binding.stream), &binding)?;
                if len as u64 > resource.size {
                    return Err(IoError::Unknown {
                        description: format!("reading {len} bytes from a {}-byte buffer", resource.size),
                        backtrace: BackTrace::capture(),
                    }
                    .into());
                }
                let current = streams.current();
                let mut out = reserve_pinned(current, len);
                if len > 0 {
                    // SAFETY: `out` goes into `pending`, which waits for a fence recorded after
                    // this copy before handing `out` out or dropping it; the source range lies in
                    // the binding's live slice (checked against its size), kept reserved by
                    // `pending`'s bindings.
                    unsafe {
                        self.driver.memcpy_dtoh_async(out.as_mut_ptr(), resource.ptr, len, current.handle)
                    }
                    .map_err(server_error)?;
                }
                Ok(out)
            })();
            match queued {
                Ok(out) => {
                    pending.bytes.push(out);
                    pending._bindings.push(binding);
                }
                Err(err) => {
                    pending.fence = Some(Fence::new(self.driver.clone(), current_handle));
                    return Err(err);
                }
            }
        }
        pending.fence = Some(Fence::new(self.driver.clone(), current_handle));
        let read: usize = pending.bytes.iter().map(|b| b.len()).sum();
        super::host_bytes::add(P::NAME, self.device, stream_id, read as u64);
        // A later write by another stream must wait for these copies.
        order_after(&self.order, current_handle, &ranges);
        Ok(pending)
    }
}

impl<P: Platform> DeviceService for GpuServer<P> {
    fn init(device_id: DeviceId) -> Self {
        let index = <P::Device as Device>::from_id(device_id).index();
        // `DeviceService::init` cannot fail: callers that want an error instead of this panic
        // check the device first (`DriverRuntime::check_device` / `try_client`).
        match Self::try_new(index) {
            Ok(server) => server,
            Err(err) => panic!("{err}"),
        }
    }

    fn utilities(&self) -> ServerUtilitiesHandle {
        self.utilities.clone() as ServerUtilitiesHandle
    }
}

/// Collectives between servers (`all_reduce`) are not offered (`SERVER_COMM_ENABLED` is false:
/// FSDP brings its own process groups); device-to-device copies (`send`/`recv`, which
/// burn-cubecl's `to_device` uses whatever that flag says) go through the host, see
/// [`super::transfer`].
impl<P: Platform> ServerCommunication for GpuServer<P> {
    const SERVER_COMM_ENABLED: bool = false;

    fn comm_init(&mut self, _device_ids: Vec<DeviceId>) -> Result<(), ServerError> {
        Ok(())
    }

    /// `recv` finishes its write before returning (on the stream's queue), so nothing is left
    /// to wait for.
    fn sync_collective(&mut self, _stream_id: StreamId) -> Result<(), ServerError> {
        Ok(())
    }

    fn send(
        &mut self,
        desc: CopyDescriptor,
        _dtype: ElemType,
        stream_id: StreamId,
        device_id_dst: DeviceId,
    ) -> Result<(), ServerError> {
        // The whole buffer, byte for byte, so that the destination keeps the source's strides.
        let len = desc.handle.size_in_used() as usize;
        let raw = CopyDescriptor::new(desc.handle, [len].into(), [1].into(), 1);
        let bytes = self.read_inner(vec![raw], stream_id)?.finish()?;
        let bytes = bytes.into_iter().next().map(|b| b.to_vec()).unwrap_or_default();
        super::transfer::post(P::NAME, self.device, device_id_dst.index_id as usize, bytes);
        Ok(())
    }

    fn recv(
        &mut self,
        handle: Handle,
        _dtype: ElemType,
        stream_id: StreamId,
        device_id_src: DeviceId,
    ) -> Result<(), ServerError> {
        let src = device_id_src.index_id as usize;
        let timeout = super::transfer::RECV_TIMEOUT;
        let Some(bytes) = super::transfer::take(P::NAME, src, self.device, timeout) else {
            return Err(ServerError::Generic {
                reason: format!(
                    "{} device {}: no data from device {src} within {timeout:?} for a device-to-device copy",
                    P::NAME,
                    self.device
                ),
                backtrace: BackTrace::capture(),
            });
        };
        let len = bytes.len();
        if len as u64 != handle.size_in_used() {
            return Err(ServerError::Generic {
                reason: format!(
                    "{} device {}: device {src} sent {len} bytes for a {}-byte buffer",
                    P::NAME,
                    self.device,
                    handle.size_in_used()
                ),
                backtrace: BackTrace::capture(),
            });
        }
        self.initialize_memory(handle.memory.clone(), handle.size(), stream_id);
        let desc = handle.copy_descriptor([len].into(), [1].into(), 1);
        self.write(vec![(desc, Bytes::from_bytes_vec(bytes))], stream_id);
        self.check_errors(stream_id)
    }
}

impl<P: Platform> ComputeServer for GpuServer<P> {
    type Kernel = Box<dyn CubeTask<CppCompiler<P::Dialect>>>;
    type Info = ();
    type MemoryLayoutPolicy = ContiguousMemoryLayoutPolicy;
    type Storage = super::storage::GpuStorage;

    fn initialize_memory(
        &mut self,
        memory: cubecl_runtime::memory_management::ManagedMemoryHandle,
        size: u64,
        stream_id: StreamId,
    ) {
        let Ok(mut streams) = self.streams.resolve(stream_id, [].into_iter(), false) else { return };
        let cursor = streams.cursor;
        let stream = streams.current();
        let bound = stream
            .memory_gpu
            .reserve(size)
            .and_then(|reserved| stream.memory_gpu.bind(reserved, memory, cursor));
        if let Err(err) = bound {
            stream.errors.push(err.into());
        }
    }

    fn staging(&mut self, sizes: &[usize], stream_id: StreamId) -> Result<Vec<Bytes>, ServerError> {
        let mut streams = self.streams.resolve(stream_id, [].into_iter(), false)?;
        let stream = streams.current();
        Ok(sizes.iter().map(|size| reserve_pinned(stream, *size)).collect())
    }

    fn logger(&self) -> Arc<ServerLogger> {
        self.streams.logger.clone()
    }

    fn utilities(&self) -> Arc<ServerUtilities<Self>> {
        self.utilities.clone()
    }

    /// Reads device memory into host memory. Before its copies, the reading stream waits for the
    /// work queued on **every** stream of the server (the ordering rule, see the module docs).
    fn read(
        &mut self,
        descriptors: Vec<CopyDescriptor>,
        stream_id: StreamId,
    ) -> DynFut<Result<Vec<Bytes>, ServerError>> {
        match self.read_inner(descriptors, stream_id) {
            Ok(pending) => Box::pin(ReadFuture { pending: Some(pending), polled: false }),
            Err(err) => Box::pin(async move { Err(err) }),
        }
    }

    fn write(&mut self, descriptors: Vec<(CopyDescriptor, Bytes)>, stream_id: StreamId) {
        let Ok(mut streams) =
            self.streams.resolve(stream_id, descriptors.iter().map(|(d, _)| &d.handle), false)
        else {
            return;
        };
        // The ordering rule (module docs): the copies wait for the streams that used the buffers.
        let mut ranges = Vec::with_capacity(descriptors.len());
        for (descriptor, _) in &descriptors {
            match resource_of(streams.get(&descriptor.handle.stream), &descriptor.handle) {
                Ok(resource) => ranges.push(range_of(&resource)),
                Err(err) => {
                    streams.current().errors.push(err.into());
                    return;
                }
            }
        }
        let handle = streams.current().handle;
        order_before(&self.order, &self.registry, handle, &ranges);
        let written: usize = descriptors.iter().map(|(_, data)| data.len()).sum();
        super::host_bytes::add(P::NAME, self.device, stream_id, written as u64);
        for (CopyDescriptor { handle: binding, shape, strides, .. }, data) in descriptors {
            let result = (|| {
                if !has_contiguous_row_major_strides(&shape, &strides) {
                    return Err(IoError::UnsupportedStrides { backtrace: BackTrace::capture() });
                }
                let resource = resource_of(streams.get(&binding.stream), &binding)?;
                let current = streams.current();
                let data = match data.property() {
                    // Memory-mapped files are copied into pinned memory first.
                    AllocationProperty::File => {
                        let mut staging = reserve_pinned(current, data.len());
                        data.copy_into(&mut staging);
                        staging
                    }
                    _ => data,
                };
                queue_htod(&self.driver, current, resource.ptr, resource.size, data)
            })();
            if let Err(err) = result {
                streams.current().errors.push(err.into());
                break;
            }
        }
        order_after(&self.order, handle, &ranges);
    }

    fn sync(&mut self, stream_id: StreamId) -> DynFut<Result<(), ServerError>> {
        if let Err(err) = self.check_errors(stream_id) {
            return Box::pin(async move { Err(err) });
        }
        let fence = match self.streams.resolve(stream_id, [].into_iter(), true) {
            Ok(mut streams) => {
                let current = streams.current();
                current.memory_gpu.storage().flush();
                Fence::new(self.driver.clone(), current.handle)
            }
            Err(err) => return Box::pin(async move { Err(err) }),
        };
        Box::pin(async move { fence.wait_sync() })
    }

    fn get_resource(
        &mut self,
        binding: Binding,
        stream_id: StreamId,
    ) -> Result<ManagedResource<GpuResource>, ServerError> {
        let mut streams = self.streams.resolve(stream_id, [&binding].into_iter(), false)?;
        let resource = resource_of(streams.get(&binding.stream), &binding)?;
        Ok(ManagedResource::new(binding.memory, resource))
    }

    unsafe fn launch(
        &mut self,
        kernel: Self::Kernel,
        count: CubeCount,
        bindings: KernelArguments,
        mode: ExecutionMode,
        stream_id: StreamId,
    ) {
        if let Err(err) = self.launch_checked(kernel, count, bindings, mode, stream_id)
            && let Ok(mut streams) = self.streams.resolve(stream_id, [].into_iter(), false)
        {
            streams.current().errors.push(err);
        }
    }

    fn flush(&mut self, stream_id: StreamId) -> Result<(), ServerError> {
        self.check_errors(stream_id)?;
        let mut streams = self.streams.resolve(stream_id, [].into_iter(), true)?;
        let current = streams.current();
        current.staging.seal();
        current.memory_gpu.storage().flush();
        Ok(())
    }

    fn memory_usage(&mut self, stream_id: StreamId) -> Result<MemoryUsage, ServerError> {
        let mut streams = self.streams.resolve(stream_id, [].into_iter(), false)?;
        Ok(streams.current().memory_gpu.memory_usage())
    }

    fn memory_cleanup(&mut self, stream_id: StreamId) {
        if let Ok(mut streams) = self.streams.resolve(stream_id, [].into_iter(), false) {
            streams.current().memory_gpu.cleanup(true);
        }
    }

    fn start_profile(&mut self, stream_id: StreamId) -> Result<ProfilingToken, ServerError> {
        cubecl_common::future::block_on(self.sync(stream_id))?;
        Ok(self.timestamps.start())
    }

    fn end_profile(
        &mut self,
        stream_id: StreamId,
        token: ProfilingToken,
    ) -> Result<ProfileDuration, ProfileError> {
        if let Err(err) = cubecl_common::future::block_on(self.sync(stream_id)) {
            self.timestamps.error(ProfileError::Server(Box::new(err)));
        }
        self.timestamps.stop(token)
    }

    fn allocation_mode(&mut self, mode: MemoryAllocationMode, stream_id: StreamId) {
        if let Ok(mut streams) = self.streams.resolve(stream_id, [].into_iter(), false) {
            streams.current().memory_gpu.mode(mode);
        }
    }
}
