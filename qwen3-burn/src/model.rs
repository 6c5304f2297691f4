//! Qwen3, top to bottom.
//!
//! ```text
//! ids ─ embed_tokens ─┬─ N × DecoderLayer ─ norm ─ lm_head ─ logits
//!                     │   x + Attention(RMSNorm(x))      (q_norm/k_norm per head, then RoPE, GQA)
//!                     │   x + Mlp(RMSNorm(x))            (down(silu(gate(x)) · up(x)))
//! ```
//!
//! Parameters are stored exactly as Hugging Face names and lays them out (`[out, in]` linear
//! weights, no biases), so that the module path of every parameter *is* its HF tensor name:
//! `model.layers.3.self_attn.q_proj.weight`. Nothing here knows about parallelism: each
//! decoder layer is marked an [`FsdpUnit`] (transparent to paths and records) and runs through
//! a [`UnitRunner`] — [`Direct`] for the plain `forward`, which inside an FSDP forward gathers
//! the layer as FSDP's own runner does.

use burn::module::{Module, Param};
use burn::tensor::activation::sigmoid;
use burn::tensor::backend::Backend;
use burn::tensor::module::attention;
use burn::tensor::ops::AttentionModuleOptions;
use burn::tensor::{DType, Int, Tensor, TensorData, TensorPrimitive};
use burn_fsdp::FsdpUnit;
use burn_fsdp::hooks::{ModuleHooks, NoHooks};
use burn_fsdp::runner::{Direct, UnitRunner};

use crate::config::Qwen3Config;
use crate::init::{INIT_STD, Qwen3Init};

// ───────────────────────────── building blocks ─────────────────────────────

/// `x`, unchanged, kept for backward rather than recomputed.
///
/// Under Burn's balanced checkpointing (what a sharded model trains under when its layers
/// reshard after forward) the result of a memory-bound op that backward needs — a `reshape`
/// that copies, an elementwise op — is not kept but made again from its nearest kept
/// ancestors. A cast to the tensor's own dtype is a compute-bound op whose result *is* kept,
/// and costs nothing: every backend hands the tensor back as it is. (`Tensor::cast` skips
/// such a cast, so the backend op is called directly.) Without autodiff, or without
/// checkpointing, this changes nothing.
fn kept<B: Backend, const D: usize>(x: Tensor<B, D>) -> Tensor<B, D> {
    let dtype = x.dtype().into();
    Tensor::from_primitive(TensorPrimitive::Float(B::float_cast(x.into_primitive().tensor(), dtype)))
}

/// A bias-free linear layer with the weight stored as PyTorch does, `[out, in]`.
///
/// # Shapes
/// - input: `[..., in]`
/// - output: `[..., out]`
#[derive(Module, Debug)]
pub struct Linear<B: Backend> {
    /// `[d_output, d_input]`.
    pub weight: Param<Tensor<B, 2>>,
}

impl<B: Backend> Linear<B> {
    fn new(name: &str, d_in: usize, d_out: usize, w: Weights, device: &B::Device) -> Self {
        Self { weight: w.normal(&format!("{name}.weight"), [d_out, d_in], device) }
    }

    /// `x · Wᵀ`.
    pub fn forward<const D: usize>(&self, x: Tensor<B, D>) -> Tensor<B, D> {
        let w = self.weight.val();
        let [d_out, d_in] = w.dims();
        let mut out_shape = x.dims();
        let rows = out_shape[..D - 1].iter().product::<usize>();
        out_shape[D - 1] = d_out;
        x.reshape([rows, d_in]).matmul(w.transpose()).reshape(out_shape)
    }
}

/// Root-mean-square normalisation computed in fp32, as HF's `Qwen3RMSNorm`:
/// `weight · (x / sqrt(mean(x²) + eps))`.
///
/// # Shapes
/// - input/output: `[..., dim]`
#[derive(Module, Debug)]
pub struct RmsNorm<B: Backend> {
    /// `[dim]`, initialised to ones.
    pub weight: Param<Tensor<B, 1>>,
    /// Added to the mean square.
    pub eps: f64,
}

impl<B: Backend> RmsNorm<B> {
    fn new(name: &str, dim: usize, eps: f64, w: Weights, device: &B::Device) -> Self {
        Self { weight: w.ones(&format!("{name}.weight"), dim, device), eps }
    }

