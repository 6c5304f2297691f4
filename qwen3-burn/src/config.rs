//! The Qwen3 configuration, read from a Hugging Face `config.json`.

use std::path::Path;

use burn::tensor::backend::Backend;
use serde::{Deserialize, Serialize};

use crate::error::{Qwen3Error, Result, io_err};
use crate::init::Qwen3Init;
use crate::model::Qwen3;

/// Shape and numerics of a Qwen3 model (the fields of HF's `Qwen3Config` that matter).
///
/// Read one with [`Qwen3Config::from_file`] or pick a preset such as
/// [`Qwen3Config::qwen3_0_6b`], then build the model with [`Qwen3Config::init`].
///
/// # Example
///
/// ```
/// use qwen3_burn::Qwen3Config;
///
/// let json = r#"{"vocab_size": 256, "hidden_size": 64, "intermediate_size": 128,
///   "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2,
///   "head_dim": 16, "rms_norm_eps": 1e-6,
///   "rope_parameters": {"rope_theta": 1000000.0, "rope_type": "default"},
///   "tie_word_embeddings": true}"#;
/// let config = Qwen3Config::from_json_str(json, "config.json".as_ref()).unwrap();
/// assert_eq!(config.rope_theta, 1e6);
/// assert_eq!(config.q_dim(), 64);
/// ```
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct Qwen3Config {
    /// Number of tokens in the vocabulary.
    pub vocab_size: usize,
    /// Width of the residual stream.
    pub hidden_size: usize,
    /// Width of the MLP's hidden layer.
    pub intermediate_size: usize,
    /// Number of decoder layers.
    pub num_hidden_layers: usize,
    /// Number of query heads.
    pub num_attention_heads: usize,
    /// Number of key/value heads (GQA); divides `num_attention_heads`.
    pub num_key_value_heads: usize,
    /// Width of one attention head (not necessarily `hidden_size / num_attention_heads`).
    pub head_dim: usize,
    /// Longest sequence the RoPE tables are meant for.
    pub max_position_embeddings: usize,
    /// Epsilon of every RMSNorm.
    pub rms_norm_eps: f64,
    /// RoPE base frequency.
    pub rope_theta: f64,
    /// Whether `lm_head` shares the embedding matrix.
    pub tie_word_embeddings: bool,
}

/// The raw HF JSON, before validation (both key styles of RoPE).
#[derive(Deserialize)]
struct HfConfig {
    vocab_size: Option<usize>,
    hidden_size: Option<usize>,
    intermediate_size: Option<usize>,
    num_hidden_layers: Option<usize>,
    num_attention_heads: Option<usize>,
    num_key_value_heads: Option<usize>,
    head_dim: Option<usize>,
    max_position_embeddings: Option<usize>,
    rms_norm_eps: Option<f64>,
    rope_theta: Option<f64>,
    rope_parameters: Option<serde_json::Value>,
    rope_scaling: Option<serde_json::Value>,
    tie_word_embeddings: Option<bool>,
    attention_bias: Option<bool>,
    hidden_act: Option<String>,
    use_sliding_window: Option<bool>,
    model_type: Option<String>,
}

impl Qwen3Config {
    /// Reads and validates an HF `config.json`.
    pub fn from_file(path: impl AsRef<Path>) -> Result<Self> {
        let path = path.as_ref();
        let text = std::fs::read_to_string(path).map_err(io_err(path))?;
        Self::from_json_str(&text, path)
    }

