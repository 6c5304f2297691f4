//! MCCL (MetaX's collective communication library, NCCL-like) bindings: `mccl*` symbols loaded at
//! run time with `libloading` from `$MACA_PATH/lib/libmccl.so`, with the status codes mapped to
//! errors, and a typed wrapper: [`Mccl`] (the library) and [`MacaCommunicator`] (one rank of a
//! communicator).
//!
//! # Which names and signatures are verified
//!
//! *Verified* (MetaX's own MCCL adaptor in the FlagCX project, copyright MetaX, calls them with
//! these argument lists): `mcclGetVersion(int*)`, `mcclGetUniqueId(mcclUniqueId*)`,
//! `mcclGetErrorString(mcclResult_t)`, `mcclCommInitRank(mcclComm_t*, int nranks, mcclUniqueId
//! by value, int rank)`, `mcclCommDestroy(comm)`, `mcclCommCount(comm, int*)`,
//! `mcclCommUserRank(comm, int*)`, `mcclAllReduce(send, recv, count, type, op, comm, stream)`,
//! `mcclAllGather(send, recv, sendcount, type, comm, stream)`, `mcclReduceScatter(send, recv,
//! recvcount, type, op, comm, stream)`, `mcclBroadcast(send, recv, count, type, root, comm,
//! stream)`, `mcclGroupStart()`, `mcclGroupEnd()`; the result names `mcclSuccess` and
//! `mcclInvalidUsage`; and that the data-type, reduction-op and result enums convert one-to-one
//! from FlagCX's, which follow NCCL's numbering.
//!
//! *Assumed* (= NCCL): `mcclCommAbort(comm)` (optional: loaded if exported, see
//! [`MacaCommunicator::abort`]); `MCCL_UNIQUE_ID_BYTES = 128`; the numeric values of `mcclDataType_t`
//! (int8 0 … float32 7, float64 8, bfloat16 9), `mcclRedOp_t` (sum 0, prod 1, max 2, min 3, avg
//! 4) and `mcclResult_t` (see [`MCCL_RESULTS`]); the result names other than the two above.

use std::cell::Cell;
use std::ffi::{CStr, c_char, c_int, c_void};
use std::fmt;
use std::marker::PhantomData;
use std::path::{Path, PathBuf};
use std::sync::Arc;

use libloading::Library;

use crate::driver::{DevicePtr, DriverError, StreamHandle, maca_root};

/// Bytes in an `mcclUniqueId` (assumed equal to `NCCL_UNIQUE_ID_BYTES`).
pub const MCCL_UNIQUE_ID_BYTES: usize = 128;

/// The rendezvous token of a communicator: created by one rank with [`Mccl::unique_id`] and sent
/// to every other rank (out of band) before [`MacaCommunicator::init_rank`].
#[repr(C)]
#[derive(Clone, Copy, PartialEq, Eq)]
pub struct McclUniqueId {
    internal: [c_char; MCCL_UNIQUE_ID_BYTES],
}

impl fmt::Debug for McclUniqueId {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "McclUniqueId({:02x?}…)", &self.to_bytes()[..8])
    }
}

impl McclUniqueId {
    /// The token's bytes, to send to the other ranks.
    pub fn to_bytes(&self) -> [u8; MCCL_UNIQUE_ID_BYTES] {
        self.internal.map(|c| c as u8)
    }

    /// A token received from another rank.
    pub fn from_bytes(bytes: [u8; MCCL_UNIQUE_ID_BYTES]) -> Self {
        Self { internal: bytes.map(|b| b as c_char) }
    }
}

/// `mcclDataType_t` (NCCL numbering, assumed).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
#[repr(i32)]
pub enum McclDataType {
    /// `mcclInt8`.
    Int8 = 0,
    /// `mcclUint8`.
    Uint8 = 1,
    /// `mcclInt32`.
    Int32 = 2,
    /// `mcclUint32`.
    Uint32 = 3,
    /// `mcclInt64`.
    Int64 = 4,
    /// `mcclUint64`.
    Uint64 = 5,
    /// `mcclFloat16`.
    Float16 = 6,
    /// `mcclFloat32`.
    Float32 = 7,
    /// `mcclFloat64`.
    Float64 = 8,
    /// `mcclBfloat16`.
    Bfloat16 = 9,
}

