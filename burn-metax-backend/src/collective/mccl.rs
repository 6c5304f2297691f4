//! [`DeviceCommunicator`] for MCCL's [`MacaCommunicator`], and the unique id as bytes.

use super::{CollectiveError, CommDType, CommOp, DeviceCommunicator, UNIQUE_ID_BYTES};
use crate::driver::{DevicePtr, StreamHandle};
use crate::mccl::{MacaCommunicator, Mccl, McclDataType, McclRedOp};

/// A new MCCL unique id (`mcclGetUniqueId`), as the bytes to send to the other ranks.
pub fn mccl_unique_id(mccl: &Mccl) -> Result<[u8; UNIQUE_ID_BYTES], CollectiveError> {
    Ok(mccl.unique_id()?.to_bytes())
}

fn data_type(dtype: CommDType) -> McclDataType {
    match dtype {
        CommDType::F16 => McclDataType::Float16,
        CommDType::BF16 => McclDataType::Bfloat16,
        CommDType::F32 => McclDataType::Float32,
        CommDType::F64 => McclDataType::Float64,
    }
}

fn red_op(op: CommOp) -> McclRedOp {
    match op {
        CommOp::Sum => McclRedOp::Sum,
        CommOp::Avg => McclRedOp::Avg,
        CommOp::Max => McclRedOp::Max,
    }
}

impl DeviceCommunicator for MacaCommunicator {
    fn library(&self) -> &'static str {
        "MCCL"
    }

    fn rank(&self) -> usize {
        MacaCommunicator::rank(self)
    }

    fn size(&self) -> usize {
        self.world_size()
    }

    unsafe fn all_gather(
        &self,
        send: DevicePtr,
        recv: DevicePtr,
        send_count: usize,
        dtype: CommDType,
        stream: StreamHandle,
    ) -> Result<(), CollectiveError> {
        // SAFETY: the caller upholds this trait method's contract, which is the inherent one's.
        unsafe { MacaCommunicator::all_gather(self, send, recv, send_count, data_type(dtype), stream) }
            .map_err(Into::into)
    }

    unsafe fn reduce_scatter(
        &self,
        send: DevicePtr,
        recv: DevicePtr,
        recv_count: usize,
        dtype: CommDType,
        op: CommOp,
        stream: StreamHandle,
    ) -> Result<(), CollectiveError> {
        // SAFETY: as in `all_gather`.
        unsafe {
            MacaCommunicator::reduce_scatter(
                self,
                send,
                recv,
                recv_count,
                data_type(dtype),
                red_op(op),
                stream,
            )
        }
        .map_err(Into::into)
    }

    unsafe fn all_reduce(
        &self,
        send: DevicePtr,
        recv: DevicePtr,
        count: usize,
        dtype: CommDType,
        op: CommOp,
        stream: StreamHandle,
    ) -> Result<(), CollectiveError> {
        // SAFETY: as in `all_gather`.
        unsafe { MacaCommunicator::all_reduce(self, send, recv, count, data_type(dtype), red_op(op), stream) }
            .map_err(Into::into)
    }

    unsafe fn broadcast(
        &self,
        send: DevicePtr,
        recv: DevicePtr,
        count: usize,
        dtype: CommDType,
        root: usize,
        stream: StreamHandle,
    ) -> Result<(), CollectiveError> {
        // SAFETY: as in `all_gather`.
        unsafe { MacaCommunicator::broadcast(self, send, recv, count, data_type(dtype), root, stream) }
            .map_err(Into::into)
    }

    fn abort(&mut self) -> Result<(), CollectiveError> {
        MacaCommunicator::abort(self).map_err(Into::into)
    }
}