    /// Parses and validates the text of an HF `config.json`; `path` is used in errors.
    pub fn from_json_str(text: &str, path: &Path) -> Result<Self> {
        let raw: HfConfig = serde_json::from_str(text)
            .map_err(|error| Qwen3Error::Json { path: path.to_path_buf(), error })?;
        let bad = |msg: String| Qwen3Error::Config { path: path.to_path_buf(), msg };
        let need = |v: Option<usize>, key: &str| v.ok_or_else(|| bad(format!("missing `{key}`")));
        if let Some(t) = &raw.model_type
            && t != "qwen3"
        {
            return Err(bad(format!("model_type is `{t}`, expected `qwen3`")));
        }
        if raw.attention_bias == Some(true) {
            return Err(bad("attention_bias = true is not supported (Qwen3 has no biases)".into()));
        }
        if let Some(act) = &raw.hidden_act
            && act != "silu"
        {
            return Err(bad(format!("hidden_act `{act}` is not supported (only `silu`)")));
        }
        if raw.use_sliding_window == Some(true) {
            return Err(bad("use_sliding_window = true is not supported".into()));
        }
        let rope_theta = match (&raw.rope_parameters, raw.rope_theta) {
            (Some(params), top) => {
                let rope_type = params.get("rope_type").and_then(|v| v.as_str()).unwrap_or("default");
                if rope_type != "default" {
                    return Err(bad(format!(
                        "rope_parameters.rope_type `{rope_type}` is not supported (only `default`)"
                    )));
                }
                match params.get("rope_theta").and_then(|v| v.as_f64()).or(top) {
                    Some(t) => t,
                    None => return Err(bad("rope_parameters has no numeric `rope_theta`".into())),
                }
            }
            (None, Some(t)) => t,
            (None, None) => return Err(bad("missing `rope_theta` (or `rope_parameters.rope_theta`)".into())),
        };
        if let Some(scaling) = &raw.rope_scaling
            && !scaling.is_null()
        {
            let t = scaling.get("rope_type").or_else(|| scaling.get("type")).and_then(|v| v.as_str());
            if t != Some("default") {
                return Err(bad(format!("rope_scaling {scaling} is not supported")));
            }
        }
        let hidden_size = need(raw.hidden_size, "hidden_size")?;
        let num_attention_heads = need(raw.num_attention_heads, "num_attention_heads")?;
        let config = Self {
            vocab_size: need(raw.vocab_size, "vocab_size")?,
            hidden_size,
            intermediate_size: need(raw.intermediate_size, "intermediate_size")?,
            num_hidden_layers: need(raw.num_hidden_layers, "num_hidden_layers")?,
            num_attention_heads,
            num_key_value_heads: raw.num_key_value_heads.unwrap_or(num_attention_heads),
            head_dim: match raw.head_dim {
                Some(h) => h,
                None if num_attention_heads > 0 => hidden_size / num_attention_heads,
                None => 0,
            },
            max_position_embeddings: raw.max_position_embeddings.unwrap_or(40960),
            rms_norm_eps: raw.rms_norm_eps.unwrap_or(1e-6),
            rope_theta,
            tie_word_embeddings: raw.tie_word_embeddings.unwrap_or(false),
        };
        config.validate().map_err(bad)?;
        Ok(config)
    }

    /// Checks that the shapes are consistent; the message names the offending key.
    pub fn validate(&self) -> std::result::Result<(), String> {
        for (key, v) in [
            ("vocab_size", self.vocab_size),
            ("hidden_size", self.hidden_size),
            ("intermediate_size", self.intermediate_size),
            ("num_hidden_layers", self.num_hidden_layers),
            ("num_attention_heads", self.num_attention_heads),
            ("num_key_value_heads", self.num_key_value_heads),
            ("head_dim", self.head_dim),
        ] {
            if v == 0 {
                return Err(format!("`{key}` must be positive"));
            }
        }
        if !self.num_attention_heads.is_multiple_of(self.num_key_value_heads) {
            return Err(format!(
                "`num_attention_heads` ({}) must be a multiple of `num_key_value_heads` ({})",
                self.num_attention_heads, self.num_key_value_heads
            ));
        }
        if !self.head_dim.is_multiple_of(2) {
            return Err(format!("`head_dim` ({}) must be even for RoPE", self.head_dim));
        }
        if self.rms_norm_eps.is_nan() || self.rms_norm_eps <= 0.0 {
            return Err("`rms_norm_eps` must be positive".into());
        }
        if self.rope_theta.is_nan() || self.rope_theta <= 0.0 {
            return Err("`rope_theta` must be positive".into());
        }
        Ok(())
    }

    /// Writes the config as an HF `config.json` (official key style, `rope_theta` at top level).
    pub fn to_json_string(&self) -> String {
        let v = serde_json::json!({
            "architectures": ["Qwen3ForCausalLM"],
            "model_type": "qwen3",
            "vocab_size": self.vocab_size,
            "hidden_size": self.hidden_size,
            "intermediate_size": self.intermediate_size,
            "num_hidden_layers": self.num_hidden_layers,
            "num_attention_heads": self.num_attention_heads,
            "num_key_value_heads": self.num_key_value_heads,
            "head_dim": self.head_dim,
            "max_position_embeddings": self.max_position_embeddings,
            "rms_norm_eps": self.rms_norm_eps,
            "rope_theta": self.rope_theta,
            "tie_word_embeddings": self.tie_word_embeddings,
            "attention_bias": false,
            "hidden_act": "silu",
            "torch_dtype": "float32",
        });
        serde_json::to_string_pretty(&v).unwrap_or_default()
    }

    /// Writes `config.json` into `dir`.
    pub fn save(&self, dir: impl AsRef<Path>) -> Result<()> {
        let path = dir.as_ref().join("config.json");
        std::fs::write(&path, self.to_json_string()).map_err(io_err(&path))
    }

