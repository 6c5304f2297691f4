//! Greedy and temperature sampling with a KV cache.

use burn::tensor::backend::Backend;
use burn::tensor::{Int, Tensor, TensorData};

use crate::model::{KvCache, Qwen3};

/// How to pick the next token.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct Sampling {
    /// `0` means greedy (argmax); otherwise logits are divided by it before sampling.
    pub temperature: f64,
    /// Seed of the sampler (ignored when greedy).
    pub seed: u64,
}

impl Default for Sampling {
    fn default() -> Self {
        Self { temperature: 0.0, seed: 0 }
    }
}

/// A small xorshift generator, so that sampling is reproducible on every backend.
struct Rng(u64);

impl Rng {
    fn next_f64(&mut self) -> f64 {
        self.0 ^= self.0 << 13;
        self.0 ^= self.0 >> 7;
        self.0 ^= self.0 << 17;
        (self.0 >> 11) as f64 / (1u64 << 53) as f64
    }
}

fn pick(logits: &[f32], sampling: &Sampling, rng: &mut Rng) -> u32 {
    let argmax = || {
        logits.iter().enumerate().fold((0usize, f32::NEG_INFINITY), |best, (i, &v)| if v > best.1 { (i, v) } else { best }).0
    };
    if sampling.temperature <= 0.0 {
        return argmax() as u32;
    }
    let max = logits.iter().copied().fold(f32::NEG_INFINITY, f32::max) as f64;
    let weights: Vec<f64> = logits.iter().map(|&v| ((v as f64 - max) / sampling.temperature).exp()).collect();
    let total: f64 = weights.iter().sum();
    let mut r = rng.next_f64() * total;
    for (i, w) in weights.iter().enumerate() {
        r -= w;
        if r <= 0.0 {
            return i as u32;
        }
    }
    argmax() as u32
}

impl<B: Backend> Qwen3<B> {
    /// Continues `prompt` by up to `max_new_tokens`, stopping early at `stop` if given.
    ///
    /// The prompt is run once; every new token then costs one position thanks to the
    /// [`KvCache`]. Returns only the new tokens.
    pub fn generate(
        &self,
        prompt: &[u32],
        max_new_tokens: usize,
        sampling: Sampling,
        stop: Option<u32>,
        device: &B::Device,
    ) -> Vec<u32> {
        let mut cache = KvCache::new();
        let mut rng = Rng(sampling.seed.wrapping_mul(0x9E37_79B9_7F4A_7C15) | 1);
        let mut out = Vec::with_capacity(max_new_tokens);
        if prompt.is_empty() || max_new_tokens == 0 {
            return out;
        }
        let mut input: Vec<i64> = prompt.iter().map(|&t| t as i64).collect();
        for _ in 0..max_new_tokens {
            let ids = Tensor::<B, 2, Int>::from_data(TensorData::new(input.clone(), [1, input.len()]), device);
            let logits = self.forward_cached(ids, &mut cache);
            let [_, t, v] = logits.dims();
            let last = logits.narrow(1, t - 1, 1).reshape([v]).into_data().convert::<f32>();
            let last = last.to_vec::<f32>().unwrap_or_default();
            let next = pick(&last, &sampling, &mut rng);
            out.push(next);
            if Some(next) == stop {
                break;
            }
            input = vec![next as i64];
        }
        out
    }
}
