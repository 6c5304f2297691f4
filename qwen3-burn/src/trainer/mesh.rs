//! How the ranks of a run are laid out ([`Topology`]), each rank's process groups
//! ([`RankGroups`]), and a whole job of in-process ranks ([`train_in_process`]).

use std::sync::Arc;

use burn::tensor::backend::Backend;
use burn_fsdp::{CommError, LocalGroup, ProcessGroup, launch};

use super::{InitialWeights, Parallelism, StepMetrics, TrainError, TrainOptions, TrainSink, train};
use crate::Qwen3Config;
use crate::train::Batches;

/// How the ranks of a run are arranged.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Topology {
    /// FSDP over all ranks.
    Flat(usize),
    /// FSDP over `dp` data-parallel ranks of `tp`-way tensor-parallel slices.
    DpTp {
        /// Data-parallel degree.
        dp: usize,
        /// Tensor-parallel degree.
        tp: usize,
    },
    /// Hybrid sharding (FSDP2's HSDP): parameters sharded over `shard` ranks, replicated over
    /// `replicate` such groups.
    Hsdp {
        /// Replica groups.
        replicate: usize,
        /// Ranks per shard group.
        shard: usize,
    },
}

impl Topology {
    /// Sizes of the mesh's `(outer, inner)` dimensions (`(1, W)` when flat).
    pub fn dims(self) -> (usize, usize) {
        match self {
            Topology::Flat(w) => (1, w),
            Topology::DpTp { dp, tp } => (dp, tp),
            Topology::Hsdp { replicate, shard } => (replicate, shard),
        }
    }

    /// All ranks.
    pub fn world(self) -> usize {
        let (a, b) = self.dims();
        a * b
    }

    /// Ranks each FSDP unit is sharded over: the world when flat, `dp` with tensor
    /// parallelism (FSDP runs over the data-parallel dimension), `shard` for HSDP.
    pub fn shard_world(self) -> usize {
        match self {
            Topology::Flat(w) => w,
            Topology::DpTp { dp, .. } => dp,
            Topology::Hsdp { shard, .. } => shard,
        }
    }

    /// Ranks that see different data (the batch is split across them).
    pub fn data_world(self) -> usize {
        match self {
            Topology::DpTp { dp, .. } => dp,
            other => other.world(),
        }
    }

    /// Which slice of the batch rank `rank` (global, row-major) trains on.
    pub fn data_rank(self, rank: usize) -> usize {
        match self {
            Topology::DpTp { tp, .. } => rank / tp,
            _ => rank,
        }
    }
}

/// A rank's handles on its mesh: for a flat run the world group only; for a 2D mesh the
/// `(dp, tp)` or `(replicate, shard)` groups.
pub struct RankGroups<B: Backend> {
    /// The layout.
    pub topology: Topology,
    /// This rank's global index (row-major over the mesh).
    pub rank: usize,
    /// Flat: the world group. 2D: the outer dimension's group (dp or replicate).
    pub outer: Arc<dyn ProcessGroup<B>>,
    /// 2D: the inner dimension's group (tp or shard).
    pub inner: Option<Arc<dyn ProcessGroup<B>>>,
    /// In-process 2D meshes: the world group, for a barrier before each backward. Burn's
    /// autodiff cleans up after a backward by locking every graph of the process, so a rank
    /// thread that finished its backward waits for the other threads' backwards; without the
    /// barrier, ranks that sync only through sub-groups can drift a micro-batch apart and
    /// deadlock on that lock (one process per rank, as with MPI, needs no gate).
    pub gate: Option<Arc<dyn ProcessGroup<B>>>,
    /// The device this rank computes on.
    pub device: B::Device,
}

