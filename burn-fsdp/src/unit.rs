//! [`FsdpUnit`]: how a model marks the blocks FSDP shards and gathers one at a time, without
//! changing any forward signature.

use std::fmt::{Debug, Display};
use std::ops::Deref;

use burn::module::{
    AutodiffModule, Content, Devices, HasAutodiffModule, Module, ModuleDisplay, ModuleDisplayDefault,
    ModuleMapper, ModuleVisitor,
};
use burn::tensor::Tensor;
use burn::tensor::backend::{AutodiffBackend, Backend};

use crate::fsdp::scope;

/// A block of a model that FSDP makes one unit: its parameters are all-gathered together just
/// before it runs and freed after (FSDP2's `fully_shard(block)`), instead of with the rest of
/// the model.
///
/// The wrapper is transparent to Burn: its module path, its record and its parameters are
/// those of the module it holds (a checkpoint of `layers.0.weight` stays `layers.0.weight`),
/// and it derefs to that module. The one change in the model is at the call site, where the
/// block runs through [`run`](Self::run):
///
/// ```text
/// // before:                         after:
/// layers: Vec<Block<B>>,             layers: Vec<FsdpUnit<Block<B>>>,
/// x = layer.forward(x);              x = layer.run(x, |layer, x| layer.forward(x));
/// ```
///
/// Outside an FSDP forward (single-device code, tests) `run` just calls the closure. Inside
/// [`Fsdp::forward`](crate::Fsdp::forward) (or `forward_valid`) it finds that forward on its
/// thread and runs the block through it: the closure sees the block with its parameters
/// all-gathered, and backward reduce-scatters their gradients. A model that marks no unit is
/// one unit, gathered whole for each forward.
///
/// # Trade-off
/// The alternative, the explicit [`UnitRunner`](crate::UnitRunner) argument, shows in every
/// forward signature on the way to a block but needs no per-thread state; this wrapper keeps
/// signatures as written at the cost of a thread-local lookup per block (nanoseconds). Both
/// can be mixed. A block must return one tensor (the closure may capture more inputs).
///
/// # Example
///
/// ```
/// use burn::backend::NdArray;
/// use burn::nn::{Linear, LinearConfig};
/// use burn::tensor::Tensor;
/// use burn_fsdp::FsdpUnit;
///
/// let device = Default::default();
/// let block = FsdpUnit::new(LinearConfig::new(3, 2).init::<NdArray>(&device));
/// let x = Tensor::<NdArray, 2>::ones([4, 3], &device);
/// // No FSDP forward is running: the block runs as it is.
/// let y = block.run(x, |linear: &Linear<NdArray>, x| linear.forward(x));
/// assert_eq!(y.dims(), [4, 2]);
/// ```
#[derive(Clone, Debug)]
pub struct FsdpUnit<M> {
    module: M,
}

impl<M> FsdpUnit<M> {
    /// Marks `module` as one FSDP unit.
    pub fn new(module: M) -> Self {
        Self { module }
    }

    /// The module as stored: outside a forward, under FSDP, its parameters are this rank's
    /// shards.
    pub fn inner(&self) -> &M {
        &self.module
    }

    /// The module, unmarked.
    pub fn into_inner(self) -> M {
        self.module
    }

    /// Runs the block: `f(module, x)`, with the module's parameters all-gathered when an FSDP
    /// forward is running on this thread (see the type's docs).
    ///
    /// # Shapes
    /// Whatever `f` takes and returns.
    pub fn run<B: Backend, const D: usize>(
        &self,
        x: Tensor<B, D>,
        f: impl FnOnce(&M, Tensor<B, D>) -> Tensor<B, D>,
    ) -> Tensor<B, D>
    where
        M: Module<B>,
    {
        scope::with_host::<B, _>(|host| match host {
            Some(host) => scope::run_unit(host, &self.module, x, f),
            None => f(&self.module, x),
        })
    }
}

impl<M> From<M> for FsdpUnit<M> {
    fn from(module: M) -> Self {
        Self::new(module)
    }
}

impl<M> Deref for FsdpUnit<M> {
    type Target = M;

    fn deref(&self) -> &M {
        &self.module
    }
}

impl<B: Backend, M: Module<B>> Module<B> for FsdpUnit<M> {
    type Record = M::Record;

    fn collect_devices(&self, devices: Devices<B>) -> Devices<B> {
        self.module.collect_devices(devices)
    }

    fn fork(self, device: &B::Device) -> Self {
        Self::new(self.module.fork(device))
    }

    fn to_device(self, device: &B::Device) -> Self {
        Self::new(self.module.to_device(device))
    }

    fn num_params(&self) -> usize {
        self.module.num_params()
    }

    fn visit<V: ModuleVisitor<B>>(&self, visitor: &mut V) {
        scope::visit_marked(|| self.module.visit(visitor));
    }

    fn map<Mapper: ModuleMapper<B>>(self, mapper: &mut Mapper) -> Self {
        Self::new(self.module.map(mapper))
    }

    fn load_record(self, record: Self::Record) -> Self {
        Self::new(self.module.load_record(record))
    }

    fn into_record(self) -> Self::Record {
        self.module.into_record()
    }
}

impl<B: AutodiffBackend, M: AutodiffModule<B>> AutodiffModule<B> for FsdpUnit<M> {
    type InnerModule = FsdpUnit<M::InnerModule>;

    fn valid(&self) -> Self::InnerModule {
        FsdpUnit::new(self.module.valid())
    }

    fn from_inner(module: Self::InnerModule) -> Self {
        Self::new(M::from_inner(module.module))
    }
}

impl<B: AutodiffBackend, M: HasAutodiffModule<B>> HasAutodiffModule<B> for FsdpUnit<M>
where
    M::TrainModule: Debug + Send + Clone,
    <M::TrainModule as Module<B>>::Record: Send,
{
    type TrainModule = FsdpUnit<M::TrainModule>;
}

impl<M: ModuleDisplay> ModuleDisplayDefault for FsdpUnit<M> {
    fn content(&self, content: Content) -> Option<Content> {
        self.module.content(content)
    }

    fn num_params(&self) -> usize {
        self.module.num_params()
    }
}

impl<M: ModuleDisplay> ModuleDisplay for FsdpUnit<M> {}

impl<M: ModuleDisplay> Display for FsdpUnit<M> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "{}", self.module.format(Default::default()))
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use burn::backend::NdArray;
    use burn::nn::{Linear, LinearConfig};

    #[derive(burn::module::Module, Debug)]
    struct Net<B: Backend> {
        blocks: Vec<FsdpUnit<Linear<B>>>,
        head: Linear<B>,
    }

    #[test]
    fn the_wrapper_adds_nothing_to_paths_or_records() {
        let device = Default::default();
        let net = Net::<NdArray> {
            blocks: vec![FsdpUnit::new(LinearConfig::new(2, 2).init(&device))],
            head: LinearConfig::new(2, 1).init(&device),
        };
        let paths: Vec<String> =
            crate::walk::describe_params::<NdArray, _>(&net).into_iter().map(|(_, p, _)| p).collect();
        assert_eq!(paths, ["blocks.0.weight", "blocks.0.bias", "head.weight", "head.bias"]);
        let units = scope::discover_units::<NdArray, _>(&net);
        assert_eq!(units.len(), 2, "the block's two parameters are in a unit, the head's in none");
        assert!(units.values().all(|(u, name)| *u == 1 && name == "blocks.0"));
    }
}
