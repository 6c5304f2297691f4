//! Sharded checkpoints: every rank writes its own shards and optimizer state; one index.
//!
//! Layout of a checkpoint directory:
//!
//! ```text
//! index.json                          global shapes, rows held by each file, step, world
//!                                     size, model config, optimizer hyper-parameters
//! rank-00000-of-00004.safetensors     param/<name>, exp_avg/<name>, exp_avg_sq/<name>,
//! …                                   step/<name>: the rank's rows of each parameter
//! ```
//!
//! Files hold only their rank's rows (no padding), so a checkpoint saved at world size W
//! loads at any W′: each rank rebuilds its new rows from the files that hold them. Every file
//! is written under a temporary name and renamed; the index is written last, after all ranks
//! have finished, and records each file's size and XXH3-64 checksum: a directory without an
//! index, or whose files do not match it (truncated, replaced, or corrupted in place), never
//! loads. Loading validates everything before touching the model, so
//! nothing is half-loaded.

use std::collections::HashMap;
use std::path::{Path, PathBuf};

use burn::module::{Module, ModuleMapper, Param, ParamId};
use burn::tensor::backend::Backend;
use burn::tensor::{Shape, Tensor, TensorData};
use serde::{Deserialize, Serialize};

use crate::comm::Tag;
use crate::fsdp::offload::{HostAdam, HostParam};
use crate::fsdp::op::FsdpBackend;
use crate::fsdp::param::ShardedParam;
use crate::fsdp::{Fsdp, FsdpError};
use crate::io::{IoError, SafetensorsFile, TensorOut, io_err, write_atomic, write_safetensors};
use crate::optim::{AdamState, TorchAdamW, TorchAdamWConfig};
use crate::tp::TensorParallel;

/// Name of the index file.
pub const INDEX_FILE: &str = "index.json";
/// Format tag written into the index.
pub const FORMAT: &str = "burn-fsdp/sharded-v1";

/// One parameter in the index.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct ParamEntry {
    /// Module path.
    pub name: String,
    /// Unsharded shape.
    pub shape: Vec<usize>,
    /// Stored dtype.
    pub dtype: String,
    /// Unit the parameter belonged to.
    pub unit: String,
    /// `[start, end)` rows of dim 0 held by each rank file, in rank order.
    pub rows: Vec<(usize, usize)>,
}

/// One rank file in the index.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct FileEntry {
    /// File name inside the checkpoint directory.
    pub name: String,
    /// Its size in bytes (a truncated file does not match).
    pub bytes: u64,
    /// XXH3-64 of its bytes, as 16 hex digits (a file corrupted in place does not match).
    /// Absent in checkpoints written before checksums were recorded.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub xxh3: Option<String>,
}

/// The steps of the complete [`Fsdp::save_records`] checkpoints in `dir`, ascending (those
/// whose index was written; empty when `dir` does not exist). The last is the one to resume
/// from with [`Fsdp::load_records`].
pub fn saved_record_steps(dir: impl AsRef<Path>) -> Vec<usize> {
    crate::records::saved(dir.as_ref(), "step")
}

/// XXH3-64 of the file at `path`, as 16 hex digits (read in 1 MiB blocks).
pub fn file_checksum(path: &Path) -> Result<String, IoError> {
    use std::io::Read;
    let mut file = std::fs::File::open(path).map_err(io_err(path))?;
    let mut hasher = xxhash_rust::xxh3::Xxh3::new();
    let mut buf = vec![0u8; 1 << 20];
    loop {
        let n = file.read(&mut buf).map_err(io_err(path))?;
        if n == 0 {
            break;
        }
        hasher.update(&buf[..n]);
    }
    Ok(format!("{:016x}", hasher.digest()))
}

