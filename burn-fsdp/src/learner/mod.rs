//! FSDP inside burn-train's `Learner` (feature `learner`): [`FsdpStrategy`], a
//! `SupervisedLearningStrategy` that runs a user's existing `SupervisedTraining` setup — their
//! `TrainStep`/`InferenceStep`, Burn optimizer, `LrScheduler` and metrics — over FSDP ranks.
//!
//! The change to a single-device setup is one line:
//!
//! ```text
//! SupervisedTraining::new(dir, train, valid)
//!     .metrics((LossMetric::new(),))
//! +   .with_training_strategy(FsdpStrategy::in_process(4, FsdpConfig::default()).into())
//!     .num_epochs(3)
//!     .launch(Learner::new(model, optim, lr));
//! ```
//!
//! What the strategy does, per rank (a thread for [`in_process`](FsdpStrategy::in_process); one
//! process each with [`over_mesh`](FsdpStrategy::over_mesh)):
//! - shards the learner's model with [`Fsdp::wrap`] (units: the blocks the model marks with
//!   [`FsdpUnit`](crate::FsdpUnit), else the whole model as one);
//! - takes its contiguous `1/W` of the training and validation items (the same count on every
//!   rank: a remainder of fewer than `W` items is left out, as `drop_last` would);
//! - runs the user's `TrainStep::step` inside [`Fsdp::try_forward`] (so its
//!   `GradientsParams::from_grads(loss.backward(), self)` is the averaged shard gradients), the
//!   optimizer step on the shards (Burn's optimizers are element-wise: a shard's step is the
//!   full step's rows), and `InferenceStep::step` inside [`Fsdp::forward_valid`];
//! - rank 0 renders the metrics of every rank's items (in-process ranks send theirs to rank 0):
//!   the metric values are those of the global batch, as one device would log them. Over a
//!   mesh of processes the same needs [`global_metrics`](FsdpStrategy::global_metrics): each
//!   step's items are all-gathered as bytes (burn-train's outputs are [`MeshItem`]s; implement
//!   it for an output of your own). Without it, rank 0 renders its own items' metrics: values
//!   of its `1/W` of each batch.
//!
//! The trained model the `Learner` returns is whole (gathered from the shards), the user's own
//! model type: `model.save_file(…)` writes a Burn record that single-device code loads.
//!
//! # Checkpoints
//! With [`FsdpStrategy::checkpoints`]`(dir)`, every rank saves its learner's records after each
//! epoch — burn-train's own `LearningCheckpointer`, so the state of any Burn optimizer (Adam,
//! AdamW, SGD with momentum, RmsProp, …), buffers (BatchNorm's running statistics, rank 0's)
//! and the scheduler are saved as they are — and rank 0 writes `epoch-N.json` last (the
//! format of [`Fsdp::save_records`], per epoch).
//! `SupervisedTraining::checkpoint(N)` resumes from it at any world size: the whole model and
//! optimizer state are rebuilt from every saved rank's rows (each rank reads all the files:
//! the whole state passes through each rank's memory once) and cut to the new ranks' rows.
//! Tested: saved at W = 2, resumed at W = 3 and 1, the next epoch's loss equals one device
//! resumed from burn-train's own checkpoint (`tests/tests/fsdp_core/learner.rs`).
//!
//! # Differences from one device, stated
//! - BatchNorm normalises each rank's rows with their own statistics (PyTorch FSDP/DDP do the
//!   same unless SyncBatchNorm), and the running statistics the returned model carries are rank
//!   0's.
//! - Burn's per-parameter `GradientClippingConfig::Norm` would clip each *shard* by its own norm;
//!   use [`FsdpStrategy::clip_grad_norm`] (the global norm, PyTorch's `clip_grad_norm_`).
//! - Gradient accumulation (`SupervisedTraining::grads_accumulation`) reduce-scatters every
//!   micro-batch (same numbers as one device; no communication saved).

mod items;

pub use items::MeshItem;

use std::any::Any;
use std::path::PathBuf;
use std::sync::mpsc::{Receiver, Sender, channel};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use burn::data::dataloader::Progress;
use burn::module::{AutodiffModule, Module, ModuleMapper, Param};
use burn::optim::GradientsAccumulator;
use burn::tensor::Tensor;
use burn::tensor::backend::{AutodiffBackend, Backend};
use burn_train::checkpoint::{
    AsyncCheckpointer, CheckpointingAction, CheckpointingStrategy, FileCheckpointer,
};
use burn_train::metric::store::EventStoreClient;
use burn_train::{
    EventProcessorTraining, InferenceStep, Learner, LearnerEvent, LearnerModelRecord, LearnerOptimizerRecord,
    LearnerSchedulerRecord, LearningCheckpointer, LearningComponentsTypes, LearningResult,
    SupervisedLearningStrategy, SupervisedTrainingEventProcessor, TrainLoader, TrainStep, TrainingComponents,
    TrainingItem, TrainingModel, TrainingStrategy, ValidLoader,
};

