//! The parameter group ("unit"): the parameters gathered by one all-gather and reduced by one
//! reduce-scatter, laid out in one flat buffer.

use std::sync::Arc;

use burn::module::ParamId;
use burn::tensor::backend::Backend;

use crate::fsdp::collectives::UnitComm;
use crate::fsdp::param::ShardedParam;

/// One FSDP unit: its parameters, their offsets in the flat shard, and its communicator.
///
/// The flat shard of a rank is the concatenation of its padded parameter shards in unit
/// order; the all-gathered buffer is `[world, shard_len]`, row `r` being rank `r`'s flat shard.
#[derive(Debug)]
pub struct ParamGroup<B: Backend> {
    /// Module path of the unit (`""` for the root unit).
    pub name: String,
    /// The unit's parameters, in visiting order.
    pub params: Vec<ShardedParam>,
    /// Offset of each parameter in the flat shard.
    pub offsets: Vec<usize>,
    /// Whether gathered parameters are freed after forward and re-gathered in backward.
    pub reshard_after_forward: bool,
    /// Collectives of the unit.
    pub(crate) comm: Arc<UnitComm<B>>,
}

impl<B: Backend> ParamGroup<B> {
    /// Elements of the rank's flat shard.
    pub fn shard_len(&self) -> usize {
        self.comm.shard_len
    }

    /// Elements of the unsharded parameters.
    pub fn numel(&self) -> usize {
        self.params.iter().map(ShardedParam::numel).sum()
    }

    /// Position of parameter `id` in the unit.
    pub fn index_of(&self, id: ParamId) -> Option<usize> {
        self.params.iter().position(|p| p.id == id)
    }
}
