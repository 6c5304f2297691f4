//! The sharded state as a whole: full parameters, shard values, module replacement.

use super::*;

impl<B: FsdpBackend, M: Module<B>> Fsdp<B, M> {
    /// The bytes this rank holds in host memory under CPU offload (master shards, gradients,
    /// optimizer state); `None` without offload.
    pub fn offloaded_bytes(&self) -> Option<crate::offload::HostBytes> {
        self.host.as_deref().map(HostStore::bytes)
    }

    /// The host store of an offloaded FSDP (`None` without offload).
    pub(crate) fn host_store(&self) -> Option<&HostStore> {
        self.host.as_deref()
    }

    /// Every unsharded parameter as `(path, shape, values)`, gathered from all ranks (every
    /// rank must call this; each gets the full list). For export and checks. On a mesh
    /// carrying tensor parallelism ([`DeviceMesh::with_tensor_parallel`]), each parameter is
    /// also reassembled from its tp slices (every rank of the dp × tp mesh must call this).
    pub fn full_parameters(&self) -> Result<Vec<(String, Vec<usize>, TensorData)>, FsdpError> {
        let local = self.full_local_parameters()?;
        let Some(tp) = self.mesh.tensor_parallel() else { return Ok(local) };
        let device = self.mesh.device().clone();
        local
            .into_iter()
            .map(|(name, shape, data)| {
                let v = crate::downcast::f32_values(data, || format!("`{name}`"))?;
                let (shape, v) = tp.unsplit(&name, &shape, v, &device)?;
                let n = shape.clone();
                Ok((name, shape, TensorData::new(v, n)))
            })
            .collect()
    }

    /// [`full_parameters`](Self::full_parameters) of this tp rank's slices.
    pub(crate) fn full_local_parameters(&self) -> Result<Vec<(String, Vec<usize>, TensorData)>, FsdpError> {
        self.quiesce();
        let shards = self.shard_values()?;
        let group = self.shard_group();
        let mut out = Vec::new();
        for unit in &self.units {
            if unit.params.is_empty() {
                continue;
            }
            let values: Vec<f32> =
                unit.params.iter().flat_map(|p| shards.get(&p.id).cloned().unwrap_or_default()).collect();
            let n = values.len();
            let flat =
                Tensor::<B::InnerBackend, 1>::from_data(TensorData::new(values, [n]), self.mesh.device());
            let full = group.all_gather(flat, &Tag::new(format!("{}:export", unit.comm.name)))?;
            let g2 = full.reshape([self.world(), unit.shard_len()]);
            for (p, &off) in unit.params.iter().zip(&unit.offsets) {
                let cols = g2.clone().narrow(1, off, p.shard_numel());
                out.push((p.path.clone(), p.global_shape.clone(), p.unshard_flat(cols).into_data()));
            }
        }
        Ok(out)
    }

    /// This rank's padded shard of every parameter, flattened to `f32` host values.
    pub(crate) fn shard_values(&self) -> Result<HashMap<ParamId, Vec<f32>>, FsdpError> {
        if let Some(host) = &self.host {
            return Ok(self
                .units
                .iter()
                .flat_map(|u| u.params.iter())
                .filter_map(|p| host.get(p.id).map(|h| (p.id, h.shard)))
                .collect());
        }
        let path = |id: ParamId| {
            self.units
                .iter()
                .flat_map(|u| u.params.iter())
                .find(|p| p.id == id)
                .map_or_else(|| format!("parameter {id}"), |p| format!("`{}` (this rank's shard)", p.path))
        };
        let shards = collect_shards::<B, M>(&self.module, &self.param_unit, self.units.len());
        shards
            .into_iter()
            .flatten()
            .map(|(id, t)| {
                let t = Tensor::<B, 1>::from_primitive(TensorPrimitive::Float(B::float_reshape(
                    t.clone(),
                    burn::tensor::Shape::new([burn::tensor::TensorMetadata::shape(&t).num_elements()]),
                )));
                Ok((id, crate::downcast::f32_values(t.inner().into_data(), || path(id))?))
            })
            .collect()
    }

    /// Replaces the sharded module (checkpoint loading).
    pub(crate) fn replace_module(&mut self, f: impl FnOnce(M) -> M) {
        let module = self.module.clone();
        self.module = retie::<B, M>(f(module));
    }
}
/// Replaces the shards of one unit's parameters by their values cut out of the flat gathered
/// buffer, without autodiff (`forward_valid`, on the inner backend).
pub(super) struct Unsharder<'a, I: Backend> {
    pub(super) unit: &'a ParamGroup<I>,
    pub(super) gathered: FloatTensor<I>,
    pub(super) world: usize,
}
impl<I: Backend> ModuleMapper<I> for Unsharder<'_, I> {
    fn map_float<const D: usize>(&mut self, param: Param<Tensor<I, D>>) -> Param<Tensor<I, D>> {
        let (id, tensor, mapper) = param.consume();
        let Some(i) = self.unit.index_of(id) else {
            return Param::from_mapped_value(id, tensor, mapper);
        };
        let view = ParamView::of(&self.unit.params[i], self.unit.offsets[i]);
        let full = view.cut::<I>(self.gathered.clone(), self.world, self.unit.shard_len());
        Param::from_mapped_value(id, Tensor::from_primitive(TensorPrimitive::Float(full)), mapper)
    }
}
