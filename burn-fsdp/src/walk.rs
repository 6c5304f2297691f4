//! Walking a module's parameters: the dotted path of each ([`PathStack`]), their ids, paths
//! and shapes in visiting order, and which lazy ones a deferred initialiser provides. Shared by
//! FSDP's wrap, its rank-0 broadcast and tensor parallelism, none of which this depends on.

use burn::module::{Module, ModuleVisitor, Param, ParamId};
use burn::tensor::Tensor;
use burn::tensor::backend::Backend;

use crate::fsdp::init::ShardInit;

/// Tracks the dotted module path (`model.layers.0.mlp.up_proj.weight`) while a
/// `ModuleVisitor`/`ModuleMapper` walks a module: push in `enter_module`, pop in
/// `exit_module`, read with [`current`](PathStack::current) at each parameter.
#[derive(Debug, Default, Clone)]
pub struct PathStack(Vec<String>);

impl PathStack {
    /// Enters a submodule (a field name or a `Vec` index).
    pub fn push(&mut self, s: &str) {
        self.0.push(s.to_owned());
    }
    /// Leaves the innermost submodule.
    pub fn pop(&mut self) {
        self.0.pop();
    }
    /// The dotted path of the current position.
    pub fn current(&self) -> String {
        self.0.join(".")
    }
    /// The segments of the current position.
    pub(crate) fn segments(&self) -> &[String] {
        &self.0
    }
}

/// `(id, path, shape)` of every float parameter, in visiting order, each id once.
pub(crate) fn describe_params<B: Backend, M: Module<B>>(module: &M) -> Vec<(ParamId, String, Vec<usize>)> {
    describe_float_tensors::<B, M>(module, None)
        .into_iter()
        .map(|(id, path, shape, _)| (id, path, shape))
        .collect()
}

/// `(id, path, shape, requires_grad)` of every float tensor a module visits — trainable
/// parameters, frozen parameters and buffers (`RunningState`, which Burn visits as float
/// parameters that do not require grad) — in visiting order, each id once.
///
/// Lazy parameters that `deferred` provides are described from their lazy shape, as trainable,
/// without running their initialisers; every other tensor is read (lazy ones initialised).
pub(crate) fn describe_float_tensors<B: Backend, M: Module<B>>(
    module: &M,
    deferred: Option<&dyn ShardInit>,
) -> Vec<(ParamId, String, Vec<usize>, bool)> {
    struct Describe<'a>(PathStack, Vec<(ParamId, String, Vec<usize>, bool)>, Option<&'a dyn ShardInit>);
    impl<B: Backend> ModuleVisitor<B> for Describe<'_> {
        fn enter_module(&mut self, name: &str, _: &str) {
            self.0.push(name);
        }
        fn exit_module(&mut self, _: &str, _: &str) {
            self.0.pop();
        }
        fn visit_float<const D: usize>(&mut self, param: &Param<Tensor<B, D>>) {
            if !self.1.iter().any(|(id, ..)| *id == param.id) {
                let path = self.0.current();
                if let Some(shape) = deferred_shape(self.2, &path, param) {
                    self.1.push((param.id, path, shape, true));
                    return;
                }
                let value = param.val();
                self.1.push((param.id, path, value.dims().to_vec(), value.is_require_grad()));
            }
        }
    }
    let mut d = Describe(PathStack::default(), Vec::new(), deferred);
    module.visit(&mut d);
    d.1
}

/// The full shape of `param` when it is still lazy and `deferred` provides it (so it must not
/// be read: its shards come from `deferred`).
pub(crate) fn deferred_shape<B: Backend, const D: usize>(
    deferred: Option<&dyn ShardInit>,
    path: &str,
    param: &Param<Tensor<B, D>>,
) -> Option<Vec<usize>> {
    let init = deferred?;
    if param.is_initialized() {
        return None;
    }
    let shape = param.lazy_shape().to_vec();
    init.provides(path, &shape).then_some(shape)
}
