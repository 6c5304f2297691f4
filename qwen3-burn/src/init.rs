//! Reproducible, shardable initialisation: the same values on one device and, shard by shard,
//! on any number of FSDP ranks.
//!
//! [`Qwen3Init`] is HF's Qwen3 initialisation (normal(0, 0.02) weights, norms at one) drawn
//! from a counter-based generator ([`seeded_normal`]): every value depends only on the seed,
//! the parameter's HF name and its index. [`Qwen3Config::init_seeded`] builds a single-device
//! model from it (lazily: nothing is allocated before first use), and the same
//! [`Qwen3Init`] given to [`Fsdp::wrap_deferred`](burn_fsdp::Fsdp::wrap_deferred) makes each
//! rank create only its own rows, so FSDP at any world size starts exactly where the single
//! device starts. [`HfWeights`](crate::checkpoint::HfWeights) is the other source of shards:
//! the rows of a checkpoint, read from the memory-mapped files.
//!
//! [`Qwen3Config::init_seeded`]: crate::Qwen3Config::init_seeded

use std::ops::Range;

use burn::module::{Param, ParamId};
use burn::tensor::backend::Backend;
use burn::tensor::{Shape, Tensor, TensorData};
use burn_fsdp::init::{InitError, ShardInit, seeded_normal};

/// Standard deviation of HF's Qwen3 weight initialisation (`initializer_range`).
pub const INIT_STD: f64 = 0.02;

/// HF's Qwen3 initialisation from a seed: RMSNorm weights (`*norm.weight`) at one, every other
/// weight normal(0, [`INIT_STD`]), each value a pure function of `(seed, name, index)`.
///
/// # Example
///
/// ```
/// use qwen3_burn::init::Qwen3Init;
/// use burn_fsdp::init::ShardInit;
///
/// let init = Qwen3Init::new(3);
/// let shape = [8, 4];
/// let whole = init.rows("model.layers.0.mlp.up_proj.weight", &shape, 0..8).unwrap();
/// let tail = init.rows("model.layers.0.mlp.up_proj.weight", &shape, 6..8).unwrap();
/// assert_eq!(&whole[24..], &tail[..]);
/// assert_eq!(init.rows("model.norm.weight", &[4], 0..4).unwrap(), vec![1.0; 4]);
/// ```
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Qwen3Init {
    /// The seed.
    pub seed: u64,
}

impl Qwen3Init {
    /// The initialisation of seed `seed`.
    pub fn new(seed: u64) -> Self {
        Self { seed }
    }

    /// Whether the parameter named `name` is an RMSNorm weight (initialised to one).
    pub fn is_norm(name: &str) -> bool {
        name.ends_with("norm.weight")
    }

    /// Rows `rows` of parameter `name` of full shape `shape`, row-major.
    pub fn values(&self, name: &str, shape: &[usize], rows: Range<usize>) -> Vec<f32> {
        let row: usize = shape.iter().skip(1).product();
        if Self::is_norm(name) {
            return vec![1.0; rows.len() * row];
        }
        seeded_normal(self.seed, name, rows.start * row..rows.end * row, 0.0, INIT_STD)
    }

    /// A lazy parameter named `name`: its values ([`values`](Self::values), all rows) are made
    /// on first use, so a model about to be sharded by
    /// [`Fsdp::wrap_deferred`](burn_fsdp::Fsdp::wrap_deferred) never allocates them.
    pub fn param<B: Backend, const D: usize>(
        &self,
        name: &str,
        shape: [usize; D],
        device: &B::Device,
    ) -> Param<Tensor<B, D>> {
        let (init, name_owned) = (*self, name.to_owned());
        Param::uninitialized(
            ParamId::new(),
            move |device, require_grad| {
                let values = init.values(&name_owned, &shape, 0..shape.first().copied().unwrap_or(1));
                let t = Tensor::from_data(TensorData::new(values, shape), device);
                if require_grad { t.require_grad() } else { t }
            },
            device.clone(),
            true,
            Shape::from(shape),
        )
    }
}

/// Every parameter of a Qwen3 model, by HF name.
impl ShardInit for Qwen3Init {
    fn provides(&self, _path: &str, _shape: &[usize]) -> bool {
        true
    }

    fn rows(&self, path: &str, shape: &[usize], rows: Range<usize>) -> Result<Vec<f32>, InitError> {
        Ok(self.values(path, shape, rows))
    }
}