use crate::comm::local::LocalGroup;
use crate::comm::mesh::DeviceMesh;
use crate::comm::{ProcessGroup, Tag};
use crate::fsdp::{Fsdp, FsdpConfig, FsdpError};
use crate::op::FsdpBackend;
use crate::records;

/// Where the ranks run.
#[derive(Clone)]
enum Ranks<B: FsdpBackend> {
    /// `world` threads of this process, on the model's device (or one device each).
    InProcess { world: usize, devices: Option<Vec<B::Device>> },
    /// This process is one rank of `mesh` (TCP, MPI, …).
    Mesh(DeviceMesh<B::InnerBackend>),
}

/// burn-train's learning strategy for FSDP: see the [module docs](self).
///
/// # Example
///
/// ```no_run
/// # use burn_fsdp::FsdpConfig;
/// # use burn_fsdp::learner::FsdpStrategy;
/// # type B = burn::backend::Autodiff<burn::backend::NdArray, burn::backend::autodiff::checkpoint::strategy::BalancedCheckpointing>;
/// let strategy = FsdpStrategy::<B>::in_process(4, FsdpConfig::default()).clip_grad_norm(1.0);
/// // SupervisedTraining::new(…).with_training_strategy(strategy.into())
/// ```
#[derive(Clone)]
pub struct FsdpStrategy<B: FsdpBackend> {
    ranks: Ranks<B>,
    config: FsdpConfig,
    clip: Option<f64>,
    timeout: Duration,
    checkpoints: Option<PathBuf>,
    /// How items travel between processes ([`Codec`] of the learner's output types), set by
    /// converting a [`GlobalMetrics`].
    codec: Option<Arc<dyn Any + Send + Sync>>,
}

impl<B: FsdpBackend> std::fmt::Debug for FsdpStrategy<B> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        let world = match &self.ranks {
            Ranks::InProcess { world, .. } => *world,
            Ranks::Mesh(mesh) => mesh.size(),
        };
        f.debug_struct("FsdpStrategy")
            .field("world", &world)
            .field("config", &self.config)
            .field("clip", &self.clip)
            .field("global_metrics", &self.codec.is_some())
            .finish()
    }
}

impl<B: FsdpBackend> FsdpStrategy<B> {
    /// FSDP over `world` ranks, threads of this process, all on the model's device.
    pub fn in_process(world: usize, config: FsdpConfig) -> Self {
        Self {
            ranks: Ranks::InProcess { world, devices: None },
            config,
            clip: None,
            timeout: Duration::from_secs(300),
            checkpoints: None,
            codec: None,
        }
    }

    /// FSDP over one in-process rank per device (rank `r` on `devices[r]`).
    pub fn on_devices(devices: Vec<B::Device>, config: FsdpConfig) -> Self {
        let world = devices.len();
        Self {
            ranks: Ranks::InProcess { world, devices: Some(devices) },
            config,
            clip: None,
            timeout: Duration::from_secs(300),
            checkpoints: None,
            codec: None,
        }
    }

    /// This process is one rank of `mesh` (built from a [`TcpGroup`](crate::comm::tcp::TcpGroup)
    /// or an MPI group): every process launches the same `SupervisedTraining`. Rank 0 renders
    /// and logs the metrics of its own items (the other processes' items stay where they are),
    /// or with [`global_metrics`](Self::global_metrics) of every rank's.
    pub fn over_mesh(mesh: DeviceMesh<B::InnerBackend>, config: FsdpConfig) -> Self {
        Self {
            ranks: Ranks::Mesh(mesh),
            config,
            clip: None,
            timeout: Duration::from_secs(300),
            checkpoints: None,
            codec: None,
        }
    }

    /// Clips gradients by their global norm before each optimizer step
    /// ([`Fsdp::clip_grad_norm`], PyTorch's `clip_grad_norm_`).
    pub fn clip_grad_norm(mut self, max_norm: f64) -> Self {
        self.clip = Some(max_norm);
        self
    }