impl McclDataType {
    /// Bytes per element.
    pub const fn size(self) -> usize {
        match self {
            Self::Int8 | Self::Uint8 => 1,
            Self::Float16 | Self::Bfloat16 => 2,
            Self::Int32 | Self::Uint32 | Self::Float32 => 4,
            Self::Int64 | Self::Uint64 | Self::Float64 => 8,
        }
    }
}

/// `mcclRedOp_t` (NCCL numbering, assumed).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
#[repr(i32)]
pub enum McclRedOp {
    /// `mcclSum`.
    Sum = 0,
    /// `mcclProd`.
    Prod = 1,
    /// `mcclMax`.
    Max = 2,
    /// `mcclMin`.
    Min = 3,
    /// `mcclAvg`.
    Avg = 4,
}

/// `(code, name)` of the `mcclResult_t` values (NCCL numbering; `mcclSuccess` and
/// `mcclInvalidUsage` verified by name).
pub const MCCL_RESULTS: &[(i32, &str)] = &[
    (0, "mcclSuccess"),
    (1, "mcclUnhandledCudaError"),
    (2, "mcclSystemError"),
    (3, "mcclInternalError"),
    (4, "mcclInvalidArgument"),
    (5, "mcclInvalidUsage"),
    (6, "mcclRemoteError"),
    (7, "mcclInProgress"),
];

/// An error of the MCCL layer.
#[derive(Debug, Clone, PartialEq, thiserror::Error)]
pub enum McclError {
    /// `libmccl.so` could not be opened or lacks a required symbol.
    #[error("MCCL is not available: {0}")]
    Load(DriverError),
    /// An `mccl*` call returned an error status.
    #[error("{call} failed: {name} ({code}): {message}")]
    Call {
        /// The C function.
        call: &'static str,
        /// The raw `mcclResult_t`.
        code: i32,
        /// Its name, or `"mcclResult?"` for a code this crate does not know.
        name: &'static str,
        /// `mcclGetErrorString`'s text.
        message: String,
    },
    /// An argument was rejected before calling MCCL.
    #[error("invalid MCCL argument: {0}")]
    InvalidArgument(String),
}

/// The name of an `mcclResult_t` code, if known.
pub fn mccl_result_name(code: i32) -> Option<&'static str> {
    MCCL_RESULTS.iter().find(|(c, _)| *c == code).map(|(_, n)| *n)
}

type Raw = *mut c_void;
type Status = c_int;

#[allow(non_snake_case)]
#[derive(Clone, Copy)]
struct McclApi {
    mcclGetUniqueId: unsafe extern "C" fn(*mut McclUniqueId) -> Status,
    mcclCommInitRank: unsafe extern "C" fn(*mut Raw, c_int, McclUniqueId, c_int) -> Status,
    mcclCommDestroy: unsafe extern "C" fn(Raw) -> Status,
    mcclAllReduce: unsafe extern "C" fn(*const c_void, Raw, usize, c_int, c_int, Raw, Raw) -> Status,
    mcclAllGather: unsafe extern "C" fn(*const c_void, Raw, usize, c_int, Raw, Raw) -> Status,
    mcclReduceScatter: unsafe extern "C" fn(*const c_void, Raw, usize, c_int, c_int, Raw, Raw) -> Status,
    mcclBroadcast: unsafe extern "C" fn(*const c_void, Raw, usize, c_int, c_int, Raw, Raw) -> Status,
    mcclGetErrorString: unsafe extern "C" fn(Status) -> *const c_char,
    mcclGroupStart: Option<unsafe extern "C" fn() -> Status>,
    mcclGroupEnd: Option<unsafe extern "C" fn() -> Status>,
    mcclGetVersion: Option<unsafe extern "C" fn(*mut c_int) -> Status>,
    mcclCommCount: Option<unsafe extern "C" fn(Raw, *mut c_int) -> Status>,
    mcclCommUserRank: Option<unsafe extern "C" fn(Raw, *mut c_int) -> Status>,
    mcclCommAbort: Option<unsafe extern "C" fn(Raw) -> Status>,
}

