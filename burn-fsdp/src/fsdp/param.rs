//! The sharded parameter: how one parameter is split on dim 0 across the ranks.

use burn::module::ParamId;
use burn::tensor::backend::Backend;
use burn::tensor::{Shape, Tensor};

/// One parameter sharded on dim 0, FSDP2 style: `world` chunks of `ceil(d0 / world)` rows,
/// the last ones padded with zeros (a rank past the end holds only padding).
///
/// The local shard `[rows_per_rank, rest…]` is the trainable leaf the optimizer sees. Its
/// padding rows get zero gradients, so AdamW (and weight decay) keeps them at zero.
#[derive(Debug, Clone, PartialEq)]
pub struct ShardedParam {
    /// The parameter's id (the same in the full and the sharded module).
    pub id: ParamId,
    /// Module path, e.g. `model.layers.0.self_attn.q_proj.weight`.
    pub path: String,
    /// Unsharded shape.
    pub global_shape: Vec<usize>,
    /// Rows of dim 0 per rank, padding included.
    pub rows_per_rank: usize,
    /// Number of ranks the parameter is sharded over.
    pub world: usize,
}

impl ShardedParam {
    /// Describes `global_shape` sharded over `world` ranks.
    pub fn new(id: ParamId, path: String, global_shape: Vec<usize>, world: usize) -> Self {
        let d0 = global_shape.first().copied().unwrap_or(1);
        let rows_per_rank = d0.div_ceil(world.max(1));
        Self { id, path, global_shape, rows_per_rank, world }
    }

    /// Elements of one row (the product of the dims after dim 0).
    pub fn row_numel(&self) -> usize {
        self.global_shape.iter().skip(1).product()
    }

    /// Elements of the unsharded parameter.
    pub fn numel(&self) -> usize {
        self.global_shape.iter().product()
    }

    /// Elements of one rank's (padded) shard.
    pub fn shard_numel(&self) -> usize {
        self.rows_per_rank * self.row_numel()
    }

    /// Shape of the padded local shard.
    pub fn shard_shape(&self) -> Vec<usize> {
        let mut s = self.global_shape.clone();
        if let Some(d0) = s.first_mut() {
            *d0 = self.rows_per_rank;
        }
        s
    }

    /// Rows of the unsharded parameter that `rank` holds (without padding). A 0-d parameter
    /// is one row.
    pub fn rows_of(&self, rank: usize) -> std::ops::Range<usize> {
        let d0 = self.global_shape.first().copied().unwrap_or(1);
        let start = (rank * self.rows_per_rank).min(d0);
        let end = ((rank + 1) * self.rows_per_rank).min(d0);
        start..end
    }

    /// Cuts `rank`'s padded shard out of the full tensor.
    ///
    /// # Shapes
    /// - full: `global_shape`
    /// - output: `shard_shape()`
    pub fn shard_of<B: Backend, const D: usize>(&self, full: Tensor<B, D>, rank: usize) -> Tensor<B, D> {
        let rows = self.rows_of(rank);
        let have = rows.len();
        let device = full.device();
        let dtype = full.dtype();
        let mut pad_shape = self.shard_shape();
        pad_shape[0] = self.rows_per_rank - have;
        let pad = || Tensor::<B, D>::zeros(Shape::from(pad_shape.clone()), &device).cast(dtype);
        if have == 0 {
            return pad();
        }
        let part = full.narrow(0, rows.start, have);
        if have == self.rows_per_rank { part } else { Tensor::cat(vec![part, pad()], 0) }
    }

    /// Rebuilds the full parameter from every rank's shard, given as rows of `gathered`.
    ///
    /// # Shapes
    /// - gathered: `[world, shard_numel()]` (this parameter's columns of the unit buffer)
    /// - output: `global_shape`
    pub fn unshard<B: Backend, const D: usize>(&self, gathered: Tensor<B, 2>) -> Tensor<B, D> {
        let mut padded = self.global_shape.clone();
        padded[0] = self.rows_per_rank * self.world;
        let full = gathered.reshape::<D, _>(Shape::from(padded));
        if self.rows_per_rank * self.world == self.global_shape[0] {
            full
        } else {
            full.narrow(0, 0, self.global_shape[0])
        }
    }
}

impl ShardedParam {
    /// [`unshard`](Self::unshard), flattened: `[world, shard_numel()]` → `[numel()]`.
    pub fn unshard_flat<B: Backend>(&self, gathered: Tensor<B, 2>) -> Tensor<B, 1> {
        let padded = self.world * self.shard_numel();
        let flat = gathered.reshape([padded]);
        if padded == self.numel() { flat } else { flat.narrow(0, 0, self.numel()) }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use burn::backend::NdArray;

    #[test]
    fn uneven_rows_are_padded_and_round_trip() {
        let device = Default::default();
        for world in 1..=8 {
            for d0 in [1usize, 2, 3, 7, 16, 17] {
                let p = ShardedParam::new(ParamId::new(), "w".into(), vec![d0, 3], world);
                let full = Tensor::<NdArray, 2>::from_data(
                    burn::tensor::TensorData::new((0..d0 * 3).map(|x| x as f32).collect::<Vec<_>>(), [d0, 3]),
                    &device,
                );
                let shards: Vec<Tensor<NdArray, 1>> =
                    (0..world).map(|r| p.shard_of(full.clone(), r).reshape([p.shard_numel()])).collect();
                let total: usize = (0..world).map(|r| p.rows_of(r).len()).sum();
                assert_eq!(total, d0);
                let gathered = Tensor::cat(shards, 0).reshape([world, p.shard_numel()]);
                let back: Tensor<NdArray, 2> = p.unshard(gathered);
                assert_eq!(back.into_data(), full.clone().into_data(), "world {world} d0 {d0}");
            }
        }
    }
}
