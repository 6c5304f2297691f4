//! Device and pinned host memory of the emulated device: host allocations, tracked so that copies
//! can be bounds-checked as the runtime would check them.

use std::alloc::Layout;
use std::collections::{BTreeMap, HashMap};
use std::sync::Mutex;
use std::sync::atomic::{AtomicUsize, Ordering};

use crate::driver::{DriverError, MacaError, Result};

/// Alignment of device allocations (as `mcMalloc`: at least 256 bytes).
const DEVICE_ALIGN: usize = 256;
/// Alignment of pinned host allocations.
const HOST_ALIGN: usize = 64;
/// Allocations up to this size are filled with `0xCD`, as real device memory is not zeroed: a
/// kernel that reads memory nobody wrote sees garbage, not zeros. Larger ones are left to the
/// operating system (zero pages, committed lazily) to keep big pools cheap.
const FILL_LIMIT: usize = 4 << 20;

fn lock<T>(m: &Mutex<T>) -> std::sync::MutexGuard<'_, T> {
    m.lock().unwrap_or_else(|e| e.into_inner())
}

fn api(call: &'static str, error: MacaError) -> DriverError {
    DriverError::Api { call, error }
}

/// The device memory of one emulated device.
#[derive(Debug)]
pub(crate) struct DeviceMemory {
    capacity: usize,
    used: AtomicUsize,
    /// Base address → length of every live allocation.
    live: Mutex<BTreeMap<usize, usize>>,
}

impl DeviceMemory {
    pub(crate) fn new(capacity: usize) -> Self {
        Self { capacity, used: AtomicUsize::new(0), live: Mutex::new(BTreeMap::new()) }
    }

    pub(crate) fn capacity(&self) -> usize {
        self.capacity
    }

    pub(crate) fn used(&self) -> usize {
        self.used.load(Ordering::Relaxed)
    }

    /// Allocates `size` bytes (a zero-byte request gets a distinct one-byte allocation).
    pub(crate) fn alloc(&self, size: usize) -> Result<usize> {
        let bytes = size.max(1);
        let layout = Layout::from_size_align(bytes, DEVICE_ALIGN)
            .map_err(|_| api("mcMalloc", MacaError::MEMORY_ALLOCATION))?;
        if self.used.fetch_add(bytes, Ordering::Relaxed) + bytes > self.capacity {
            self.used.fetch_sub(bytes, Ordering::Relaxed);
            return Err(api("mcMalloc", MacaError::MEMORY_ALLOCATION));
        }
        // SAFETY: `layout` has a non-zero size.
        let ptr = unsafe { std::alloc::alloc(layout) };
        if ptr.is_null() {
            self.used.fetch_sub(bytes, Ordering::Relaxed);
            return Err(api("mcMalloc", MacaError::MEMORY_ALLOCATION));
        }
        if bytes <= FILL_LIMIT {
            // SAFETY: `ptr` is a fresh allocation of `bytes` bytes.
            unsafe { std::ptr::write_bytes(ptr, 0xCD, bytes) };
        }
        lock(&self.live).insert(ptr as usize, bytes);
        Ok(ptr as usize)
    }

    /// Frees an allocation made by [`DeviceMemory::alloc`].
    ///
    /// # Safety
    /// No queued or running work uses the allocation any more.
    pub(crate) unsafe fn free(&self, ptr: usize) -> Result<()> {
        let bytes = lock(&self.live)
            .remove(&ptr)
            .ok_or_else(|| api("mcFree", MacaError::from_code(17).unwrap_or(MacaError::INVALID_VALUE)))?;
        self.used.fetch_sub(bytes, Ordering::Relaxed);
        // SAFETY: `ptr` was allocated by `alloc` with this size and alignment (it was live in the
        // map, now removed, so it is freed once); the caller guarantees nothing uses it.
        unsafe {
            std::alloc::dealloc(ptr as *mut u8, Layout::from_size_align_unchecked(bytes, DEVICE_ALIGN))
        };
        Ok(())
    }

