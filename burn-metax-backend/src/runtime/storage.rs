//! Compute storages over the [`Driver`]: device memory ([`GpuStorage`]) and page-locked host
//! memory ([`PinnedStorage`]). CubeCL's memory management (pools, slices, reuse) sits on top of
//! them; they only allocate and free whole pages.

use std::collections::HashMap;
use std::mem::MaybeUninit;
use std::sync::Arc;

use cubecl_common::backtrace::BackTrace;
use cubecl_common::bytes::{AllocationController, AllocationProperty};
use cubecl_core::server::IoError;
use cubecl_runtime::memory_management::ManagedMemoryBinding;
use cubecl_runtime::storage::{ComputeStorage, StorageHandle, StorageId, StorageUtilization};

use super::order::{DeviceOrder, StreamOrdering};
use crate::driver::{DevicePtr, Driver, DriverError, HostPtr, MacaError, StreamHandle};

/// Alignment of device allocations handed out by the memory pools, in bytes.
pub const DEVICE_MEMORY_ALIGNMENT: usize = 256;
/// Alignment of pinned host staging buffers, in bytes.
pub const PINNED_MEMORY_ALIGNMENT: usize = std::mem::size_of::<u128>();

fn io_error(what: &str, error: DriverError) -> IoError {
    IoError::Unknown { description: format!("{what}: {error}"), backtrace: BackTrace::capture() }
}

/// Device memory of one stream's memory pools.
pub struct GpuStorage {
    driver: Arc<dyn Driver>,
    stream: StreamHandle,
    /// Pages: address and size.
    memory: HashMap<StorageId, (DevicePtr, u64)>,
    pending_frees: Vec<StorageId>,
    order: Arc<DeviceOrder>,
}

impl std::fmt::Debug for GpuStorage {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("GpuStorage")
            .field("stream", &self.stream)
            .field("allocations", &self.memory.len())
            .finish()
    }
}

/// A slice of device memory: its address and length.
#[derive(Debug, Clone, Copy)]
pub struct GpuResource {
    /// Device address of the slice's first byte.
    pub ptr: DevicePtr,
    /// Length of the slice, in bytes.
    pub size: u64,
}

impl GpuStorage {
    pub(crate) fn new(driver: Arc<dyn Driver>, stream: StreamHandle, order: Arc<DeviceOrder>) -> Self {
        Self { driver, stream, memory: HashMap::new(), pending_frees: Vec::new(), order }
    }

    /// Live device allocations (pages) of this storage.
    pub fn allocation_count(&self) -> usize {
        self.memory.len()
    }

    /// The driver this storage allocates with.
    pub(crate) fn driver(&self) -> Arc<dyn Driver> {
        self.driver.clone()
    }
}

impl ComputeStorage for GpuStorage {
    type Resource = GpuResource;

    fn alignment(&self) -> usize {
        DEVICE_MEMORY_ALIGNMENT
    }

    fn get(&mut self, handle: &StorageHandle) -> GpuResource {
        // The memory manager only asks for pages it allocated and has not freed.
        let (base, _) = *self.memory.get(&handle.id).expect("storage handle of a live device allocation");
        GpuResource { ptr: base.offset(handle.offset() as usize), size: handle.size() }
    }

    fn alloc(&mut self, size: u64) -> Result<StorageHandle, IoError> {
        let bytes = usize::try_from(size)
            .map_err(|_| IoError::BufferTooBig { size, backtrace: BackTrace::capture() })?;
        let ptr = match self.driver.malloc_async(bytes, self.stream) {
            Ok(ptr) => ptr,
            Err(DriverError::Api { error, .. }) if error == MacaError::MEMORY_ALLOCATION => {
                return Err(IoError::BufferTooBig { size, backtrace: BackTrace::capture() });
            }
            Err(err) => return Err(io_error("device allocation failed", err)),
        };
        // A stream-ordered allocation is only usable by other streams once the stream has
        // reached it; pages are allocated rarely, so wait here rather than track it.
        if let Err(err) = self.driver.stream_synchronize(self.stream) {
            // SAFETY: `ptr` was just allocated by this driver and nothing uses it yet.
            let _ = unsafe { self.driver.free(ptr) };
            return Err(io_error("synchronising after a device allocation failed", err));
        }
        let id = StorageId::new();
        self.memory.insert(id, (ptr, size));
        Ok(StorageHandle::new(id, StorageUtilization { offset: 0, size }))
    }

    fn dealloc(&mut self, id: StorageId) {
        self.pending_frees.push(id);
    }

