//! Hugging Face checkpoints: `config.json` + `model.safetensors` (or a sharded
//! `model.safetensors.index.json` + several files), read and written by HF tensor names.
//!
//! The module path of every parameter of [`Qwen3`] is its HF name, so loading is a
//! [`ModuleMapper`] that replaces each parameter with the tensor of the same name, and saving
//! a [`ModuleVisitor`] that collects them. `bf16`/`f16`/`f64` tensors are converted to the
//! model's float type; anything else is refused with an error naming file and tensor.

use std::collections::{BTreeMap, HashMap};
use std::path::{Path, PathBuf};

use burn::module::{Module, ModuleMapper, ModuleVisitor, Param};
use burn::tensor::backend::Backend;
use burn::tensor::{Tensor, TensorData};
use burn_fsdp::PathStack;
use burn_fsdp::init::{InitError, ShardInit};
pub use burn_fsdp::io::{SafetensorsFile, TensorOut, write_atomic, write_safetensors};
#[cfg(test)]
use safetensors::Dtype;

use crate::config::Qwen3Config;
use crate::error::{Qwen3Error, Result, io_err};
use crate::init::Qwen3Init;
use crate::model::Qwen3;

/// Name of the HF weights file.
pub const WEIGHTS_FILE: &str = "model.safetensors";
/// Name of the HF index of a sharded checkpoint.
pub const INDEX_FILE: &str = "model.safetensors.index.json";
/// Name of the HF config file.
pub const CONFIG_FILE: &str = "config.json";

/// The tensors of a checkpoint, possibly spread over several files.
pub struct HfWeights {
    files: Vec<SafetensorsFile>,
    /// tensor name → index into `files`.
    where_is: BTreeMap<String, usize>,
    /// What to name in "missing tensor" errors.
    origin: PathBuf,
}

impl HfWeights {
    /// Gives the pages of the checkpoint's files read so far back to the kernel
    /// ([`SafetensorsFile::release_pages`]): once every rank has its shards, the mapped files
    /// stop counting in the process's resident memory. Reading again still works.
    pub fn release_pages(&self) {
        for file in &self.files {
            file.release_pages();
        }
    }

    /// Opens `dir/model.safetensors`, or the files listed in `dir/model.safetensors.index.json`,
    /// or `path` itself when it is a `.safetensors` file.
    pub fn open(path: impl AsRef<Path>) -> Result<Self> {
        let path = path.as_ref();
        if path.is_file() {
            return Self::from_files(vec![SafetensorsFile::open(path)?], path.to_path_buf());
        }
        let single = path.join(WEIGHTS_FILE);
        let index = path.join(INDEX_FILE);
        if single.is_file() {
            return Self::from_files(vec![SafetensorsFile::open(&single)?], single);
        }
        if !index.is_file() {
            return Err(Qwen3Error::Io {
                path: single,
                error: std::io::Error::new(
                    std::io::ErrorKind::NotFound,
                    format!("no {WEIGHTS_FILE} and no {INDEX_FILE} in {}", path.display()),
                ),
            });
        }
        let text = std::fs::read_to_string(&index).map_err(io_err(&index))?;
        let json: serde_json::Value =
            serde_json::from_str(&text).map_err(|error| Qwen3Error::Json { path: index.clone(), error })?;
        let map = json.get("weight_map").and_then(|m| m.as_object()).ok_or_else(|| Qwen3Error::Config {
            path: index.clone(),
            msg: "no `weight_map` object".into(),
        })?;
        let mut file_names: Vec<String> = Vec::new();
        let mut where_is = BTreeMap::new();
        for (name, file) in map {
            let file = file.as_str().ok_or_else(|| Qwen3Error::Config {
                path: index.clone(),
                msg: format!("weight_map entry `{name}` is not a file name"),
            })?;
            let i = match file_names.iter().position(|f| f == file) {
                Some(i) => i,
                None => {
                    file_names.push(file.to_owned());
                    file_names.len() - 1
                }
            };
            where_is.insert(name.clone(), i);
        }
        let files = file_names
            .iter()
            .map(|f| SafetensorsFile::open(path.join(f)).map_err(Qwen3Error::from))
            .collect::<Result<Vec<_>>>()?;
        // Every tensor the index promises must be in its file.
        for (name, &i) in &where_is {
            files[i].info(name)?;
        }
        Ok(Self { files, where_is, origin: index })
    }