/// Resolves `name` in `lib` as a `T`.
///
/// # Safety
/// `T` must be the exact function pointer type of the symbol.
unsafe fn symbol<T: Copy>(lib: &Library, path: &Path, name: &'static str) -> Result<T, McclError> {
    // SAFETY: the caller guarantees `T` matches the symbol's type; the library outlives the copy
    // (it is kept in the same `Mccl`).
    unsafe { lib.get::<T>(name.as_bytes()) }.map(|s| *s).map_err(|_| {
        McclError::Load(DriverError::MissingSymbol { library: path.to_path_buf(), symbol: name })
    })
}

/// The MCCL library, opened at run time.
pub struct Mccl {
    path: PathBuf,
    api: McclApi,
    // Kept last so the library outlives the function pointers above.
    _library: Library,
}

impl fmt::Debug for Mccl {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("Mccl").field("path", &self.path).finish_non_exhaustive()
    }
}

impl Mccl {
    /// Opens `$MACA_PATH/lib/libmccl.so` (default `/opt/maca/lib/libmccl.so`).
    pub fn load() -> Result<Self, McclError> {
        Self::load_from(maca_root())
    }

    /// Opens `root/lib/libmccl.so`.
    pub fn load_from(root: impl AsRef<Path>) -> Result<Self, McclError> {
        let path = root.as_ref().join("lib").join("libmccl.so");
        // SAFETY: opening the library runs its initialisers; MCCL (or its mock) is trusted code
        // whose initialisers have no preconditions on this process.
        let library = unsafe { Library::new(&path) }.map_err(|e| {
            McclError::Load(DriverError::LibraryNotFound { path: path.clone(), reason: e.to_string() })
        })?;
        let p = path.as_path();
        // SAFETY: for every `symbol` call, the field type is the C prototype of the symbol of
        // that name, as listed in the module documentation.
        let api = unsafe {
            McclApi {
                mcclGetUniqueId: symbol(&library, p, "mcclGetUniqueId")?,
                mcclCommInitRank: symbol(&library, p, "mcclCommInitRank")?,
                mcclCommDestroy: symbol(&library, p, "mcclCommDestroy")?,
                mcclAllReduce: symbol(&library, p, "mcclAllReduce")?,
                mcclAllGather: symbol(&library, p, "mcclAllGather")?,
                mcclReduceScatter: symbol(&library, p, "mcclReduceScatter")?,
                mcclBroadcast: symbol(&library, p, "mcclBroadcast")?,
                mcclGetErrorString: symbol(&library, p, "mcclGetErrorString")?,
                mcclGroupStart: symbol(&library, p, "mcclGroupStart").ok(),
                mcclGroupEnd: symbol(&library, p, "mcclGroupEnd").ok(),
                mcclGetVersion: symbol(&library, p, "mcclGetVersion").ok(),
                mcclCommCount: symbol(&library, p, "mcclCommCount").ok(),
                mcclCommUserRank: symbol(&library, p, "mcclCommUserRank").ok(),
                mcclCommAbort: symbol(&library, p, "mcclCommAbort").ok(),
            }
        };
        Ok(Self { path, api, _library: library })
    }

    /// The library this was opened from.
    pub fn path(&self) -> &Path {
        &self.path
    }

    /// MCCL's own description of a result code (`mcclGetErrorString`).
    pub fn error_string(&self, code: i32) -> String {
        // SAFETY: `mcclGetErrorString` accepts any code and returns a static string or null.
        let p = unsafe { (self.api.mcclGetErrorString)(code) };
        if p.is_null() {
            return String::new();
        }
        // SAFETY: non-null, NUL-terminated, owned by the library.
        unsafe { CStr::from_ptr(p) }.to_string_lossy().into_owned()
    }

