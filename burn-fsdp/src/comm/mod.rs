//! The communicator abstraction: collectives over Burn tensors.
//!
//! A [`ProcessGroup`] is one rank's handle on a group of ranks. Every collective takes a
//! [`Tag`] naming what it is for (unit and phase); implementations check that all ranks agree
//! on the tag, turning a silently mismatched collective order into an error. Every collective
//! has a timeout: if a peer dies or stops arriving, the others get a [`CommError`] naming the
//! collective and the missing rank instead of hanging.
//!
//! This is the crate's communication layer (PyTorch's c10d): it knows nothing of FSDP, and
//! FSDP (`src/fsdp/` and the files beside it) sits on top of it.
//!
//! | file | what |
//! |---|---|
//! | `mod.rs` | [`ProcessGroup`], [`Tag`], [`CommError`], counters |
//! | [`local`] | [`LocalGroup`](local::LocalGroup): ranks as threads of one process, [`launch`](local::launch) |
//! | [`tcp`] | [`TcpGroup`](tcp::TcpGroup): one process per rank over TCP (`env://` rendezvous) |
//! | `mpi` | `MpiGroup`: one process per rank over MPI (feature `mpi`) |
//! | [`host`] | the host reductions and byte codecs the host-buffer transports share |
//! | [`mesh`] | [`DeviceMesh`](mesh::DeviceMesh): 1-D and 2-D meshes of process groups |

pub mod host;
pub mod local;
pub mod mesh;
#[cfg(feature = "mpi")]
pub mod mpi;
pub mod tcp;

use std::fmt;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::Duration;

use burn::tensor::Tensor;
use burn::tensor::backend::Backend;

/// How values from different ranks are combined.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum ReduceOp {
    /// Sum over ranks.
    Sum,
    /// Mean over ranks.
    Avg,
    /// Maximum over ranks.
    Max,
}

/// The kinds of collective, for counting and messages.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum CollectiveKind {
    /// [`ProcessGroup::all_gather`].
    AllGather,
    /// [`ProcessGroup::reduce_scatter`].
    ReduceScatter,
    /// [`ProcessGroup::all_reduce`].
    AllReduce,
    /// [`ProcessGroup::broadcast`].
    Broadcast,
    /// [`ProcessGroup::barrier`].
    Barrier,
}

impl CollectiveKind {
    /// All kinds, in counter order.
    pub const ALL: [CollectiveKind; 5] = [
        CollectiveKind::AllGather,
        CollectiveKind::ReduceScatter,
        CollectiveKind::AllReduce,
        CollectiveKind::Broadcast,
        CollectiveKind::Barrier,
    ];

    /// Index into per-kind counters.
    pub fn index(self) -> usize {
        self as usize
    }

    /// The snake-case name (`all_gather`, …).
    pub fn name(self) -> &'static str {
        match self {
            CollectiveKind::AllGather => "all_gather",
            CollectiveKind::ReduceScatter => "reduce_scatter",
            CollectiveKind::AllReduce => "all_reduce",
            CollectiveKind::Broadcast => "broadcast",
            CollectiveKind::Barrier => "barrier",
        }
    }
}

impl fmt::Display for CollectiveKind {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.name())
    }
}

/// What a collective is for: all ranks must issue collectives with equal tags in equal order.
#[derive(Debug, Clone, PartialEq, Eq, Hash)]
pub struct Tag(pub String);

impl Tag {
    /// A tag from anything printable.
    pub fn new(s: impl Into<String>) -> Self {
        Self(s.into())
    }
}

impl fmt::Display for Tag {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(&self.0)
    }
}

impl From<&str> for Tag {
    fn from(s: &str) -> Self {
        Self(s.to_owned())
    }
}

/// A failed collective.
#[derive(Debug, Clone, PartialEq, thiserror::Error)]
pub enum CommError {
    /// Some ranks did not arrive within the timeout.
    #[error("{kind} `{tag}` timed out after {timeout:?} on rank {rank}: rank(s) {missing:?} did not arrive")]
    Timeout {
        /// The collective.
        kind: CollectiveKind,
        /// Its tag.
        tag: Tag,
        /// The rank reporting.
        rank: usize,
        /// The ranks that never arrived.
        missing: Vec<usize>,
        /// The timeout.
        timeout: Duration,
    },
    /// A peer failed (panicked or returned an error) and the group was aborted.
    #[error("{kind} `{tag}` on rank {rank} aborted: rank {failed_rank} failed: {reason}")]
    PeerFailed {
        /// The collective.
        kind: CollectiveKind,
        /// Its tag.
        tag: Tag,
        /// The rank reporting.
        rank: usize,
        /// The rank that failed.
        failed_rank: usize,
        /// Why it failed.
        reason: String,
    },
    /// Ranks issued different collectives at the same point.
    #[error(
        "collective mismatch at call #{seq} on rank {rank}: this rank issued {mine}, rank {other_rank} issued {theirs}"
    )]
    Mismatch {
        /// Sequence number of the call.
        seq: u64,
        /// The rank reporting.
        rank: usize,
        /// What this rank issued (kind and tag).
        mine: String,
        /// The other rank.
        other_rank: usize,
        /// What the other rank issued.
        theirs: String,
    },
    /// The collective did not complete within the timeout and the transport cannot say
    /// which peer is missing (MPI): a peer died or stopped calling collectives.
    #[error(
        "{kind} `{tag}` on rank {rank} did not complete within {timeout:?}: a peer died or stopped issuing collectives"
    )]
    Stalled {
        /// The collective.
        kind: CollectiveKind,
        /// Its tag.
        tag: Tag,
        /// The rank reporting.
        rank: usize,
        /// The timeout.
        timeout: Duration,
    },
    /// Inputs have sizes or dtypes that cannot be combined.
    #[error("{kind} `{tag}` on rank {rank}: {msg}")]
    BadInput {
        /// The collective.
        kind: CollectiveKind,
        /// Its tag.
        tag: Tag,
        /// The rank reporting.
        rank: usize,
        /// What is wrong.
        msg: String,
    },
}

