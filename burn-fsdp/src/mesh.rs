//! Device meshes: named dimensions of ranks, each with its process group.

use std::sync::Arc;

use burn::tensor::backend::Backend;

use crate::comm::ProcessGroup;

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
}

impl<B: Backend> Clone for DeviceMesh<B> {
    fn clone(&self) -> Self {
        Self { names: self.names.clone(), groups: self.groups.clone(), device: self.device.clone() }
    }
}

impl<B: Backend> DeviceMesh<B> {
    /// A 1D mesh (dimension `"dp"`) over `group`, computing on `device`.
    pub fn new_1d(group: Arc<dyn ProcessGroup<B>>, device: B::Device) -> Self {
        Self { names: vec!["dp".to_owned()], groups: vec![group], device }
    }

    /// A mesh from named dimensions, outermost first.
    pub fn from_groups(dims: Vec<(String, Arc<dyn ProcessGroup<B>>)>, device: B::Device) -> Self {
        let (names, groups) = dims.into_iter().unzip();
        Self { names, groups, device }
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