    /// Normalises the last dimension.
    pub fn forward<const D: usize>(&self, x: Tensor<B, D>) -> Tensor<B, D> {
        let dtype = x.dtype();
        let x = x.cast(DType::F32);
        let inv_rms = (x.clone().square().mean_dim(D - 1) + self.eps).sqrt().recip();
        (x * inv_rms).cast(dtype) * self.weight.val().unsqueeze()
    }
}

/// Token embedding table.
///
/// # Shapes
/// - input: `[batch, seq]` token ids
/// - output: `[batch, seq, hidden]`
#[derive(Module, Debug)]
pub struct Embedding<B: Backend> {
    /// `[vocab, hidden]`.
    pub weight: Param<Tensor<B, 2>>,
}

impl<B: Backend> Embedding<B> {
    /// Looks up the rows of `ids`.
    pub fn forward(&self, ids: Tensor<B, 2, Int>) -> Tensor<B, 3> {
        crate::lookup::embedding(self.weight.val(), ids)
    }
}

/// Rotary position embedding tables for positions `offset .. offset + len`.
///
/// HF layout: `inv_freq[i] = 1 / θ^(2i/d)`, angles duplicated over both halves
/// (`emb = cat(freqs, freqs)`), applied as `x·cos + rotate_half(x)·sin` with
/// `rotate_half(x) = cat(-x₂, x₁)`. Angles are formed in fp32 as HF does, then
/// `cos`/`sin` are taken in f64 and rounded once.
///
/// The rotation is applied in the projections' own layout, `[batch, len, heads, head_dim]`
/// (before heads are moved in front of positions), where both operands of every element-wise
/// product are contiguous: the table, repeated over heads, is one row broadcast over the batch.
/// On a CPU backend this avoids walking a transposed tensor element by element, forward and
/// backward; the values are the same in any layout.
#[derive(Debug, Clone)]
pub struct Rope<B: Backend> {
    cos: Tensor<B, 4>,
    sin: Tensor<B, 4>,
}

impl<B: Backend> Rope<B> {
    /// Builds the `[1, len, 1, head_dim]` tables.
    pub fn new(head_dim: usize, theta: f64, offset: usize, len: usize, device: &B::Device) -> Self {
        let half = head_dim / 2;
        let inv_freq: Vec<f32> = (0..half)
            .map(|i| {
                let exponent = (2 * i) as f32 / head_dim as f32;
                1.0f32 / (theta as f32).powf(exponent)
            })
            .collect();
        let mut cos = Vec::with_capacity(len * head_dim);
        let mut sin = Vec::with_capacity(len * head_dim);
        for pos in offset..offset + len {
            for j in 0..head_dim {
                let angle = (pos as f32 * inv_freq[j % half]) as f64;
                cos.push(angle.cos() as f32);
                sin.push(angle.sin() as f32);
            }
        }
        let shape = [1, len, 1, head_dim];
        Self {
            cos: Tensor::from_data(TensorData::new(cos, shape), device),
            sin: Tensor::from_data(TensorData::new(sin, shape), device),
        }
    }

    /// Rotates `x` of shape `[batch, len, heads, head_dim]`.
    ///
    /// # Shapes
    /// - `x`: `[batch, len, heads, head_dim]` (the tables' `len` and `head_dim`)
    /// - output: the same
    pub fn apply(&self, x: Tensor<B, 4>) -> Tensor<B, 4> {
        let dtype = x.dtype();
        let [b, t, h, d] = x.dims();
        let half = d / 2;
        let x1 = x.clone().narrow(3, 0, half);
        let x2 = x.clone().narrow(3, half, half);
        let rotated = Tensor::cat(vec![x2.neg(), x1], 3);
        // One row of `len · heads · head_dim` values, broadcast over the batch.
        let row =
            |table: &Tensor<B, 4>| table.clone().cast(dtype).expand([1, t, h, d]).reshape([1, t * h * d]);
        let flat = |y: Tensor<B, 4>| y.reshape([b, t * h * d]);
        (flat(x) * row(&self.cos) + flat(rotated) * row(&self.sin)).reshape([b, t, h, d])
    }
}

