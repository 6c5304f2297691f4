//! A small conv net with BatchNorm trained with FSDP on 2 and 3 in-process ranks, with Burn's
//! SGD (momentum), against one device.
//!
//! ```text
//! cargo run --release -p burn-fsdp --example conv_batchnorm
//! ```
//!
//! BatchNorm's running statistics are buffers: FSDP leaves them whole on every rank, outside
//! all collectives, as PyTorch FSDP2 does. In training mode each rank normalises with its own
//! rows' statistics, so the one-device reference splits each batch into the ranks' rows as
//! micro-batches and averages their gradients.

use std::path::Path;
use std::time::Duration;

use burn::backend::autodiff::checkpoint::strategy::BalancedCheckpointing;
use burn::backend::{Autodiff, NdArray};
use burn::module::Module;
use burn::nn::conv::{Conv2d, Conv2dConfig};
use burn::nn::loss::CrossEntropyLossConfig;
use burn::nn::pool::{AdaptiveAvgPool2d, AdaptiveAvgPool2dConfig};
use burn::nn::{BatchNorm, BatchNormConfig, Linear, LinearConfig, PaddingConfig2d};
use burn::optim::momentum::MomentumConfig;
use burn::optim::{GradientsAccumulator, GradientsParams, Optimizer, SgdConfig};
use burn::record::{FullPrecisionSettings, NamedMpkFileRecorder};
use burn::tensor::backend::Backend;
use burn::tensor::{Int, Tensor, TensorData};
use burn_fsdp::{DeviceMesh, Fsdp, FsdpConfig, FsdpUnit, ReduceOp, launch};

const CHANNELS: [usize; 3] = [1, 6, 10];
const SIDE: usize = 8;
const CLASSES: usize = 4;
const ROWS: usize = 12;
const STEPS: usize = 6;
const LR: f64 = 0.1;

/// Conv 3×3 → BatchNorm → ReLU.
#[derive(Module, Debug)]
struct ConvBlock<B: Backend> {
    conv: Conv2d<B>,
    norm: BatchNorm<B>,
}

/// Conv blocks (each an FSDP unit), global average pooling, a linear classifier (root unit).
#[derive(Module, Debug)]
struct ConvNet<B: Backend> {
    blocks: Vec<FsdpUnit<ConvBlock<B>>>,
    pool: AdaptiveAvgPool2d,
    classifier: Linear<B>,
}

impl<B: Backend> ConvNet<B> {
    fn new(device: &B::Device) -> Self {
        let blocks = (0..CHANNELS.len() - 1)
            .map(|i| {
                FsdpUnit::new(ConvBlock {
                    conv: Conv2dConfig::new([CHANNELS[i], CHANNELS[i + 1]], [3, 3])
                        .with_padding(PaddingConfig2d::Same)
                        .init(device),
                    norm: BatchNormConfig::new(CHANNELS[i + 1]).init(device),
                })
            })
            .collect();
        Self {
            blocks,
            pool: AdaptiveAvgPool2dConfig::new([1, 1]).init(),
            classifier: LinearConfig::new(CHANNELS[CHANNELS.len() - 1], CLASSES).init(device),
        }
    }

    fn loss(&self, x: Tensor<B, 4>, labels: Tensor<B, 1, Int>) -> Tensor<B, 1> {
        let mut h = x;
        for block in &self.blocks {
            h = block.run(h, |b, h| burn::tensor::activation::relu(b.norm.forward(b.conv.forward(h))));
        }
        let features = self.pool.forward(h).flatten::<2>(1, 3);
        CrossEntropyLossConfig::new()
            .init(&features.device())
            .forward(self.classifier.forward(features), labels)
    }
}

/// Rows `rows` of step `step`'s batch of synthetic images: a class-specific stripe pattern
/// plus noise.
fn data<B: Backend>(
    step: usize,
    rows: std::ops::Range<usize>,
    device: &B::Device,
) -> (Tensor<B, 4>, Tensor<B, 1, Int>) {
    let n = rows.len();
    let sample = |r: usize| step * ROWS + r;
    let class = |i: usize| (i * 5 + i / 4) % CLASSES;
    let x: Vec<f32> = rows
        .clone()
        .flat_map(|r| {
            let i = sample(r);
            (0..SIDE * SIDE).map(move |p| {
                let (row, col) = (p / SIDE, p % SIDE);
                let stripe = match class(i) {
                    0 => row,
                    1 => col,
                    2 => row + col,
                    _ => row + SIDE - col,
                };
                (stripe as f32 * 1.3).sin() + 0.3 * ((i * 31 + p * 3) as f32 * 0.21).cos()
            })
        })
        .collect();
    let y: Vec<i64> = rows.map(|r| class(sample(r)) as i64).collect();
    (
        Tensor::from_data(TensorData::new(x, [n, 1, SIDE, SIDE]), device),
        Tensor::from_data(TensorData::new(y, [n]), device),
    )
}

