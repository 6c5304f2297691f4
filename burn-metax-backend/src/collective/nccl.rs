//! [`NcclCommunicator`]: NCCL through cudarc (`libnccl.so` opened at run time, so the crate
//! builds without NCCL), on the CUDA proxy's device buffers.

use std::cell::Cell;
use std::ffi::{CStr, c_int, c_void};
use std::fmt;
use std::marker::PhantomData;
use std::time::Duration;

use cudarc::nccl::{result as nccl, sys};

use super::group::DeviceGroup;
use super::{CollectiveError, CommDType, CommOp, DeviceCommunicator, UNIQUE_ID_BYTES};
use crate::driver::{DevicePtr, StreamHandle};
use crate::runtime::{CudaProxyDevice, CudaProxyPlatform};

/// A [`DeviceGroup`] over NCCL on the CUDA proxy (backend `CudaProxy`).
pub type CudaProxyNcclGroup = DeviceGroup<CudaProxyPlatform, NcclCommunicator>;

/// Fails unless the dynamic loader finds NCCL. cudarc panics on a missing library, so every
/// entry point checks this first.
fn check_loaded() -> Result<(), CollectiveError> {
    // SAFETY: only tries to open the library; no NCCL call is made.
    if unsafe { sys::is_culib_present() } {
        Ok(())
    } else {
        Err(CollectiveError::Unavailable {
            library: "NCCL",
            reason: "the dynamic loader found no libnccl.so (cudarc looks for `libnccl.so`, not \
                     `libnccl.so.2`: install the NCCL development package or add a `libnccl.so` \
                     link on LD_LIBRARY_PATH)"
                .into(),
        })
    }
}

fn call_error(call: &'static str, e: nccl::NcclError) -> CollectiveError {
    let status = e.0;
    // SAFETY: `ncclGetErrorString` accepts any result and returns a static string or null.
    let text = unsafe { sys::ncclGetErrorString(status) };
    let message = if text.is_null() {
        String::new()
    } else {
        // SAFETY: non-null, NUL-terminated, owned by the library.
        unsafe { CStr::from_ptr(text) }.to_string_lossy().into_owned()
    };
    CollectiveError::Call { call, code: status as i32, name: format!("{status:?}"), message }
}

fn check(call: &'static str, r: Result<nccl::NcclStatus, nccl::NcclError>) -> Result<(), CollectiveError> {
    r.map(|_| ()).map_err(|e| call_error(call, e))
}

fn to_c_int(what: &str, v: usize) -> Result<c_int, CollectiveError> {
    c_int::try_from(v).map_err(|_| CollectiveError::InvalidArgument(format!("{what} {v} out of range")))
}

fn data_type(dtype: CommDType) -> sys::ncclDataType_t {
    match dtype {
        CommDType::F16 => sys::ncclDataType_t::ncclFloat16,
        CommDType::BF16 => sys::ncclDataType_t::ncclBfloat16,
        CommDType::F32 => sys::ncclDataType_t::ncclFloat32,
        CommDType::F64 => sys::ncclDataType_t::ncclFloat64,
    }
}

fn red_op(op: CommOp) -> sys::ncclRedOp_t {
    match op {
        CommOp::Sum => sys::ncclRedOp_t::ncclSum,
        CommOp::Avg => sys::ncclRedOp_t::ncclAvg,
        CommOp::Max => sys::ncclRedOp_t::ncclMax,
    }
}

fn stream(s: StreamHandle) -> sys::cudaStream_t {
    s.as_raw() as sys::cudaStream_t
}

/// One rank of an NCCL communicator (`ncclComm_t`); destroyed on drop unless aborted.
///
/// `Send` but not `Sync`: NCCL allows calls on a communicator from any thread, one at a time.
pub struct NcclCommunicator {
    comm: usize,
    rank: usize,
    size: usize,
    aborted: bool,
    _not_sync: PhantomData<Cell<()>>,
}

impl fmt::Debug for NcclCommunicator {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("NcclCommunicator")
            .field("rank", &self.rank)
            .field("size", &self.size)
            .field("aborted", &self.aborted)
            .finish()
    }
}

impl NcclCommunicator {
    /// A new unique id (`ncclGetUniqueId`), as the bytes to send to the other ranks.
    pub fn unique_id() -> Result<[u8; UNIQUE_ID_BYTES], CollectiveError> {
        check_loaded()?;
        let id = nccl::get_uniqueid().map_err(|e| call_error("ncclGetUniqueId", e))?;
        Ok(id.internal.map(|c| c as u8))
    }

    /// Joins the communicator `id` as `rank` of `size` (`ncclCommInitRank`; blocks until every
    /// rank has joined). The calling thread's current CUDA device is the one the rank uses:
    /// [`DeviceGroup::nccl`] runs this on the device's server thread.
    pub fn init_rank(id: [u8; UNIQUE_ID_BYTES], rank: usize, size: usize) -> Result<Self, CollectiveError> {
        if size == 0 || rank >= size {
            return Err(CollectiveError::InvalidArgument(format!("rank {rank} of a world of {size}")));
        }
        check_loaded()?;
        let nranks = to_c_int("world size", size)?;
        let my_rank = to_c_int("rank", rank)?;
        let id = sys::ncclUniqueId { internal: id.map(|b| b as std::ffi::c_char) };
        let mut comm: sys::ncclComm_t = std::ptr::null_mut();
        // SAFETY: `comm` is a valid out-pointer; the id is passed by value as the API takes it.
        let r = unsafe { nccl::comm_init_rank(&mut comm, nranks, id, my_rank) };
        check("ncclCommInitRank", r)?;
        Ok(Self { comm: comm as usize, rank, size, aborted: false, _not_sync: PhantomData })
    }