    fn from_files(files: Vec<SafetensorsFile>, origin: PathBuf) -> Result<Self> {
        let mut where_is = BTreeMap::new();
        for (i, f) in files.iter().enumerate() {
            for n in f.names()? {
                where_is.insert(n, i);
            }
        }
        Ok(Self { files, where_is, origin })
    }

    /// All tensor names.
    pub fn names(&self) -> impl Iterator<Item = &str> {
        self.where_is.keys().map(String::as_str)
    }

    /// Whether tensor `name` exists.
    pub fn contains(&self, name: &str) -> bool {
        self.where_is.contains_key(name)
    }

    /// The file holding `name`.
    pub fn file_of(&self, name: &str) -> Result<&SafetensorsFile> {
        match self.where_is.get(name) {
            Some(&i) => Ok(&self.files[i]),
            None => Err(Qwen3Error::MissingTensor { path: self.origin.clone(), name: name.to_owned() }),
        }
    }

    /// Tensor `name` as `f32` values and shape.
    pub fn read_f32(&self, name: &str) -> Result<(Vec<f32>, Vec<usize>)> {
        Ok(self.file_of(name)?.read_f32(name)?)
    }

    /// A digest of every file's bytes, in order: equal for byte-identical checkpoints.
    pub fn digest(&self) -> u64 {
        self.files
            .iter()
            .fold(0xCBF2_9CE4_8422_2325, |h, f| (h ^ f.digest()).wrapping_mul(0x0000_0100_0000_01B3))
    }
}

/// The rows of a checkpoint, for [`Fsdp::wrap_deferred`](burn_fsdp::Fsdp::wrap_deferred):
/// each rank reads only its own rows of each tensor from the memory-mapped files (bf16/f16/f64
/// converted to f32 row by row). Every parameter is provided, so a tensor missing from the
/// checkpoint is an error naming it (check the whole checkpoint first with
/// [`Qwen3::check_weights`]).
impl ShardInit for HfWeights {
    fn provides(&self, _path: &str, _shape: &[usize]) -> bool {
        true
    }

    fn rows(
        &self,
        path: &str,
        shape: &[usize],
        rows: std::ops::Range<usize>,
    ) -> std::result::Result<Vec<f32>, InitError> {
        let file = self.file_of(path)?;
        let (got, _) = file.info(path)?;
        if got != shape {
            let path_buf = file.path().to_path_buf();
            return Err(Box::new(Qwen3Error::Shape {
                path: path_buf,
                name: path.to_owned(),
                expected: shape.to_vec(),
                got,
            }));
        }
        Ok(file.read_rows_f32(path, rows)?.0)
    }
}

/// Where the loader reads tensors from: checkpoint files, or tensors already in memory.
pub trait TensorSource {
    /// All tensor names.
    fn tensor_names(&self) -> Vec<String>;
    /// Tensor `name` as `f32` values and shape.
    fn read(&self, name: &str) -> Result<(Vec<f32>, Vec<usize>)>;
    /// The file to name in errors about `name`.
    fn origin_of(&self, name: &str) -> PathBuf;
}

impl TensorSource for HfWeights {
    fn tensor_names(&self) -> Vec<String> {
        self.names().map(str::to_owned).collect()
    }
    fn read(&self, name: &str) -> Result<(Vec<f32>, Vec<usize>)> {
        self.read_f32(name)
    }
    fn origin_of(&self, name: &str) -> PathBuf {
        self.file_of(name).map(|f| f.path().to_path_buf()).unwrap_or_else(|_| self.origin.clone())
    }
}