    /// Saves a checkpoint into `dir` after every epoch: each rank its learner's records (its
    /// shards, its optimizer's state for them — any Burn optimizer — and the scheduler), rank 0
    /// an index last. `SupervisedTraining::checkpoint(epoch)` resumes from it, at any world
    /// size. Use this instead of burn-train's `with_file_checkpointer`, which saves one
    /// unsharded record.
    pub fn checkpoints(mut self, dir: impl Into<PathBuf>) -> Self {
        self.checkpoints = Some(dir.into());
        self
    }

    /// Over a mesh of processes, rank 0 renders the metrics of every rank's items, as one
    /// device would log the global batch (in-process ranks always do).
    ///
    /// Each step, every rank's output item is all-gathered as bytes (its tensors: for
    /// burn-train's `ClassificationOutput`, the loss, logits and targets of its rows), so the
    /// `TrainStep` and `InferenceStep` outputs must be [`MeshItem`]s: burn-train's are;
    /// implement it for an output type of your own.
    ///
    /// ```text
    /// .with_training_strategy(FsdpStrategy::over_mesh(mesh, config).global_metrics().into())
    /// ```
    pub fn global_metrics(self) -> GlobalMetrics<B> {
        GlobalMetrics(self)
    }

    /// How long in-process ranks wait in a collective before failing (default 300 s).
    pub fn timeout(mut self, timeout: Duration) -> Self {
        self.timeout = timeout;
        self
    }
}

impl<LC> From<FsdpStrategy<LC::Backend>> for TrainingStrategy<LC>
where
    LC: LearningComponentsTypes + 'static,
    LC::Backend: FsdpBackend,
    LC::TrainingModel: Send,
    LC::Optimizer: Send,
    LC::LrScheduler: Send,
    <LC::TrainingModel as TrainStep>::Output: Send,
    <LC::InferenceModel as InferenceStep>::Output: Send,
{
    fn from(strategy: FsdpStrategy<LC::Backend>) -> Self {
        TrainingStrategy::Custom(Arc::new(strategy))
    }
}

/// An [`FsdpStrategy`] whose rank 0 renders every rank's items over a mesh of processes
/// ([`FsdpStrategy::global_metrics`]); it converts into burn-train's `TrainingStrategy` where
/// the learner's outputs are [`MeshItem`]s.
#[derive(Clone, Debug)]
pub struct GlobalMetrics<B: FsdpBackend>(FsdpStrategy<B>);

impl<LC> From<GlobalMetrics<LC::Backend>> for TrainingStrategy<LC>
where
    LC: LearningComponentsTypes + 'static,
    LC::Backend: FsdpBackend,
    LC::TrainingModel: Send,
    LC::Optimizer: Send,
    LC::LrScheduler: Send,
    TrainOut<LC>: Send + MeshItem<LC::Backend>,
    ValidOut<LC>: Send + MeshItem<InnerOf<LC>>,
{
    fn from(GlobalMetrics(mut strategy): GlobalMetrics<LC::Backend>) -> Self {
        let codec: CodecOf<LC> = Codec {
            encode: encode_item::<LC::Backend, TrainOut<LC>, ValidOut<LC>>,
            decode: decode_item::<LC::Backend, TrainOut<LC>, ValidOut<LC>>,
        };
        strategy.codec = Some(Arc::new(codec));
        TrainingStrategy::Custom(Arc::new(strategy))
    }
}

/// What rank 0 receives from the other ranks.
enum Item<T, V> {
    Train(T),
    Valid(V),
}

type InnerOf<LC> = <<LC as LearningComponentsTypes>::Backend as AutodiffBackend>::InnerBackend;
type DeviceOf<LC> = burn::tensor::Device<<LC as LearningComponentsTypes>::Backend>;

/// How the items of a learner travel between processes (made where the output types are
/// known to be [`MeshItem`]s, kept type-erased in the strategy).
struct Codec<T, V, D> {
    encode: fn(&Item<T, V>) -> Vec<u8>,
    decode: Decode<Item<T, V>, D>,
}

/// Reads an item written by a `Codec`'s `encode` on `D`.
type Decode<I, D> = fn(&[u8], &D) -> Result<I, String>;

type CodecOf<LC> = Codec<TrainOut<LC>, ValidOut<LC>, DeviceOf<LC>>;

