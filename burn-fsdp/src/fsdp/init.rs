//! Deferred initialisation: each rank creates only its own shards.
//!
//! [`Fsdp::wrap`](crate::Fsdp::wrap) takes a model whose every rank holds the whole of it, then
//! slices. For a large model that is W full copies in one process (in-process ranks) and a
//! full copy per rank otherwise. [`Fsdp::wrap_deferred`](crate::Fsdp::wrap_deferred) is
//! PyTorch FSDP2's meta-device flow instead (`fully_shard` on a model built on `meta`, then
//! `init_weights`/`load_state_dict` per shard): the model is built with Burn's *lazy*
//! parameters ([`Param::uninitialized`](burn::module::Param::uninitialized), which allocate
//! nothing until first read), and a [`ShardInit`] produces, for each parameter, only the rows
//! of dim 0 that this rank holds. The lazy initialisers of the parameters it provides never
//! run.
//!
//! A [`ShardInit`] must be a pure function of the parameter and the rows: every rank asks for
//! different rows of the same tensor, and the shards together must be the tensor a single
//! device would hold. [`seeded_normal`] is a random initialiser with that property (a
//! counter-based generator: element `i` of a parameter depends only on the seed, the
//! parameter's name and `i`), so a model initialised by it on one device and the same model
//! initialised shard by shard on W ranks start bit-identical. Checkpoint readers read the rows
//! from the file (safetensors are memory-mapped: [`SafetensorsFile::read_rows_f32`]).
//!
//! [`SafetensorsFile::read_rows_f32`]: crate::io::SafetensorsFile::read_rows_f32

use std::ops::Range;

/// The error a [`ShardInit`] returns; [`FsdpError::Init`](crate::FsdpError::Init) names the
/// parameter.
pub type InitError = Box<dyn std::error::Error + Send + Sync>;

/// Values of the rows of parameters, for [`Fsdp::wrap_deferred`](crate::Fsdp::wrap_deferred).
///
/// # Example
///
/// Ones for every norm weight, a seeded normal elsewhere (what a transformer's own
/// initialiser would do), provided for every parameter:
///
/// ```
/// use burn_fsdp::init::{InitError, ShardInit, seeded_normal};
///
/// struct MyInit { seed: u64 }
///
/// impl ShardInit for MyInit {
///     fn provides(&self, _path: &str, _shape: &[usize]) -> bool {
///         true
///     }
///     fn rows(&self, path: &str, shape: &[usize], rows: std::ops::Range<usize>) -> Result<Vec<f32>, InitError> {
///         let row: usize = shape[1..].iter().product();
///         if path.ends_with("norm.weight") {
///             return Ok(vec![1.0; rows.len() * row]);
///         }
///         Ok(seeded_normal(self.seed, path, rows.start * row..rows.end * row, 0.0, 0.02))
///     }
/// }
///
/// let init = MyInit { seed: 7 };
/// let all = init.rows("w", &[4, 3], 0..4).unwrap();
/// // Any split of the rows gives the same values as the whole.
/// let halves = [init.rows("w", &[4, 3], 0..2).unwrap(), init.rows("w", &[4, 3], 2..4).unwrap()].concat();
/// assert_eq!(all, halves);
/// ```
pub trait ShardInit: Send + Sync {
    /// Whether this source gives the values of the lazy parameter `path` (module path, e.g.
    /// `model.layers.0.mlp.up_proj.weight`) of full shape `shape`. A parameter it does not
    /// provide is materialised by its own initialiser and handled as by
    /// [`Fsdp::wrap`](crate::Fsdp::wrap) (broadcast from rank 0, then sliced); so are
    /// parameters already initialised. Every parameter provided is trainable: return `false`
    /// for frozen ones.
    fn provides(&self, path: &str, shape: &[usize]) -> bool;

