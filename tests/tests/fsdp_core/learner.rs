//! FSDP inside burn-train's `Learner` (issue #42): a user's `SupervisedTraining` setup — their
//! `TrainStep`/`InferenceStep`, a Burn optimizer, a learning rate, the loss metric — runs over
//! W = 1, 2, 3 in-process ranks by changing the strategy only, and logs the per-epoch losses the
//! single-device `Learner` logs (≤ 1e-5), on two models:
//!
//! - a conv net with BatchNorm, its conv blocks marked `FsdpUnit`, trained with SGD + momentum.
//!   BatchNorm normalises each rank's rows by their own statistics, so the single-device
//!   reference takes the same rows as `W` micro-batches with burn-train's gradient accumulation
//!   (which sums them) and `lr / W` (SGD is linear in the gradient: the same steps);
//! - a text classifier on Burn's own `TransformerEncoder`, left as written (one unit), trained
//!   with AdamW; the single-device reference takes each step's rows of all ranks as one batch.
//!
//! The rows each rank takes: its contiguous `1/W` of the items; the reference's batches are laid
//! out so that step `k` holds the `k`-th batch of every rank.

use std::path::Path;

use burn::backend::autodiff::checkpoint::strategy::BalancedCheckpointing;
use burn::data::dataloader::batcher::Batcher;
use burn::data::dataloader::{DataLoader, DataLoaderBuilder};
use burn::data::dataset::InMemDataset;
use burn::module::Module;
use burn::nn::conv::{Conv2d, Conv2dConfig};
use burn::nn::loss::CrossEntropyLossConfig;
use burn::nn::transformer::{TransformerEncoder, TransformerEncoderConfig, TransformerEncoderInput};
use burn::nn::{
    BatchNorm, BatchNormConfig, Embedding, EmbeddingConfig, Linear, LinearConfig, PaddingConfig2d,
};
use burn::optim::momentum::MomentumConfig;
use burn::optim::{AdamWConfig, SgdConfig};
use burn::tensor::backend::{AutodiffBackend, Backend};
use burn::tensor::{Int, Tensor, TensorData};
use burn_fsdp::learner::FsdpStrategy;
use burn_fsdp::{FsdpBackend, FsdpConfig, FsdpUnit};
use burn_train::metric::LossMetric;
use burn_train::{
    ClassificationOutput, InferenceStep, Learner, SupervisedTraining, TrainOutput, TrainStep,
    TrainingStrategy,
};

use super::any_model::FB;

type IB = burn::backend::NdArray<f32>;

const ITEMS: usize = 72; // per-rank shares of 72, 36, 24 items: whole batches of 4
const BATCH: usize = 4;
const EPOCHS: usize = 2;
const CLASSES: usize = 3;

// ---------------------------------------------------------------------------------------
// Data: deterministic items; an item is (features, label).

#[derive(Clone, Debug)]
struct Sample {
    x: Vec<f32>,
    label: usize,
}

#[derive(Clone, Debug)]
struct Batch<B: Backend> {
    x: Tensor<B, 2>,
    targets: Tensor<B, 1, Int>,
}

#[derive(Clone, Default)]
struct Rows;

impl<B: Backend> Batcher<B, Sample, Batch<B>> for Rows {
    fn batch(&self, items: Vec<Sample>, device: &B::Device) -> Batch<B> {
        let width = items[0].x.len();
        let n = items.len();
        let x: Vec<f32> = items.iter().flat_map(|s| s.x.iter().copied()).collect();
        let y: Vec<i64> = items.iter().map(|s| s.label as i64).collect();
        Batch {
            x: Tensor::from_data(TensorData::new(x, [n, width]), device),
            targets: Tensor::from_data(TensorData::new(y, [n]), device),
        }
    }
}

