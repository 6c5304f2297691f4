//! A toy model with awkward parameter shapes for FSDP tests: uneven rows for every world size.

use burn::module::{Module, Param};
use burn::tensor::backend::Backend;
use burn::tensor::{Tensor, TensorData};
use burn_fsdp::UnitRunner;

/// One block: `x + narrow(v · bᵀ)` with `v = [tanh(x · aᵀ), x[:, :10]]`.
#[derive(Module, Debug)]
pub struct ToyBlock<B: Backend> {
    /// `[7, 15]`.
    pub a: Param<Tensor<B, 2>>,
    /// `[16, 17]`.
    pub b: Param<Tensor<B, 2>>,
    /// `[17]`.
    pub bias: Param<Tensor<B, 1>>,
}

/// Root parameters `head` `[16, 15]` and `scale` `[15]`, and a `Vec` of blocks (the units).
#[derive(Module, Debug)]
pub struct Toy<B: Backend> {
    /// `[16, 15]`.
    pub head: Param<Tensor<B, 2>>,
    /// `[15]`.
    pub scale: Param<Tensor<B, 1>>,
    /// The blocks.
    pub blocks: Vec<ToyBlock<B>>,
}

fn det<B: Backend, const D: usize>(
    shape: [usize; D],
    seed: usize,
    device: &B::Device,
) -> Param<Tensor<B, D>> {
    let n: usize = shape.iter().product();
    let v: Vec<f32> =
        (0..n).map(|i| (((i * 7919 + seed * 104_729) % 1000) as f32 / 1000.0 - 0.5) * 0.4).collect();
    Param::from_tensor(Tensor::from_data(TensorData::new(v, shape), device))
}

impl<B: Backend> Toy<B> {
    /// A deterministic toy model with `blocks` blocks (same values on every call).
    pub fn new(blocks: usize, device: &B::Device) -> Self {
        Self {
            head: det([16, 15], 1, device),
            scale: Param::from_tensor(Tensor::ones([15], device)),
            blocks: (0..blocks)
                .map(|i| ToyBlock {
                    a: det([7, 15], 10 + i, device),
                    b: det([16, 17], 20 + i, device),
                    bias: det([17], 30 + i, device),
                })
                .collect(),
        }
    }

    /// `[n, 15]` → `[n, 16]` (fp32), each block run through `runner`. Computes in the dtype
    /// of its parameters (bf16 under a mixed-precision policy).
    pub fn forward_with<R: UnitRunner<B>>(&self, x: Tensor<B, 2>, runner: &mut R) -> Tensor<B, 2> {
        let scale = self.scale.val();
        let mut x = x.cast(scale.dtype()) * scale.unsqueeze();
        for block in &self.blocks {
            x = runner.run(block, x, |blk, x| {
                let u = x.clone().matmul(blk.a.val().transpose()).tanh();
                let v = Tensor::cat(vec![u, x.clone().narrow(1, 0, 10)], 1) + blk.bias.val().unsqueeze();
                let y = v.matmul(blk.b.val().transpose());
                x + y.narrow(1, 0, 15)
            });
        }
        x.matmul(self.head.val().transpose()).cast(burn::tensor::DType::F32)
    }

    /// Mean squared error against `target`.
    pub fn loss<R: UnitRunner<B>>(
        &self,
        x: Tensor<B, 2>,
        target: Tensor<B, 2>,
        runner: &mut R,
    ) -> Tensor<B, 1> {
        (self.forward_with(x, runner) - target).powf_scalar(2.0).mean()
    }
}

/// Deterministic inputs `[n, 15]` and targets `[n, 16]` of step `step`.
pub fn toy_batch<B: Backend>(step: usize, n: usize, device: &B::Device) -> (Tensor<B, 2>, Tensor<B, 2>) {
    let x: Vec<f32> = (0..n * 15).map(|i| ((i * 31 + step * 17) % 23) as f32 / 23.0 - 0.5).collect();
    let y: Vec<f32> = (0..n * 16).map(|i| ((i * 13 + step * 5) % 19) as f32 / 19.0 - 0.5).collect();
    (
        Tensor::from_data(TensorData::new(x, [n, 15]), device),
        Tensor::from_data(TensorData::new(y, [n, 16]), device),
    )
}