/// The contents of `index.json`.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct CheckpointIndex {
    /// Always [`FORMAT`].
    pub format: String,
    /// Index of the next training step (the number of steps done).
    pub step: u64,
    /// World size the checkpoint was saved at.
    pub world_size: usize,
    /// The model's configuration, as given by the caller (compared on load).
    pub model_config: serde_json::Value,
    /// Optimizer hyper-parameters: `lr`, `betas`, `eps`, `weight_decay`.
    pub optimizer: Option<OptimizerEntry>,
    /// Every parameter.
    pub params: Vec<ParamEntry>,
    /// The rank files, in rank order.
    pub files: Vec<FileEntry>,
}

/// AdamW hyper-parameters in the index.
#[derive(Debug, Clone, Copy, PartialEq, Serialize, Deserialize)]
pub struct OptimizerEntry {
    /// Learning rate.
    pub lr: f64,
    /// Betas.
    pub betas: (f64, f64),
    /// Epsilon.
    pub eps: f64,
    /// Weight decay.
    pub weight_decay: f64,
}

impl From<TorchAdamWConfig> for OptimizerEntry {
    fn from(c: TorchAdamWConfig) -> Self {
        Self { lr: c.lr, betas: c.betas, eps: c.eps, weight_decay: c.weight_decay }
    }
}