fn samples(width: usize, tokens: bool, salt: usize) -> Vec<Sample> {
    (0..ITEMS)
        .map(|i| {
            let x = (0..width)
                .map(|j| {
                    let v = (i * 31 + j * 7 + salt * 13) % 17;
                    if tokens { (v % 11) as f32 } else { (v as f32 - 8.0) * 0.1 }
                })
                .collect();
            Sample { x, label: (i * 5 + salt) % CLASSES }
        })
        .collect()
}

/// The single-device order: step `k`'s batch holds the `k`-th batch of every rank's share.
fn interleaved(items: &[Sample], world: usize) -> Vec<Sample> {
    let per = items.len() / world;
    let mut out = Vec::new();
    for k in 0..per / BATCH {
        for r in 0..world {
            out.extend_from_slice(&items[r * per + k * BATCH..r * per + (k + 1) * BATCH]);
        }
    }
    out
}

fn loader<B: Backend>(items: Vec<Sample>, batch: usize) -> std::sync::Arc<dyn DataLoader<B, Batch<B>>> {
    DataLoaderBuilder::new(Rows).batch_size(batch).build(InMemDataset::new(items))
}

// ---------------------------------------------------------------------------------------
// Model 1: conv blocks with BatchNorm (each block an FSDP unit), a linear head.

const SIDE: usize = 6;

#[derive(Module, Debug)]
struct ConvBlock<B: Backend> {
    conv: Conv2d<B>,
    norm: BatchNorm<B>,
}

#[derive(Module, Debug)]
struct ConvNet<B: Backend> {
    blocks: Vec<FsdpUnit<ConvBlock<B>>>,
    head: Linear<B>,
}

impl<B: Backend> ConvNet<B> {
    fn new(device: &B::Device) -> Self {
        let block = |c_in, c_out| ConvBlock {
            conv: Conv2dConfig::new([c_in, c_out], [3, 3]).with_padding(PaddingConfig2d::Same).init(device),
            norm: BatchNormConfig::new(c_out).init(device),
        };
        Self {
            blocks: vec![FsdpUnit::new(block(1, 4)), FsdpUnit::new(block(4, 5))],
            head: LinearConfig::new(5 * SIDE * SIDE, CLASSES).init(device),
        }
    }

    fn forward(&self, x: Tensor<B, 2>, targets: Tensor<B, 1, Int>) -> ClassificationOutput<B> {
        let [n, _] = x.dims();
        let mut h = x.reshape([n, 1, SIDE, SIDE]);
        for block in &self.blocks {
            h = block.run(h, |b, h| b.norm.forward(b.conv.forward(h)).tanh());
        }
        let logits = self.head.forward(h.reshape([n, 5 * SIDE * SIDE]));
        let loss =
            CrossEntropyLossConfig::new().init(&logits.device()).forward(logits.clone(), targets.clone());
        ClassificationOutput::new(loss, logits, targets)
    }
}

// ---------------------------------------------------------------------------------------
// Model 2: a text classifier on Burn's TransformerEncoder, as written (no marks).

const SEQ: usize = 5;
const VOCAB: usize = 11;
const D_MODEL: usize = 8;

#[derive(Module, Debug)]
struct TextNet<B: Backend> {
    embedding: Embedding<B>,
    encoder: TransformerEncoder<B>,
    head: Linear<B>,
}

impl<B: Backend> TextNet<B> {
    fn new(device: &B::Device) -> Self {
        Self {
            embedding: EmbeddingConfig::new(VOCAB, D_MODEL).init(device),
            encoder: TransformerEncoderConfig::new(D_MODEL, 16, 2, 2).with_dropout(0.0).init(device),
            head: LinearConfig::new(D_MODEL, CLASSES).init(device),
        }
    }

    fn forward(&self, x: Tensor<B, 2>, targets: Tensor<B, 1, Int>) -> ClassificationOutput<B> {
        let [n, _] = x.dims();
        let tokens = x.int();
        let h = self.encoder.forward(TransformerEncoderInput::new(self.embedding.forward(tokens)));
        let logits = self.head.forward(h.mean_dim(1).reshape([n, D_MODEL]));
        let loss =
            CrossEntropyLossConfig::new().init(&logits.device()).forward(logits.clone(), targets.clone());
        ClassificationOutput::new(loss, logits, targets)
    }
}