    fn check(&self, call: &'static str, code: Status) -> Result<(), McclError> {
        if code == 0 {
            return Ok(());
        }
        Err(McclError::Call {
            call,
            code,
            name: mccl_result_name(code).unwrap_or("mcclResult?"),
            message: self.error_string(code),
        })
    }

    /// Whether the library exports `mcclCommAbort` (see [`MacaCommunicator::abort`]).
    pub fn has_abort(&self) -> bool {
        self.api.mcclCommAbort.is_some()
    }

    /// The library version (`mcclGetVersion`), if it exports one.
    pub fn version(&self) -> Option<Result<i32, McclError>> {
        let f = self.api.mcclGetVersion?;
        let mut version: c_int = 0;
        // SAFETY: `version` is a valid out-pointer.
        let status = unsafe { f(&mut version) };
        Some(self.check("mcclGetVersion", status).map(|()| version))
    }

    /// A new rendezvous token (`mcclGetUniqueId`); call on one rank and share it.
    pub fn unique_id(&self) -> Result<McclUniqueId, McclError> {
        let mut id = McclUniqueId { internal: [0; MCCL_UNIQUE_ID_BYTES] };
        // SAFETY: `id` is a writable `mcclUniqueId`.
        let status = unsafe { (self.api.mcclGetUniqueId)(&mut id) };
        self.check("mcclGetUniqueId", status)?;
        Ok(id)
    }

    /// Starts a group of collectives (`mcclGroupStart`): they are issued together at
    /// [`Mccl::group_end`]. A no-op if the library does not export it.
    pub fn group_start(&self) -> Result<(), McclError> {
        let Some(f) = self.api.mcclGroupStart else { return Ok(()) };
        // SAFETY: no arguments.
        let status = unsafe { f() };
        self.check("mcclGroupStart", status)
    }

    /// Ends a group started with [`Mccl::group_start`] (`mcclGroupEnd`).
    pub fn group_end(&self) -> Result<(), McclError> {
        let Some(f) = self.api.mcclGroupEnd else { return Ok(()) };
        // SAFETY: no arguments.
        let status = unsafe { f() };
        self.check("mcclGroupEnd", status)
    }
}

/// One rank of an MCCL communicator (`mcclComm_t`); destroyed on drop.
///
/// Collectives are queued on a MACA stream, like kernels: they are `unsafe` because the buffers
/// are raw device addresses that must stay valid until the stream has run them.
///
/// The communicator can move between threads (`Send`) but is not `Sync`: MCCL, like NCCL, does
/// not allow concurrent calls on one communicator.
pub struct MacaCommunicator {
    mccl: Arc<Mccl>,
    comm: usize,
    rank: usize,
    world_size: usize,
    /// Set by [`MacaCommunicator::abort`]: the handle is gone (or leaked) and must not be used.
    aborted: bool,
    _not_sync: PhantomData<Cell<()>>,
}

impl fmt::Debug for MacaCommunicator {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("MacaCommunicator")
            .field("rank", &self.rank)
            .field("world_size", &self.world_size)
            .finish()
    }
}

fn to_c_int(what: &str, v: usize) -> Result<c_int, McclError> {
    c_int::try_from(v).map_err(|_| McclError::InvalidArgument(format!("{what} {v} out of range")))
}

impl MacaCommunicator {
    /// Joins the communicator identified by `id` as `rank` of `world_size`
    /// (`mcclCommInitRank`; blocks until every rank has joined). The calling thread's current
    /// MACA device is the one the rank uses.
    pub fn init_rank(
        mccl: Arc<Mccl>,
        world_size: usize,
        id: &McclUniqueId,
        rank: usize,
    ) -> Result<Self, McclError> {
        if world_size == 0 || rank >= world_size {
            return Err(McclError::InvalidArgument(format!("rank {rank} of a world of {world_size}")));
        }
        let nranks = to_c_int("world size", world_size)?;
        let my_rank = to_c_int("rank", rank)?;
        let mut comm: Raw = std::ptr::null_mut();
        // SAFETY: `comm` is a valid out-pointer; the id is passed by value as the API takes it.
        let status = unsafe { (mccl.api.mcclCommInitRank)(&mut comm, nranks, *id, my_rank) };
        mccl.check("mcclCommInitRank", status)?;
        Ok(Self { mccl, comm: comm as usize, rank, world_size, aborted: false, _not_sync: PhantomData })
    }