/// `item` as bytes: a kind byte (0 training, 1 validation), then its tensors.
fn encode_item<B, T, V>(item: &Item<T, V>) -> Vec<u8>
where
    B: AutodiffBackend,
    T: MeshItem<B>,
    V: MeshItem<B::InnerBackend>,
{
    let (kind, data) = match item {
        Item::Train(t) => (0u8, t.to_data()),
        Item::Valid(v) => (1u8, v.to_data()),
    };
    let mut out = vec![kind];
    out.extend(items::encode(&data));
    out
}

fn decode_item<B, T, V>(bytes: &[u8], device: &B::Device) -> Result<Item<T, V>, String>
where
    B: AutodiffBackend,
    T: MeshItem<B>,
    V: MeshItem<B::InnerBackend>,
{
    let (kind, rest) = bytes.split_first().ok_or("an empty item")?;
    let data = items::decode(rest)?;
    match kind {
        0 => T::from_data(data, device).map(Item::Train),
        1 => V::from_data(data, device).map(Item::Valid),
        k => Err(format!("an item of kind {k} (0 and 1 exist)")),
    }
}

type TrainOut<LC> = <<LC as LearningComponentsTypes>::TrainingModel as TrainStep>::Output;
type ValidOut<LC> = <<LC as LearningComponentsTypes>::InferenceModel as InferenceStep>::Output;
type ItemOf<LC> = Item<TrainOut<LC>, ValidOut<LC>>;

/// Where a rank's items go.
enum Sink<LC: LearningComponentsTypes> {
    /// Rank 0: the event processor, and where the other ranks' items come from.
    Render { processor: SupervisedTrainingEventProcessor<LC>, peers: Peers<LC> },
    /// Another in-process rank: to rank 0.
    Send(Sender<ItemOf<LC>>),
    /// Another process, its items all-gathered with rank 0's ([`FsdpStrategy::global_metrics`]);
    /// it keeps its own processor (its `Learner` returns through it).
    Gather { processor: SupervisedTrainingEventProcessor<LC>, mesh: MeshItems<LC> },
    /// Another process: its items are not rendered; it keeps its own processor.
    Quiet(SupervisedTrainingEventProcessor<LC>),
}

/// Where rank 0 gets the other ranks' items from.
enum Peers<LC: LearningComponentsTypes> {
    /// Over a mesh of processes without [`FsdpStrategy::global_metrics`]: nowhere.
    None,
    /// The other in-process ranks, in rank order.
    Threads(Vec<Receiver<ItemOf<LC>>>),
    /// Every rank of a mesh of processes.
    Mesh(MeshItems<LC>),
}

/// The items of every process of a mesh, all-gathered each step.
struct MeshItems<LC: LearningComponentsTypes> {
    groups: Vec<Arc<dyn ProcessGroup<InnerOf<LC>>>>,
    device: DeviceOf<LC>,
    encode: fn(&ItemOf<LC>) -> Vec<u8>,
    decode: Decode<ItemOf<LC>, DeviceOf<LC>>,
}

impl<LC: LearningComponentsTypes> MeshItems<LC> {
    /// Every rank's item of this step, rank order; this rank's is `item` itself.
    fn gather(&self, item: ItemOf<LC>) -> Result<Vec<ItemOf<LC>>, FsdpError> {
        let tag = Tag::new(match item {
            Item::Train(_) => "learner: training items",
            Item::Valid(_) => "learner: validation items",
        });
        let all = items::all_gather_bytes(&self.groups, (self.encode)(&item), &tag, &self.device)?;
        let mine = self.groups.iter().fold(0, |acc, g| acc * g.size() + g.rank());
        let mut item = Some(item);
        all.iter()
            .enumerate()
            .map(|(r, bytes)| match item.take().filter(|_| r == mine) {
                Some(item) => Ok(item),
                None => (self.decode)(bytes, &self.device).map_err(|e| {
                    FsdpError::Config(format!("FsdpStrategy: the item rank {r} sent does not read: {e}"))
                }),
            })
            .collect()
    }
}

/// What one rank starts from.
struct RankInput<LC: LearningComponentsTypes> {
    learner: Learner<LC>,
    train: TrainLoader<LC>,
    valid: ValidLoader<LC>,
    sink: Sink<LC>,
}

