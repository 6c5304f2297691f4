//! An MLP classifier trained with FSDP on 2 and 3 in-process ranks, with Burn's own AdamW and
//! cosine schedule, against the same training on one device.
//!
//! ```text
//! cargo run --release -p burn-fsdp --example mlp_classifier
//! ```
//!
//! The model is an ordinary Burn module (Burn's default initialisers); what FSDP adds to its
//! code is the `FsdpUnit` around each hidden layer (in the struct, and `layer.run(h, …)` where
//! it is called), which makes each layer its own unit; no signature changes. The reference weights
//! are saved once with Burn's recorder and loaded by every rank, as a pretrained checkpoint
//! would be.

use std::path::Path;
use std::time::Duration;

use burn::backend::autodiff::checkpoint::strategy::BalancedCheckpointing;
use burn::backend::{Autodiff, NdArray};
use burn::module::Module;
use burn::nn::loss::CrossEntropyLossConfig;
use burn::nn::{Linear, LinearConfig};
use burn::optim::lr_scheduler::LrScheduler;
use burn::optim::lr_scheduler::cosine::CosineAnnealingLrSchedulerConfig;
use burn::optim::{AdamWConfig, GradientsParams, Optimizer};
use burn::record::{FullPrecisionSettings, NamedMpkFileRecorder};
use burn::tensor::backend::Backend;
use burn::tensor::{Int, Tensor, TensorData};
use burn_fsdp::{DeviceMesh, Fsdp, FsdpConfig, FsdpUnit, ReduceOp, launch};

/// Features, hidden widths, classes.
const DIMS: [usize; 4] = [12, 32, 32, 5];
const ROWS: usize = 24;
const STEPS: usize = 8;

/// Hidden layers (each an FSDP unit) and an output layer (in the root unit).
#[derive(Module, Debug)]
struct Mlp<B: Backend> {
    hidden: Vec<FsdpUnit<Linear<B>>>,
    output: Linear<B>,
}

impl<B: Backend> Mlp<B> {
    fn new(device: &B::Device) -> Self {
        let hidden = (0..DIMS.len() - 2)
            .map(|i| FsdpUnit::new(LinearConfig::new(DIMS[i], DIMS[i + 1]).init(device)))
            .collect();
        Self { hidden, output: LinearConfig::new(DIMS[2], DIMS[3]).init(device) }
    }

    /// Mean cross-entropy of `x`'s rows against `labels`.
    fn loss(&self, x: Tensor<B, 2>, labels: Tensor<B, 1, Int>) -> Tensor<B, 1> {
        let mut h = x;
        for layer in &self.hidden {
            h = layer.run(h, |layer, h| burn::tensor::activation::relu(layer.forward(h)));
        }
        CrossEntropyLossConfig::new().init(&h.device()).forward(self.output.forward(h), labels)
    }
}

/// Rows `rows` of step `step`'s batch of a synthetic dataset: class `c` rows are a
/// class-specific pattern plus noise.
fn data<B: Backend>(
    step: usize,
    rows: std::ops::Range<usize>,
    device: &B::Device,
) -> (Tensor<B, 2>, Tensor<B, 1, Int>) {
    let n = rows.len();
    let sample = |r: usize| step * ROWS + r;
    let class = |i: usize| (i * 7 + i / 3) % DIMS[3];
    let x: Vec<f32> = rows
        .clone()
        .flat_map(|r| {
            let i = sample(r);
            (0..DIMS[0]).map(move |j| {
                (((class(i) + 1) * (j + 1)) as f32 * 0.7).sin() + 0.3 * ((i * 13 + j * 7) as f32 * 0.37).sin()
            })
        })
        .collect();
    let y: Vec<i64> = rows.map(|r| class(sample(r)) as i64).collect();
    (
        Tensor::from_data(TensorData::new(x, [n, DIMS[0]]), device),
        Tensor::from_data(TensorData::new(y, [n]), device),
    )
}

fn schedule() -> impl LrScheduler {
    CosineAnnealingLrSchedulerConfig::new(0.01, STEPS).init().expect("valid schedule")
}

fn recorder() -> NamedMpkFileRecorder<FullPrecisionSettings> {
    NamedMpkFileRecorder::new()
}

/// One device, the whole batch each step.
fn single(weights: &Path) -> Vec<f64> {
    type B = Autodiff<NdArray>;
    let device = Default::default();
    let mut model = Mlp::<B>::new(&device).load_file(weights, &recorder(), &device).expect("weights");
    let mut optim = AdamWConfig::new().with_weight_decay(0.05).init();
    let mut lr = schedule();
    (0..STEPS)
        .map(|step| {
            let (x, y) = data::<B>(step, 0..ROWS, &device);
            let loss = model.loss(x, y);
            let value = loss.clone().into_scalar() as f64;
            let grads = GradientsParams::from_grads(loss.backward(), &model);
            model = optim.step(lr.step(), model.clone(), grads);
            value
        })
        .collect()
}

/// FSDP over `world` in-process ranks, each on its `ROWS / world` rows.
fn fsdp(world: usize, weights: &Path) -> Vec<f64> {
    type B = Autodiff<NdArray, BalancedCheckpointing>;
    let weights = weights.to_path_buf();
    let losses = launch(world, Duration::from_secs(60), move |group| {
        let device = Default::default();
        let rank = group.rank();
        let model = Mlp::<B>::new(&device).load_file(&weights, &recorder(), &device).expect("weights");
        let mut fsdp = Fsdp::wrap(model, &DeviceMesh::new_1d(group, device), FsdpConfig::default())?;
        let mut optim = AdamWConfig::new().with_weight_decay(0.05).init();
        let mut lr = schedule();
        let per = ROWS / world;
        let mut losses = Vec::new();
        for step in 0..STEPS {
            let (x, y) = data::<B>(step, rank * per..(rank + 1) * per, &device);
            let loss = fsdp.forward(|model, _| model.loss(x, y));
            losses.push(fsdp.all_reduce_scalar(loss.clone().into_scalar() as f64, ReduceOp::Avg, "loss")?);
            let grads = fsdp.gradients(loss.backward());
            fsdp.step_with(&mut optim, lr.step(), grads)?;
        }
        Ok::<_, burn_fsdp::FsdpError>(losses)
    });
    losses.expect("FSDP training").remove(0)
}

/// Trains on one device and with FSDP at W = 2, 3; returns the largest relative loss difference.
fn run() -> f64 {
    let dir = std::env::temp_dir().join(format!("burn-fsdp-example-mlp-{}", std::process::id()));
    std::fs::create_dir_all(&dir).expect("temp dir");
    let weights = dir.join("mlp");
    Mlp::<NdArray>::new(&Default::default()).save_file(&weights, &recorder()).expect("save weights");
    let weights = weights.with_extension("mpk");
    let want = single(&weights);
    println!("one device: {}", fmt(&want));
    let mut worst = 0f64;
    for world in [2, 3] {
        let got = fsdp(world, &weights);
        let d = got.iter().zip(&want).map(|(a, b)| (a - b).abs() / b.abs()).fold(0.0, f64::max);
        println!("FSDP W={world}: {}  (max rel. diff {d:.1e})", fmt(&got));
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