/// Errors of saving and loading checkpoints; each names the file at fault.
#[derive(Debug, thiserror::Error)]
pub enum CheckpointError {
    /// A file could not be read or written, or is malformed.
    #[error(transparent)]
    Io(#[from] IoError),
    /// The index is missing, malformed, or disagrees with the files or the model.
    #[error("{path}: {msg}")]
    Invalid {
        /// The file at fault.
        path: PathBuf,
        /// What is wrong.
        msg: String,
    },
    /// A collective failed while saving or loading.
    #[error(transparent)]
    Fsdp(#[from] FsdpError),
}

fn invalid(path: impl Into<PathBuf>, msg: impl Into<String>) -> CheckpointError {
    CheckpointError::Invalid { path: path.into(), msg: msg.into() }
}

/// Name of rank `r`'s file at world size `w`.
pub fn rank_file(r: usize, w: usize) -> String {
    format!("rank-{r:05}-of-{w:05}.safetensors")
}

/// Reads and validates `dir/index.json`, and the sizes and checksums of the files it lists.
pub fn read_index(dir: &Path) -> Result<CheckpointIndex, CheckpointError> {
    let path = dir.join(INDEX_FILE);
    if !path.is_file() {
        return Err(invalid(
            &path,
            "no index: not a checkpoint directory, or a save that did not finish (the index is written last)",
        ));
    }
    let text = std::fs::read_to_string(&path).map_err(io_err(&path))?;
    let index: CheckpointIndex =
        serde_json::from_str(&text).map_err(|e| invalid(&path, format!("malformed index: {e}")))?;
    if index.format != FORMAT {
        return Err(invalid(&path, format!("format `{}` is not `{FORMAT}`", index.format)));
    }
    if index.files.len() != index.world_size {
        return Err(invalid(
            &path,
            format!("lists {} files for world size {}", index.files.len(), index.world_size),
        ));
    }
    for f in &index.files {
        let p = dir.join(&f.name);
        let meta = std::fs::metadata(&p)
            .map_err(|e| invalid(&p, format!("listed in {INDEX_FILE} but unreadable: {e}")))?;
        if meta.len() != f.bytes {
            return Err(invalid(
                &p,
                format!("has {} bytes, {INDEX_FILE} says {} (truncated or replaced)", meta.len(), f.bytes),
            ));
        }
        if let Some(want) = &f.xxh3 {
            let got = file_checksum(&p)?;
            if &got != want {
                return Err(invalid(
                    &p,
                    format!("checksum {got} does not match {INDEX_FILE}'s {want}: the file is corrupted"),
                ));
            }
        }
    }
    for p in &index.params {
        if p.rows.len() != index.world_size || p.shape.is_empty() {
            return Err(invalid(&path, format!("entry of `{}` is inconsistent", p.name)));
        }
    }
    Ok(index)
}

/// A checkpoint's files opened for reading full parameters.
pub struct CheckpointReader {
    dir: PathBuf,
    index: CheckpointIndex,
    files: Vec<SafetensorsFile>,
}

impl CheckpointReader {
    /// Opens and validates a checkpoint directory.
    pub fn open(dir: impl AsRef<Path>) -> Result<Self, CheckpointError> {
        let dir = dir.as_ref().to_path_buf();
        let index = read_index(&dir)?;
        let files = index
            .files
            .iter()
            .map(|f| SafetensorsFile::open(dir.join(&f.name)))
            .collect::<Result<Vec<_>, _>>()?;
        Ok(Self { dir, index, files })
    }

    /// The index.
    pub fn index(&self) -> &CheckpointIndex {
        &self.index
    }

    /// The directory.
    pub fn dir(&self) -> &Path {
        &self.dir
    }

    /// The full (unsharded) values of `prefix/<name>`, concatenated from every rank file.
    pub fn full(&self, prefix: &str, entry: &ParamEntry) -> Result<Vec<f32>, CheckpointError> {
        let row = entry.shape[1..].iter().product::<usize>();
        let mut out = Vec::with_capacity(entry.shape.iter().product());
        for (file, &(start, end)) in self.files.iter().zip(&entry.rows) {
            let name = format!("{prefix}/{}", entry.name);
            let (values, shape) = file.read_f32(&name)?;
            let mut want = entry.shape.clone();
            want[0] = end - start;
            if shape != want || values.len() != (end - start) * row {
                return Err(invalid(
                    file.path(),
                    format!("tensor `{name}` has shape {shape:?}, the index says {want:?}"),
                ));
            }
            out.extend_from_slice(&values);
        }
        Ok(out)
    }

    /// Optimizer step count of `name`, if optimizer state was saved.
    pub fn step_of(&self, entry: &ParamEntry) -> Result<Option<u64>, CheckpointError> {
        let name = format!("step/{}", entry.name);
        match self.files[0].read_i64(&name) {
            Ok((v, _)) => Ok(v.first().map(|&s| s as u64)),
            Err(IoError::Missing { .. }) => Ok(None),
            Err(e) => Err(e.into()),
        }
    }

    /// Every parameter, unsharded: `(name, shape, values)` (a consolidated export).
    pub fn full_parameters(&self) -> Result<Vec<FullParam>, CheckpointError> {
        self.index
            .params
            .iter()
            .map(|p| Ok((p.name.clone(), p.shape.clone(), self.full("param", p)?)))
            .collect()
    }
}

/// Writes `index.json` (last, atomically) for the rank files of a `world`-rank save in `dir`,
/// recording each file's size and checksum.
fn write_index(
    dir: &Path,
    world: usize,
    step: u64,
    model_config: &serde_json::Value,
    optim: &TorchAdamWConfig,
    params: Vec<ParamEntry>,
) -> Result<(), CheckpointError> {
    let files = (0..world)
        .map(|r| {
            let name = rank_file(r, world);
            let p = dir.join(&name);
            let bytes = std::fs::metadata(&p).map_err(io_err(&p))?.len();
            Ok(FileEntry { name, bytes, xxh3: Some(file_checksum(&p)?) })
        })
        .collect::<Result<Vec<_>, IoError>>()?;
    let index = CheckpointIndex {
        format: FORMAT.into(),
        step,
        world_size: world,
        model_config: model_config.clone(),
        optimizer: Some((*optim).into()),
        params,
        files,
    };
    let json =
        serde_json::to_string_pretty(&index).map_err(|e| invalid(dir.join(INDEX_FILE), e.to_string()))?;
    write_atomic(&dir.join(INDEX_FILE), json.as_bytes())?;
    Ok(())
}

struct AdamStep {
    step: u64,
}

/// One unsharded parameter: `(name, shape, values)`.
pub type FullParam = (String, Vec<usize>, Vec<f32>);

/// Unpadded rows of a flat padded shard, as `(shape, values)`.
fn unpadded(p: &ShardedParam, rank: usize, flat: Vec<f32>) -> (Vec<usize>, Vec<f32>) {
    let rows = p.rows_of(rank).len();
    let mut shape = p.global_shape.clone();
    shape[0] = rows;
    let mut v = flat;
    v.truncate(rows * p.row_numel());
    (shape, v)
}

fn to_f32<B: Backend, const D: usize>(
    t: Tensor<B, D>,
    what: &str,
    path: &str,
) -> Result<Vec<f32>, FsdpError> {
    crate::downcast::f32_values(t.into_data(), || format!("{what} of `{path}`"))
}

/// Builds rank `rank`'s padded shard (flattened) of a full parameter.
fn shard_values(p: &ShardedParam, rank: usize, full: &[f32]) -> Vec<f32> {
    let row = p.row_numel();
    let rows = p.rows_of(rank);
    let mut v = full[rows.start * row..rows.end * row].to_vec();
    v.resize(p.shard_numel(), 0.0);
    v
}

impl<B: FsdpBackend, M: Module<B>> Fsdp<B, M> {
    /// Sharded checkpoints hold the sharded parameters and their optimizer state only: a model
    /// with buffers or frozen parameters ([`Fsdp::replicated_tensors`]) would lose them
    /// silently, so saving it is refused (every rank refuses, before any collective).
    fn refuse_replicated(&self, dir: &Path) -> Result<(), CheckpointError> {
        match self.replicated_tensors() {
            [] => Ok(()),
            names => Err(invalid(
                dir,
                format!(
                    "sharded checkpoints do not store tensors that are not sharded yet: {} buffer(s) or \
                     frozen parameter(s), e.g. `{}`; gather the parameters with `Fsdp::full_parameters` \
                     and save the whole model with Burn's recorder instead",
                    names.len(),
                    names[0]
                ),
            )),
        }
    }

    /// Saves this rank's shards and `optim`'s state into `dir` (every rank calls this).
    ///
    /// `step` is the index of the next training step; `model_config` is stored and compared
    /// when loading. Rank 0 writes the index last, once every rank's file is in place. On a
    /// mesh carrying tensor parallelism
    /// ([`DeviceMesh::with_tensor_parallel`](crate::DeviceMesh::with_tensor_parallel)) the
    /// files hold whole (unsplit) parameters, as a 1D run of world size dp writes them:
    /// every parameter and its state are all-gathered over dp and tp first (each rank
    /// briefly holds the full model and optimizer state), and the tp-rank-0 ranks write.
    pub fn save_sharded(
        &self,
        dir: impl AsRef<Path>,
        optim: &TorchAdamW<B::InnerBackend>,
        step: u64,
        model_config: &serde_json::Value,
    ) -> Result<(), CheckpointError> {
        if let Some(tp) = self.mesh().tensor_parallel().cloned() {
            return self.save_sharded_tp(dir, optim, step, model_config, &tp);
        }
        self.refuse_replicated(dir.as_ref())?;
        self.quiesce();
        let dir = dir.as_ref();
        let (rank, world) = (self.rank(), self.world());
        let group = self.shard_group();
        // HSDP: replicas hold the same shards; the first replica writes them.
        let writer = self.replicate_rank() == 0;
        std::fs::create_dir_all(dir).map_err(io_err(dir))?;
        if rank == 0 && writer {
            // An older index in this directory must not validate the files about to change.
            let old = dir.join(INDEX_FILE);
            if old.exists() {
                std::fs::remove_file(&old).map_err(io_err(&old))?;
            }
        }
        group.barrier(&Tag::new("checkpoint:begin")).map_err(FsdpError::from)?;
        let shards = self.shard_values()?;
        let mut tensors = Vec::new();
        for unit in self.units() {
            for p in &unit.params {
                let Some(values) = shards.get(&p.id) else { continue };
                let (shape, v) = unpadded(p, rank, values.clone());
                tensors.push((format!("param/{}", p.path), TensorOut::F32(shape, v)));
                let state = match self.host_store() {
                    Some(host) => {
                        host.get(p.id).and_then(|h| h.adam).map(|a| (a.step, a.exp_avg, a.exp_avg_sq))
                    }
                    None => match optim.state(&p.id) {
                        Some(s) => Some((
                            s.step,
                            to_f32(s.exp_avg.clone(), "exp_avg", &p.path)?,
                            to_f32(s.exp_avg_sq.clone(), "exp_avg_sq", &p.path)?,
                        )),
                        None => None,
                    },
                };
                if let Some((step, m, v)) = state {
                    let s = AdamStep { step };
                    let (shape, m) = unpadded(p, rank, m);
                    let (_, v) = unpadded(p, rank, v);
                    tensors.push((format!("exp_avg/{}", p.path), TensorOut::F32(shape.clone(), m)));
                    tensors.push((format!("exp_avg_sq/{}", p.path), TensorOut::F32(shape, v)));
                    tensors.push((format!("step/{}", p.path), TensorOut::I64(vec![1], vec![s.step as i64])));
                }
            }
        }
        if writer {
            write_safetensors(dir.join(rank_file(rank, world)), tensors, None)?;
        }
        group.barrier(&Tag::new("checkpoint:files-written")).map_err(FsdpError::from)?;
        if rank == 0 && writer {
            let params = self
                .units()
                .iter()
                .flat_map(|u| {
                    u.params.iter().map(|p| ParamEntry {
                        name: p.path.clone(),
                        shape: p.global_shape.clone(),
                        dtype: "F32".into(),
                        unit: u.name.clone(),
                        rows: (0..world).map(|r| (p.rows_of(r).start, p.rows_of(r).end)).collect(),
                    })
                })
                .collect();
            write_index(dir, world, step, model_config, optim.config(), params)?;
        }
        group.barrier(&Tag::new("checkpoint:done")).map_err(FsdpError::from)?;
        Ok(())
    }

    /// [`save_sharded`](Self::save_sharded) for a tensor-parallel model (FSDP over the dp
    /// group of a `dp × tp` mesh): writes the same format as a 1D run of world size dp, with
    /// whole (unsplit) parameters, so the checkpoint loads on any mesh.
    ///
    /// Every parameter and its AdamW state are all-gathered over dp and tp first (so each rank
    /// briefly holds the full model and optimizer state); the tp-rank-0 ranks write.
    fn save_sharded_tp(
        &self,
        dir: impl AsRef<Path>,
        optim: &TorchAdamW<B::InnerBackend>,
        step: u64,
        model_config: &serde_json::Value,
        tp: &TensorParallel<B::InnerBackend>,
    ) -> Result<(), CheckpointError> {
        self.refuse_replicated(dir.as_ref())?;
        self.quiesce();
        if self.host_store().is_some() || self.replicate_group().is_some() {
            return Err(FsdpError::Config(
                "tensor-parallel checkpoints support neither offload nor HSDP".into(),
            )
            .into());
        }
        let dir = dir.as_ref();
        let (rank, world) = (self.rank(), self.world());
        let (dp, tpg) = (self.shard_group().clone(), tp.group().clone());
        let writer = tpg.rank() == 0;
        let device = self.mesh().device().clone();
        let barrier = |name: &str| -> Result<(), CheckpointError> {
            dp.barrier(&Tag::new(format!("checkpoint:{name}"))).map_err(FsdpError::from)?;
            tpg.barrier(&Tag::new(format!("checkpoint:{name}:tp"))).map_err(FsdpError::from)?;
            Ok(())
        };
        std::fs::create_dir_all(dir).map_err(io_err(dir))?;
        if rank == 0 && writer {
            let old = dir.join(INDEX_FILE);
            if old.exists() {
                std::fs::remove_file(&old).map_err(io_err(&old))?;
            }
        }
        barrier("begin")?;
        let shards = self.shard_values()?;
        // The whole parameter from every dp rank's padded flat shard, then from every tp slice.
        let whole = |p: &ShardedParam,
                     what: &str,
                     flat: Vec<f32>|
         -> Result<(Vec<usize>, Vec<f32>), CheckpointError> {
            let n = flat.len();
            let t = Tensor::<B::InnerBackend, 1>::from_data(TensorData::new(flat, [n]), &device);
            let mut full = if world > 1 {
                to_f32(
                    dp.all_gather(t, &Tag::new(format!("checkpoint:{what}:{}", p.path)))
                        .map_err(FsdpError::from)?,
                    what,
                    &p.path,
                )?
            } else {
                to_f32(t, what, &p.path)?
            };
            full.truncate(p.global_shape.iter().product());
            Ok(tp.unsplit(&p.path, &p.global_shape, full, &device)?)
        };
        let mut tensors = Vec::new();
        let mut entries = Vec::new();
        for unit in self.units() {
            for p in &unit.params {
                let values = shards.get(&p.id).cloned().unwrap_or_default();
                let (shape, full) = whole(p, "param", values)?;
                let global = ShardedParam::new(p.id, p.path.clone(), shape.clone(), world);
                let rows = |v: &[f32]| {
                    let r = global.rows_of(rank);
                    let mut sh = shape.clone();
                    sh[0] = r.len();
                    (sh, v[r.start * global.row_numel()..r.end * global.row_numel()].to_vec())
                };
                let (sh, mine) = rows(&full);
                tensors.push((format!("param/{}", p.path), TensorOut::F32(sh, mine)));
                if let Some(s) = optim.state(&p.id) {
                    let (m, v) = (
                        to_f32(s.exp_avg.clone(), "exp_avg", &p.path)?,
                        to_f32(s.exp_avg_sq.clone(), "exp_avg_sq", &p.path)?,
                    );
                    let step = s.step;
                    let (_, m) = whole(p, "exp_avg", m)?;
                    let (_, v) = whole(p, "exp_avg_sq", v)?;
                    let (sh, m) = rows(&m);
                    let (_, v) = rows(&v);
                    tensors.push((format!("exp_avg/{}", p.path), TensorOut::F32(sh.clone(), m)));
                    tensors.push((format!("exp_avg_sq/{}", p.path), TensorOut::F32(sh, v)));
                    tensors.push((format!("step/{}", p.path), TensorOut::I64(vec![1], vec![step as i64])));
                }
                entries.push(ParamEntry {
                    name: p.path.clone(),
                    shape,
                    dtype: "F32".into(),
                    unit: unit.name.clone(),
                    rows: (0..world).map(|r| (global.rows_of(r).start, global.rows_of(r).end)).collect(),
                });
            }
        }
        if writer {
            write_safetensors(dir.join(rank_file(rank, world)), tensors, None)?;
        }
        barrier("files-written")?;
        if rank == 0 && writer {
            write_index(dir, world, step, model_config, optim.config(), entries)?;
        }
        barrier("done")?;
        Ok(())
    }

    /// Loads a checkpoint saved at any world size into this rank's shards and `optim`.
    ///
    /// On a mesh carrying tensor parallelism
    /// ([`DeviceMesh::with_tensor_parallel`](crate::DeviceMesh::with_tensor_parallel)), every
    /// parameter is checked against its global (unsplit) shape and this rank loads its tp
    /// slice, then its dp shard of that. Any checkpoint loads on any mesh: files always hold
    /// whole (unsplit) parameters.
    ///
    /// Fails (changing nothing) when the model config, parameter names or shapes differ, or a
    /// file is missing, truncated or inconsistent with the index. Returns the index.
    pub fn load_sharded(
        &mut self,
        dir: impl AsRef<Path>,
        optim: &mut TorchAdamW<B::InnerBackend>,
        model_config: &serde_json::Value,
    ) -> Result<CheckpointIndex, CheckpointError> {
        let tp = self.mesh().tensor_parallel().cloned();
        let tp = tp.as_deref();
        let reader = CheckpointReader::open(dir.as_ref())?;
        let index_path = reader.dir().join(INDEX_FILE);
        let index = reader.index().clone();
        if &index.model_config != model_config {
            return Err(invalid(
                &index_path,
                format!(
                    "saved for a different model config:\n  saved:   {}\n  current: {model_config}",
                    index.model_config
                ),
            ));
        }
        let entries: HashMap<&str, &ParamEntry> = index.params.iter().map(|p| (p.name.as_str(), p)).collect();
        let ours: Vec<&ShardedParam> = self.units().iter().flat_map(|u| u.params.iter()).collect();
        if ours.len() != index.params.len() {
            return Err(invalid(
                &index_path,
                format!("holds {} parameters, the model has {}", index.params.len(), ours.len()),
            ));
        }
        let rank = self.rank();
        let device = self.mesh().device().clone();
        // Read and check everything first.
        let mut values: HashMap<ParamId, Vec<f32>> = HashMap::new();
        let mut states: Vec<(ParamId, u64, Vec<f32>, Vec<f32>)> = Vec::new();
        for p in ours {
            let Some(e) = entries.get(p.path.as_str()) else {
                return Err(invalid(&index_path, format!("has no parameter `{}`", p.path)));
            };
            let want =
                tp.map_or_else(|| p.global_shape.clone(), |tp| tp.global_shape(&p.path, &p.global_shape));
            if e.shape != want {
                return Err(invalid(
                    &index_path,
                    format!("parameter `{}` has shape {:?}, the model {:?}", p.path, e.shape, want),
                ));
            }
            let local = |full: Vec<f32>| match tp {
                Some(tp) => tp.local_slice(&p.path, &e.shape, &full).1,
                None => full,
            };
            values.insert(p.id, shard_values(p, rank, &local(reader.full("param", e)?)));
            if let Some(step) = reader.step_of(e)? {
                let m = shard_values(p, rank, &local(reader.full("exp_avg", e)?));
                let v = shard_values(p, rank, &local(reader.full("exp_avg_sq", e)?));
                states.push((p.id, step, m, v));
            }
        }
        if let Some(host) = self.host_store() {
            let mut adam: HashMap<ParamId, HostAdam> = states
                .into_iter()
                .map(|(id, step, exp_avg, exp_avg_sq)| (id, HostAdam { step, exp_avg, exp_avg_sq }))
                .collect();
            for (id, shard) in values {
                host.set(id, HostParam { shard, grad: None, adam: adam.remove(&id) });
            }
            return Ok(index);
        }
        // Then apply.
        let shapes: HashMap<ParamId, Vec<usize>> =
            self.units().iter().flat_map(|u| u.params.iter().map(|p| (p.id, p.shard_shape()))).collect();
        let mut loader = ShardLoader::<B> { values, shapes, _b: Default::default() };
        self.replace_module(|m| m.map(&mut loader));
        let flat = |v: Vec<f32>| {
            let n = v.len();
            Tensor::<B::InnerBackend, 1>::from_data(TensorData::new(v, [n]), &device)
        };
        for (id, step, m, v) in states {
            optim.set_state(id, AdamState { step, exp_avg: flat(m), exp_avg_sq: flat(v) });
        }
        Ok(index)
    }
}

struct ShardLoader<B: Backend> {
    values: HashMap<ParamId, Vec<f32>>,
    shapes: HashMap<ParamId, Vec<usize>>,
    _b: std::marker::PhantomData<B>,
}

impl<B: FsdpBackend> ModuleMapper<B> for ShardLoader<B> {
    fn map_float<const D: usize>(&mut self, param: Param<Tensor<B, D>>) -> Param<Tensor<B, D>> {
        let (id, tensor, mapper) = param.consume();
        let (Some(v), Some(shape)) = (self.values.remove(&id), self.shapes.get(&id)) else {
            return Param::from_mapped_value(id, tensor, mapper);
        };
        let require_grad = tensor.is_require_grad();
        let dtype = tensor.dtype();
        let t = Tensor::<B, D>::from_data(TensorData::new(v, Shape::from(shape.clone())), &tensor.device())
            .cast(dtype);
        let t = if require_grad { t.require_grad() } else { t };
        Param::from_mapped_value(id, t, mapper)
    }
}
