//! burn-train's `Learner` with FSDP: a text classifier on Burn's own `TransformerEncoder`,
//! trained by an ordinary `SupervisedTraining` setup (`TrainStep`/`InferenceStep`, AdamW, the
//! loss metric) once on one device and once over 2 in-process FSDP ranks.
//!
//! ```text
//! cargo run --release -p burn-fsdp --features learner --example learner_text_classifier
//! ```
//!
//! The model and its steps are exactly as a single-device user writes them; the FSDP run
//! differs by one line, the training strategy:
//!
//! ```text
//! .with_training_strategy(FsdpStrategy::in_process(2, FsdpConfig::default()).into())
//! ```
//!
//! Each rank takes its half of the items, in batches of `BATCH`; the one-device run takes the
//! two halves' batches together (`2 · BATCH` rows per step), so both see the same rows per
//! step and log the same per-epoch losses.

use std::path::Path;

use burn::backend::autodiff::checkpoint::strategy::BalancedCheckpointing;
use burn::backend::{Autodiff, NdArray};
use burn::data::dataloader::batcher::Batcher;
use burn::data::dataloader::{DataLoader, DataLoaderBuilder};
use burn::data::dataset::InMemDataset;
use burn::module::Module;
use burn::nn::loss::CrossEntropyLossConfig;
use burn::nn::transformer::{TransformerEncoder, TransformerEncoderConfig, TransformerEncoderInput};
use burn::nn::{Embedding, EmbeddingConfig, Linear, LinearConfig};
use burn::optim::AdamWConfig;
use burn::tensor::backend::{AutodiffBackend, Backend};
use burn::tensor::{Int, Tensor, TensorData};
use burn_fsdp::FsdpConfig;
use burn_fsdp::learner::FsdpStrategy;
use burn_train::metric::LossMetric;
use burn_train::{ClassificationOutput, InferenceStep, Learner, SupervisedTraining, TrainOutput, TrainStep};

/// FSDP's backend: re-gathering parameters in backward needs `BalancedCheckpointing`.
type B = Autodiff<NdArray<f32>, BalancedCheckpointing>;
type Inner = NdArray<f32>;

const ITEMS: usize = 96;
const BATCH: usize = 8;
const EPOCHS: usize = 2;
const SEQ: usize = 6;
const VOCAB: usize = 16;
const CLASSES: usize = 4;

// ------------------------------------------------------------------------------------------
// The user's code, single-device Burn as written.

/// Token embedding → Burn's `TransformerEncoder` → mean over positions → linear classifier.
#[derive(Module, Debug)]
struct TextClassifier<B: Backend> {
    embedding: Embedding<B>,
    encoder: TransformerEncoder<B>,
    output: Linear<B>,
}

impl<B: Backend> TextClassifier<B> {
    fn new(device: &B::Device) -> Self {
        Self {
            embedding: EmbeddingConfig::new(VOCAB, 16).init(device),
            encoder: TransformerEncoderConfig::new(16, 32, 2, 2).with_dropout(0.0).init(device),
            output: LinearConfig::new(16, CLASSES).init(device),
        }
    }

    fn forward(&self, tokens: Tensor<B, 2, Int>, labels: Tensor<B, 1, Int>) -> ClassificationOutput<B> {
        let h = self.encoder.forward(TransformerEncoderInput::new(self.embedding.forward(tokens)));
        let [n, _, d] = h.dims();
        let logits = self.output.forward(h.mean_dim(1).reshape([n, d]));
        let loss =
            CrossEntropyLossConfig::new().init(&logits.device()).forward(logits.clone(), labels.clone());
        ClassificationOutput::new(loss, logits, labels)
    }
}

#[derive(Clone, Debug)]
struct TextBatch<B: Backend> {
    tokens: Tensor<B, 2, Int>,
    labels: Tensor<B, 1, Int>,
}

impl<B: AutodiffBackend> TrainStep for TextClassifier<B> {
    type Input = TextBatch<B>;
    type Output = ClassificationOutput<B>;
    fn step(&self, batch: TextBatch<B>) -> TrainOutput<ClassificationOutput<B>> {
        let item = self.forward(batch.tokens, batch.labels);
        TrainOutput::new(self, item.loss.backward(), item)
    }
}

impl<B: Backend> InferenceStep for TextClassifier<B> {
    type Input = TextBatch<B>;
    type Output = ClassificationOutput<B>;
    fn step(&self, batch: TextBatch<B>) -> ClassificationOutput<B> {
        self.forward(batch.tokens, batch.labels)
    }
}

/// A sequence of tokens and its class (the class decides which tokens are frequent).
#[derive(Clone, Debug)]
struct Text {
    tokens: Vec<i64>,
    label: usize,
}

#[derive(Clone, Default)]
struct TextBatcher;