/// A process rank's mesh groups from its world group: the world itself for a flat run, else
/// its row and column of the mesh split from the world with `split(color, key)`
/// (`MPI_Comm_split` semantics; row-major: rank = outer · inner_size + inner). The device is
/// the backend's default.
pub fn split_mesh<B, G>(
    topology: Topology,
    rank: usize,
    world: Arc<G>,
    split: impl Fn(&G, u32, u32) -> Result<Arc<G>, CommError>,
) -> Result<RankGroups<B>, TrainError>
where
    B: Backend,
    G: ProcessGroup<B> + 'static,
{
    let (outer, inner): (Arc<dyn ProcessGroup<B>>, _) = match topology {
        Topology::Flat(_) => (world, None),
        _ => {
            let (_, i) = topology.dims();
            let (a, b) = (rank / i, rank % i);
            let err = |e: CommError| TrainError::Invalid(format!("splitting the job into the mesh: {e}"));
            let inner: Arc<dyn ProcessGroup<B>> = split(&world, a as u32, b as u32).map_err(err)?;
            (split(&world, b as u32, a as u32).map_err(err)?, Some(inner))
        }
    };
    Ok(RankGroups { topology, rank, outer, inner, gate: None, device: Default::default() })
}

/// [`train`] over `topology.world()` in-process ranks (threads), rank `r` on device
/// `device_of(r)`; each rank trains on its slice of every step's batch. Returns rank 0's
/// metrics, or the error of the rank that failed first (its peers stop within their current
/// collective, [`TrainOptions::timeout`] at the latest).
pub fn train_in_process<B: Backend>(
    topology: Topology,
    config: &Qwen3Config,
    weights: &InitialWeights,
    batches: &Batches,
    options: &TrainOptions,
    sink: &dyn TrainSink,
    device_of: impl Fn(usize) -> B::Device + Sync,
) -> Result<Vec<StepMetrics>, TrainError> {
    use std::panic::{AssertUnwindSafe, catch_unwind, resume_unwind};
    let timeout = options.timeout;
    let rank_train = |groups: RankGroups<B>| {
        train::<B>(Parallelism::Sharded(groups), config, weights, batches, options, sink)
    };
    let results = match topology {
        Topology::Flat(world) => launch(world, timeout, |group| {
            let rank = group.rank();
            rank_train(RankGroups {
                topology,
                rank,
                outer: group,
                inner: None,
                gate: None,
                device: device_of(rank),
            })
        }),
        _ => {
            let (o, i) = topology.dims();
            // One inner group per outer index (rows of the mesh), one outer group per inner
            // index (columns).
            let rows: Vec<_> = (0..o).map(|_| LocalGroup::new_group(i, timeout)).collect();
            let cols: Vec<_> = (0..i).map(|_| LocalGroup::new_group(o, timeout)).collect();
            launch(topology.world(), timeout, |group| {
                let rank = group.rank();
                let (a, b) = (rank / i, rank % i);
                let (outer, inner) = (cols[b][a].clone(), rows[a][b].clone());
                let groups = RankGroups::<B> {
                    topology,
                    rank,
                    outer: outer.clone(),
                    inner: Some(inner.clone()),
                    gate: Some(group.clone()),
                    device: device_of(rank),
                };
                // A failing rank aborts its mesh groups too, so that no peer waits for it.
                let fail = |why: &str| {
                    outer.fail(why);
                    inner.fail(why);
                };
                match catch_unwind(AssertUnwindSafe(|| rank_train(groups))) {
                    Ok(Ok(v)) => Ok(v),
                    Ok(Err(e)) => {
                        fail(&format!("rank {rank}: {}", error_chain(&e)));
                        Err(e)
                    }
                    Err(p) => {
                        fail(&format!("rank {rank} panicked"));
                        resume_unwind(p)
                    }
                }
            })
        }
    }?;
    results.into_iter().next().ok_or_else(|| TrainError::Invalid("no rank ran".into()))
}

/// An error and its sources, `: `-separated (as `anyhow`'s `{:#}`).
pub(crate) fn error_chain(e: &dyn std::error::Error) -> String {
    let mut out = e.to_string();
    let mut source = e.source();
    while let Some(s) = source {
        out.push_str(": ");
        out.push_str(&s.to_string());
        source = s.source();
    }
    out
}
