//! Device-buffer communicators for burn-fsdp (feature `collectives`).
//!
//! - [`DeviceCommunicator`]: one rank of a collective library's communicator, driven with raw
//!   device pointers, an element count, a [`CommDType`] and a stream. Implemented by
//!   [`MacaCommunicator`](crate::mccl::MacaCommunicator) (MCCL, `libmccl.so` loaded at run
//!   time) and, with the `cuda` feature, by `NcclCommunicator` (NCCL through cudarc, loaded at
//!   run time).
//! - [`DeviceGroup`]: a [`burn_fsdp::comm::ProcessGroup`] for the backends of this crate
//!   ([`Metax`](crate::Metax), and `CudaProxy` with the `cuda` feature) over such a
//!   communicator. Tensors stay on the device: each collective runs on the group's own
//!   *communication stream*, ordered against the server's compute streams by events (see
//!   [`DeviceGroup`] for the ordering and timeout rules).
//!
//! Communicators are created from a 128-byte unique id that one rank makes
//! ([`mccl_unique_id`], `NcclCommunicator::unique_id`) and
//! sends to the others out of band (the caller's business: e.g. over TCP).

mod emu;
mod group;
mod mccl;
#[cfg(feature = "cuda")]
mod nccl;
mod stream;
mod watchdog;

use std::fmt;

use burn::tensor::DType;
use burn_fsdp::comm::ReduceOp;

use crate::driver::{DevicePtr, DriverError, StreamHandle};
use crate::mccl::McclError;
use crate::runtime::BackendError;

pub use emu::{EmuCommunicator, EmuGroupAbort};
pub use group::{DEFAULT_TIMEOUT, DeviceGroup, MetaxEmuGroup, MetaxGroup};
pub use mccl::mccl_unique_id;
#[cfg(feature = "cuda")]
pub use nccl::{CudaProxyNcclGroup, NcclCommunicator};

/// Bytes in a communicator's unique id (`mcclUniqueId`, `ncclUniqueId`).
pub const UNIQUE_ID_BYTES: usize = 128;

/// The element types the device communicators move and reduce.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum CommDType {
    /// IEEE half precision.
    F16,
    /// bfloat16.
    BF16,
    /// IEEE single precision.
    F32,
    /// IEEE double precision.
    F64,
}

impl CommDType {
    /// The communicator type of a Burn dtype, or `None` for one the communicators do not handle.
    pub fn from_dtype(dtype: DType) -> Option<Self> {
        match dtype {
            DType::F16 => Some(Self::F16),
            DType::BF16 => Some(Self::BF16),
            DType::F32 => Some(Self::F32),
            DType::F64 => Some(Self::F64),
            _ => None,
        }
    }

    /// The Burn dtype.
    pub fn dtype(self) -> DType {
        match self {
            Self::F16 => DType::F16,
            Self::BF16 => DType::BF16,
            Self::F32 => DType::F32,
            Self::F64 => DType::F64,
        }
    }

    /// Bytes per element.
    pub const fn size(self) -> usize {
        match self {
            Self::F16 | Self::BF16 => 2,
            Self::F32 => 4,
            Self::F64 => 8,
        }
    }
}

/// How a reducing collective combines the ranks' elements.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum CommOp {
    /// Sum.
    Sum,
    /// Mean: the library's average operation (`mcclAvg`, `ncclAvg`).
    Avg,
    /// Maximum.
    Max,
}

impl From<ReduceOp> for CommOp {
    fn from(op: ReduceOp) -> Self {
        match op {
            ReduceOp::Sum => Self::Sum,
            ReduceOp::Avg => Self::Avg,
            ReduceOp::Max => Self::Max,
        }
    }
}

impl From<CommOp> for ReduceOp {
    fn from(op: CommOp) -> Self {
        match op {
            CommOp::Sum => Self::Sum,
            CommOp::Avg => Self::Avg,
            CommOp::Max => Self::Max,
        }
    }
}