/// Tensors held in memory, e.g. from [`Qwen3::to_hf_tensors`] (for building identical
/// replicas on several ranks without re-reading files).
impl TensorSource for [(String, TensorOut)] {
    fn tensor_names(&self) -> Vec<String> {
        self.iter().map(|(n, _)| n.clone()).collect()
    }
    fn read(&self, name: &str) -> Result<(Vec<f32>, Vec<usize>)> {
        match self.iter().find(|(n, _)| n == name) {
            Some((_, TensorOut::F32(shape, v))) => Ok((v.clone(), shape.clone())),
            Some((_, TensorOut::I64(..))) => {
                Err(Qwen3Error::DType { path: "<memory>".into(), name: name.to_owned(), dtype: "I64".into() })
            }
            None => Err(Qwen3Error::MissingTensor { path: "<memory>".into(), name: name.to_owned() }),
        }
    }
    fn origin_of(&self, _name: &str) -> PathBuf {
        "<memory>".into()
    }
}

/// Replaces every parameter with the checkpoint tensor of the same name.
struct Loader<'a, S: TensorSource + ?Sized> {
    weights: &'a S,
    path: PathStack,
    used: Vec<String>,
    error: Option<Qwen3Error>,
}

impl<B: Backend, S: TensorSource + ?Sized> ModuleMapper<B> for Loader<'_, S> {
    fn enter_module(&mut self, name: &str, _container_type: &str) {
        self.path.push(name);
    }

    fn exit_module(&mut self, _name: &str, _container_type: &str) {
        self.path.pop();
    }

    fn map_float<const D: usize>(&mut self, param: Param<Tensor<B, D>>) -> Param<Tensor<B, D>> {
        let name = self.path.current();
        if self.error.is_some() {
            return param;
        }
        // A lazy parameter (the skeleton of `from_weights`) is replaced unread: its random
        // initialiser never runs.
        let lazy = !param.is_initialized();
        let (expected, device) = (param.lazy_shape().to_vec(), param.lazy_device());
        let (id, tensor, mapper, require_grad) = if lazy {
            (param.id, None, Default::default(), true)
        } else {
            let (id, tensor, mapper) = param.consume();
            let require_grad = tensor.is_require_grad();
            (id, Some(tensor), mapper, require_grad)
        };
        let loaded = self.weights.read(&name).and_then(|(values, shape)| {
            if shape != expected {
                let path = self.weights.origin_of(&name);
                return Err(Qwen3Error::Shape {
                    path,
                    name: name.clone(),
                    expected: expected.clone(),
                    got: shape,
                });
            }
            Ok(values)
        });
        match loaded {
            Ok(values) => {
                self.used.push(name);
                let t = Tensor::from_data(TensorData::new(values, expected), &device);
                let t = if require_grad { t.require_grad() } else { t };
                Param::from_mapped_value(id, t, mapper)
            }
            Err(e) => {
                self.error = Some(e);
                let t = tensor.unwrap_or_else(|| Tensor::zeros(expected, &device));
                Param::from_mapped_value(id, t, mapper)
            }
        }
    }
}

/// Collects every parameter as `(HF name, shape, f32 values)`.
struct Collector {
    path: PathStack,
    out: Vec<(String, TensorOut)>,
}

impl<B: Backend> ModuleVisitor<B> for Collector {
    fn enter_module(&mut self, name: &str, _container_type: &str) {
        self.path.push(name);
    }

    fn exit_module(&mut self, _name: &str, _container_type: &str) {
        self.path.pop();
    }

    fn visit_float<const D: usize>(&mut self, param: &Param<Tensor<B, D>>) {
        let t = param.val();
        let shape = t.dims().to_vec();
        let values = t.into_data().convert::<f32>().to_vec::<f32>().unwrap_or_default();
        self.out.push((self.path.current(), TensorOut::F32(shape, values)));
    }
}

/// Refuses tensors of `weights` that no parameter (`used`) took.
fn refuse_unknown<S: TensorSource + ?Sized>(
    config: &Qwen3Config,
    weights: &S,
    used: &[String],
) -> Result<()> {
    let used: std::collections::HashSet<&str> = used.iter().map(String::as_str).collect();
    let mut unknown: Vec<String> = weights
        .tensor_names()
        .into_iter()
        .filter(|n| !used.contains(n.as_str()))
        // A tied checkpoint may still carry a copy of the head; HF ignores it too.
        .filter(|n| !(config.tie_word_embeddings && n == "lm_head.weight"))
        .collect();
    if unknown.is_empty() {
        return Ok(());
    }
    unknown.sort();
    let path = weights.origin_of(&unknown[0]);
    Err(Qwen3Error::UnknownTensors { path, names: unknown })
}