/// Number of collectives and bytes sent, per kind.
#[derive(Debug, Default)]
pub struct CommCounters {
    calls: [AtomicU64; 5],
    bytes: [AtomicU64; 5],
}

/// A snapshot of [`CommCounters`].
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct CommStats {
    /// Calls per kind (index with [`CollectiveKind::index`]).
    pub calls: [u64; 5],
    /// Bytes contributed by this rank, per kind.
    pub bytes: [u64; 5],
}

impl CommStats {
    /// Calls of one kind.
    pub fn calls(&self, kind: CollectiveKind) -> u64 {
        self.calls[kind.index()]
    }

    /// Bytes of one kind.
    pub fn bytes(&self, kind: CollectiveKind) -> u64 {
        self.bytes[kind.index()]
    }

    /// `self - earlier`, per counter.
    pub fn since(&self, earlier: &CommStats) -> CommStats {
        let mut out = *self;
        for i in 0..5 {
            out.calls[i] -= earlier.calls[i];
            out.bytes[i] -= earlier.bytes[i];
        }
        out
    }
}

impl CommCounters {
    /// Records one call of `kind` contributing `bytes`.
    pub fn record(&self, kind: CollectiveKind, bytes: u64) {
        self.calls[kind.index()].fetch_add(1, Ordering::Relaxed);
        self.bytes[kind.index()].fetch_add(bytes, Ordering::Relaxed);
    }

    /// The current values.
    pub fn snapshot(&self) -> CommStats {
        let mut s = CommStats::default();
        for i in 0..5 {
            s.calls[i] = self.calls[i].load(Ordering::Relaxed);
            s.bytes[i] = self.bytes[i].load(Ordering::Relaxed);
        }
        s
    }
}

/// One rank's handle on a group of ranks, with collectives on 1D tensors of backend `B`.
///
/// Tensors are flattened by the caller. A group of size 1 must issue no communication and
/// return its input unchanged (or as the identity of the operation).
pub trait ProcessGroup<B: Backend>: Send + Sync {
    /// This rank's index in the group.
    fn rank(&self) -> usize;
    /// Number of ranks.
    fn size(&self) -> usize;
    /// Counters of the collectives this rank issued.
    fn stats(&self) -> CommStats;

    /// Concatenation of every rank's `input` in rank order: `[n]` → `[size·n]`.
    fn all_gather(&self, input: Tensor<B, 1>, tag: &Tag) -> Result<Tensor<B, 1>, CommError>;
    /// Reduces every rank's `input` and keeps this rank's chunk: `[size·n]` → `[n]`.
    fn reduce_scatter(&self, input: Tensor<B, 1>, op: ReduceOp, tag: &Tag)
    -> Result<Tensor<B, 1>, CommError>;
    /// Reduces every rank's `input`; all ranks get the result.
    fn all_reduce(&self, input: Tensor<B, 1>, op: ReduceOp, tag: &Tag) -> Result<Tensor<B, 1>, CommError>;
    /// Every rank gets `root`'s `input`.
    fn broadcast(&self, input: Tensor<B, 1>, root: usize, tag: &Tag) -> Result<Tensor<B, 1>, CommError>;
    /// Returns once every rank has called it.
    fn barrier(&self, tag: &Tag) -> Result<(), CommError>;
    /// Marks the group failed because this rank failed: every waiting and future collective
    /// of every rank returns [`CommError::PeerFailed`].
    fn abort(&self, reason: &str);
}

/// Checks that every rank of `group` passes the same `digest` (e.g. a hash of its flags and
/// model config), so that a rank started differently is refused before any real work.
///
/// Errors on every rank with a [`CommError::BadInput`] naming `what` and the first rank that
/// differs from rank 0. [`check_items_on_all_ranks`] names which of several items differ.
pub fn check_same_on_all_ranks<B: Backend>(
    group: &dyn ProcessGroup<B>,
    what: &str,
    digest: u64,
    device: &B::Device,
) -> Result<(), CommError> {
    check_items_on_all_ranks(group, what, &[(what.to_owned(), digest)], device)
}