impl<B: Backend> Batcher<B, Text, TextBatch<B>> for TextBatcher {
    fn batch(&self, items: Vec<Text>, device: &B::Device) -> TextBatch<B> {
        let n = items.len();
        let tokens: Vec<i64> = items.iter().flat_map(|t| t.tokens.iter().copied()).collect();
        let labels: Vec<i64> = items.iter().map(|t| t.label as i64).collect();
        TextBatch {
            tokens: Tensor::from_data(TensorData::new(tokens, [n, SEQ]), device),
            labels: Tensor::from_data(TensorData::new(labels, [n]), device),
        }
    }
}

fn texts(salt: usize) -> Vec<Text> {
    (0..ITEMS)
        .map(|i| {
            let label = (i * 7 + salt) % CLASSES;
            let tokens =
                (0..SEQ).map(|j| ((label * 3 + (i * 5 + j * 11 + salt) % 5) % VOCAB) as i64).collect();
            Text { tokens, label }
        })
        .collect()
}

fn loader<X: Backend>(items: Vec<Text>, batch: usize) -> std::sync::Arc<dyn DataLoader<X, TextBatch<X>>> {
    DataLoaderBuilder::new(TextBatcher).batch_size(batch).build(InMemDataset::new(items))
}

// ------------------------------------------------------------------------------------------
// The two runs.

/// The model every run starts from: drawn once from a seed (its clones share the values).
fn initial_model() -> TextClassifier<B> {
    let device = Default::default();
    <B as Backend>::seed(&device, 42);
    let model = TextClassifier::<B>::new(&device);
    // Burn initialises parameters lazily: draw them now, once.
    model.clone().load_record(model.into_record())
}

/// The items in the order one device must see them to take, at each step, the batches the
/// `world` ranks take (rank `r` holds the `r`-th contiguous share of the items).
fn as_one_device(items: &[Text], world: usize) -> Vec<Text> {
    let per = items.len() / world;
    (0..per / BATCH)
        .flat_map(|k| (0..world).flat_map(move |r| r * per + k * BATCH..r * per + (k + 1) * BATCH))
        .map(|i| items[i].clone())
        .collect()
}

/// Per-epoch mean training loss, as the Learner logged it under `dir`.
fn epoch_losses(dir: &Path) -> Vec<f64> {
    (1..=EPOCHS)
        .map(|e| {
            let log =
                std::fs::read_to_string(dir.join(format!("train/epoch-{e}/Loss.log"))).unwrap_or_default();
            let values: Vec<f64> =
                log.lines().filter_map(|l| l.split(',').next().and_then(|v| v.parse().ok())).collect();
            values.iter().sum::<f64>() / values.len().max(1) as f64
        })
        .collect()
}

/// Trains on one device, then over `world` FSDP ranks; returns both runs' epoch losses.
fn run(world: usize, dir: &Path) -> (Vec<f64>, Vec<f64>) {
    let (train, valid) = (texts(0), texts(1));
    let model = initial_model();

    let one = dir.join("one-device");
    SupervisedTraining::new(
        &one,
        loader::<B>(as_one_device(&train, world), BATCH * world),
        loader::<Inner>(as_one_device(&valid, world), BATCH * world),
    )
    .metrics((LossMetric::new(),))
    .num_epochs(EPOCHS)
    .launch(Learner::new(model.clone(), AdamWConfig::new().init(), 5e-3));

    let fsdp = dir.join("fsdp");
    let trained = SupervisedTraining::new(&fsdp, loader::<B>(train, BATCH), loader::<Inner>(valid, BATCH))
        .metrics((LossMetric::new(),))
        .with_training_strategy(FsdpStrategy::in_process(world, FsdpConfig::default()).into())
        .num_epochs(EPOCHS)
        .launch(Learner::new(model, AdamWConfig::new().init(), 5e-3));
    // The trained model is whole and single-device: save it with Burn's recorder as usual.
    let _: TextClassifier<Inner> = trained.model;

    (epoch_losses(&one), epoch_losses(&fsdp))
}

fn main() {
    let dir = std::env::temp_dir().join("burn-fsdp-learner-example");
    let (one, fsdp) = run(2, &dir);
    println!("epoch losses, one device:      {one:.6?}");
    println!("epoch losses, FSDP on 2 ranks: {fsdp:.6?}");
    println!("artifacts (metric logs): {}", dir.display());
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_learner_over_fsdp_logs_the_losses_of_one_device() {
        let dir = std::env::temp_dir().join(format!("burn-fsdp-learner-example-test-{}", std::process::id()));
        let (one, fsdp) = run(2, &dir);
        let _ = std::fs::remove_dir_all(&dir);
        assert_eq!(one.len(), EPOCHS);
        for (e, (a, b)) in fsdp.iter().zip(&one).enumerate() {
            assert!((a - b).abs() <= 1e-5 * b.abs(), "epoch {}: FSDP {a} vs one device {b}", e + 1);
        }
        assert!(one[EPOCHS - 1] < one[0], "the loss went down: {one:?}");
    }
}