/// Shapes of all parameters of a module, in visiting order, without initialising lazy ones.
fn parameter_shapes<B: Backend, M: Module<B>>(module: &M) -> Vec<Vec<usize>> {
    struct Shapes(Vec<Vec<usize>>);
    impl<B: Backend> ModuleVisitor<B> for Shapes {
        fn visit_float<const D: usize>(&mut self, param: &Param<Tensor<B, D>>) {
            self.0.push(param.lazy_shape().to_vec());
        }
    }
    let mut v = Shapes(Vec::new());
    module.visit(&mut v);
    v.0
}

/// HF names of all parameters of a module, in visiting order.
pub fn parameter_names<B: Backend, M: Module<B>>(module: &M) -> Vec<String> {
    struct Names(PathStack, Vec<String>);
    impl<B: Backend> ModuleVisitor<B> for Names {
        fn enter_module(&mut self, name: &str, _: &str) {
            self.0.push(name);
        }
        fn exit_module(&mut self, _: &str, _: &str) {
            self.0.pop();
        }
        fn visit_float<const D: usize>(&mut self, _param: &Param<Tensor<B, D>>) {
            self.1.push(self.0.current());
        }
    }
    let mut v = Names(PathStack::default(), Vec::new());
    module.visit(&mut v);
    v.1
}

impl<B: Backend> Qwen3<B> {
    /// Loads an HF checkpoint directory (`config.json` + weights) onto `device`.
    ///
    /// Returns the model and its config. Errors name the file and, for tensors, the tensor:
    /// missing, misshapen, non-float, or unknown to this config.
    pub fn load(dir: impl AsRef<Path>, device: &B::Device) -> Result<(Self, Qwen3Config)> {
        let dir = dir.as_ref();
        let config = Qwen3Config::from_file(dir.join(CONFIG_FILE))?;
        let model = Self::load_weights(&config, dir, device)?;
        Ok((model, config))
    }

    /// Loads weights for `config` from `path` (a directory or a `.safetensors` file).
    pub fn load_weights(config: &Qwen3Config, path: impl AsRef<Path>, device: &B::Device) -> Result<Self> {
        let weights = HfWeights::open(path)?;
        Self::from_weights(config, &weights, device)
    }

    /// Builds the model for `config` from already opened `weights` (files or memory).
    pub fn from_weights<S: TensorSource + ?Sized>(
        config: &Qwen3Config,
        weights: &S,
        device: &B::Device,
    ) -> Result<Self> {
        // A lazy skeleton: the loader replaces every parameter without initialising it.
        let model = Self::new_seeded(config, Qwen3Init::new(0), device);
        let mut loader = Loader { weights, path: PathStack::default(), used: Vec::new(), error: None };
        let model = model.map(&mut loader);
        if let Some(e) = loader.error {
            return Err(e);
        }
        refuse_unknown(config, weights, &loader.used)?;
        Ok(model)
    }

    /// Checks, without reading any tensor data, that `weights` holds exactly the parameters of
    /// a model of `config` with their shapes: what [`from_weights`](Self::from_weights) checks,
    /// for loading shard by shard with [`Fsdp::wrap_deferred`](burn_fsdp::Fsdp::wrap_deferred)
    /// (where each rank reads only its rows and a missing tensor must not fall back to a
    /// random one).
    pub fn check_weights(config: &Qwen3Config, weights: &HfWeights) -> Result<()> {
        let skeleton = Self::new_seeded(config, Qwen3Init::new(0), &Default::default());
        let names = parameter_names::<B, _>(&skeleton);
        let shapes = parameter_shapes::<B, _>(&skeleton);
        for (name, expected) in names.iter().zip(shapes) {
            let file = weights.file_of(name)?;
            let (got, _) = file.info(name)?;
            if got != expected {
                let path = file.path().to_path_buf();
                return Err(Qwen3Error::Shape { path, name: name.clone(), expected, got });
            }
        }
        refuse_unknown(config, weights, &names)
    }