macro_rules! steps {
    ($model:ident) => {
        impl<B: AutodiffBackend> TrainStep for $model<B> {
            type Input = Batch<B>;
            type Output = ClassificationOutput<B>;
            fn step(&self, batch: Batch<B>) -> TrainOutput<ClassificationOutput<B>> {
                let item = self.forward(batch.x, batch.targets);
                TrainOutput::new(self, item.loss.backward(), item)
            }
        }
        impl<B: Backend> InferenceStep for $model<B> {
            type Input = Batch<B>;
            type Output = ClassificationOutput<B>;
            fn step(&self, batch: Batch<B>) -> ClassificationOutput<B> {
                self.forward(batch.x, batch.targets)
            }
        }
    };
}
steps!(ConvNet);
steps!(TextNet);

/// `make`'s model with every parameter drawn now, from a fixed seed: its clones share the
/// values (a lazy parameter would draw again in each clone).
fn fixed<B: Backend, M: Module<B>>(make: impl FnOnce(&B::Device) -> M) -> M {
    struct Draw;
    impl<B: Backend> burn::module::ModuleMapper<B> for Draw {
        fn map_float<const D: usize>(
            &mut self,
            param: burn::module::Param<Tensor<B, D>>,
        ) -> burn::module::Param<Tensor<B, D>> {
            let (id, tensor, mapper) = param.consume();
            burn::module::Param::from_mapped_value(id, tensor, mapper)
        }
    }
    let device = Default::default();
    B::seed(&device, 7);
    make(&device).map(&mut Draw)
}

// ---------------------------------------------------------------------------------------
// Reading what the Learner logged.

/// Mean of each epoch's logged values of `metric` in `split`.
fn epoch_means(dir: &Path, split: &str, metric: &str) -> Vec<f64> {
    (1..=EPOCHS)
        .map(|e| {
            let file = dir.join(split).join(format!("epoch-{e}")).join(format!("{metric}.log"));
            let text = std::fs::read_to_string(&file).unwrap_or_else(|e| panic!("{}: {e}", file.display()));
            let (mut sum, mut n) = (0.0, 0.0);
            for line in text.lines().filter(|l| !l.is_empty()) {
                let mut parts = line.split(',');
                let v: f64 = parts.next().and_then(|v| v.parse().ok()).expect("a value");
                let c: f64 = parts.next().and_then(|c| c.parse().ok()).unwrap_or(1.0);
                sum += v * c;
                n += c;
            }
            sum / n
        })
        .collect()
}

fn close(name: &str, got: &[f64], want: &[f64]) {
    assert_eq!(got.len(), want.len(), "{name}: epochs");
    for (e, (g, w)) in got.iter().zip(want).enumerate() {
        let d = (g - w).abs() / w.abs().max(1e-12);
        assert!(d <= 1e-5, "{name}, epoch {}: {g} vs one device {w} ({d:e})", e + 1);
    }
    // The training moved: a test of a frozen model would pass trivially.
    if name.contains("train") {
        assert!((got[0] - got[got.len() - 1]).abs() > 1e-4, "{name}: the loss did not move: {got:?}");
    }
}

// ---------------------------------------------------------------------------------------