impl<LC> SupervisedLearningStrategy<LC> for FsdpStrategy<LC::Backend>
where
    LC: LearningComponentsTypes + 'static,
    LC::Backend: FsdpBackend,
    LC::TrainingModel: Send,
    LC::Optimizer: Send,
    LC::LrScheduler: Send,
    TrainOut<LC>: Send,
    ValidOut<LC>: Send,
{
    /// burn-train's `train`, except that resuming (`SupervisedTraining::checkpoint`) reads
    /// FSDP's own checkpoints (the file checkpointer's unsharded records are not used).
    fn train(
        &self,
        learner: Learner<LC>,
        train: TrainLoader<LC>,
        valid: ValidLoader<LC>,
        mut components: TrainingComponents<LC>,
    ) -> LearningResult<LC::InferenceModel> {
        let starting_epoch = components.checkpoint.map_or(1, |epoch| epoch + 1);
        let summary = components.summary.clone();
        components.event_processor.process_train(LearnerEvent::Start);
        let (model, mut processor) = self.fit(components, learner, train, valid, starting_epoch);
        let summary = summary.and_then(|s| s.init().ok());
        processor.process_train(LearnerEvent::End(summary));
        LearningResult { model: model.valid(), renderer: processor.renderer() }
    }

    fn fit(
        &self,
        components: TrainingComponents<LC>,
        learner: Learner<LC>,
        train: TrainLoader<LC>,
        valid: ValidLoader<LC>,
        starting_epoch: usize,
    ) -> (TrainingModel<LC>, SupervisedTrainingEventProcessor<LC>) {
        if components.checkpointer.is_some() {
            eprintln!(
                "warning: FsdpStrategy: burn-train's file checkpointer saves one unsharded record and is \
                 not used; FsdpStrategy::checkpoints(dir) saves FSDP's sharded checkpoints"
            );
        }
        let resume = starting_epoch.checked_sub(1).filter(|&e| e > 0);
        if resume.is_some() && self.checkpoints.is_none() {
            panic!(
                "SupervisedTraining::checkpoint asks to resume, and this FsdpStrategy has no checkpoint \
                 directory: set FsdpStrategy::checkpoints(dir)"
            );
        }
        let loop_ = Loop {
            epochs: starting_epoch..=components.num_epochs,
            accumulation: components.grad_accumulation,
            interrupter: components.interrupter.clone(),
            clip: self.clip,
            config: self.config.clone(),
            checkpoints: self.checkpoints.clone(),
            resume,
            store: components.event_store.clone(),
        };
        let processor = components.event_processor;
        let result = match &self.ranks {
            Ranks::Mesh(mesh) => {
                let items = match &self.codec {
                    None => None,
                    Some(codec) => match codec.downcast_ref::<CodecOf<LC>>() {
                        Some(codec) => Some(MeshItems::<LC> {
                            groups: (0..mesh.ndim()).map(|i| mesh.group_at(i).clone()).collect(),
                            device: mesh.device().clone(),
                            encode: codec.encode,
                            decode: codec.decode,
                        }),
                        // `GlobalMetrics` makes the codec for the learner it converts into.
                        None => panic!("FsdpStrategy::global_metrics was made for another learner's types"),
                    },
                };
                let sink = match (mesh.rank(), items) {
                    (0, Some(items)) => Sink::Render { processor, peers: Peers::Mesh(items) },
                    (0, None) => Sink::Render { processor, peers: Peers::None },
                    (_, Some(items)) => Sink::Gather { processor, mesh: items },
                    (_, None) => Sink::Quiet(processor),
                };
                let (w, r) = (mesh.size(), mesh.rank());
                let input = RankInput { learner, train: shard(train, r, w), valid: shard(valid, r, w), sink };
                loop_.run(mesh.clone(), input).map_err(|e| e.to_string())
            }
            Ranks::InProcess { world, devices } => {
                let world = (*world).max(1);
                let mut receivers = Vec::new();
                let mut inputs: Vec<Option<RankInput<LC>>> = Vec::new();
                let mut processor = Some(processor);
                for r in 0..world {
                    let sink = match processor.take() {
                        Some(processor) => Sink::Render { processor, peers: Peers::None },
                        None => {
                            let (tx, rx) = channel();
                            receivers.push(rx);
                            Sink::Send(tx)
                        }
                    };
                    let mut learner = learner.clone();
                    if let Some(devices) = devices {
                        learner.fork(&devices[r]);
                    }
                    let (train, valid) = (shard(train.clone(), r, world), shard(valid.clone(), r, world));
                    inputs.push(Some(RankInput { learner, train, valid, sink }));
                }
                if let Some(Some(RankInput { sink: Sink::Render { peers, .. }, .. })) = inputs.first_mut() {
                    *peers = Peers::Threads(receivers);
                }
                let inputs: Vec<Mutex<Option<RankInput<LC>>>> = inputs.into_iter().map(Mutex::new).collect();
                let devices = devices.clone();
                crate::launch(world, self.timeout, |group: Arc<LocalGroup>| {
                    let r = group.rank();
                    let input =
                        inputs[r].lock().ok().and_then(|mut i| i.take()).ok_or_else(|| {
                            FsdpError::Config(format!("FsdpStrategy: rank {r} has no input"))
                        })?;
                    let device = match &devices {
                        Some(d) => d[r].clone(),
                        None => input.learner.model().devices().first().cloned().unwrap_or_default(),
                    };
                    let mesh = DeviceMesh::new_1d(group, device);
                    loop_.run(mesh, input)
                })
                .map_err(|e| e.to_string())
                .and_then(|mut outs| {
                    if outs.is_empty() { Err("no rank returned".into()) } else { Ok(outs.remove(0)) }
                })
            }
        };
        match result {
            Ok(Some(done)) => done,
            Ok(None) => unreachable!("rank 0 returns the model"),
            // burn-train's strategies have no error path: a failed rank ends the training as
            // burn-train's own failures do.
            Err(e) => panic!("FSDP training failed: {e}"),
        }
    }
}