/// The rotary tables a model has built, kept on their device for the next forward.
///
/// The tables depend only on the positions, the head width, the base frequency, the backend
/// and the device, so a model that trains on sequences of one length builds them once: every
/// later forward finds them here instead of computing `2 · len · head_dim` sines and cosines
/// on the host and uploading them (on a GPU, a host → device copy per forward: 1 MiB at
/// Qwen3-0.6B with 1 024 positions). Only tables that start at position 0 are kept (training and
/// a prompt's prefill); incremental decoding builds its one-position tables as it goes. At most
/// [`RopeCache::CAPACITY`] are kept, the least recently used dropped first.
///
/// Clones share the cache: a model moved to another device, or its inner model under
/// autodiff, looks up its own backend's tables on its own device.
#[derive(Clone, Default)]
pub struct RopeCache {
    entries: std::sync::Arc<std::sync::Mutex<Vec<RopeEntry>>>,
}

/// One kept pair of tables: what they were built for and, type-erased, `(device, Rope<B>)`
/// (whose type is the backend's).
struct RopeEntry {
    head_dim: usize,
    theta: u64,
    len: usize,
    tables: Box<dyn std::any::Any + Send + Sync>,
}

impl RopeCache {
    /// The most tables kept (sequence lengths × devices × backends).
    pub const CAPACITY: usize = 16;

    /// The tables for positions `offset..offset + len` on `device`: kept ones when `offset`
    /// is 0 and they were built before, otherwise built (and kept when `offset` is 0).
    pub fn get<B: Backend>(
        &self,
        head_dim: usize,
        theta: f64,
        offset: usize,
        len: usize,
        device: &B::Device,
    ) -> Rope<B> {
        if offset != 0 {
            return Rope::new(head_dim, theta, offset, len, device);
        }
        let theta_bits = theta.to_bits();
        let matches = |e: &RopeEntry| {
            e.head_dim == head_dim
                && e.theta == theta_bits
                && e.len == len
                && e.tables.downcast_ref::<(B::Device, Rope<B>)>().is_some_and(|(d, _)| d == device)
        };
        {
            let mut entries = self.entries.lock().unwrap_or_else(|e| e.into_inner());
            if let Some(at) = entries.iter().position(matches) {
                // Most recently used last.
                let entry = entries.remove(at);
                let rope = entry.tables.downcast_ref::<(B::Device, Rope<B>)>().map(|(_, r)| r.clone());
                entries.push(entry);
                if let Some(rope) = rope {
                    return rope;
                }
            }
        }
        // Built outside the lock: ranks on other devices need not wait for it.
        let rope = Rope::new(head_dim, theta, 0, len, device);
        let mut entries = self.entries.lock().unwrap_or_else(|e| e.into_inner());
        if !entries.iter().any(matches) {
            if entries.len() >= Self::CAPACITY {
                entries.remove(0);
            }
            entries.push(RopeEntry {
                head_dim,
                theta: theta_bits,
                len,
                tables: Box::new((device.clone(), rope.clone())),
            });
        }
        rope
    }

    /// How many tables are kept.
    pub fn len(&self) -> usize {
        self.entries.lock().unwrap_or_else(|e| e.into_inner()).len()
    }

    /// Whether no table is kept.
    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }
}

impl std::fmt::Debug for RopeCache {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("RopeCache").field("tables", &self.len()).finish()
    }
}

/// Keys and values of earlier positions, per layer, for incremental decoding.
#[derive(Debug, Clone, Default)]
pub struct KvCache<B: Backend> {
    layers: Vec<Option<(Tensor<B, 4>, Tensor<B, 4>)>>,
}

impl<B: Backend> KvCache<B> {
    /// An empty cache.
    pub fn new() -> Self {
        Self { layers: Vec::new() }
    }

    /// Number of cached positions (of the first layer; all layers agree between calls).
    pub fn len(&self) -> usize {
        self.len_of(0)
    }

    /// Number of positions cached for `layer`.
    pub fn len_of(&self, layer: usize) -> usize {
        match self.layers.get(layer) {
            Some(Some((k, _))) => k.dims()[2],
            _ => 0,
        }
    }

    /// Whether nothing is cached yet.
    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }

    fn append(&mut self, layer: usize, k: Tensor<B, 4>, v: Tensor<B, 4>) -> (Tensor<B, 4>, Tensor<B, 4>) {
        if self.layers.len() <= layer {
            self.layers.resize(layer + 1, None);
        }
        let (k, v) = match self.layers[layer].take() {
            Some((pk, pv)) => (Tensor::cat(vec![pk, k], 2), Tensor::cat(vec![pv, v], 2)),
            None => (k, v),
        };
        self.layers[layer] = Some((k.clone(), v.clone()));
        (k, v)
    }
}