    /// All parameters as `(HF name, tensor)` in f32, ready to write.
    pub fn to_hf_tensors(&self) -> Vec<(String, TensorOut)> {
        let mut c = Collector { path: PathStack::default(), out: Vec::new() };
        self.visit(&mut c);
        c.out
    }

    /// Saves `config.json` + `model.safetensors` into `dir` in HF layout (f32; no
    /// `lm_head.weight` when tied), each file written atomically.
    pub fn save(&self, config: &Qwen3Config, dir: impl AsRef<Path>) -> Result<()> {
        write_hf_checkpoint(config, self.to_hf_tensors(), dir.as_ref())
    }
}

/// Writes `config.json` + `model.safetensors` (`tensors` under their HF names) into `dir`,
/// creating it, each file atomically: what [`Qwen3::save`] and the trainer's export of FSDP's
/// gathered parameters both write.
pub fn write_hf_checkpoint(
    config: &Qwen3Config,
    tensors: Vec<(String, TensorOut)>,
    dir: &Path,
) -> Result<()> {
    std::fs::create_dir_all(dir).map_err(io_err(dir))?;
    let meta = HashMap::from([("format".to_owned(), "pt".to_owned())]);
    write_safetensors(dir.join(WEIGHTS_FILE), tensors, Some(meta))?;
    Ok(write_atomic(&dir.join(CONFIG_FILE), config.to_json_string().as_bytes())?)
}

#[cfg(test)]
mod tests {
    use super::*;
    use burn::backend::NdArray;
    use burn::tensor::Int;

    type B = NdArray<f32>;

    fn small(tied: bool) -> Qwen3Config {
        Qwen3Config {
            vocab_size: 37,
            hidden_size: 24,
            intermediate_size: 40,
            num_hidden_layers: 2,
            num_attention_heads: 3,
            num_key_value_heads: 1,
            head_dim: 10,
            max_position_embeddings: 64,
            rms_norm_eps: 1e-6,
            rope_theta: 10_000.0,
            tie_word_embeddings: tied,
        }
    }

    fn logits(model: &Qwen3<B>) -> Vec<f32> {
        let ids = Tensor::<B, 2, Int>::from_ints([[1, 5, 36, 2, 0], [7, 7, 3, 9, 11]], &Default::default());
        model.forward(ids).into_data().to_vec::<f32>().unwrap()
    }

    fn saved(tied: bool) -> (tempfile::TempDir, Qwen3Config, Qwen3<B>) {
        let dir = tempfile::tempdir().unwrap();
        let config = small(tied);
        let model = config.init::<B>(&Default::default());
        model.save(&config, dir.path()).unwrap();
        (dir, config, model)
    }

    /// Rewrites the weights file of `dir` through `edit`.
    fn edit_weights(dir: &Path, edit: impl FnOnce(&mut Vec<(String, TensorOut)>)) {
        let model = Qwen3::<B>::load(dir, &Default::default()).unwrap().0;
        let mut tensors = model.to_hf_tensors();
        edit(&mut tensors);
        write_safetensors(dir.join(WEIGHTS_FILE), tensors, None).unwrap();
    }

    #[test]
    fn hf_names_match_the_module_paths() {
        let names = parameter_names::<B, _>(&small(false).init::<B>(&Default::default()));
        for n in [
            "model.embed_tokens.weight",
            "model.layers.0.self_attn.q_proj.weight",
            "model.layers.1.self_attn.k_norm.weight",
            "model.layers.1.mlp.down_proj.weight",
            "model.layers.0.post_attention_layernorm.weight",
            "model.norm.weight",
            "lm_head.weight",
        ] {
            assert!(names.iter().any(|x| x == n), "{n} not in {names:?}");
        }
        assert_eq!(names.len(), 1 + 2 * 11 + 1 + 1);
        let tied = parameter_names::<B, _>(&small(true).init::<B>(&Default::default()));
        assert!(!tied.iter().any(|x| x == "lm_head.weight"));
    }

