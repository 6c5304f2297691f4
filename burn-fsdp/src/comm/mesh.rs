//! Device meshes: named dimensions of ranks, each with its process group.

use std::sync::Arc;

use burn::tensor::backend::Backend;

use crate::comm::ProcessGroup;
use crate::tp::TensorParallel;

/// One rank's view of a mesh of ranks (1D now; the layout is ready for 2D).
///
/// Every dimension has a name and a [`ProcessGroup`] of the ranks that differ only in that
/// dimension's coordinate.
///
/// # Example
///
/// ```
/// use burn::backend::NdArray;
/// use burn_fsdp::{DeviceMesh, LocalGroup};
///
/// let groups = LocalGroup::new_group(1, std::time::Duration::from_secs(5));
/// let mesh = DeviceMesh::<NdArray>::new_1d(groups[0].clone(), Default::default());
/// assert_eq!((mesh.size(), mesh.rank()), (1, 0));
/// ```
pub struct DeviceMesh<B: Backend> {
    names: Vec<String>,
    groups: Vec<Arc<dyn ProcessGroup<B>>>,
    device: B::Device,
    tp: Option<Arc<TensorParallel<B>>>,
}

impl<B: Backend> Clone for DeviceMesh<B> {
    fn clone(&self) -> Self {
        Self {
            names: self.names.clone(),
            groups: self.groups.clone(),
            device: self.device.clone(),
            tp: self.tp.clone(),
        }
    }
}

impl<B: Backend> DeviceMesh<B> {
    /// A 1D mesh (dimension `"dp"`) over `group`, computing on `device`.
    pub fn new_1d(group: Arc<dyn ProcessGroup<B>>, device: B::Device) -> Self {
        Self { names: vec!["dp".to_owned()], groups: vec![group], device, tp: None }
    }

    /// A mesh from named dimensions, outermost first.
    pub fn from_groups(dims: Vec<(String, Arc<dyn ProcessGroup<B>>)>, device: B::Device) -> Self {
        let (names, groups) = dims.into_iter().unzip();
        Self { names, groups, device, tp: None }
    }

    /// A 2D mesh `[outer, inner]`, e.g. `("dp", dp_group)` × `("tp", tp_group)` for data ×
    /// tensor parallelism or `("replicate", …)` × `("shard", …)` for HSDP. Global rank =
    /// `outer_rank · inner_size + inner_rank` (row-major, as PyTorch's `init_device_mesh`).
    ///
    /// Each group is this rank's handle on its row or column of the mesh: ranks sharing the
    /// outer index form one inner group, ranks sharing the inner index one outer group.
    pub fn new_2d(
        outer: (&str, Arc<dyn ProcessGroup<B>>),
        inner: (&str, Arc<dyn ProcessGroup<B>>),
        device: B::Device,
    ) -> Self {
        Self {
            names: vec![outer.0.to_owned(), inner.0.to_owned()],
            groups: vec![outer.1, inner.1],
            device,
            tp: None,
        }
    }

    /// This data-parallel mesh with the model's tensor parallelism ([`TensorParallel::apply`]
    /// returns it): FSDP wrapped over it shards the tp-local parameters over the mesh, and its
    /// operations see the tp dimension — [`Fsdp::clip_grad_norm`](crate::Fsdp::clip_grad_norm)
    /// takes the norm over dp and tp, [`Fsdp::full_parameters`](crate::Fsdp::full_parameters)
    /// reassembles the tp slices, [`Fsdp::save_sharded`](crate::Fsdp::save_sharded) writes and
    /// [`Fsdp::load_sharded`](crate::Fsdp::load_sharded) reads whole parameters (the checkpoint
    /// loads on any mesh). PyTorch's `fully_shard(model, mesh=mesh["dp"])` after
    /// `parallelize_module(model, mesh["tp"], plan)`, where the parameters' DTensor placements
    /// carry what this carries.
    ///
    /// ```ignore
    /// let (model, tp) = TensorParallel::apply(model, tp_group, plan)?;
    /// let mesh = DeviceMesh::new_1d(dp_group, device).with_tensor_parallel(Arc::new(tp));
    /// let fsdp = Fsdp::wrap(model, &mesh, FsdpConfig::default())?;
    /// ```
    pub fn with_tensor_parallel(mut self, tp: Arc<TensorParallel<B>>) -> Self {
        self.tp = Some(tp);
        self
    }

    /// The tensor parallelism this mesh carries ([`with_tensor_parallel`](Self::with_tensor_parallel)).
    pub fn tensor_parallel(&self) -> Option<&Arc<TensorParallel<B>>> {
        self.tp.as_ref()
    }

    /// The 1D mesh of one named dimension (PyTorch's `mesh["dp"]`).
    pub fn submesh(&self, name: &str) -> Option<Self> {
        let i = self.names.iter().position(|n| n == name)?;
        Some(Self {
            names: vec![name.to_owned()],
            groups: vec![self.groups[i].clone()],
            device: self.device.clone(),
            tp: self.tp.clone(),
        })
    }

    /// Number of dimensions.
    pub fn ndim(&self) -> usize {
        self.groups.len()
    }

    /// Dimension names, outermost first.
    pub fn dim_names(&self) -> &[String] {
        &self.names
    }

    /// The group of dimension `name`.
    pub fn group(&self, name: &str) -> Option<&Arc<dyn ProcessGroup<B>>> {
        self.names.iter().position(|n| n == name).map(|i| &self.groups[i])
    }

    /// The group of dimension `i`.
    pub fn group_at(&self, i: usize) -> &Arc<dyn ProcessGroup<B>> {
        &self.groups[i]
    }

    /// Total number of ranks.
    pub fn size(&self) -> usize {
        self.groups.iter().map(|g| g.size()).product()
    }

    /// This rank's global index (row-major over the dimensions).
    pub fn rank(&self) -> usize {
        self.groups.iter().fold(0, |acc, g| acc * g.size() + g.rank())
    }

    /// The device this rank computes on.
    pub fn device(&self) -> &B::Device {
        &self.device
    }
}