// ───────────────────────────── attention ─────────────────────────────

/// Grouped-query self-attention with per-head RMSNorm on queries and keys.
///
/// # Shapes
/// - input/output: `[batch, seq, hidden]`
#[derive(Module, Debug)]
pub struct Attention<B: Backend> {
    /// `[heads·head_dim, hidden]`.
    pub q_proj: Linear<B>,
    /// `[kv_heads·head_dim, hidden]`.
    pub k_proj: Linear<B>,
    /// `[kv_heads·head_dim, hidden]`.
    pub v_proj: Linear<B>,
    /// `[hidden, heads·head_dim]`.
    pub o_proj: Linear<B>,
    /// RMSNorm over each query head (`[head_dim]`), before RoPE.
    pub q_norm: RmsNorm<B>,
    /// RMSNorm over each key head (`[head_dim]`), before RoPE.
    pub k_norm: RmsNorm<B>,
    /// Number of query heads.
    pub num_heads: usize,
    /// Number of key/value heads.
    pub num_kv_heads: usize,
    /// Width of one head.
    pub head_dim: usize,
}

impl<B: Backend> Attention<B> {
    fn new(name: &str, c: &Qwen3Config, w: Weights, device: &B::Device) -> Self {
        let n = |s: &str| format!("{name}.{s}");
        Self {
            q_proj: Linear::new(&n("q_proj"), c.hidden_size, c.q_dim(), w, device),
            k_proj: Linear::new(&n("k_proj"), c.hidden_size, c.kv_dim(), w, device),
            v_proj: Linear::new(&n("v_proj"), c.hidden_size, c.kv_dim(), w, device),
            o_proj: Linear::new(&n("o_proj"), c.q_dim(), c.hidden_size, w, device),
            q_norm: RmsNorm::new(&n("q_norm"), c.head_dim, c.rms_norm_eps, w, device),
            k_norm: RmsNorm::new(&n("k_norm"), c.head_dim, c.rms_norm_eps, w, device),
            num_heads: c.num_attention_heads,
            num_kv_heads: c.num_key_value_heads,
            head_dim: c.head_dim,
        }
    }

    /// Causal attention over `x`, continuing `cache` when given (`layer` indexes it).
    ///
    /// The number of heads is read from the weights, so a tensor-parallel shard of this module
    /// (fewer heads per rank) runs unchanged.
    pub fn forward(
        &self,
        x: Tensor<B, 3>,
        rope: &Rope<B>,
        cache: Option<(&mut KvCache<B>, usize)>,
    ) -> Tensor<B, 3> {
        let [b, t, _] = x.dims();
        let hd = self.head_dim;
        let heads = self.q_proj.weight.dims()[0] / hd;
        let kv_heads = self.k_proj.weight.dims()[0] / hd;
        let split = |y: Tensor<B, 3>, n: usize| y.reshape([b, t, n, hd]);
        let q = rope.apply(self.q_norm.forward(split(self.q_proj.forward(x.clone()), heads))).swap_dims(1, 2);
        let k =
            rope.apply(self.k_norm.forward(split(self.k_proj.forward(x.clone()), kv_heads))).swap_dims(1, 2);
        let v = split(self.v_proj.forward(x), kv_heads).swap_dims(1, 2);
        let past = cache.as_ref().map_or(0, |(c, layer)| c.len_of(*layer));
        let (k, v) = match cache {
            Some((c, layer)) => c.append(layer, k, v),
            None => (k, v),
        };
        let s = past + t;
        let rep = heads / kv_heads;
        let repeat = |y: Tensor<B, 4>| {
            if rep == 1 {
                y
            } else {
                // Each key/value head once per query head of its group, copied in runs of
                // `hd` values from the `[b, s, kv_heads, hd]` layout the projection made (an
                // `expand` to `[b, kv_heads, rep, s, hd]` is copied value by value).
                let y = y.swap_dims(1, 2).unsqueeze_dim::<5>(3).repeat_dim(3, rep);
                y.reshape([b, s, heads, hd]).swap_dims(1, 2)
            }
        };
        let (k, v) = (repeat(k), repeat(v));
        // Burn's attention op: softmax(q·kᵀ/√d)·v with the causal mask aligned to the last
        // query (so a cache of `past` keys is attended to in full); a backend with a fused
        // kernel runs it without materialising the scores. Scores and softmax are f32, as in
        // HF's eager attention, whatever the parameters' dtype.
        let dtype = q.dtype();
        let f32 = |y: Tensor<B, 4>| if y.dtype() == DType::F32 { y } else { y.cast(DType::F32) };
        let options = AttentionModuleOptions { scale: None, softcap: None, is_causal: true };
        let out = attention(f32(q), f32(k), f32(v), None, None, options);
        let out = if dtype == DType::F32 { out } else { out.cast(dtype) };
        // [b, heads, t, hd] → [b, t, heads · hd]: a strided copy. `o_proj`'s backward needs
        // its result; keep it rather than copy again (see `kept`).
        let out = kept(out.swap_dims(1, 2).reshape([b, t, heads * hd]));
        self.o_proj.forward(out)
    }
}

