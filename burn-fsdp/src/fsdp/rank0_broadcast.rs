//! Wrap's first pass: rank 0's values, and this rank's shard of each trainable parameter.
//!
//! FSDP shards a model that every rank must hold identically before sharding. Burn makes that
//! easy to get wrong without any error: a model built once and cloned per rank re-runs its lazy
//! initialisers on each clone (different random weights per rank), and each rank seeding its
//! own RNG differently does the same. [`Fsdp::wrap`](crate::Fsdp::wrap) therefore replaces every
//! float tensor of the model — trainable parameters, frozen parameters and buffers — by rank 0's
//! value (PyTorch DDP's `sync_module_states`, FSDP1's `sync_module_states=True`) before it
//! slices its shards: one broadcast per tensor over the shard group, then over the replicate
//! group of an HSDP mesh.
//!
//! Tensor by tensor: a lazy parameter (Burn's `XConfig::init` makes them all lazy) is
//! materialised, broadcast, and — when trainable — cut to this rank's padded rows at once, its
//! full value dropped before the next tensor is touched. So wrapping a model fresh from
//! `XConfig::init` holds at most one full parameter at a time beside the shards (buffers and
//! frozen parameters stay whole, as FSDP keeps them).

use std::sync::Arc;

use burn::module::{Module, ModuleMapper, Param, ParamId};
use burn::tensor::Tensor;
use burn::tensor::backend::{AutodiffBackend, Backend};

use crate::comm::{CommError, ProcessGroup, Tag};
use crate::fsdp::init::ShardInit;
use crate::fsdp::param::ShardedParam;
use crate::walk::{PathStack, deferred_shape};

/// What the first pass learnt of one float tensor: id, module path, full shape, trainable.
pub(crate) type Described = (ParamId, String, Vec<usize>, bool);

/// `model` with every float tensor replaced by rank 0's value over each of `groups`, in order,
/// and every trainable one cut to rank `rank`'s padded rows of `world` (a fresh leaf); with
/// the description of every float tensor, in visiting order, each id once. Ranks whose models
/// differ in structure get a collective mismatch or timeout error, naming the tensor path,
/// instead of wrong results.
///
/// Lazy parameters that `deferred` provides are left untouched (and unread): every rank
/// produces its own rows of them from the same deterministic source.
pub(crate) fn from_rank0_sharded<B: AutodiffBackend, M: Module<B>>(
    model: M,
    groups: &[&Arc<dyn ProcessGroup<B::InnerBackend>>],
    (rank, world): (usize, usize),
    deferred: Option<&dyn ShardInit>,
) -> Result<(M, Vec<Described>), CommError> {
    let groups: Vec<_> = groups.iter().copied().filter(|g| g.size() > 1).collect();
    let mut mapper = FromRank0 {
        groups,
        rank,
        world,
        path: PathStack::default(),
        count: 0,
        error: None,
        deferred,
        described: Vec::new(),
    };
    let model = model.map(&mut mapper);
    match mapper.error {
        Some(e) => Err(e),
        None => Ok((model, mapper.described)),
    }
}

struct FromRank0<'a, I: Backend> {
    groups: Vec<&'a Arc<dyn ProcessGroup<I>>>,
    rank: usize,
    world: usize,
    path: PathStack,
    count: usize,
    /// The first failure; later tensors are left as they are.
    error: Option<CommError>,
    deferred: Option<&'a dyn ShardInit>,
    described: Vec<Described>,
}

impl<I: Backend> FromRank0<'_, I> {
    fn describe(&mut self, id: ParamId, path: String, shape: Vec<usize>, trainable: bool) {
        if !self.described.iter().any(|(seen, ..)| *seen == id) {
            self.described.push((id, path, shape, trainable));
        }
    }
}

impl<B: AutodiffBackend> ModuleMapper<B> for FromRank0<'_, B::InnerBackend> {
    fn enter_module(&mut self, name: &str, _: &str) {
        self.path.push(name);
    }

    fn exit_module(&mut self, _: &str, _: &str) {
        self.path.pop();
    }

    fn map_float<const D: usize>(&mut self, param: Param<Tensor<B, D>>) -> Param<Tensor<B, D>> {
        let path = self.path.current();
        if let Some(shape) = deferred_shape(self.deferred, &path, &param) {
            self.describe(param.id, path, shape, true);
            return param;
        }
        if self.error.is_some() {
            return param;
        }
        // Materialises a lazy parameter (this one only).
        let (id, tensor, mapper) = param.consume();
        let require_grad = tensor.is_require_grad();
        let (shape, dtype, dims) = (tensor.shape(), tensor.dtype(), tensor.dims().to_vec());
        let n = shape.num_elements();
        let mut flat = tensor.inner().reshape([n]);
        if !self.groups.is_empty() {
            let tag = Tag::new(format!("wrap:from-rank0:{}:{path}", self.count));
            self.count += 1;
            for group in &self.groups {
                match group.broadcast(flat.clone(), 0, &tag) {
                    Ok(t) => flat = t,
                    Err(e) => {
                        self.error = Some(e);
                        let t = Tensor::<B, D>::from_inner(flat.reshape(shape));
                        return Param::from_mapped_value(id, t.set_require_grad(require_grad), mapper);
                    }
                }
            }
            if flat.dtype() != dtype {
                flat = flat.cast(dtype);
            }
        }
        let full: Tensor<B::InnerBackend, D> = flat.reshape(shape);
        self.describe(id, path.clone(), dims.clone(), require_grad);
        if !require_grad {
            return Param::from_mapped_value(id, Tensor::from_inner(full), mapper);
        }
        // This rank's rows, copied out so that nothing keeps the full value alive.
        let device = full.device();
        let shard = ShardedParam::new(id, path, dims, self.world).shard_of(full, self.rank);
        let shard = Tensor::<B::InnerBackend, D>::from_data(shard.into_data(), &device);
        Param::from_mapped_value(id, Tensor::from_inner(shard).require_grad(), mapper)
    }
}