    #[test]
    fn save_load_round_trip_gives_identical_logits() {
        for tied in [true, false] {
            let (dir, config, model) = saved(tied);
            let (loaded, c2) = Qwen3::<B>::load(dir.path(), &Default::default()).unwrap();
            assert_eq!(c2, config);
            assert_eq!(logits(&model), logits(&loaded), "tied = {tied}");
            let names = SafetensorsFile::open(dir.path().join(WEIGHTS_FILE)).unwrap().names().unwrap();
            assert_eq!(names.iter().any(|n| n == "lm_head.weight"), !tied);
        }
    }

    #[test]
    fn sharded_checkpoint_loads() {
        let (dir, _config, model) = saved(false);
        let tensors = model.to_hf_tensors();
        let (first, second): (Vec<_>, Vec<_>) =
            tensors.into_iter().enumerate().partition(|(i, _)| i % 2 == 0);
        let mut weight_map = serde_json::Map::new();
        for (file, part) in
            [("model-00001-of-00002.safetensors", first), ("model-00002-of-00002.safetensors", second)]
        {
            let part: Vec<_> = part.into_iter().map(|(_, t)| t).collect();
            for (n, _) in &part {
                weight_map.insert(n.clone(), file.into());
            }
            write_safetensors(dir.path().join(file), part, None).unwrap();
        }
        std::fs::remove_file(dir.path().join(WEIGHTS_FILE)).unwrap();
        let index = serde_json::json!({"metadata": {}, "weight_map": weight_map});
        std::fs::write(dir.path().join(INDEX_FILE), index.to_string()).unwrap();
        let (loaded, _) = Qwen3::<B>::load(dir.path(), &Default::default()).unwrap();
        assert_eq!(logits(&model), logits(&loaded));
    }

    #[test]
    fn half_precision_files_are_converted() {
        let (dir, _config, model) = saved(true);
        // Write every tensor as bf16 and check the values are those of the rounded originals.
        let tensors = model.to_hf_tensors();
        let bf: Vec<(String, Vec<u8>, Vec<usize>)> = tensors
            .iter()
            .map(|(n, t)| match t {
                TensorOut::F32(s, v) => (
                    n.clone(),
                    v.iter().flat_map(|x| half::bf16::from_f32(*x).to_le_bytes()).collect(),
                    s.clone(),
                ),
                TensorOut::I64(..) => unreachable!(),
            })
            .collect();
        let views: Vec<_> = bf
            .iter()
            .map(|(n, d, s)| {
                (n.clone(), safetensors::tensor::TensorView::new(Dtype::BF16, s.clone(), d).unwrap())
            })
            .collect();
        std::fs::write(dir.path().join(WEIGHTS_FILE), safetensors::serialize(views, None).unwrap()).unwrap();
        let (loaded, _) = Qwen3::<B>::load(dir.path(), &Default::default()).unwrap();
        let got = loaded.model.norm.weight.val().into_data().to_vec::<f32>().unwrap();
        let want: Vec<f32> = model
            .model
            .norm
            .weight
            .val()
            .into_data()
            .to_vec::<f32>()
            .unwrap()
            .iter()
            .map(|x| half::bf16::from_f32(*x).to_f32())
            .collect();
        assert_eq!(got, want);
    }

    #[test]
    fn missing_tensor_is_named() {
        let (dir, ..) = saved(true);
        edit_weights(dir.path(), |t| t.retain(|(n, _)| n != "model.layers.1.mlp.up_proj.weight"));
        let e = Qwen3::<B>::load(dir.path(), &Default::default()).unwrap_err();
        assert!(matches!(e, Qwen3Error::MissingTensor { .. }), "{e}");
        let msg = e.to_string();
        assert!(msg.contains("model.layers.1.mlp.up_proj.weight") && msg.contains(WEIGHTS_FILE), "{msg}");
        // An untied config needs lm_head.weight, which a tied checkpoint lacks.
        let (dir, ..) = saved(true);
        let mut cfg = small(false);
        cfg.tie_word_embeddings = false;
        let e = Qwen3::<B>::load_weights(&cfg, dir.path(), &Default::default()).unwrap_err().to_string();
        assert!(e.contains("lm_head.weight"), "{e}");
    }

