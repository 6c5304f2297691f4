//! Streams: each CubeCL stream owns a driver stream, its device-memory pools, its pinned-memory
//! pools, its pending errors and a queue of host buffers to keep alive until the device used them.

use std::sync::{Arc, Mutex};

use cubecl_common::backtrace::BackTrace;
use cubecl_core::MemoryConfiguration;
use cubecl_core::ir::MemoryDeviceProperties;
use cubecl_core::server::{Binding, ServerError};
use cubecl_runtime::logging::ServerLogger;
use cubecl_runtime::memory_management::{MemoryAllocationMode, MemoryManagement, MemoryManagementOptions};
use cubecl_runtime::stream::EventStreamBackend;

use super::fence::Fence;
use super::order::DeviceOrder;
use super::staging::StagingQueue;
use super::storage::{GpuStorage, PINNED_MEMORY_ALIGNMENT, PinnedStorage};
use crate::driver::{Driver, StreamHandle};

/// One CubeCL stream on the device.
pub struct GpuStream {
    pub(crate) handle: StreamHandle,
    pub(crate) memory_gpu: MemoryManagement<GpuStorage>,
    pub(crate) memory_cpu: MemoryManagement<PinnedStorage>,
    pub(crate) errors: Vec<ServerError>,
    pub(crate) staging: StagingQueue,
}

impl std::fmt::Debug for GpuStream {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("GpuStream").field("handle", &self.handle).field("errors", &self.errors.len()).finish()
    }
}

/// Every driver stream the server created, so that blocking copies can wait for all of them
/// (see [`super::server::GpuServer`]).
pub(crate) type StreamRegistry = Arc<Mutex<Vec<StreamHandle>>>;

/// Creates [`GpuStream`]s and their events for CubeCL's [`cubecl_runtime::stream::MultiStream`].
#[derive(Debug)]
pub struct GpuStreamBackend {
    driver: Arc<dyn Driver>,
    memory_properties: MemoryDeviceProperties,
    memory_config: MemoryConfiguration,
    logger: Arc<ServerLogger>,
    registry: StreamRegistry,
    order: Arc<DeviceOrder>,
}

impl GpuStreamBackend {
    pub(crate) fn new(
        driver: Arc<dyn Driver>,
        memory_properties: MemoryDeviceProperties,
        memory_config: MemoryConfiguration,
        logger: Arc<ServerLogger>,
        registry: StreamRegistry,
        order: Arc<DeviceOrder>,
    ) -> Self {
        Self { driver, memory_properties, memory_config, logger, registry, order }
    }
}

impl EventStreamBackend for GpuStreamBackend {
    type Stream = GpuStream;
    type Event = Fence;

    fn create_stream(&self) -> GpuStream {
        // Non-blocking: CubeCL streams never synchronise implicitly with the legacy default stream.
        let (handle, errors) = match self.driver.stream_create(true) {
            Ok(handle) => {
                self.registry.lock().unwrap_or_else(|e| e.into_inner()).push(handle);
                (handle, Vec::new())
            }
            // No way to return an error here: the stream starts unhealthy, so that the first
            // operation that checks its health reports why.
            Err(err) => (
                StreamHandle::DEFAULT,
                vec![ServerError::Generic {
                    reason: format!("could not create a stream: {err}"),
                    backtrace: BackTrace::capture(),
                }],
            ),
        };
        let memory_gpu = MemoryManagement::from_configuration(
            GpuStorage::new(self.driver.clone(), handle, self.order.clone()),
            &self.memory_properties,
            self.memory_config.clone(),
            self.logger.clone(),
            MemoryManagementOptions::new("Device memory"),
        );
        let memory_cpu = MemoryManagement::from_configuration(
            PinnedStorage::new(self.driver.clone()),
            &MemoryDeviceProperties {
                max_page_size: self.memory_properties.max_page_size,
                alignment: PINNED_MEMORY_ALIGNMENT as u64,
            },
            self.memory_config.clone(),
            self.logger.clone(),
            MemoryManagementOptions::new("Pinned host memory").mode(MemoryAllocationMode::Auto),
        );
        GpuStream {
            handle,
            memory_gpu,
            memory_cpu,
            errors,
            staging: StagingQueue::new(self.driver.clone(), handle),
        }
    }

    fn flush(stream: &mut GpuStream) -> Fence {
        Fence::new(stream.memory_gpu.storage().driver(), stream.handle)
    }

    fn wait_event(stream: &mut GpuStream, event: Fence) {
        event.wait_async(stream.handle);
    }

    fn wait_event_sync(event: Fence) -> Result<(), ServerError> {
        // Only cubecl-runtime's garbage-collection thread calls this, and it panics on an error
        // (then the server panics on its next hand-off to that thread). A failed wait means the
        // device is broken (e.g. poisoned); the streams report that error themselves, so the
        // collector just proceeds.
        // It queues no device work, so its waits stall nothing: the emulated device counts them
        // apart from the host syncs of the threads that queue work.
        let _ = crate::emu::in_background(|| event.wait_sync());
        Ok(())
    }

    fn handle_cursor(stream: &GpuStream, binding: &Binding) -> u64 {
        // An unknown binding is treated as the newest possible work, so it is always waited for.
        stream.memory_gpu.get_cursor(binding.memory.clone()).unwrap_or(u64::MAX)
    }

    fn is_healthy(stream: &GpuStream) -> bool {
        stream.errors.is_empty()
    }
}