// ───────────────────────────── MLP and layer ─────────────────────────────

/// SwiGLU feed-forward: `down(silu(gate(x)) · up(x))`.
///
/// # Shapes
/// - input/output: `[batch, seq, hidden]`
#[derive(Module, Debug)]
pub struct Mlp<B: Backend> {
    /// `[intermediate, hidden]`.
    pub gate_proj: Linear<B>,
    /// `[intermediate, hidden]`.
    pub up_proj: Linear<B>,
    /// `[hidden, intermediate]`.
    pub down_proj: Linear<B>,
}

impl<B: Backend> Mlp<B> {
    /// Applies the MLP.
    pub fn forward(&self, x: Tensor<B, 3>) -> Tensor<B, 3> {
        // silu(g) = g · σ(g), as Burn's `silu` computes it, with σ(g) kept for backward (see
        // `kept`): making it again would cost an `exp` per value.
        let g = self.gate_proj.forward(x.clone());
        let silu = g.clone() * kept(sigmoid(g));
        self.down_proj.forward(silu * self.up_proj.forward(x))
    }
}

/// One pre-norm decoder layer.
///
/// # Shapes
/// - input/output: `[batch, seq, hidden]`
#[derive(Module, Debug)]
pub struct DecoderLayer<B: Backend> {
    /// Self-attention.
    pub self_attn: Attention<B>,
    /// Feed-forward.
    pub mlp: Mlp<B>,
    /// Norm before attention.
    pub input_layernorm: RmsNorm<B>,
    /// Norm before the MLP.
    pub post_attention_layernorm: RmsNorm<B>,
}

impl<B: Backend> DecoderLayer<B> {
    /// `h = x + attn(norm(x)); h + mlp(norm(h))`.
    ///
    /// `hooks` sees the inputs and outputs of `self_attn` and `mlp` (tensor parallelism
    /// inserts its collectives there; [`NoHooks`] passes everything through).
    pub fn forward(
        &self,
        x: Tensor<B, 3>,
        rope: &Rope<B>,
        cache: Option<(&mut KvCache<B>, usize)>,
        hooks: &dyn ModuleHooks<B>,
    ) -> Tensor<B, 3> {
        let a = hooks.input("self_attn", self.input_layernorm.forward(x.clone()));
        let h = x + hooks.output("self_attn", self.self_attn.forward(a, rope, cache));
        let m = hooks.input("mlp", self.post_attention_layernorm.forward(h.clone()));
        h + hooks.output("mlp", self.mlp.forward(m))
    }
}

// ───────────────────────────── the model ─────────────────────────────

/// The decoder stack (HF's `Qwen3Model`, path prefix `model.`).
#[derive(Module, Debug)]
pub struct Qwen3Model<B: Backend> {
    /// `[vocab, hidden]`.
    pub embed_tokens: Embedding<B>,
    /// The decoder layers, each an FSDP unit (`FsdpUnit` is transparent: the same paths and
    /// records, and it derefs to the layer).
    pub layers: Vec<FsdpUnit<DecoderLayer<B>>>,
    /// Final norm.
    pub norm: RmsNorm<B>,
}