    fn flush(&mut self) {
        for id in self.pending_frees.drain(..) {
            if let Some((ptr, size)) = self.memory.remove(&id) {
                // Other streams' last uses of the page come first (ordering by need; under the
                // all-streams rule every operation already waited for them).
                let page = (ptr.as_raw() as u64, ptr.as_raw() as u64 + size);
                if self.order.rule() == StreamOrdering::ByNeed {
                    let mut uses = self.order.uses();
                    uses.wait_for(self.stream, &[page]);
                    uses.remove(page);
                }
                // SAFETY: the memory manager deallocates a page only once no handle refers to it
                // any more; work already queued on this storage's stream may still use it, which
                // `free_async` on that same stream allows. Other streams' uses were ordered before
                // this point on the stream (by the wait above, or by the all-streams rule).
                let _ = unsafe { self.driver.free_async(ptr, self.stream) };
            }
        }
    }
}

/// Page-locked host memory used as staging for copies.
pub struct PinnedStorage {
    driver: Arc<dyn Driver>,
    memory: HashMap<StorageId, (HostPtr, usize)>,
}

impl std::fmt::Debug for PinnedStorage {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("PinnedStorage").field("allocations", &self.memory.len()).finish()
    }
}

/// A slice of pinned host memory.
#[derive(Debug, Clone, Copy)]
pub struct PinnedResource {
    /// Address of the slice's first byte.
    pub ptr: HostPtr,
    /// Length of the slice, in bytes.
    pub size: usize,
}

impl PinnedStorage {
    pub(crate) fn new(driver: Arc<dyn Driver>) -> Self {
        Self { driver, memory: HashMap::new() }
    }
}

impl ComputeStorage for PinnedStorage {
    type Resource = PinnedResource;

    fn alignment(&self) -> usize {
        PINNED_MEMORY_ALIGNMENT
    }

    fn get(&mut self, handle: &StorageHandle) -> PinnedResource {
        let (base, _) = *self.memory.get(&handle.id).expect("storage handle of a live pinned allocation");
        PinnedResource {
            ptr: HostPtr::from_raw(base.as_raw() + handle.offset() as usize),
            size: handle.size() as usize,
        }
    }

    fn alloc(&mut self, size: u64) -> Result<StorageHandle, IoError> {
        let bytes = usize::try_from(size)
            .map_err(|_| IoError::BufferTooBig { size, backtrace: BackTrace::capture() })?;
        let ptr = self.driver.malloc_host(bytes).map_err(|e| io_error("pinned host allocation failed", e))?;
        let id = StorageId::new();
        self.memory.insert(id, (ptr, bytes));
        Ok(StorageHandle::new(id, StorageUtilization { offset: 0, size }))
    }

    fn dealloc(&mut self, id: StorageId) {
        if let Some((ptr, _)) = self.memory.remove(&id) {
            // SAFETY: the memory manager frees a page only when no `Bytes` built on it is alive
            // (each holds a binding); copies reading or writing it were waited for before their
            // `Bytes` were released (read fences, drop queue).
            let _ = unsafe { self.driver.free_host(ptr) };
        }
    }

    fn flush(&mut self) {}
}

impl Drop for PinnedStorage {
    fn drop(&mut self) {
        for (_, (ptr, _)) in self.memory.drain() {
            // SAFETY: the storage is dropped with its stream's memory manager, after which no
            // `Bytes` of it can be alive (they hold bindings into that manager).
            let _ = unsafe { self.driver.free_host(ptr) };
        }
    }
}

/// Lets a slice of pinned memory back a [`cubecl_common::bytes::Bytes`]: the binding keeps the
/// slice reserved in the memory pool until the bytes are dropped.
pub(crate) struct PinnedBytesController {
    resource: PinnedResource,
    _binding: ManagedMemoryBinding,
}

impl PinnedBytesController {
    pub(crate) fn new(binding: ManagedMemoryBinding, resource: PinnedResource) -> Self {
        Self { resource, _binding: binding }
    }
}

impl AllocationController for PinnedBytesController {
    fn alloc_align(&self) -> usize {
        PINNED_MEMORY_ALIGNMENT
    }

    fn property(&self) -> AllocationProperty {
        AllocationProperty::Pinned
    }

    unsafe fn memory_mut(&mut self) -> &mut [MaybeUninit<u8>] {
        // SAFETY: the slice `ptr..ptr+size` lies in a live `mcMallocHost` allocation that the
        // binding keeps reserved for this controller alone; `MaybeUninit<u8>` has `u8`'s layout.
        unsafe { std::slice::from_raw_parts_mut(self.resource.ptr.as_mut_ptr().cast(), self.resource.size) }
    }

    fn memory(&self) -> &[MaybeUninit<u8>] {
        // SAFETY: as in `memory_mut`; shared access through `&self`.
        unsafe {
            std::slice::from_raw_parts(self.resource.ptr.as_mut_ptr().cast_const().cast(), self.resource.size)
        }
    }
}
