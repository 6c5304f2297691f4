//! Identical replicas at wrap time: rank 0's values are the truth.
//!
//! FSDP shards a model that every rank must hold identically before sharding. Burn makes that
//! easy to get wrong without any error: a model built once and cloned per rank re-runs its lazy
//! initialisers on each clone (different random weights per rank), and each rank seeding its
//! own RNG differently does the same. [`Fsdp::wrap`](crate::Fsdp::wrap) therefore replaces every
//! float tensor of the model — trainable parameters, frozen parameters and buffers — by rank 0's
//! value (PyTorch DDP's `sync_module_states`, FSDP1's `sync_module_states=True`) before it
//! slices its shards: one broadcast per tensor over the shard group, then over the replicate
//! group of an HSDP mesh.

use std::sync::Arc;

use burn::module::{Module, ModuleMapper, Param};
use burn::tensor::Tensor;
use burn::tensor::backend::{AutodiffBackend, Backend};

use crate::comm::{CommError, ProcessGroup, Tag};
use crate::fsdp::init::ShardInit;
use crate::walk::{PathStack, deferred_shape};

/// `model` with every float tensor replaced by rank 0's value over each of `groups`, in order.
/// Ranks whose models differ in structure get a collective mismatch or timeout error, naming
/// the tensor path, instead of wrong results.
///
/// Lazy parameters that `deferred` provides are left untouched (and unread): every rank
/// produces its own rows of them from the same deterministic source.
pub(crate) fn from_rank0<B: AutodiffBackend, M: Module<B>>(
    model: M,
    groups: &[&Arc<dyn ProcessGroup<B::InnerBackend>>],
    deferred: Option<&dyn ShardInit>,
) -> Result<M, CommError> {
    let groups: Vec<_> = groups.iter().copied().filter(|g| g.size() > 1).collect();
    if groups.is_empty() {
        return Ok(model);
    }
    let mut mapper = FromRank0 { groups, path: PathStack::default(), count: 0, error: None, deferred };
    let model = model.map(&mut mapper);
    match mapper.error {
        Some(e) => Err(e),
        None => Ok(model),
    }
}

struct FromRank0<'a, I: Backend> {
    groups: Vec<&'a Arc<dyn ProcessGroup<I>>>,
    path: PathStack,
    count: usize,
    /// The first failure; later tensors are left as they are.
    error: Option<CommError>,
    deferred: Option<&'a dyn ShardInit>,
}

impl<B: AutodiffBackend> ModuleMapper<B> for FromRank0<'_, B::InnerBackend> {
    fn enter_module(&mut self, name: &str, _: &str) {
        self.path.push(name);
    }

    fn exit_module(&mut self, _: &str, _: &str) {
        self.path.pop();
    }

    fn map_float<const D: usize>(&mut self, param: Param<Tensor<B, D>>) -> Param<Tensor<B, D>> {
        if deferred_shape(self.deferred, &self.path.current(), &param).is_some() {
            return param;
        }
        let (id, tensor, mapper) = param.consume();
        if self.error.is_some() {
            return Param::from_mapped_value(id, tensor, mapper);
        }
        let require_grad = tensor.is_require_grad();
        let (shape, dtype) = (tensor.shape(), tensor.dtype());
        let n = shape.num_elements();
        let tag = Tag::new(format!("wrap:from-rank0:{}:{}", self.count, self.path.current()));
        self.count += 1;
        let mut flat = tensor.clone().inner().reshape([n]);
        for group in &self.groups {
            match group.broadcast(flat, 0, &tag) {
                Ok(t) => flat = t,
                Err(e) => {
                    self.error = Some(e);
                    return Param::from_mapped_value(id, tensor, mapper);
                }
            }
        }
        let flat = if flat.dtype() == dtype { flat } else { flat.cast(dtype) };
        let mut t = Tensor::<B, D>::from_inner(flat.reshape(shape));
        if require_grad {
            t = t.require_grad();
        }
        Param::from_mapped_value(id, t, mapper)
    }
}
