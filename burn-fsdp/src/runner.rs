//! The execution hook through which a model runs its FSDP units.
//!
//! Burn has no per-read hook on [`Param`](burn::module::Param), so a sharded model cannot
//! gather a parameter "when it is touched". Instead, a model that wants to be shardable runs
//! each of its blocks (decoder layers, …) through a [`UnitRunner`]. Without FSDP the
//! [`Direct`] runner just calls the block; FSDP's runner gathers the block's shards first and
//! drops the gathered view afterwards. The model code stays free of any parallelism: it only
//! says *where* its blocks run, as torchtitan models do by being plain `nn.Module`s.

use burn::module::Module;
use burn::tensor::{Tensor, backend::Backend};

/// Runs one block of a model on an activation.
///
/// `unit` is the block as stored in the model (for FSDP: holding shards), `x` its input
/// activation and `f` the block's forward. An implementation may call `f` with a different
/// view of `unit` (for FSDP: one whose parameters are all-gathered), but must call it exactly
/// once.
///
/// # Example
///
/// ```
/// use burn::backend::NdArray;
/// use burn::tensor::Tensor;
/// use burn_fsdp::runner::{Direct, UnitRunner};
///
/// let device = Default::default();
/// let x = Tensor::<NdArray, 2>::ones([2, 3], &device);
/// // Any Burn module can be a unit; `Relu` has no parameters.
/// let y = Direct.run(&burn::nn::Relu::new(), x, |_unit, x| x * 2);
/// assert_eq!(y.into_data().to_vec::<f32>().unwrap(), vec![2.0; 6]);
/// ```
pub trait UnitRunner<B: Backend> {
    /// Runs `f(unit, x)`, possibly on another view of `unit`.
    fn run<M: Module<B>, const D: usize>(
        &mut self,
        unit: &M,
        x: Tensor<B, D>,
        f: impl FnOnce(&M, Tensor<B, D>) -> Tensor<B, D>,
    ) -> Tensor<B, D>;

    /// [`run`](Self::run) for a block whose forward can run again: `f` changes nothing
    /// between runs and owns what it uses besides `unit` and `x`. A runner may then keep only
    /// `x` through forward and run `f` again in backward (activation checkpointing,
    /// [`crate::activation_checkpointing`]); the default runs it once, as [`run`](Self::run).
    fn run_recomputable<M: Module<B> + 'static, const D: usize>(
        &mut self,
        unit: &M,
        x: Tensor<B, D>,
        f: impl Fn(&M, Tensor<B, D>) -> Tensor<B, D> + 'static,
    ) -> Tensor<B, D> {
        self.run(unit, x, f)
    }
}

/// The runner of the thread: outside an FSDP forward it calls every block directly (plain
/// single-device execution); inside [`Fsdp::forward`](crate::Fsdp::forward) or
/// `forward_valid` it runs each block as that forward's runner does (gathering the block's
/// unit), as [`FsdpUnit::run`](crate::FsdpUnit::run) does. So a model whose plain `forward`
/// passes `&mut Direct` to its runner-taking forward works unchanged inside `fsdp.forward`.
#[derive(Debug, Clone, Copy, Default)]
pub struct Direct;

impl<B: Backend> UnitRunner<B> for Direct {
    fn run<M: Module<B>, const D: usize>(
        &mut self,
        unit: &M,
        x: Tensor<B, D>,
        f: impl FnOnce(&M, Tensor<B, D>) -> Tensor<B, D>,
    ) -> Tensor<B, D> {
        crate::fsdp::scope::with_host::<B, _>(|host| match host {
            Some(host) => crate::fsdp::scope::run_unit(host, unit, x, f),
            None => f(unit, x),
        })
    }
}