    fn raw(&self) -> Result<sys::ncclComm_t, CollectiveError> {
        if self.aborted {
            return Err(CollectiveError::InvalidArgument("the NCCL communicator was aborted".into()));
        }
        Ok(self.comm as sys::ncclComm_t)
    }
}

impl DeviceCommunicator for NcclCommunicator {
    fn library(&self) -> &'static str {
        "NCCL"
    }

    fn rank(&self) -> usize {
        self.rank
    }

    fn size(&self) -> usize {
        self.size
    }

    unsafe fn all_gather(
        &self,
        send: DevicePtr,
        recv: DevicePtr,
        send_count: usize,
        dtype: CommDType,
        s: StreamHandle,
    ) -> Result<(), CollectiveError> {
        let comm = self.raw()?;
        // SAFETY: the caller guarantees the buffers and the stream; `comm` is live (not aborted).
        let r = unsafe {
            nccl::all_gather(
                send.as_raw() as *const c_void,
                recv.as_raw() as *mut c_void,
                send_count,
                data_type(dtype),
                comm,
                stream(s),
            )
        };
        check("ncclAllGather", r)
    }

    unsafe fn reduce_scatter(
        &self,
        send: DevicePtr,
        recv: DevicePtr,
        recv_count: usize,
        dtype: CommDType,
        op: CommOp,
        s: StreamHandle,
    ) -> Result<(), CollectiveError> {
        let comm = self.raw()?;
        // SAFETY: as in `all_gather`.
        let r = unsafe {
            nccl::reduce_scatter(
                send.as_raw() as *const c_void,
                recv.as_raw() as *mut c_void,
                recv_count,
                data_type(dtype),
                red_op(op),
                comm,
                stream(s),
            )
        };
        check("ncclReduceScatter", r)
    }

    unsafe fn all_reduce(
        &self,
        send: DevicePtr,
        recv: DevicePtr,
        count: usize,
        dtype: CommDType,
        op: CommOp,
        s: StreamHandle,
    ) -> Result<(), CollectiveError> {
        let comm = self.raw()?;
        // SAFETY: as in `all_gather`.
        let r = unsafe {
            nccl::all_reduce(
                send.as_raw() as *const c_void,
                recv.as_raw() as *mut c_void,
                count,
                data_type(dtype),
                red_op(op),
                comm,
                stream(s),
            )
        };
        check("ncclAllReduce", r)
    }

    unsafe fn broadcast(
        &self,
        send: DevicePtr,
        recv: DevicePtr,
        count: usize,
        dtype: CommDType,
        root: usize,
        s: StreamHandle,
    ) -> Result<(), CollectiveError> {
        if root >= self.size {
            return Err(CollectiveError::InvalidArgument(format!("root {root} of a world of {}", self.size)));
        }
        let root = to_c_int("root", root)?;
        let comm = self.raw()?;
        // SAFETY: as in `all_gather`.
        let r = unsafe {
            nccl::broadcast(
                send.as_raw() as *const c_void,
                recv.as_raw() as *mut c_void,
                count,
                data_type(dtype),
                root,
                comm,
                stream(s),
            )
        };
        check("ncclBroadcast", r)
    }

    fn abort(&mut self) -> Result<(), CollectiveError> {
        if self.aborted {
            return Ok(());
        }
        self.aborted = true;
        // SAFETY: `self.comm` came from `ncclCommInitRank`, was neither aborted nor destroyed
        // (checked above), and is not used again (`aborted` is set).
        let r = unsafe { nccl::comm_abort(self.comm as sys::ncclComm_t) };
        check("ncclCommAbort", r)
    }
}

impl Drop for NcclCommunicator {
    fn drop(&mut self) {
        if self.aborted {
            return;
        }
        // SAFETY: `self.comm` came from `ncclCommInitRank`, was not aborted (checked above), and
        // is destroyed once.
        let _ = unsafe { nccl::comm_destroy(self.comm as sys::ncclComm_t) };
    }
}

impl DeviceGroup<CudaProxyPlatform, NcclCommunicator> {
    /// Joins the NCCL communicator `id` (made by [`NcclCommunicator::unique_id`] on one rank and
    /// sent to the others) as `rank` of `size`, on `device`, with collective timeout `timeout`.
    ///
    /// `ncclCommInitRank` runs on the device's server thread (where the device's CUDA context
    /// is current) and blocks until every rank has joined.
    pub fn nccl(
        device: CudaProxyDevice,
        id: [u8; UNIQUE_ID_BYTES],
        rank: usize,
        size: usize,
        timeout: Duration,
    ) -> Result<Self, CollectiveError> {
        let comm = Self::on_device_thread(&device, move || NcclCommunicator::init_rank(id, rank, size))??;
        Self::new(device, comm, timeout)
    }
}