/// Checks that every rank of `group` passes the same digest for each named item (e.g. one
/// per flag, one for the model config, one for the data), so that a rank started
/// differently is refused before any real work.
///
/// Errors on every rank with a [`CommError::BadInput`] naming the first rank that differs
/// from rank 0 and every item in which it differs (`--lr, data`). Every rank must pass the
/// same item names in the same order (the same program); a different number of items fails
/// the all-gather itself. The digests travel as four 16-bit pieces each, in f32 (exact).
pub fn check_items_on_all_ranks<B: Backend>(
    group: &dyn ProcessGroup<B>,
    what: &str,
    items: &[(String, u64)],
    device: &B::Device,
) -> Result<(), CommError> {
    let tag = Tag::new(format!("consistency: {what}"));
    let pieces: Vec<f32> =
        items.iter().flat_map(|(_, d)| (0..4).map(move |i| ((d >> (16 * i)) & 0xffff) as f32)).collect();
    let n = pieces.len();
    let t = Tensor::<B, 1>::from_data(
        burn::tensor::TensorData::new(pieces, [n]),
        (device, burn::tensor::DType::F32),
    );
    let all = group.all_gather(t, &tag)?;
    let bad = |msg: String| CommError::BadInput {
        kind: CollectiveKind::AllGather,
        tag: tag.clone(),
        rank: group.rank(),
        msg,
    };
    let values = all.into_data().convert::<f32>().to_vec::<f32>().map_err(|e| bad(format!("{e:?}")))?;
    let digests: Vec<u64> = values
        .chunks_exact(4)
        .map(|c| c.iter().enumerate().fold(0u64, |acc, (i, v)| acc | ((*v as u64) << (16 * i))))
        .collect();
    let per_rank: Vec<&[u64]> = digests.chunks(items.len().max(1)).collect();
    let Some(r) = per_rank.iter().position(|d| *d != per_rank[0]) else {
        return Ok(());
    };
    let differ: Vec<&str> = items
        .iter()
        .enumerate()
        .filter(|(i, _)| per_rank[r].get(*i) != per_rank[0].get(*i))
        .map(|(_, (name, _))| name.as_str())
        .collect();
    Err(bad(format!(
        "rank {r} was started with different {what} than rank 0, in: {}; start every rank with the same command line and files",
        differ.join(", ")
    )))
}

/// The panic payload of a collective that failed where no `Result` can be returned: inside
/// a forward, or inside autodiff's backward (FSDP's all-gathers and reduce-scatters, tensor
/// parallelism's all-reduces).
///
/// The rank's driver catches the unwind ([`launch`](crate::launch) does) and turns it into
/// an error with [`panic_message`]; [`quiet_collective_panics`] keeps the panic hook from
/// printing a backtrace for it, so that a rank whose peer died reports one line, not a crash.
///
/// ```
/// use burn_fsdp::comm::{CollectiveFailure, panic_message, quiet_collective_panics};
///
/// quiet_collective_panics();
/// let caught = std::panic::catch_unwind(|| {
///     std::panic::panic_any(CollectiveFailure("all_gather `layer.0` aborted: rank 2 failed".into()))
/// })
/// .unwrap_err();
/// assert_eq!(panic_message(caught.as_ref()), "all_gather `layer.0` aborted: rank 2 failed");
/// ```
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct CollectiveFailure(pub String);

impl fmt::Display for CollectiveFailure {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(&self.0)
    }
}

impl CollectiveFailure {
    /// Unwinds with this failure as the payload (the panic hook stays quiet once
    /// [`quiet_collective_panics`] has run).
    pub fn raise(message: impl Into<String>) -> ! {
        std::panic::panic_any(CollectiveFailure(message.into()))
    }
}

/// Wraps the process's panic hook (once; later calls do nothing) so that it prints nothing
/// for a [`CollectiveFailure`]: that unwind is an error report on its way to the rank's
/// driver, not a bug. Every other panic is printed as before.
pub fn quiet_collective_panics() {
    static ONCE: std::sync::Once = std::sync::Once::new();
    ONCE.call_once(|| {
        let previous = std::panic::take_hook();
        std::panic::set_hook(Box::new(move |info| {
            if !info.payload().is::<CollectiveFailure>() {
                previous(info);
            }
        }));
    });
}

/// The message of a caught panic: a [`CollectiveFailure`]'s, a `panic!` string's, or
/// `"a panic without a message"`.
pub fn panic_message(payload: &(dyn std::any::Any + Send)) -> String {
    if let Some(f) = payload.downcast_ref::<CollectiveFailure>() {
        f.0.clone()
    } else if let Some(s) = payload.downcast_ref::<String>() {
        s.clone()
    } else if let Some(s) = payload.downcast_ref::<&str>() {
        (*s).to_owned()
    } else {
        "a panic without a message".to_owned()
    }
}