    /// Checks that `ptr..ptr+len` lies inside one live allocation.
    pub(crate) fn check(&self, call: &'static str, ptr: usize, len: usize) -> Result<()> {
        let live = lock(&self.live);
        let inside = live
            .range(..=ptr)
            .next_back()
            .is_some_and(|(&base, &size)| ptr.checked_add(len).is_some_and(|end| end <= base + size));
        if inside {
            Ok(())
        } else {
            Err(api(call, MacaError::from_code(17).unwrap_or(MacaError::INVALID_VALUE)))
        }
    }

    /// Whether `ptr` is the base of a live allocation.
    pub(crate) fn owns(&self, ptr: usize) -> bool {
        lock(&self.live).contains_key(&ptr)
    }
}

impl Drop for DeviceMemory {
    fn drop(&mut self) {
        for (ptr, bytes) in std::mem::take(&mut *lock(&self.live)) {
            // SAFETY: every entry is a live allocation of `alloc`; the device is being dropped, so
            // no work can use it any more.
            unsafe {
                std::alloc::dealloc(ptr as *mut u8, Layout::from_size_align_unchecked(bytes, DEVICE_ALIGN))
            };
        }
    }
}

/// Pinned host memory (`mcMallocHost`): plain aligned host allocations.
#[derive(Debug, Default)]
pub(crate) struct HostMemory {
    live: Mutex<HashMap<usize, usize>>,
}

impl HostMemory {
    pub(crate) fn alloc(&self, size: usize) -> Result<usize> {
        let bytes = size.max(1);
        let layout = Layout::from_size_align(bytes, HOST_ALIGN)
            .map_err(|_| api("mcMallocHost", MacaError::MEMORY_ALLOCATION))?;
        // SAFETY: `layout` has a non-zero size.
        let ptr = unsafe { std::alloc::alloc(layout) };
        if ptr.is_null() {
            return Err(api("mcMallocHost", MacaError::MEMORY_ALLOCATION));
        }
        lock(&self.live).insert(ptr as usize, bytes);
        Ok(ptr as usize)
    }

    /// # Safety
    /// No queued work uses the allocation any more.
    pub(crate) unsafe fn free(&self, ptr: usize) -> Result<()> {
        let bytes = lock(&self.live)
            .remove(&ptr)
            .ok_or_else(|| api("mcFreeHost", MacaError::from_code(16).unwrap_or(MacaError::INVALID_VALUE)))?;
        // SAFETY: allocated by `alloc` with this size and alignment, removed from the map so
        // freed once; the caller guarantees nothing uses it.
        unsafe { std::alloc::dealloc(ptr as *mut u8, Layout::from_size_align_unchecked(bytes, HOST_ALIGN)) };
        Ok(())
    }
}

impl Drop for HostMemory {
    fn drop(&mut self) {
        for (ptr, bytes) in std::mem::take(&mut *lock(&self.live)) {
            // SAFETY: live allocations of `alloc`; the driver is being dropped.
            unsafe {
                std::alloc::dealloc(ptr as *mut u8, Layout::from_size_align_unchecked(bytes, HOST_ALIGN))
            };
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn copies_are_bounds_checked_against_live_allocations() {
        let memory = DeviceMemory::new(1 << 20);
        let a = memory.alloc(100).expect("alloc");
        assert_eq!(a % DEVICE_ALIGN, 0);
        assert!(memory.check("copy", a, 100).is_ok());
        assert!(memory.check("copy", a + 10, 90).is_ok());
        assert!(memory.check("copy", a + 10, 91).is_err());
        assert!(memory.check("copy", a - 1, 1).is_err());
        // SAFETY: nothing uses `a`.
        unsafe { memory.free(a) }.expect("free");
        assert!(memory.check("copy", a, 1).is_err());
        // SAFETY: double free is refused before touching memory.
        assert!(unsafe { memory.free(a) }.is_err());
        assert_eq!(memory.used(), 0);
    }

    #[test]
    fn capacity_is_enforced_and_fresh_memory_is_not_zero() {
        let memory = DeviceMemory::new(1000);
        let a = memory.alloc(600).expect("alloc");
        assert!(
            matches!(memory.alloc(600), Err(DriverError::Api { error, .. }) if error == MacaError::MEMORY_ALLOCATION)
        );
        // SAFETY: `a` is a live 600-byte allocation.
        assert_eq!(unsafe { *(a as *const u8) }, 0xCD);
        // SAFETY: nothing uses `a`.
        unsafe { memory.free(a) }.expect("free");
    }
}