/// An error of a device communicator or of the device work around it.
#[derive(Debug, Clone, PartialEq, thiserror::Error)]
pub enum CollectiveError {
    /// The library could not be loaded.
    #[error("{library} is not available: {reason}")]
    Unavailable {
        /// The library ("MCCL", "NCCL").
        library: &'static str,
        /// Why.
        reason: String,
    },
    /// A library call returned an error status.
    #[error("{call} failed: {name} ({code}): {message}")]
    Call {
        /// The C function.
        call: &'static str,
        /// The raw status.
        code: i32,
        /// The status's name (e.g. `ncclInvalidUsage`).
        name: String,
        /// The library's own description (`mcclGetErrorString`, `ncclGetErrorString`).
        message: String,
    },
    /// An argument was rejected before calling the library.
    #[error("invalid argument: {0}")]
    InvalidArgument(String),
    /// A driver call (events, streams) failed.
    #[error(transparent)]
    Driver(#[from] DriverError),
    /// The device cannot be used.
    #[error(transparent)]
    Backend(#[from] BackendError),
    /// The device's server failed (e.g. its thread is gone).
    #[error("the device's compute server failed: {0}")]
    Server(String),
}

impl From<McclError> for CollectiveError {
    fn from(e: McclError) -> Self {
        match e {
            McclError::Load(error) => Self::Unavailable { library: "MCCL", reason: error.to_string() },
            McclError::Call { call, code, name, message } => {
                Self::Call { call, code, name: name.to_owned(), message }
            }
            McclError::InvalidArgument(msg) => Self::InvalidArgument(msg),
        }
    }
}

/// One rank of a collective library's communicator, driven with raw device buffers.
///
/// Collectives are *queued* on `stream`, like kernels, and return before they run; they are
/// `unsafe` because the buffers are raw device addresses that must hold the stated number of
/// elements and stay allocated until the stream has run the collective. Every rank must issue
/// the same collectives, with the same counts, types and ops, in the same order.
///
/// Implementations need not be `Sync`: the libraries do not allow concurrent calls on one
/// communicator ([`DeviceGroup`] serialises them). Dropping a communicator destroys it (unless
/// it was aborted).
pub trait DeviceCommunicator: Send + fmt::Debug + 'static {
    /// The library's name ("MCCL", "NCCL").
    fn library(&self) -> &'static str;
    /// This rank.
    fn rank(&self) -> usize;
    /// Number of ranks.
    fn size(&self) -> usize;

    /// Concatenates every rank's `send_count` elements of `send` into `recv`, in rank order.
    ///
    /// # Safety
    /// `send` holds `send_count` and `recv` `send_count * size()` elements of `dtype` in live
    /// memory of this rank's device, and both stay allocated until `stream` has run the
    /// collective.
    unsafe fn all_gather(
        &self,
        send: DevicePtr,
        recv: DevicePtr,
        send_count: usize,
        dtype: CommDType,
        stream: StreamHandle,
    ) -> Result<(), CollectiveError>;

    /// Reduces `recv_count * size()` elements across ranks with `op` and leaves this rank's
    /// `recv_count`-element chunk in `recv`.
    ///
    /// # Safety
    /// `send` holds `recv_count * size()` and `recv` `recv_count` elements of `dtype`, as for
    /// [`DeviceCommunicator::all_gather`].
    unsafe fn reduce_scatter(
        &self,
        send: DevicePtr,
        recv: DevicePtr,
        recv_count: usize,
        dtype: CommDType,
        op: CommOp,
        stream: StreamHandle,
    ) -> Result<(), CollectiveError>;

    /// Reduces `count` elements across ranks with `op`; every rank gets the result in `recv`.
    ///
    /// # Safety
    /// `send` and `recv` hold `count` elements of `dtype` (they may be equal: in place), as
    /// for [`DeviceCommunicator::all_gather`].
    unsafe fn all_reduce(
        &self,
        send: DevicePtr,
        recv: DevicePtr,
        count: usize,
        dtype: CommDType,
        op: CommOp,
        stream: StreamHandle,
    ) -> Result<(), CollectiveError>;

    /// Copies `count` elements of `send` on rank `root` into `recv` on every rank.
    ///
    /// # Safety
    /// `send` (read on the root only) and `recv` hold `count` elements of `dtype`, as for
    /// [`DeviceCommunicator::all_gather`].
    unsafe fn broadcast(
        &self,
        send: DevicePtr,
        recv: DevicePtr,
        count: usize,
        dtype: CommDType,
        root: usize,
        stream: StreamHandle,
    ) -> Result<(), CollectiveError>;

    /// Aborts the communicator: its queued collectives stop waiting for peers (their results
    /// are undefined), later collectives fail, and drop no longer destroys it. Idempotent.
    fn abort(&mut self) -> Result<(), CollectiveError>;
}