    #[test]
    fn wrong_shape_is_named() {
        let (dir, ..) = saved(true);
        edit_weights(dir.path(), |t| {
            for (n, v) in t.iter_mut() {
                if n == "model.layers.0.self_attn.k_proj.weight" {
                    *v = TensorOut::F32(vec![24, 10], vec![0.0; 240]);
                }
            }
        });
        let e = Qwen3::<B>::load(dir.path(), &Default::default()).unwrap_err();
        let msg = e.to_string();
        assert!(matches!(e, Qwen3Error::Shape { .. }), "{msg}");
        assert!(msg.contains("model.layers.0.self_attn.k_proj.weight") && msg.contains("[10, 24]"), "{msg}");
    }

    #[test]
    fn integer_dtype_is_refused_with_name() {
        let (dir, ..) = saved(true);
        edit_weights(dir.path(), |t| {
            for (n, v) in t.iter_mut() {
                if n == "model.norm.weight" {
                    *v = TensorOut::I64(vec![24], vec![1; 24]);
                }
            }
        });
        let e = Qwen3::<B>::load(dir.path(), &Default::default()).unwrap_err();
        assert!(matches!(e, Qwen3Error::DType { .. }), "{e}");
        assert!(e.to_string().contains("model.norm.weight"), "{e}");
    }

    #[test]
    fn unknown_tensors_are_reported() {
        let (dir, ..) = saved(true);
        edit_weights(dir.path(), |t| {
            t.push(("model.layers.7.self_attn.q_proj.weight".into(), TensorOut::F32(vec![1], vec![0.0])))
        });
        let e = Qwen3::<B>::load(dir.path(), &Default::default()).unwrap_err();
        assert!(matches!(e, Qwen3Error::UnknownTensors { .. }), "{e}");
        assert!(e.to_string().contains("model.layers.7.self_attn.q_proj.weight"), "{e}");
    }

    #[test]
    fn truncated_and_missing_files_are_errors() {
        let (dir, ..) = saved(true);
        let path = dir.path().join(WEIGHTS_FILE);
        let bytes = std::fs::read(&path).unwrap();
        std::fs::write(&path, &bytes[..bytes.len() - 100]).unwrap();
        let e = Qwen3::<B>::load(dir.path(), &Default::default()).unwrap_err();
        assert!(matches!(e, Qwen3Error::Safetensors { .. }), "{e}");
        assert!(e.to_string().contains(WEIGHTS_FILE), "{e}");
        std::fs::remove_file(&path).unwrap();
        let e = Qwen3::<B>::load(dir.path(), &Default::default()).unwrap_err().to_string();
        assert!(e.contains(WEIGHTS_FILE) && e.contains(INDEX_FILE), "{e}");
        std::fs::write(dir.path().join(CONFIG_FILE), "{").unwrap();
        let e = Qwen3::<B>::load(dir.path(), &Default::default()).unwrap_err().to_string();
        assert!(e.contains(CONFIG_FILE), "{e}");
    }

    #[test]
    fn index_naming_a_missing_tensor_is_an_error() {
        let (dir, _config, model) = saved(true);
        let tensors = model.to_hf_tensors();
        let mut weight_map = serde_json::Map::new();
        for (n, _) in &tensors {
            weight_map.insert(n.clone(), "part.safetensors".into());
        }
        weight_map.insert("model.norm.extra".into(), "part.safetensors".into());
        write_safetensors(dir.path().join("part.safetensors"), tensors, None).unwrap();
        std::fs::remove_file(dir.path().join(WEIGHTS_FILE)).unwrap();
        std::fs::write(
            dir.path().join(INDEX_FILE),
            serde_json::json!({"weight_map": weight_map}).to_string(),
        )
        .unwrap();
        let e = Qwen3::<B>::load(dir.path(), &Default::default()).unwrap_err().to_string();
        assert!(e.contains("model.norm.extra") && e.contains("part.safetensors"), "{e}");
    }
}
