//! Burn records of a sharded model: the whole model as the user's own type, and sharded
//! checkpoints of the model (buffers included) and of any Burn optimizer, loadable at another
//! world size (the format: `crate::records`).

use std::path::Path;

use burn::record::Record;

use super::*;
use crate::records::{self, Index};
use crate::walk::PathStack;

/// Canonical parameter names (paths) → this model's ids.
pub(crate) type IdMap = HashMap<String, String>;

impl<B: FsdpBackend, M: AutodiffModule<B>> Fsdp<B, M> {
    /// The whole model, of the user's own type: every parameter gathered from the shards and
    /// full (its dtype and `require_grad` kept), buffers (BatchNorm's running statistics) as
    /// this rank holds them. Every rank must call this (it all-gathers); each gets the whole
    /// model, so that rank 0 can save a Burn record that single-device code loads with Burn's
    /// own recorder — FSDP2's `get_model_state_dict(full_state_dict=True)`.
    ///
    /// Memory: the whole model, once per rank, on the mesh device. A tensor-parallel model's
    /// parameters stay this rank's tp slices, as its module holds them
    /// ([`full_parameters`](Self::full_parameters) reassembles them).
    ///
    /// # Example
    /// ```ignore
    /// let model = fsdp.full_module()?;
    /// if fsdp.rank() == 0 {
    ///     model.save_file("model", &NamedMpkFileRecorder::<FullPrecisionSettings>::new())?;
    /// }
    /// // Later, on one device, the model as written:
    /// let model = MyModelConfig::new().init(&device).load_file("model", &recorder, &device)?;
    /// ```
    pub fn full_module(&self) -> Result<M, FsdpError> {
        let full: HashMap<String, (Vec<usize>, TensorData)> = self
            .full_local_parameters()?
            .into_iter()
            .map(|(path, shape, data)| (path, (shape, data)))
            .collect();
        struct Load<'a, B: Backend> {
            path: PathStack,
            full: &'a HashMap<String, (Vec<usize>, TensorData)>,
            device: B::Device,
        }
        impl<B: Backend> ModuleMapper<B> for Load<'_, B> {
            fn enter_module(&mut self, name: &str, _: &str) {
                self.path.push(name);
            }
            fn exit_module(&mut self, _: &str, _: &str) {
                self.path.pop();
            }
            fn map_float<const D: usize>(&mut self, param: Param<Tensor<B, D>>) -> Param<Tensor<B, D>> {
                let Some((shape, data)) = self.full.get(&self.path.current()) else { return param };
                let (id, tensor, mapper) = param.consume();
                let grad = tensor.is_require_grad();
                let flat = Tensor::<B, 1>::from_data(data.clone(), &self.device).cast(tensor.dtype());
                let t: Tensor<B, D> = flat.reshape(burn::tensor::Shape::from(shape.clone()));
                Param::from_mapped_value(id, if grad { t.require_grad() } else { t }, mapper)
            }
        }
        let device = self.mesh.device().clone();
        Ok(self.module.clone().map(&mut Load::<B> { path: PathStack::default(), full: &full, device }))
    }

    /// Saves a sharded checkpoint of Burn records into `dir` as checkpoint `step`: each rank
    /// writes its records with Burn's recorder (the model's — its shards and its buffers —
    /// and `optim`'s, whatever state the optimizer keeps: Adam's and AdamW's moments, SGD's
    /// momentum, RmsProp's averages), rank 0 writes `dir/step-{step}.json` last, once every
    /// rank's files are in place. [`load_records`](Self::load_records) restores it at any
    /// world size. Every rank must call this; all return the same success or an error.
    ///
    /// For a hand-written loop stepping with [`step_with`](Self::step_with); the Learner's
    /// [`FsdpStrategy::checkpoints`](crate::learner::FsdpStrategy::checkpoints) writes the same
    /// format per epoch. [`save_sharded`](Self::save_sharded) is the other format: safetensors
    /// with [`TorchAdamW`]'s state, streamed row by row (for models too large to re-slice in
    /// memory: a load here re-slices every saved rank's records at once as serde values on the
    /// host, tens of bytes per byte saved).
    ///
    /// # Errors
    /// [`FsdpError::Checkpoint`] naming the file that could not be written (on every rank:
    /// the others report that a rank failed); [`FsdpError::Config`] with CPU offload (use
    /// `save_sharded`).
    ///
    /// # Example
    /// ```ignore
    /// fsdp.step_with(&mut optim, lr, grads)?;
    /// if step % 100 == 0 {
    ///     fsdp.save_records("checkpoints", step, &optim)?;
    /// }
    /// // Resuming, at any world size: the model built and wrapped as before, then
    /// let optim = fsdp.load_records("checkpoints", step, AdamWConfig::new().init())?;
    /// ```
    pub fn save_records<O: Optimizer<M, B>>(
        &self,
        dir: impl AsRef<Path>,
        step: usize,
        optim: &O,
    ) -> Result<(), FsdpError> {
        self.refuse_offload("save_records")?;
        self.commit_records(dir.as_ref(), "step", step, |rank_dir| {
            records::save_rank::<M::Record, B>(self.module.clone().into_record(), rank_dir, "model", step)?;
            records::save_rank::<O::Record, B>(optim.to_record(), rank_dir, "optim", step)
        })
    }

    /// Loads checkpoint `step` of [`save_records`](Self::save_records) from `dir`, whatever
    /// world size saved it: this rank's rows of every parameter and of the optimizer's state,
    /// the buffers as rank 0 saved them. The model is matched by parameter path and shape
    /// (built afresh, its parameter ids differ from the saved ones: the state is renamed to
    /// them). Returns `optim` with its state loaded. Every rank must call this.
    ///
    /// # Errors
    /// [`FsdpError::Checkpoint`] naming the file: no complete checkpoint `step` (its index is
    /// written last), a parameter missing or of another shape, a record that does not load;
    /// [`FsdpError::Config`] when the records do not fit this model or optimizer, and with CPU
    /// offload. Nothing is changed unless everything loaded.
    pub fn load_records<O: Optimizer<M, B>>(
        &mut self,
        dir: impl AsRef<Path>,
        step: usize,
        optim: O,
    ) -> Result<O, FsdpError> {
        let dir = dir.as_ref();
        self.refuse_offload("load_records")?;
        let (index, ids) = self.records_index(dir, "step", step)?;
        let model = self.read_mine::<M::Record>(dir, &index, &ids, "model")?;
        let state = self.read_mine::<O::Record>(dir, &index, &ids, "optim")?;
        self.load_module_record(model);
        Ok(optim.load_record(state))
    }

    fn refuse_offload(&self, what: &str) -> Result<(), FsdpError> {
        match self.host {
            Some(_) => Err(FsdpError::Config(format!(
                "{what}: with CPU offload the shards live in host memory, which `save_sharded`/`load_sharded` \
                 checkpoint (with TorchAdamW's state)"
            ))),
            None => Ok(()),
        }
    }

    /// Writes one record checkpoint: rank 0 first removes an index of the same number (never
    /// an index that validates files about to change), each writing rank calls `write` with its
    /// directory, rank 0 writes the index once all succeeded. Every rank learns whether any
    /// failed.
    pub(crate) fn commit_records(
        &self,
        dir: &Path,
        kind: &str,
        number: usize,
        write: impl FnOnce(&Path) -> Result<(), FsdpError>,
    ) -> Result<(), FsdpError> {
        let (rank, world) = (self.rank(), self.world());
        let writer = self.replicate_rank() == 0;
        let lead = rank == 0 && writer;
        let mut mine = Ok(());
        if lead {
            let index = records::index_path(dir, kind, number);
            mine = std::fs::create_dir_all(dir).map_err(|e| records::err(dir, e)).and_then(|()| {
                match std::fs::remove_file(&index) {
                    Err(e) if e.kind() != std::io::ErrorKind::NotFound => Err(records::err(&index, e)),
                    _ => Ok(()),
                }
            });
        }
        self.agree(mine, dir, "records:begin")?;
        let mine = if writer {
            let rank_dir = records::rank_dir(dir, rank, world);
            let ids: Vec<(String, String)> = self
                .units
                .iter()
                .flat_map(|u| u.params.iter())
                .map(|p| (p.id.serialize(), p.path.clone()))
                .collect();
            records::write_ids(&rank_dir, number, &ids).and_then(|()| write(&rank_dir))
        } else {
            Ok(())
        };
        self.agree(mine, dir, "records:written")?;
        let mine = if lead {
            let params = self
                .units
                .iter()
                .flat_map(|u| u.params.iter())
                .map(|p| (p.path.clone(), p.global_shape.clone()))
                .collect();
            records::write_index(dir, &Index { kind: kind.into(), number, world, params })
        } else {
            Ok(())
        };
        self.agree(mine, dir, "records:done")
    }

    /// This rank's result, or an error on every rank when any rank failed.
    fn agree(&self, mine: Result<(), FsdpError>, dir: &Path, tag: &str) -> Result<(), FsdpError> {
        let failed = self.all_reduce_scalar(if mine.is_err() { 1.0 } else { 0.0 }, ReduceOp::Max, tag)?;
        mine?;
        if failed > 0.0 {
            return Err(records::err(
                dir,
                "another rank could not write or read its part (its own error says which file); no index \
                 was written for this checkpoint",
            ));
        }
        Ok(())
    }

    /// The index of checkpoint `number` checked against this model (each parameter by path
    /// and global shape), and the renaming of canonical names to this model's ids.
    pub(crate) fn records_index(
        &self,
        dir: &Path,
        kind: &str,
        number: usize,
    ) -> Result<(Index, IdMap), FsdpError> {
        let index = records::read_index(dir, kind, number)?;
        let path = records::index_path(dir, kind, number);
        let saved: HashMap<&str, &Vec<usize>> =
            index.params.iter().map(|(p, shape)| (p.as_str(), shape)).collect();
        let mut ids = IdMap::new();
        for p in self.units.iter().flat_map(|u| u.params.iter()) {
            let Some(shape) = saved.get(p.path.as_str()) else {
                return Err(records::err(&path, format!("has no parameter `{}`", p.path)));
            };
            if **shape != p.global_shape {
                return Err(records::err(
                    &path,
                    format!(
                        "parameter `{}` was saved with shape {:?}; the model's is {:?}",
                        p.path, shape, p.global_shape
                    ),
                ));
            }
            ids.insert(records::canonical(&p.path), p.id.serialize());
        }
        if ids.len() != index.params.len() {
            return Err(records::err(
                &path,
                format!("holds {} sharded parameters; the model has {}", index.params.len(), ids.len()),
            ));
        }
        Ok((index, ids))
    }

    /// This rank's part of saved record `name`: every saved rank's rows gathered, cut to this
    /// rank's, the ids renamed to this model's.
    pub(crate) fn read_mine<R: Record<B>>(
        &self,
        dir: &Path,
        index: &Index,
        ids: &IdMap,
        name: &str,
    ) -> Result<R, FsdpError> {
        let device = self.mesh.device().clone();
        let saved = records::load_all::<R, B>(dir, index, name, &device)?;
        let whole = records::unshard(&saved, index)?;
        let mut mine = records::reslice(&whole, index, self.rank(), self.world())?;
        records::rename_ids(&mut mine, ids);
        records::from_value(mine, &device, &format!("the {name} record of {}", dir.display()))
    }

    /// Loads a model record of this rank's shards (from [`read_mine`](Self::read_mine)),
    /// keeping each parameter's dtype.
    pub(crate) fn load_module_record(&mut self, record: M::Record) {
        struct Dtypes(HashMap<ParamId, DType>);
        impl<B: Backend> ModuleVisitor<B> for Dtypes {
            fn visit_float<const D: usize>(&mut self, param: &Param<Tensor<B, D>>) {
                self.0.insert(param.id, param.val().dtype());
            }
        }
        impl<B: Backend> ModuleMapper<B> for Dtypes {
            fn map_float<const D: usize>(&mut self, param: Param<Tensor<B, D>>) -> Param<Tensor<B, D>> {
                match self.0.get(&param.id).copied() {
                    Some(dtype) if dtype != param.val().dtype() => param.map(|t| {
                        let grad = t.is_require_grad();
                        let t = t.detach().cast(dtype);
                        if grad { t.require_grad() } else { t }
                    }),
                    _ => param,
                }
            }
        }
        let mut dtypes = Dtypes(HashMap::new());
        self.module.visit(&mut dtypes);
        self.replace_module(|m| m.load_record(record).map(&mut dtypes));
    }
}