    /// As [`MacaCommunicator::init_rank`], from the id's bytes as [`Mccl::unique_id`] made them
    /// (`McclUniqueId::to_bytes`) on the rank that created it and as they were sent to this one.
    pub fn from_unique_id(
        mccl: Arc<Mccl>,
        id: [u8; MCCL_UNIQUE_ID_BYTES],
        rank: usize,
        world_size: usize,
    ) -> Result<Self, McclError> {
        Self::init_rank(mccl, world_size, &McclUniqueId::from_bytes(id), rank)
    }

    /// Whether [`MacaCommunicator::abort`] was called.
    pub fn is_aborted(&self) -> bool {
        self.aborted
    }

    /// Aborts the communicator (`mcclCommAbort`): collectives of it still queued or running on
    /// the device stop waiting for peers and complete without a meaningful result, and its
    /// resources are freed. Every later collective of this value fails with
    /// [`McclError::InvalidArgument`], and drop no longer destroys it.
    ///
    /// If the library does not export `mcclCommAbort`, the handle is only marked aborted and
    /// leaked (destroying a communicator with work in flight may wait for peers forever); queued
    /// collectives then still wait for their peers.
    pub fn abort(&mut self) -> Result<(), McclError> {
        if self.aborted {
            return Ok(());
        }
        self.aborted = true;
        let Some(f) = self.mccl.api.mcclCommAbort else { return Ok(()) };
        // SAFETY: `self.comm` came from `mcclCommInitRank`, was not destroyed or aborted before
        // (checked above), and is not used again (`aborted` is set).
        let status = unsafe { f(self.raw()) };
        self.mccl.check("mcclCommAbort", status)
    }

    fn live(&self) -> Result<(), McclError> {
        if self.aborted {
            Err(McclError::InvalidArgument("the communicator was aborted".into()))
        } else {
            Ok(())
        }
    }

    /// This rank.
    pub fn rank(&self) -> usize {
        self.rank
    }

    /// Number of ranks.
    pub fn world_size(&self) -> usize {
        self.world_size
    }

    /// The library.
    pub fn mccl(&self) -> &Arc<Mccl> {
        &self.mccl
    }

    /// `(count, rank)` as MCCL reports them (`mcclCommCount`, `mcclCommUserRank`), when exported.
    pub fn query(&self) -> Option<Result<(usize, usize), McclError>> {
        let (count_f, rank_f) = (self.mccl.api.mcclCommCount?, self.mccl.api.mcclCommUserRank?);
        if let Err(e) = self.live() {
            return Some(Err(e));
        }
        let (mut count, mut rank): (c_int, c_int) = (0, 0);
        // SAFETY: valid out-pointers; `self.comm` is a live communicator.
        let status = unsafe { count_f(self.raw(), &mut count) };
        let result = self.mccl.check("mcclCommCount", status).and_then(|()| {
            // SAFETY: as above.
            let status = unsafe { rank_f(self.raw(), &mut rank) };
            self.mccl.check("mcclCommUserRank", status)
        });
        Some(result.map(|()| (usize::try_from(count).unwrap_or(0), usize::try_from(rank).unwrap_or(0))))
    }

    fn raw(&self) -> Raw {
        self.comm as Raw
    }