/// Qwen3 for causal language modelling (HF's `Qwen3ForCausalLM`).
///
/// Build with [`Qwen3Config::init`] or load with [`Qwen3::load`](crate::Qwen3::load).
///
/// # Shapes
/// - input: `[batch, seq]` token ids
/// - output: `[batch, seq, vocab]` logits (fp32)
///
/// # Example
///
/// ```
/// use burn::backend::NdArray;
/// use burn::tensor::{Int, Tensor};
/// use qwen3_burn::Qwen3Config;
///
/// let config = Qwen3Config { num_hidden_layers: 1, ..Qwen3Config::tiny() };
/// let device = Default::default();
/// let model = config.init::<NdArray>(&device);
/// let ids = Tensor::<NdArray, 2, Int>::from_ints([[1, 2, 3]], &device);
/// assert_eq!(model.forward(ids).dims(), [1, 3, config.vocab_size]);
/// ```
#[derive(Module, Debug)]
pub struct Qwen3<B: Backend> {
    /// The decoder stack.
    pub model: Qwen3Model<B>,
    /// Output projection `[vocab, hidden]`; `None` when tied to `model.embed_tokens`.
    pub lm_head: Option<Linear<B>>,
    /// RoPE base frequency.
    pub rope_theta: f64,
    /// Width of one attention head.
    pub head_dim: usize,
    /// The rotary tables built so far (not a parameter, not in the record).
    #[module(skip)]
    pub rope_cache: RopeCache,
}

impl<B: Backend> Qwen3<B> {
    /// A randomly initialised model (normal(0, 0.02) weights, unit norms) drawn from the
    /// backend's RNG.
    pub fn new(c: &Qwen3Config, device: &B::Device) -> Self {
        Self::build(c, Weights::BackendRng, device)
    }

    /// The model initialised by `init`, lazily: each parameter is made on first use, so a
    /// model handed to [`Fsdp::wrap_deferred`](burn_fsdp::Fsdp::wrap_deferred) with the same
    /// `init` (or with checkpoint weights) never allocates a full parameter.
    pub fn new_seeded(c: &Qwen3Config, init: Qwen3Init, device: &B::Device) -> Self {
        Self::build(c, Weights::Seeded(init), device)
    }

    fn build(c: &Qwen3Config, w: Weights, device: &B::Device) -> Self {
        let layers = (0..c.num_hidden_layers)
            .map(|i| {
                let n = |s: &str| format!("model.layers.{i}.{s}");
                FsdpUnit::new(DecoderLayer {
                    self_attn: Attention::new(&n("self_attn"), c, w, device),
                    mlp: Mlp {
                        gate_proj: Linear::new(
                            &n("mlp.gate_proj"),
                            c.hidden_size,
                            c.intermediate_size,
                            w,
                            device,
                        ),
                        up_proj: Linear::new(
                            &n("mlp.up_proj"),
                            c.hidden_size,
                            c.intermediate_size,
                            w,
                            device,
                        ),
                        down_proj: Linear::new(
                            &n("mlp.down_proj"),
                            c.intermediate_size,
                            c.hidden_size,
                            w,
                            device,
                        ),
                    },
                    input_layernorm: RmsNorm::new(
                        &n("input_layernorm"),
                        c.hidden_size,
                        c.rms_norm_eps,
                        w,
                        device,
                    ),
                    post_attention_layernorm: RmsNorm::new(
                        &n("post_attention_layernorm"),
                        c.hidden_size,
                        c.rms_norm_eps,
                        w,
                        device,
                    ),
                })
            })
            .collect();
        Self {
            model: Qwen3Model {
                embed_tokens: Embedding {
                    weight: w.normal("model.embed_tokens.weight", [c.vocab_size, c.hidden_size], device),
                },
                layers,
                norm: RmsNorm::new("model.norm", c.hidden_size, c.rms_norm_eps, w, device),
            },
            lm_head: (!c.tie_word_embeddings)
                .then(|| Linear::new("lm_head", c.hidden_size, c.vocab_size, w, device)),
            rope_theta: c.rope_theta,
            head_dim: c.head_dim,
            rope_cache: RopeCache::default(),
        }
    }

    /// Logits for every position of `ids`.
    pub fn forward(&self, ids: Tensor<B, 2, Int>) -> Tensor<B, 3> {
        self.forward_with(ids, &mut Direct)
    }

