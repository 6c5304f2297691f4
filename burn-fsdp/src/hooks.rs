//! Module hooks: what a model calls at the inputs and outputs of its submodules, through which
//! tensor parallelism inserts its collectives (see [`crate::tp`]).

use burn::tensor::Tensor;
use burn::tensor::backend::Backend;

/// Hooks a model calls at the inputs and outputs of its submodules, named by module path
/// relative to the unit (e.g. `self_attn`, `mlp`) — Burn's counterpart of PyTorch's module
/// forward hooks, through which tensor parallelism inserts its collectives without the model
/// knowing (see [`crate::tp`]).
///
/// # Shapes
/// - activations: `[batch, seq, hidden]`
pub trait ModuleHooks<B: Backend> {
    /// Called with the input of submodule `path`; returns what the submodule sees.
    fn input(&self, path: &str, x: Tensor<B, 3>) -> Tensor<B, 3> {
        let _ = path;
        x
    }
    /// Called with the output of submodule `path`; returns what the model continues with.
    fn output(&self, path: &str, y: Tensor<B, 3>) -> Tensor<B, 3> {
        let _ = path;
        y
    }
}

/// No hooks: every input and output passes unchanged.
#[derive(Debug, Clone, Copy, Default)]
pub struct NoHooks;

impl<B: Backend> ModuleHooks<B> for NoHooks {}