    /// Rows `rows` of dim 0 of parameter `path` of full shape `shape`, row-major `f32`:
    /// `rows.len() · shape[1..].product()` values. `rows` may be empty (a rank past the end of
    /// a short parameter holds only padding).
    fn rows(&self, path: &str, shape: &[usize], rows: Range<usize>) -> Result<Vec<f32>, InitError>;
}

/// Elements `range` of the flattened parameter `key` drawn from `normal(mean, std)` with a
/// counter-based generator: each value depends only on `(seed, key, index)`, so any slice is
/// the same as slicing the whole, on any number of ranks, in any order.
///
/// Each element takes two 64-bit outputs of SplitMix64 at counter positions derived from the
/// seed, an FNV-1a hash of `key` and the index, and turns them into one normal value by
/// Box–Muller (in `f64`, rounded once to `f32`).
///
/// ```
/// use burn_fsdp::init::seeded_normal;
///
/// let whole = seeded_normal(1, "w", 0..1000, 0.0, 1.0);
/// assert_eq!(&whole[250..750], &seeded_normal(1, "w", 250..750, 0.0, 1.0)[..]);
/// let mean = whole.iter().map(|&x| x as f64).sum::<f64>() / 1000.0;
/// assert!(mean.abs() < 0.1);
/// assert_ne!(whole, seeded_normal(2, "w", 0..1000, 0.0, 1.0));
/// ```
pub fn seeded_normal(seed: u64, key: &str, range: Range<usize>, mean: f64, std: f64) -> Vec<f32> {
    let base = splitmix64(seed ^ fnv1a(key.as_bytes()));
    range
        .map(|i| {
            let c = base.wrapping_add((i as u64).wrapping_mul(2));
            let (a, b) = (splitmix64(c), splitmix64(c.wrapping_add(1)));
            // u1 in (0, 1] (never 0, so ln is finite), u2 in [0, 1).
            let u1 = ((a >> 11) + 1) as f64 * (1.0 / (1u64 << 53) as f64);
            let u2 = (b >> 11) as f64 * (1.0 / (1u64 << 53) as f64);
            let z = (-2.0 * u1.ln()).sqrt() * (std::f64::consts::TAU * u2).cos();
            (mean + std * z) as f32
        })
        .collect()
}

/// SplitMix64's output function at counter `x` (Steele, Lea & Flood 2014).
fn splitmix64(x: u64) -> u64 {
    let mut z = x.wrapping_add(0x9E37_79B9_7F4A_7C15);
    z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
    z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
    z ^ (z >> 31)
}

/// 64-bit FNV-1a.
fn fnv1a(bytes: &[u8]) -> u64 {
    bytes.iter().fold(0xCBF2_9CE4_8422_2325, |h, &b| (h ^ b as u64).wrapping_mul(0x0000_0100_0000_01B3))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn seeded_normal_has_the_moments_of_its_distribution() {
        let v = seeded_normal(42, "model.layers.0.mlp.up_proj.weight", 0..200_000, 0.5, 2.0);
        let n = v.len() as f64;
        let mean = v.iter().map(|&x| x as f64).sum::<f64>() / n;
        let var = v.iter().map(|&x| (x as f64 - mean).powi(2)).sum::<f64>() / n;
        // Standard errors: 2/sqrt(n) ≈ 0.0045 for the mean, ≈ 0.013 for the variance of 4.
        assert!((mean - 0.5).abs() < 0.02, "mean {mean}");
        assert!((var - 4.0).abs() < 0.06, "variance {var}");
        let within_one = v.iter().filter(|&&x| (x as f64 - 0.5).abs() < 2.0).count() as f64 / n;
        assert!((within_one - 0.6827).abs() < 0.005, "P(|z| < 1) = {within_one}");
    }

    #[test]
    fn different_keys_give_different_streams() {
        let a = seeded_normal(0, "a.weight", 0..64, 0.0, 1.0);
        let b = seeded_normal(0, "b.weight", 0..64, 0.0, 1.0);
        assert_ne!(a, b);
        assert_eq!(a, seeded_normal(0, "a.weight", 0..64, 0.0, 1.0));
    }
}