fn sgd<B: burn::tensor::backend::AutodiffBackend, M: burn::module::AutodiffModule<B>>() -> impl Optimizer<M, B>
{
    SgdConfig::new().with_momentum(Some(MomentumConfig::new().with_momentum(0.9))).init()
}

fn recorder() -> NamedMpkFileRecorder<FullPrecisionSettings> {
    NamedMpkFileRecorder::new()
}

/// One device: each batch as `world` micro-batches (the ranks' rows), gradients averaged.
fn single(world: usize, weights: &Path) -> Vec<f64> {
    type B = Autodiff<NdArray>;
    let device = Default::default();
    let mut model = ConvNet::<B>::new(&device).load_file(weights, &recorder(), &device).expect("weights");
    let mut optim = sgd();
    let per = ROWS / world;
    (0..STEPS)
        .map(|step| {
            let mut accum = GradientsAccumulator::new();
            let mut total = 0.0;
            for r in 0..world {
                let (x, y) = data::<B>(step, r * per..(r + 1) * per, &device);
                let loss = model.loss(x, y).div_scalar(world as f64);
                total += loss.clone().into_scalar() as f64;
                accum.accumulate(&model, GradientsParams::from_grads(loss.backward(), &model));
            }
            model = optim.step(LR, model.clone(), accum.grads());
            total
        })
        .collect()
}

/// FSDP over `world` in-process ranks.
fn fsdp(world: usize, weights: &Path) -> Vec<f64> {
    type B = Autodiff<NdArray, BalancedCheckpointing>;
    let weights = weights.to_path_buf();
    let losses = launch(world, Duration::from_secs(60), move |group| {
        let device = Default::default();
        let rank = group.rank();
        let model = ConvNet::<B>::new(&device).load_file(&weights, &recorder(), &device).expect("weights");
        let mut fsdp = Fsdp::wrap(model, &DeviceMesh::new_1d(group, device), FsdpConfig::default())?;
        assert!(fsdp.replicated_tensors().iter().all(|p| p.contains("running_")));
        let mut optim = sgd();
        let per = ROWS / world;
        let mut losses = Vec::new();
        for step in 0..STEPS {
            let (x, y) = data::<B>(step, rank * per..(rank + 1) * per, &device);
            let loss = fsdp.forward(|model, _| model.loss(x, y));
            losses.push(fsdp.all_reduce_scalar(loss.clone().into_scalar() as f64, ReduceOp::Avg, "loss")?);
            let grads = fsdp.gradients(loss.backward());
            fsdp.step_with(&mut optim, LR, grads)?;
        }
        Ok::<_, burn_fsdp::FsdpError>(losses)
    });
    losses.expect("FSDP training").remove(0)
}

/// Trains with FSDP at W = 2, 3 and the one-device references; the largest relative loss
/// difference.
fn run() -> f64 {
    let dir = std::env::temp_dir().join(format!("burn-fsdp-example-conv-{}", std::process::id()));
    std::fs::create_dir_all(&dir).expect("temp dir");
    let weights = dir.join("convnet");
    ConvNet::<NdArray>::new(&Default::default()).save_file(&weights, &recorder()).expect("save weights");
    let weights = weights.with_extension("mpk");
    let mut worst = 0f64;
    for world in [2, 3] {
        let want = single(world, &weights);
        let got = fsdp(world, &weights);
        let d = got.iter().zip(&want).map(|(a, b)| (a - b).abs() / b.abs()).fold(0.0, f64::max);
        println!("W={world} one device (micro-batches): {}", fmt(&want));
        println!("W={world} FSDP:                       {}  (max rel. diff {d:.1e})", fmt(&got));
        worst = worst.max(d);
    }
    let _ = std::fs::remove_dir_all(&dir);
    worst
}

fn fmt(losses: &[f64]) -> String {
    losses.iter().map(|l| format!("{l:.5}")).collect::<Vec<_>>().join(" ")
}

fn main() {
    let worst = run();
    assert!(worst < 1e-5, "FSDP differs from one device by {worst:e}");
    println!("FSDP matches one device (max rel. loss diff {worst:.1e} < 1e-5)");
}

#[cfg(test)]
mod tests {
    #[test]
    fn fsdp_matches_one_device() {
        let worst = super::run();
        assert!(worst < 1e-5, "{worst:e}");
    }
}
