//! burn-metax-backend: a Burn backend for MetaX GPUs through the MACA runtime and CubeCL.
//!
//! This crate currently provides the foundation of that backend:
//! - [`driver`]: the [`driver::Driver`] trait over the GPU runtime calls (devices, memory,
//!   copies, streams, events, modules, launches, run-time compilation), its error type with the
//!   MACA status-code table, and [`driver::MacaDriver`], which opens `libmcruntime.so` at run
//!   time from `$MACA_PATH/lib` (default `/opt/maca/lib`). Without the SDK, loading fails with
//!   a clear error and device enumeration returns nothing.
//! - [`dialect`]: [`dialect::MacaDialect`], the cubecl-cpp dialect for MACA (64-lane waves,
//!   64-bit ballots and shuffle masks, no inline assembly, no MMA), and
//!   [`dialect::compile_kernel_source`], which compiles a CubeCL kernel to MACA C++ source.
//!
//! The tests build a mock `libmcruntime.so` (`mock-mcruntime/`, a standalone crate) and run the
//! driver against it.
#![warn(missing_docs)]
#![warn(clippy::undocumented_unsafe_blocks)]

pub mod dialect;
pub mod driver;