#[test]
fn conv_batchnorm_learner_over_fsdp_logs_the_losses_of_one_device() {
    let width = SIDE * SIDE;
    let (train, valid) = (samples(width, false, 0), samples(width, false, 1));
    for world in [1, 2, 3] {
        let dir = tempfile::tempdir().expect("tempdir");
        let lr = 0.1;
        let sgd = || SgdConfig::new().with_momentum(Some(MomentumConfig::new().with_momentum(0.9)));
        // One device: batch-size micro-batches, `world` of them accumulated, lr / world.
        let one = dir.path().join("one");
        let model = fixed::<FB, _>(ConvNet::new);
        SupervisedTraining::new(
            &one,
            loader::<FB>(interleaved(&train, world), BATCH),
            loader::<IB>(valid.clone(), BATCH),
        )
        .metrics((LossMetric::new(),))
        .grads_accumulation(world)
        .num_epochs(EPOCHS)
        .launch(Learner::new(model.clone(), sgd().init(), lr / world as f64));
        // FSDP: the strategy is the one change.
        let fsdp = dir.path().join("fsdp");
        let result = SupervisedTraining::new(
            &fsdp,
            loader::<FB>(train.clone(), BATCH),
            loader::<IB>(valid.clone(), BATCH),
        )
        .metrics((LossMetric::new(),))
        .with_training_strategy(FsdpStrategy::in_process(world, FsdpConfig::default()).into())
        .num_epochs(EPOCHS)
        .launch(Learner::new(model, sgd().init(), lr));
        close(
            &format!("conv W = {world}, train"),
            &epoch_means(&fsdp, "train", "Loss"),
            &epoch_means(&one, "train", "Loss"),
        );
        // The returned model is whole: the user's own type, every parameter full size.
        let model: ConvNet<IB> = result.model;
        assert_eq!(model.head.weight.dims(), [5 * SIDE * SIDE, CLASSES]);
    }
}

#[test]
fn transformer_text_classifier_learner_over_fsdp_logs_the_losses_of_one_device() {
    transformer_on::<FB>("NdArray", &[1, 2, 3]);
}

/// What users get by default: Burn's Flex CPU backend.
#[test]
fn transformer_text_classifier_learner_on_flex_the_default_backend() {
    type A = burn::backend::Autodiff<burn::backend::Flex, BalancedCheckpointing>;
    transformer_on::<A>("Flex", &[2, 3]);
}

fn transformer_on<A: FsdpBackend>(backend: &str, worlds: &[usize]) {
    let (train, valid) = (samples(SEQ, true, 0), samples(SEQ, true, 1));
    for &world in worlds {
        let dir = tempfile::tempdir().expect("tempdir");
        let adamw = || AdamWConfig::new().with_weight_decay(0.01);
        let lr = 0.01;
        let model = fixed::<A, _>(TextNet::new);
        let one = dir.path().join("one");
        let single = SupervisedTraining::new(
            &one,
            loader::<A>(interleaved(&train, world), BATCH * world),
            loader::<A::InnerBackend>(interleaved(&valid, world), BATCH * world),
        )
        .metrics((LossMetric::new(),))
        .num_epochs(EPOCHS)
        .launch(Learner::new(model.clone(), adamw().init(), lr));
        let fsdp = dir.path().join("fsdp");
        let strategy: TrainingStrategy<_> = FsdpStrategy::in_process(world, FsdpConfig::default()).into();
        let result = SupervisedTraining::new(
            &fsdp,
            loader::<A>(train.clone(), BATCH),
            loader::<A::InnerBackend>(valid.clone(), BATCH),
        )
        .metrics((LossMetric::new(),))
        .with_training_strategy(strategy)
        .num_epochs(EPOCHS)
        .launch(Learner::new(model, adamw().init(), lr));
        for split in ["train", "valid"] {
            close(
                &format!("transformer on {backend}, W = {world}, {split}"),
                &epoch_means(&fsdp, split, "Loss"),
                &epoch_means(&one, split, "Loss"),
            );
        }
        // The trained models agree too (the returned one is whole).
        let (a, b): (TextNet<A::InnerBackend>, TextNet<A::InnerBackend>) = (result.model, single.model);
        let x = loader::<A::InnerBackend>(valid.clone(), ITEMS).iter().next().expect("a batch");
        let (ya, yb) = (a.forward(x.x.clone(), x.targets.clone()), b.forward(x.x, x.targets));
        let (ya, yb): (Vec<f32>, Vec<f32>) =
            (ya.output.into_data().to_vec().expect("f32"), yb.output.into_data().to_vec().expect("f32"));
        let d = ya.iter().zip(&yb).map(|(p, q)| (p - q).abs()).fold(0.0f32, f32::max);
        assert!(d <= 1e-4, "{backend}, W = {world}: the trained models' logits differ by {d:e}");
    }
}