    /// [`forward`](Self::forward) with each decoder layer run through `runner`.
    pub fn forward_with<R: UnitRunner<B>>(&self, ids: Tensor<B, 2, Int>, runner: &mut R) -> Tensor<B, 3> {
        self.forward_inner(ids, runner, None, None)
    }

    /// [`forward_with`](Self::forward_with), also calling `hooks` around each layer's
    /// attention and MLP (how tensor parallelism is applied from outside the model).
    pub fn forward_hooked<R: UnitRunner<B>>(
        &self,
        ids: Tensor<B, 2, Int>,
        runner: &mut R,
        hooks: &dyn ModuleHooks<B>,
    ) -> Tensor<B, 3> {
        self.forward_inner(ids, runner, Some(hooks), None)
    }

    /// Logits of the new tokens `ids`, attending to (and extending) `cache`.
    pub fn forward_cached(&self, ids: Tensor<B, 2, Int>, cache: &mut KvCache<B>) -> Tensor<B, 3> {
        self.forward_inner(ids, &mut Direct, None, Some(cache))
    }

    /// The final hidden states (after the last norm), the input of the LM head: what
    /// [`forward_with`](Self::forward_with) computes before [`head_weight`](Self::head_weight)
    /// turns it into logits. With [`chunked_cross_entropy`](crate::train::chunked_cross_entropy)
    /// this trains without ever holding the full-vocabulary logits.
    ///
    /// # Shapes
    /// - ids: `[batch, seq]`
    /// - output: `[batch, seq, hidden]`
    pub fn hidden_with<R: UnitRunner<B>>(&self, ids: Tensor<B, 2, Int>, runner: &mut R) -> Tensor<B, 3> {
        self.hidden(ids, runner, None, None)
    }

    /// [`hidden_with`](Self::hidden_with) with `hooks` (see [`forward_hooked`](Self::forward_hooked)).
    pub fn hidden_hooked<R: UnitRunner<B>>(
        &self,
        ids: Tensor<B, 2, Int>,
        runner: &mut R,
        hooks: &dyn ModuleHooks<B>,
    ) -> Tensor<B, 3> {
        self.hidden(ids, runner, Some(hooks), None)
    }

    /// The LM head's weight, `[vocab, hidden]`: `lm_head.weight`, or the embedding when the
    /// head is tied. `logits = hidden · weightᵀ`.
    pub fn head_weight(&self) -> Tensor<B, 2> {
        match &self.lm_head {
            Some(head) => head.weight.val(),
            None => self.model.embed_tokens.weight.val(),
        }
    }

    fn forward_inner<R: UnitRunner<B>>(
        &self,
        ids: Tensor<B, 2, Int>,
        runner: &mut R,
        hooks: Option<&dyn ModuleHooks<B>>,
        cache: Option<&mut KvCache<B>>,
    ) -> Tensor<B, 3> {
        let x = self.hidden(ids, runner, hooks, cache);
        let logits = match &self.lm_head {
            Some(head) => head.forward(x),
            None => Linear { weight: self.model.embed_tokens.weight.clone() }.forward(x),
        };
        logits.cast(DType::F32)
    }

    fn hidden<R: UnitRunner<B>>(
        &self,
        ids: Tensor<B, 2, Int>,
        runner: &mut R,
        hooks: Option<&dyn ModuleHooks<B>>,
        mut cache: Option<&mut KvCache<B>>,
    ) -> Tensor<B, 3> {
        let device = ids.device();
        let [_, t] = ids.dims();
        let past = cache.as_ref().map_or(0, |c| c.len());
        let rope = self.rope_cache.get(self.head_dim, self.rope_theta, past, t, &device);
        let mut x = self.model.embed_tokens.forward(ids);
        for (i, layer) in self.model.layers.iter().enumerate() {
            x = match (hooks, cache.as_deref_mut()) {
                // A layer that only reads its input and the rope tables can run again
                // (activation checkpointing).
                (None, None) => {
                    let rope = rope.clone();
                    runner.run_recomputable(layer, x, move |layer, x| layer.forward(x, &rope, None, &NoHooks))
                }
                (hooks, cache) => runner.run(layer, x, |layer, x| {
                    layer.forward(x, &rope, cache.map(|c| (c, i)), hooks.unwrap_or(&NoHooks))
                }),
            };
        }
        self.model.norm.forward(x)
    }
}