/// This rank's contiguous share of a data loader's items, the same count on every rank.
fn shard<B: Backend, O: 'static>(
    loader: Arc<dyn burn::data::dataloader::DataLoader<B, O>>,
    rank: usize,
    world: usize,
) -> Arc<dyn burn::data::dataloader::DataLoader<B, O>> {
    if world == 1 {
        return loader;
    }
    let per = loader.num_items() / world;
    loader.slice(rank * per, (rank + 1) * per)
}

/// The training loop of one rank.
struct Loop {
    epochs: std::ops::RangeInclusive<usize>,
    accumulation: Option<usize>,
    interrupter: burn_train::Interrupter,
    clip: Option<f64>,
    config: FsdpConfig,
    checkpoints: Option<PathBuf>,
    /// The epoch whose checkpoint to start from.
    resume: Option<usize>,
    store: Arc<EventStoreClient>,
}

type Done<LC> = (TrainingModel<LC>, SupervisedTrainingEventProcessor<LC>);

impl Loop {
    fn run<LC>(
        &self,
        mesh: DeviceMesh<<LC::Backend as burn::tensor::backend::AutodiffBackend>::InnerBackend>,
        input: RankInput<LC>,
    ) -> Result<Option<Done<LC>>, FsdpError>
    where
        LC: LearningComponentsTypes,
        LC::Backend: FsdpBackend,
    {
        let RankInput { mut learner, train, valid, mut sink } = input;
        let device = mesh.device().clone();
        // The ranks' learners are clones, whose buffers (Burn's `RunningState`) are one shared
        // object updated in place: each rank wraps a copy of its own (`from_inner(valid())`
        // makes new buffers and new leaves, with the same ids and `require_grad`).
        let own = <TrainingModel<LC> as AutodiffModule<LC::Backend>>::from_inner(learner.model().valid());
        let mut fsdp = Fsdp::wrap(own, &mesh, self.config.clone())?;
        // Resuming: this rank's rows of the model and of the optimizer's state, whatever world
        // size saved them (see `crate::records`).
        let resume = match (&self.checkpoints, self.resume) {
            (Some(dir), Some(epoch)) => {
                let (index, ids) = fsdp.records_index(dir, "epoch", epoch)?;
                let model = fsdp.read_mine::<LearnerModelRecord<LC>>(dir, &index, &ids, "model")?;
                let optim = fsdp.read_mine::<LearnerOptimizerRecord<LC>>(dir, &index, &ids, "optim")?;
                // The scheduler's state is the same on every rank: rank 0's.
                let scheduler = records::load_rank::<LearnerSchedulerRecord<LC>, LC::Backend>(
                    dir,
                    &index,
                    0,
                    "scheduler",
                    &device,
                )?;
                let scheduler = records::from_value(scheduler, &device, "the scheduler record")?;
                fsdp.load_module_record(model);
                Some((optim, scheduler))
            }
            _ => None,
        };
        // The learner's optimizer steps the shards: its model holds them. Only its parameters
        // are read back (`take_parameters`); the forward runs on FSDP's module and its buffers.
        learner.load_model(fsdp.module().clone().into_record());
        if let Some((optim, scheduler)) = resume {
            learner.load_optim(optim);
            learner.load_scheduler(scheduler);
        }
        for epoch in self.epochs.clone() {
            let global = Progress { items_processed: epoch, items_total: *self.epochs.end() };
            // Training.
            let mut iterator = train.iter();
            let mut iteration = 0;
            let mut accumulator = GradientsAccumulator::new();
            let mut micro = 0;
            while let Some(item) = iterator.next() {
                iteration += 1;
                learner.lr_step();
                let progress = iterator.progress();
                let out = fsdp.try_forward(|model, _| model.step(item))?;
                let mut grads = match self.accumulation {
                    Some(n) => {
                        accumulator.accumulate(fsdp.module(), out.grads);
                        micro += 1;
                        if micro < n {
                            None
                        } else {
                            micro = 0;
                            Some(accumulator.grads())
                        }
                    }
                    None => Some(out.grads),
                };
                if let (Some(grads), Some(max)) = (grads.as_mut(), self.clip) {
                    fsdp.clip_grad_norm(grads, max)?;
                }
                if let Some(grads) = grads {
                    learner.optimizer_step(grads);
                    let stepped = learner.model();
                    fsdp.replace_module(|module| take_parameters(module, &stepped));
                }
                let lr = learner.lr_current();
                sink.item(Item::Train(out.item), progress, &global, iteration, Some(lr), mesh.size())?;
                if self.interrupter.should_stop() {
                    break;
                }
            }
            sink.end_train(epoch);
            if self.interrupter.should_stop() {
                break;
            }
            // Validation.
            let mut iterator = valid.iter();
            let mut iteration = 0;
            while let Some(item) = iterator.next() {
                iteration += 1;
                let progress = iterator.progress();
                let out = fsdp.forward_valid(|model, _| model.step(item))?;
                sink.item(Item::Valid(out), progress, &global, iteration, None, mesh.size())?;
                if self.interrupter.should_stop() {
                    break;
                }
            }
            sink.end_valid(epoch);
            if let Some(dir) = &self.checkpoints {
                self.save(dir, epoch, &mut learner, &fsdp)?;
            }
        }
        // The whole model, the user's own type: every rank takes part in the gathers.
        let full = fsdp.full_module()?;
        Ok(match sink {
            Sink::Render { processor, .. } | Sink::Gather { processor, .. } | Sink::Quiet(processor) => {
                Some((full, processor))
            }
            Sink::Send(_) => None,
        })
    }
}