fn walk(dir: &Path) -> Vec<String> {
    let mut out = Vec::new();
    for entry in std::fs::read_dir(dir).into_iter().flatten().flatten() {
        let path = entry.path();
        if path.is_dir() {
            out.extend(walk(&path));
        } else {
            out.push(path.display().to_string());
        }
    }
    out
}

/// Copies the files of `from` into `to` (a checkpoint directory, one level deep).
fn copy_dir(from: &Path, to: &Path) {
    std::fs::create_dir_all(to).expect("mkdir");
    for entry in std::fs::read_dir(from).expect("read_dir") {
        let entry = entry.expect("entry");
        std::fs::copy(entry.path(), to.join(entry.file_name())).expect("copy");
    }
}

#[test]
fn learner_checkpoints_resume_at_another_world_size_as_one_device_resumes() {
    use burn::record::{FullPrecisionSettings, NamedMpkFileRecorder};
    let (train, valid) = (samples(SEQ, true, 0), samples(SEQ, true, 1));
    let adamw = || AdamWConfig::new().with_weight_decay(0.01);
    let lr = 0.01;
    let model = fixed::<FB, _>(TextNet::new);
    let dir = tempfile::tempdir().expect("tempdir");
    let recorder = NamedMpkFileRecorder::<FullPrecisionSettings>::new;
    // Epoch 1 at W = 2: FSDP with its sharded checkpoints; one device (the same rows per step)
    // with burn-train's own file checkpointer.
    let one = dir.path().join("one-epoch-1");
    SupervisedTraining::new(
        &one,
        loader::<FB>(interleaved(&train, 2), BATCH * 2),
        loader::<IB>(interleaved(&valid, 2), BATCH * 2),
    )
    .metrics((LossMetric::new(),))
    .with_file_checkpointer(recorder())
    .num_epochs(1)
    .launch(Learner::new(model.clone(), adamw().init(), lr));
    let sharded = dir.path().join("fsdp-checkpoints");
    let fsdp = dir.path().join("fsdp-epoch-1");
    SupervisedTraining::new(&fsdp, loader::<FB>(train.clone(), BATCH), loader::<IB>(valid.clone(), BATCH))
        .metrics((LossMetric::new(),))
        .with_training_strategy(
            FsdpStrategy::in_process(2, FsdpConfig::default()).checkpoints(&sharded).into(),
        )
        .num_epochs(1)
        .launch(Learner::new(model.clone(), adamw().init(), lr));
    assert!(sharded.join("epoch-1.json").exists(), "the index is written");
    // Epoch 2, resumed: at W = 3 and W = 1 from the W = 2 checkpoint; one device from its own.
    for world in [3, 1] {
        let one_resumed = dir.path().join(format!("one-resumed-{world}"));
        copy_dir(&one.join("checkpoint"), &one_resumed.join("checkpoint"));
        SupervisedTraining::new(
            &one_resumed,
            loader::<FB>(interleaved(&train, world), BATCH * world),
            loader::<IB>(interleaved(&valid, world), BATCH * world),
        )
        .metrics((LossMetric::new(),))
        .with_file_checkpointer(recorder())
        .checkpoint(1)
        .num_epochs(2)
        .launch(Learner::new(model.clone(), adamw().init(), lr));
        let resumed = dir.path().join(format!("fsdp-resumed-{world}"));
        SupervisedTraining::new(
            &resumed,
            loader::<FB>(train.clone(), BATCH),
            loader::<IB>(valid.clone(), BATCH),
        )
        .metrics((LossMetric::new(),))
        .with_training_strategy(
            FsdpStrategy::in_process(world, FsdpConfig::default()).checkpoints(&sharded).into(),
        )
        .checkpoint(1)
        .num_epochs(2)
        .launch(Learner::new(model.clone(), adamw().init(), lr));
        let read = |dir: &Path| {
            // burn-train's metric store numbers the epochs of a run from 1, a resumed run too
            // (one device and FSDP alike): the resumed epoch 2 is logged under `epoch-1`.
            let file = dir.join("train/epoch-1/Loss.log");
            let text = std::fs::read_to_string(&file).unwrap_or_else(|e| {
                let listing: Vec<String> = walk(dir);
                panic!("{}: {e}; the run wrote {listing:?}", file.display())
            });
            let v: Vec<f64> = text.lines().filter_map(|l| l.split(',').next()?.parse().ok()).collect();
            v.iter().sum::<f64>() / v.len() as f64
        };
        let (got, want) = (read(&resumed), read(&one_resumed));
        let d = (got - want).abs() / want.abs();
        assert!(d <= 1e-5, "resumed at W = {world}: epoch 2 loss {got} vs one device {want} ({d:e})");
    }
}