    /// `recv[i] = op over ranks of send[i]`, for `count` elements (`mcclAllReduce`).
    ///
    /// # Safety
    /// `send` and `recv` hold `count` elements of `dtype` in live device memory of this rank's
    /// device (they may be equal: in place), and stay live until `stream` has run the collective.
    pub unsafe fn all_reduce(
        &self,
        send: DevicePtr,
        recv: DevicePtr,
        count: usize,
        dtype: McclDataType,
        op: McclRedOp,
        stream: StreamHandle,
    ) -> Result<(), McclError> {
        self.live()?;
        // SAFETY: the caller guarantees the buffers; the communicator is live (checked above).
        let status = unsafe {
            (self.mccl.api.mcclAllReduce)(
                send.as_raw() as *const c_void,
                recv.as_raw() as Raw,
                count,
                dtype as c_int,
                op as c_int,
                self.raw(),
                stream.as_raw() as Raw,
            )
        };
        self.mccl.check("mcclAllReduce", status)
    }

    /// Concatenates every rank's `send_count` elements into `recv` (`mcclAllGather`).
    ///
    /// # Safety
    /// `send` holds `send_count` elements and `recv` `send_count * world_size` elements of
    /// `dtype`, live until `stream` has run the collective.
    pub unsafe fn all_gather(
        &self,
        send: DevicePtr,
        recv: DevicePtr,
        send_count: usize,
        dtype: McclDataType,
        stream: StreamHandle,
    ) -> Result<(), McclError> {
        self.live()?;
        // SAFETY: the caller guarantees the buffers; the communicator is live (checked above).
        let status = unsafe {
            (self.mccl.api.mcclAllGather)(
                send.as_raw() as *const c_void,
                recv.as_raw() as Raw,
                send_count,
                dtype as c_int,
                self.raw(),
                stream.as_raw() as Raw,
            )
        };
        self.mccl.check("mcclAllGather", status)
    }

    /// Reduces `recv_count * world_size` elements across ranks and leaves this rank's
    /// `recv_count`-element slice in `recv` (`mcclReduceScatter`).
    ///
    /// # Safety
    /// `send` holds `recv_count * world_size` elements and `recv` `recv_count` elements of
    /// `dtype`, live until `stream` has run the collective.
    pub unsafe fn reduce_scatter(
        &self,
        send: DevicePtr,
        recv: DevicePtr,
        recv_count: usize,
        dtype: McclDataType,
        op: McclRedOp,
        stream: StreamHandle,
    ) -> Result<(), McclError> {
        self.live()?;
        // SAFETY: the caller guarantees the buffers; the communicator is live (checked above).
        let status = unsafe {
            (self.mccl.api.mcclReduceScatter)(
                send.as_raw() as *const c_void,
                recv.as_raw() as Raw,
                recv_count,
                dtype as c_int,
                op as c_int,
                self.raw(),
                stream.as_raw() as Raw,
            )
        };
        self.mccl.check("mcclReduceScatter", status)
    }

    /// Copies `count` elements from `send` on rank `root` to `recv` on every rank
    /// (`mcclBroadcast`).
    ///
    /// # Safety
    /// `send` (read on the root only) and `recv` hold `count` elements of `dtype`, live until
    /// `stream` has run the collective.
    pub unsafe fn broadcast(
        &self,
        send: DevicePtr,
        recv: DevicePtr,
        count: usize,
        dtype: McclDataType,
        root: usize,
        stream: StreamHandle,
    ) -> Result<(), McclError> {
        self.live()?;
        if root >= self.world_size {
            return Err(McclError::InvalidArgument(format!("root {root} of a world of {}", self.world_size)));
        }
        let root = to_c_int("root", root)?;
        // SAFETY: the caller guarantees the buffers; the communicator is live.
        let status = unsafe {
            (self.mccl.api.mcclBroadcast)(
                send.as_raw() as *const c_void,
                recv.as_raw() as Raw,
                count,
                dtype as c_int,
                root,
                self.raw(),
                stream.as_raw() as Raw,
            )
        };
        self.mccl.check("mcclBroadcast", status)
    }
}

impl Drop for MacaCommunicator {
    fn drop(&mut self) {
        if self.aborted {
            return;
        }
        // SAFETY: `self.comm` came from `mcclCommInitRank`, was not aborted (checked above), and
        // is destroyed once.
        let _ = unsafe { (self.mccl.api.mcclCommDestroy)(self.raw()) };
    }
}