impl Loop {
    /// Saves this rank's learner records of `epoch` (see `crate::records`); rank 0 writes the
    /// index once every rank's files are in place.
    fn save<LC>(
        &self,
        dir: &std::path::Path,
        epoch: usize,
        learner: &mut Learner<LC>,
        fsdp: &Fsdp<LC::Backend, TrainingModel<LC>>,
    ) -> Result<(), FsdpError>
    where
        LC: LearningComponentsTypes,
        LC::Backend: FsdpBackend,
    {
        if fsdp.rank() == 0 && fsdp.replicate_rank() == 0 {
            // The model record carries the buffers: rank 0's own (the learners' clones share
            // one buffer object, which only rank 0 writes).
            learner.load_model(fsdp.module().clone().into_record());
        }
        fsdp.commit_records(dir, "epoch", epoch, |rank_dir| {
            std::fs::create_dir_all(rank_dir).map_err(|e| records::err(rank_dir, e))?;
            let file = |name: &str| FileCheckpointer::new(records::recorder(), rank_dir, name);
            // Dropping the checkpointer waits for its files.
            LearningCheckpointer::<LC>::new(
                AsyncCheckpointer::new(file("model")),
                AsyncCheckpointer::new(file("optim")),
                AsyncCheckpointer::new(file("scheduler")),
                Box::new(EveryEpoch),
            )
            .checkpoint(learner, epoch, &self.store);
            // burn-train's checkpointer logs a failure and goes on: check that the files exist.
            for name in ["model", "optim", "scheduler"] {
                let path = records::record_path(rank_dir, name, epoch).with_extension("mpk");
                if !path.is_file() {
                    return Err(records::err(&path, "burn-train's checkpointer did not write it"));
                }
            }
            Ok(())
        })
    }
}

/// Saves every epoch (the Learner's FSDP checkpoints).
struct EveryEpoch;

impl CheckpointingStrategy for EveryEpoch {
    fn checkpointing(&mut self, _epoch: usize, _store: &EventStoreClient) -> Vec<CheckpointingAction> {
        vec![CheckpointingAction::Save]
    }
}