/// Logits of `model` on the validation items.
fn logits(model: &TextNet<IB>, items: &[Sample]) -> Vec<f32> {
    let batch = loader::<IB>(items.to_vec(), items.len()).iter().next().expect("a batch");
    model.forward(batch.x, batch.targets).output.into_data().to_vec().expect("f32")
}

fn max_diff(a: &[f32], b: &[f32]) -> f32 {
    a.iter().zip(b).map(|(p, q)| (p - q).abs()).fold(0.0, f32::max)
}

/// One rank per "process" (threads here, each launching its own `SupervisedTraining` with
/// `FsdpStrategy::over_mesh`) trains what in-process ranks train, every rank returns the whole
/// model, and global-norm clipping is applied.
#[test]
fn over_a_mesh_each_rank_launches_the_same_setup_and_clipping_applies() {
    use burn_fsdp::DeviceMesh;
    use burn_fsdp::comm::local::LocalGroup;
    use std::time::Duration;
    let (train, valid) = (samples(SEQ, true, 0), samples(SEQ, true, 1));
    let model = fixed::<FB, _>(TextNet::new);
    let dir = tempfile::tempdir().expect("tempdir");
    let adamw = || AdamWConfig::new().with_weight_decay(0.01);
    let in_process = |clip: Option<f64>, name: &str| -> TextNet<IB> {
        let mut strategy = FsdpStrategy::in_process(2, FsdpConfig::default());
        if let Some(max) = clip {
            strategy = strategy.clip_grad_norm(max);
        }
        SupervisedTraining::new(
            dir.path().join(name),
            loader::<FB>(train.clone(), BATCH),
            loader::<IB>(valid.clone(), BATCH),
        )
        .metrics((LossMetric::new(),))
        .with_training_strategy(strategy.into())
        .num_epochs(1)
        .launch(Learner::new(model.clone(), adamw().init(), 0.01))
        .model
    };
    let clipped = in_process(Some(0.05), "clipped");
    let unclipped = in_process(None, "unclipped");
    let groups = LocalGroup::new_group(2, Duration::from_secs(120));
    let meshed: Vec<TextNet<IB>> = std::thread::scope(|s| {
        let handles: Vec<_> = groups
            .into_iter()
            .enumerate()
            .map(|(r, group)| {
                let (model, train, valid, dir) =
                    (model.clone(), train.clone(), valid.clone(), dir.path().to_path_buf());
                s.spawn(move || {
                    let mesh = DeviceMesh::new_1d(group, Default::default());
                    let strategy = FsdpStrategy::over_mesh(mesh, FsdpConfig::default()).clip_grad_norm(0.05);
                    SupervisedTraining::new(
                        dir.join(format!("rank-{r}")),
                        loader::<FB>(train, BATCH),
                        loader::<IB>(valid, BATCH),
                    )
                    .metrics((LossMetric::new(),))
                    .with_training_strategy(strategy.into())
                    .num_epochs(1)
                    .launch(Learner::new(model, adamw().init(), 0.01))
                    .model
                })
            })
            .collect();
        handles.into_iter().map(|h| h.join().expect("rank")).collect()
    });
    let want = logits(&clipped, &valid);
    for (r, m) in meshed.iter().enumerate() {
        let d = max_diff(&logits(m, &valid), &want);
        assert!(d <= 1e-6, "rank {r} over a mesh vs in-process: logits differ by {d:e}");
    }
    let d = max_diff(&logits(&unclipped, &valid), &want);
    assert!(d > 1e-4, "clipping changed nothing ({d:e})");
}