    /// Width of all query heads together.
    pub fn q_dim(&self) -> usize {
        self.num_attention_heads * self.head_dim
    }

    /// Width of all key (or value) heads together.
    pub fn kv_dim(&self) -> usize {
        self.num_key_value_heads * self.head_dim
    }

    /// Number of parameters (counting a tied embedding once).
    pub fn num_params(&self) -> usize {
        let (h, i, v) = (self.hidden_size, self.intermediate_size, self.vocab_size);
        let attn = h * self.q_dim() * 2 + h * self.kv_dim() * 2 + 2 * self.head_dim;
        let layer = attn + 3 * h * i + 2 * h;
        let head = if self.tie_word_embeddings { 0 } else { v * h };
        v * h + self.num_hidden_layers * layer + h + head
    }

    /// Looks a preset up by name: `tiny`, `0.6b`, `1.7b`, `4b`, `8b`, `32b`.
    pub fn preset(name: &str) -> Option<Self> {
        match name.to_ascii_lowercase().trim_start_matches("qwen3-") {
            "tiny" => Some(Self::tiny()),
            "0.6b" => Some(Self::qwen3_0_6b()),
            "1.7b" => Some(Self::qwen3_1_7b()),
            "4b" => Some(Self::qwen3_4b()),
            "8b" => Some(Self::qwen3_8b()),
            "32b" => Some(Self::qwen3_32b()),
            _ => None,
        }
    }

    fn qwen3_shape(hidden: usize, inter: usize, layers: usize, heads: usize, tied: bool) -> Self {
        Self {
            vocab_size: 151_936,
            hidden_size: hidden,
            intermediate_size: inter,
            num_hidden_layers: layers,
            num_attention_heads: heads,
            num_key_value_heads: 8,
            head_dim: 128,
            max_position_embeddings: 40_960,
            rms_norm_eps: 1e-6,
            rope_theta: 1_000_000.0,
            tie_word_embeddings: tied,
        }
    }

    /// A small Qwen3 (≈0.6M parameters) for demos and tests: the built-in default model.
    pub fn tiny() -> Self {
        Self {
            vocab_size: 512,
            hidden_size: 128,
            intermediate_size: 256,
            num_hidden_layers: 4,
            num_attention_heads: 4,
            num_key_value_heads: 2,
            head_dim: 32,
            max_position_embeddings: 1024,
            rms_norm_eps: 1e-6,
            rope_theta: 1_000_000.0,
            tie_word_embeddings: true,
        }
    }

    /// The shapes of Qwen3-0.6B (16 × 128 = 2048 query width ≠ hidden 1024).
    pub fn qwen3_0_6b() -> Self {
        Self::qwen3_shape(1024, 3072, 28, 16, true)
    }

    /// The shapes of Qwen3-1.7B.
    pub fn qwen3_1_7b() -> Self {
        Self::qwen3_shape(2048, 6144, 28, 16, true)
    }

    /// The shapes of Qwen3-4B.
    pub fn qwen3_4b() -> Self {
        Self::qwen3_shape(2560, 9728, 36, 32, true)
    }

    /// The shapes of Qwen3-8B (untied `lm_head`).
    pub fn qwen3_8b() -> Self {
        Self::qwen3_shape(4096, 12288, 36, 32, false)
    }

    /// The shapes of Qwen3-32B (untied `lm_head`, 64 query heads, 8 key/value heads).
    pub fn qwen3_32b() -> Self {
        Self::qwen3_shape(5120, 25600, 64, 64, false)
    }

    /// Builds a randomly initialised model (HF's init: normal(0, 0.02), norms at one).
    ///
    /// The backend's RNG decides the values; seed it with `B::seed` for reproducibility.
    pub fn init<B: Backend>(&self, device: &B::Device) -> Qwen3<B> {
        Qwen3::new(self, device)
    }

    /// Builds the model initialised from `seed` ([`Qwen3Init`]): the same values on every
    /// machine and backend, lazily made on first use, and — given the same seed to
    /// [`Fsdp::wrap_deferred`](burn_fsdp::Fsdp::wrap_deferred) — the same values sharded over
    /// any number of ranks without any rank making a full copy.
    ///
    /// ```
    /// use burn::backend::NdArray;
    /// use qwen3_burn::Qwen3Config;
    ///
    /// let config = Qwen3Config { num_hidden_layers: 1, ..Qwen3Config::tiny() };
    /// let a = config.init_seeded::<NdArray>(5, &Default::default());
    /// let b = config.init_seeded::<NdArray>(5, &Default::default());
    /// assert_eq!(a.model.embed_tokens.weight.val().into_data(), b.model.embed_tokens.weight.val().into_data());
    /// ```
    pub fn init_seeded<B: Backend>(&self, seed: u64, device: &B::Device) -> Qwen3<B> {
        Qwen3::new_seeded(self, Qwen3Init::new(seed), device)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const TINY_A: &str = r#"{"vocab_size": 256, "hidden_size": 64, "intermediate_size": 128,
        "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 16,
        "max_position_embeddings": 128, "rms_norm_eps": 1e-06, "rope_theta": 1000000.0,
        "tie_word_embeddings": true, "attention_bias": false, "hidden_act": "silu",
        "architectures": ["Qwen3ForCausalLM"], "model_type": "qwen3", "torch_dtype": "float32"}"#;