impl<LC: LearningComponentsTypes> Sink<LC> {
    /// This rank's output `item` of one step (training or validation); rank 0 renders it and
    /// the other in-process ranks' items of the same step, as progress through `world` ranks.
    fn item(
        &mut self,
        item: ItemOf<LC>,
        progress: Progress,
        global: &Progress,
        iteration: usize,
        lr: Option<f64>,
        world: usize,
    ) -> Result<(), FsdpError> {
        match self {
            Sink::Render { processor, peers } => {
                let progress = global_progress(&progress, world);
                let training = matches!(item, Item::Train(_));
                let mut emit = |item: ItemOf<LC>| match item {
                    Item::Train(item) => {
                        let item =
                            TrainingItem::new(item, progress.clone(), global.clone(), Some(iteration), lr);
                        processor.process_train(LearnerEvent::ProcessedItem(item));
                    }
                    Item::Valid(item) => {
                        let item =
                            TrainingItem::new(item, progress.clone(), global.clone(), Some(iteration), lr);
                        processor.process_valid(LearnerEvent::ProcessedItem(item));
                    }
                };
                match peers {
                    Peers::None => emit(item),
                    Peers::Threads(peers) => {
                        emit(item);
                        for (k, rx) in peers.iter().enumerate() {
                            match rx.recv() {
                                Ok(peer) if matches!(peer, Item::Train(_)) == training => emit(peer),
                                _ => return Err(peer_lost(k + 1)),
                            }
                        }
                    }
                    Peers::Mesh(mesh) => {
                        for (r, peer) in mesh.gather(item)?.into_iter().enumerate() {
                            if matches!(peer, Item::Train(_)) != training {
                                return Err(FsdpError::Config(format!(
                                    "FsdpStrategy: rank {r} sent an item of the other phase (training vs \
                                     validation): the ranks' loops went out of step"
                                )));
                            }
                            emit(peer);
                        }
                    }
                }
                Ok(())
            }
            Sink::Send(tx) => tx.send(item).map_err(|_| peer_lost(0)),
            Sink::Gather { mesh, .. } => mesh.gather(item).map(|_| ()),
            Sink::Quiet(_) => Ok(()),
        }
    }

    fn end_train(&mut self, epoch: usize) {
        if let Sink::Render { processor, .. } = self {
            processor.process_train(LearnerEvent::EndEpoch(epoch));
        }
    }

    fn end_valid(&mut self, epoch: usize) {
        if let Sink::Render { processor, .. } = self {
            processor.process_valid(LearnerEvent::EndEpoch(epoch));
        }
    }
}

/// A rank's progress through its share, as progress through all ranks' items.
fn global_progress(local: &Progress, world: usize) -> Progress {
    Progress { items_processed: local.items_processed * world, items_total: local.items_total * world }
}

fn peer_lost(rank: usize) -> FsdpError {
    FsdpError::Config(format!("FsdpStrategy: rank {rank} stopped sending its items (it failed)"))
}

/// `into` with every trainable parameter replaced by `from`'s of the same id (buffers and
/// frozen parameters stay `into`'s).
fn take_parameters<B: Backend, M: Module<B>>(into: M, from: &M) -> M {
    struct Collect<B: Backend>(
        std::collections::HashMap<burn::module::ParamId, burn::tensor::ops::FloatTensor<B>>,
    );
    impl<B: Backend> burn::module::ModuleVisitor<B> for Collect<B> {
        fn visit_float<const D: usize>(&mut self, param: &Param<Tensor<B, D>>) {
            if param.val().is_require_grad() {
                self.0.insert(param.id, param.val().into_primitive().tensor());
            }
        }
    }
    struct Take<B: Backend>(
        std::collections::HashMap<burn::module::ParamId, burn::tensor::ops::FloatTensor<B>>,
    );
    impl<B: Backend> ModuleMapper<B> for Take<B> {
        fn map_float<const D: usize>(&mut self, param: Param<Tensor<B, D>>) -> Param<Tensor<B, D>> {
            if !param.val().is_require_grad() {
                return param;
            }
            let (id, tensor, mapper) = param.consume();
            match self.0.remove(&id) {
                Some(t) => Param::from_mapped_value(
                    id,
                    Tensor::from_primitive(burn::tensor::TensorPrimitive::Float(t)),
                    mapper,
                ),
                None => Param::from_mapped_value(id, tensor, mapper),
            }
        }
    }
    let mut collect = Collect(std::collections::HashMap::new());
    from.visit(&mut collect);
    into.map(&mut Take(collect.0))
}