/// Where [`Qwen3::build`] takes each parameter's initial values from (the HF name says which).
#[derive(Debug, Clone, Copy)]
enum Weights {
    /// Eagerly, from the backend's RNG.
    BackendRng,
    /// Lazily, from a seed, shardable.
    Seeded(Qwen3Init),
}

impl Weights {
    fn normal<B: Backend, const D: usize>(
        self,
        name: &str,
        shape: [usize; D],
        device: &B::Device,
    ) -> Param<Tensor<B, D>> {
        match self {
            Weights::BackendRng => {
                let normal = burn::tensor::Distribution::Normal(0.0, INIT_STD);
                Param::from_tensor(Tensor::random(shape, normal, device))
            }
            Weights::Seeded(init) => init.param(name, shape, device),
        }
    }

    fn ones<B: Backend>(self, name: &str, dim: usize, device: &B::Device) -> Param<Tensor<B, 1>> {
        match self {
            Weights::BackendRng => Param::from_tensor(Tensor::ones([dim], device)),
            Weights::Seeded(init) => init.param(name, [dim], device),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use burn::backend::{Autodiff, NdArray};

    fn values<B: Backend>(rope: &Rope<B>) -> (Vec<f32>, Vec<f32>) {
        let v = |t: &Tensor<B, 4>| t.clone().into_data().to_vec::<f32>().expect("f32 tables");
        (v(&rope.cos), v(&rope.sin))
    }

    #[test]
    fn the_rope_cache_keeps_tables_from_position_zero_and_gives_the_same_values() {
        let device = Default::default();
        let cache = RopeCache::default();
        let built = Rope::<NdArray>::new(16, 1e4, 0, 8, &device);
        let first = cache.get::<NdArray>(16, 1e4, 0, 8, &device);
        let again = cache.get::<NdArray>(16, 1e4, 0, 8, &device);
        assert_eq!(cache.len(), 1, "one length, one pair of tables");
        assert_eq!(values(&first), values(&built));
        assert_eq!(values(&again), values(&built));
        // Another length, theta, width or backend is its own entry.
        cache.get::<NdArray>(16, 1e4, 0, 5, &device);
        cache.get::<NdArray>(16, 1e6, 0, 5, &device);
        cache.get::<NdArray>(8, 1e6, 0, 5, &device);
        cache.get::<Autodiff<NdArray>>(8, 1e6, 0, 5, &device);
        assert_eq!(cache.len(), 5);
        // Decoding positions are built each time and not kept.
        let later = cache.get::<NdArray>(16, 1e4, 3, 2, &device);
        assert_eq!(values(&later), values(&Rope::<NdArray>::new(16, 1e4, 3, 2, &device)));
        assert_eq!(cache.len(), 5);
    }

    #[test]
    fn the_rope_cache_drops_the_least_recently_used_past_its_capacity() {
        let device = Default::default();
        let cache = RopeCache::default();
        for len in 1..=RopeCache::CAPACITY {
            cache.get::<NdArray>(4, 1e4, 0, len, &device);
        }
        // Length 1 used again: length 2 is now the oldest.
        cache.get::<NdArray>(4, 1e4, 0, 1, &device);
        cache.get::<NdArray>(4, 1e4, 0, 100, &device);
        assert_eq!(cache.len(), RopeCache::CAPACITY);
        let lens: Vec<usize> = cache.entries.lock().unwrap().iter().map(|e| e.len).collect();
        assert!(lens.contains(&1) && !lens.contains(&2) && lens.contains(&100), "{lens:?}");
    }

    #[test]
    fn a_model_builds_its_rope_tables_once_per_length_and_its_logits_do_not_change() {
        let c = Qwen3Config { num_hidden_layers: 1, ..Qwen3Config::tiny() };
        let device = Default::default();
        let model = c.init::<NdArray>(&device);
        let ids = Tensor::<NdArray, 2, Int>::from_ints([[1, 2, 3, 4]], &device);
        let first = model.forward(ids.clone()).into_data();
        assert_eq!(model.rope_cache.len(), 1);
        let second = model.forward(ids.clone()).into_data();
        assert_eq!(model.rope_cache.len(), 1);
        assert_eq!(first, second);
        // A model with an empty cache (as before the cache) gives the same bits.
        let fresh = Qwen3 { rope_cache: RopeCache::default(), ..model.clone() };
        assert_eq!(fresh.forward(ids).into_data(), first);
    }
}