    fn parse(s: &str) -> Result<Qwen3Config> {
        Qwen3Config::from_json_str(s, Path::new("cfg/config.json"))
    }

    #[test]
    fn reads_official_key_style() {
        let c = parse(TINY_A).unwrap();
        assert_eq!(c.rope_theta, 1e6);
        assert_eq!((c.num_attention_heads, c.num_key_value_heads, c.head_dim), (4, 2, 16));
        assert!(c.tie_word_embeddings);
        assert_eq!(c.rms_norm_eps, 1e-6);
    }

    #[test]
    fn reads_transformers5_rope_parameters() {
        let s = TINY_A.replace(
            r#""rope_theta": 1000000.0"#,
            r#""rope_parameters": {"rope_theta": 5000.0, "rope_type": "default"}"#,
        );
        assert_eq!(parse(&s).unwrap().rope_theta, 5000.0);
    }

    #[test]
    fn head_dim_is_honoured_not_derived() {
        let s = TINY_A.replace(r#""head_dim": 16"#, r#""head_dim": 32"#);
        let c = parse(&s).unwrap();
        assert_eq!(c.head_dim, 32);
        assert_eq!(c.q_dim(), 128);
        let s = TINY_A.replace(r#""head_dim": 16,"#, "");
        assert_eq!(parse(&s).unwrap().head_dim, 16, "default is hidden / heads");
        let p = Qwen3Config::qwen3_0_6b();
        assert_eq!((p.q_dim(), p.hidden_size), (2048, 1024));
    }

    #[test]
    fn errors_name_the_file_and_key() {
        let e = parse("{ not json").unwrap_err().to_string();
        assert!(e.contains("cfg/config.json") && e.contains("invalid JSON"), "{e}");
        let e = parse(&TINY_A.replace(r#""vocab_size": 256,"#, "")).unwrap_err().to_string();
        assert!(e.contains("cfg/config.json") && e.contains("vocab_size"), "{e}");
        let e = parse(&TINY_A.replace(r#""rope_theta": 1000000.0,"#, "")).unwrap_err().to_string();
        assert!(e.contains("rope_theta"), "{e}");
        let e = parse(&TINY_A.replace(r#""num_key_value_heads": 2"#, r#""num_key_value_heads": 3"#))
            .unwrap_err()
            .to_string();
        assert!(e.contains("num_key_value_heads"), "{e}");
        let e = parse(&TINY_A.replace(r#""model_type": "qwen3""#, r#""model_type": "llama""#)).unwrap_err();
        assert!(e.to_string().contains("llama"), "{e}");
        let e = parse(&TINY_A.replace(r#""hidden_size": 64"#, r#""hidden_size": "64""#)).unwrap_err();
        assert!(matches!(e, Qwen3Error::Json { .. }), "{e}");
        let e = Qwen3Config::from_file("/nonexistent/config.json").unwrap_err().to_string();
        assert!(e.contains("/nonexistent/config.json"), "{e}");
    }

    #[test]
    fn json_round_trip_and_presets() {
        let c = parse(TINY_A).unwrap();
        assert_eq!(parse(&c.to_json_string()).unwrap(), c);
        for name in ["tiny", "0.6b", "Qwen3-1.7B", "4b", "8b", "32b"] {
            let p = Qwen3Config::preset(name).unwrap();
            p.validate().unwrap();
            assert_eq!(parse(&p.to_json_string()).unwrap(), p);
        }
        assert!(!Qwen3Config::qwen3_8b().tie_word_embeddings);
        assert!(Qwen3Config::preset("70b").is_none());
        // Qwen3-0.6B has ~0.6B parameters (tied, so the head is not counted twice).
        let n = Qwen3Config::qwen3_0_6b().num_params();
        assert!((590_000_000..610_000_000).contains(&n), "{n}");
        // Qwen3-32B: 32.8B parameters on its model card.
        let n = Qwen3Config::qwen3_32b().num_params();
        assert!((32_700_000_000..32_850_000_000).contains(&n), "{n}");
    }
}