/// Over a mesh of processes (threads here, each launching its own `SupervisedTraining`),
/// `global_metrics()` makes rank 0 log what in-process ranks log, the metrics of every rank's
/// items (the loss and the accuracy, which reads the logits and targets that travelled), line
/// for line; without it rank 0 logs its own items only.
#[test]
fn over_a_mesh_global_metrics_log_every_rank_s_items() {
    use burn_fsdp::DeviceMesh;
    use burn_fsdp::comm::local::LocalGroup;
    use burn_train::metric::AccuracyMetric;
    use std::time::Duration;
    const W: usize = 2;
    let (train, valid) = (samples(SEQ, true, 0), samples(SEQ, true, 1));
    let model = fixed::<FB, _>(TextNet::new);
    let dir = tempfile::tempdir().expect("tempdir");
    let adamw = || AdamWConfig::new().with_weight_decay(0.01);
    let run = |dir: &Path, strategy: TrainingStrategy<_>| {
        SupervisedTraining::new(dir, loader::<FB>(train.clone(), BATCH), loader::<IB>(valid.clone(), BATCH))
            .metrics((LossMetric::new(), AccuracyMetric::new()))
            .with_training_strategy(strategy)
            .num_epochs(1)
            .launch(Learner::new(model.clone(), adamw().init(), 0.01))
            .model
    };
    run(&dir.path().join("in-process"), FsdpStrategy::in_process(W, FsdpConfig::default()).into());
    for global in [true, false] {
        let groups = LocalGroup::new_group(W, Duration::from_secs(120));
        let name = if global { "global" } else { "own" };
        std::thread::scope(|s| {
            for (r, group) in groups.into_iter().enumerate() {
                let dir = dir.path().join(format!("{name}-{r}"));
                let run = &run;
                s.spawn(move || {
                    let strategy = FsdpStrategy::over_mesh(
                        DeviceMesh::new_1d(group, Default::default()),
                        FsdpConfig::default(),
                    );
                    run(&dir, if global { strategy.global_metrics().into() } else { strategy.into() })
                });
            }
        });
    }
    let root = dir.path();
    let read = |run: &str, file: &str| -> Vec<f64> {
        let path = root.join(run).join(file);
        let text = std::fs::read_to_string(&path)
            .unwrap_or_else(|e| panic!("{}: {e}; the run wrote {:?}", path.display(), walk(&root.join(run))));
        text.lines().filter_map(|l| l.split(',').next()?.parse().ok()).collect()
    };
    for file in [
        "train/epoch-1/Loss.log",
        "valid/epoch-1/Loss.log",
        "train/epoch-1/Accuracy.log",
        "valid/epoch-1/Accuracy.log",
    ] {
        let want = read("in-process", file);
        let got = read("global-0", file);
        assert_eq!(got.len(), want.len(), "{file}: rank 0 logs every rank's items ({} lines)", want.len());
        assert!(want.len() == ITEMS / BATCH, "{file}: one line per batch of every rank");
        for (i, (g, w)) in got.iter().zip(&want).enumerate() {
            assert!((g - w).abs() <= 1e-6 * w.abs().max(1.0), "{file} line {i}: {g} vs in-process {w}");
        }
        let own = read("own-0", file);
        assert_eq!(own.len(), want.len() / W, "{file}: without global_metrics rank 0 logs its own items");
    }
}
