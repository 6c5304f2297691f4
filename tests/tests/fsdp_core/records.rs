//! Burn records of a sharded model (issue #42), in a hand-written loop:
//!
//! - `Fsdp::save_records` / `Fsdp::load_records`: Burn's Adam, AdamW, SGD with momentum and
//!   RmsProp keep their state through a sharded checkpoint saved at W = 2 and loaded at
//!   W = 1, 2, 3 into a model built afresh (other values, other parameter ids): the whole run
//!   matches one device's uninterrupted run (≤ 1e-5), on NdArray and on Flex, the default;
//! - BatchNorm's running statistics (buffers) are saved and restored;
//! - `Fsdp::full_module`: the trained model, of the user's own type, saved by rank 0 with
//!   Burn's recorder, loads into the single-device model with Burn's `load_file`;
//! - a missing checkpoint, a model of another shape and a damaged file are errors naming them.

use std::path::{Path, PathBuf};
use std::time::Duration;

use burn::backend::autodiff::checkpoint::strategy::BalancedCheckpointing;
use burn::backend::{Autodiff, Flex, NdArray};
use burn::module::{AutodiffModule, Module, Param};
use burn::nn::{BatchNorm, BatchNormConfig, Linear, LinearConfig};
use burn::optim::momentum::MomentumConfig;
use burn::optim::{AdamConfig, AdamWConfig, GradientsParams, Optimizer, RmsPropConfig, SgdConfig};
use burn::record::{FullPrecisionSettings, NamedMpkFileRecorder};
use burn::tensor::backend::{AutodiffBackend, Backend};
use burn::tensor::{ElementConversion, Tensor, TensorData};
use burn_fsdp::checkpoint::saved_record_steps;
use burn_fsdp::{DeviceMesh, Fsdp, FsdpBackend, FsdpConfig, FsdpError, FsdpUnit, ReduceOp, launch};
use tests::max_rel_diff;

type AB = Autodiff<NdArray<f32>>;
type FB = Autodiff<NdArray<f32>, BalancedCheckpointing>;

pub(super) const ROWS: usize = 12; // each rank takes ROWS / W rows
const DIMS: [usize; 4] = [7, 10, 5, 3]; // rows that shard unevenly at W = 2 and 3
const STEPS: usize = 6;
const SAVED_AT: usize = 3; // the checkpoint holds the state after steps 0, 1, 2
const LR: f64 = 0.05;

/// An MLP as a Burn user writes it, its hidden layers marked as units; `norm` is a BatchNorm
/// over the last hidden layer's features (buffers), left out where ranks must see the same
/// statistics as one device.
#[derive(Module, Debug)]
pub(super) struct Net<B: Backend> {
    hidden: Vec<FsdpUnit<Linear<B>>>,
    norm: Option<BatchNorm<B>>,
    head: Linear<B>,
}

impl<B: Backend> Net<B> {
    /// Deterministic values from `salt` (a model built with another salt differs everywhere).
    pub(super) fn new(salt: usize, norm: bool, device: &B::Device) -> Self {
        let linear = |d_in: usize, d_out: usize, k: usize| {
            let w: Vec<f32> =
                (0..d_in * d_out).map(|i| (((i * 7 + k * 5 + salt * 3) % 17) as f32 - 8.0) * 0.05).collect();
            let b: Vec<f32> = (0..d_out).map(|i| (((i + k + salt) % 5) as f32 - 2.0) * 0.03).collect();
            Linear {
                weight: Param::from_tensor(Tensor::from_data(TensorData::new(w, [d_in, d_out]), device)),
                bias: Some(Param::from_tensor(Tensor::from_data(TensorData::new(b, [d_out]), device))),
            }
        };
        Self {
            hidden: vec![
                FsdpUnit::new(linear(DIMS[0], DIMS[1], 1)),
                FsdpUnit::new(linear(DIMS[1], DIMS[2], 2)),
            ],
            norm: norm.then(|| BatchNormConfig::new(DIMS[2]).init(device)),
            head: linear(DIMS[2], DIMS[3], 3),
        }
    }

    fn forward(&self, x: Tensor<B, 2>) -> Tensor<B, 2> {
        let mut h = x;
        for layer in &self.hidden {
            h = layer.run(h, |l, h| l.forward(h).tanh());
        }
        if let Some(norm) = &self.norm {
            h = norm.forward(h);
        }
        self.head.forward(h)
    }

    pub(super) fn loss(&self, x: Tensor<B, 2>, y: Tensor<B, 2>) -> Tensor<B, 1> {
        (self.forward(x) - y).powf_scalar(2.0).mean()
    }
}

pub(super) fn batch<B: Backend>(step: usize, device: &B::Device) -> (Tensor<B, 2>, Tensor<B, 2>) {
    let x: Vec<f32> = (0..ROWS * DIMS[0]).map(|i| (((i * 5 + step * 11) % 19) as f32 - 9.0) * 0.1).collect();
    let y: Vec<f32> = (0..ROWS * DIMS[3]).map(|i| (((i * 3 + step) % 7) as f32 - 3.0) * 0.2).collect();
    (
        Tensor::from_data(TensorData::new(x, [ROWS, DIMS[0]]), device),
        Tensor::from_data(TensorData::new(y, [ROWS, DIMS[3]]), device),
    )
}

fn values<B: Backend, const D: usize>(t: Tensor<B, D>) -> Vec<f64> {
    t.into_data().convert::<f64>().to_vec::<f64>().expect("f64")
}

/// One device, uninterrupted: the losses of every step and the trained model's output.
fn single<S: AutodiffBackend, O: Optimizer<Net<S>, S>>(mut optim: O) -> (Vec<f64>, Vec<f64>) {
    let device = Default::default();
    let mut model = Net::<S>::new(0, false, &device);
    let mut losses = Vec::new();
    for step in 0..STEPS {
        let (x, y) = batch::<S>(step, &device);
        let loss = model.loss(x, y);
        losses.push(loss.clone().into_scalar().elem::<f64>());
        let grads = GradientsParams::from_grads(loss.backward(), &model);
        model = optim.step(LR, model, grads);
    }
    let out = model.valid().forward(batch::<S::InnerBackend>(0, &device).0);
    (losses, values(out))
}

/// Steps `steps` of the run on this rank's rows; the global mean loss of each.
fn train<F: FsdpBackend, O: Optimizer<Net<F>, F>>(
    fsdp: &mut Fsdp<F, Net<F>>,
    optim: &mut O,
    steps: std::ops::Range<usize>,
) -> Result<Vec<f64>, FsdpError> {
    let device = fsdp.mesh().device().clone();
    let per = ROWS / fsdp.world();
    let rank = fsdp.rank();
    let mut losses = Vec::new();
    for step in steps {
        let (x, y) = batch::<F>(step, &device);
        let (x, y) = (x.narrow(0, rank * per, per), y.narrow(0, rank * per, per));
        let loss = fsdp.try_forward(|m, _| m.loss(x, y))?;
        let local = loss.clone().into_scalar().elem::<f64>();
        let grads = GradientsParams::from_grads(loss.backward(), fsdp.module());
        losses.push(fsdp.all_reduce_scalar(local, ReduceOp::Avg, "loss")?);
        fsdp.step_with(optim, LR, grads)?;
    }
    Ok(losses)
}

/// The largest difference relative to the largest entry (outputs near zero make elementwise
/// relative differences meaningless).
fn off(a: &[f64], b: &[f64]) -> f64 {
    assert_eq!(a.len(), b.len());
    let scale = b.iter().fold(0.0f64, |m, v| m.max(v.abs()));
    a.iter().zip(b).map(|(x, y)| (x - y).abs()).fold(0.0, f64::max) / scale
}

fn fresh_dir(name: &str) -> PathBuf {
    let dir = std::env::temp_dir().join(format!("burn-fsdp-records-{name}-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&dir);
    dir
}

/// Steps 0..SAVED_AT at W = 2, saved; then a model built afresh (salt 1: other values, other
/// ids) at `resume_world` loads the checkpoint and steps on. Every step's loss and the final
/// model (rank 0's `full_module`, evaluated) against one device.
fn check_resume<S, F, O1, O2>(name: &str, single_optim: impl Fn() -> O1, fsdp_optim: fn() -> O2)
where
    S: AutodiffBackend,
    F: FsdpBackend,
    O1: Optimizer<Net<S>, S>,
    O2: Optimizer<Net<F>, F> + 'static,
{
    let (want_losses, want_out) = single::<S, _>(single_optim());
    let dir = fresh_dir(name);
    let first = {
        let dir = dir.clone();
        launch(2, Duration::from_secs(60), move |group| {
            let device: F::Device = Default::default();
            let mesh = DeviceMesh::new_1d(group, device.clone());
            let mut fsdp = Fsdp::wrap(Net::<F>::new(0, false, &device), &mesh, FsdpConfig::default())?;
            let mut optim = fsdp_optim();
            let losses = train(&mut fsdp, &mut optim, 0..SAVED_AT)?;
            fsdp.save_records(&dir, SAVED_AT, &optim)?;
            Ok::<_, FsdpError>(losses)
        })
        .expect("W = 2 until the checkpoint")
        .remove(0)
    };
    assert_eq!(saved_record_steps(&dir), [SAVED_AT]);
    for world in [1, 2, 3] {
        let dir = dir.clone();
        let (rest, out) = launch(world, Duration::from_secs(60), move |group| {
            let device: F::Device = Default::default();
            let mesh = DeviceMesh::new_1d(group, device.clone());
            let mut fsdp = Fsdp::wrap(Net::<F>::new(1, false, &device), &mesh, FsdpConfig::default())?;
            let mut optim = fsdp.load_records(&dir, SAVED_AT, fsdp_optim())?;
            let losses = train(&mut fsdp, &mut optim, SAVED_AT..STEPS)?;
            let model = fsdp.full_module()?.valid();
            let out = values(model.forward(batch::<F::InnerBackend>(0, &device).0));
            Ok::<_, FsdpError>((losses, out))
        })
        .expect("resumed ranks")
        .remove(0);
        let losses: Vec<f64> = first.iter().chain(&rest).copied().collect();
        let case = format!("{name}: saved at W = 2, resumed at W = {world}");
        let d = max_rel_diff(&losses, &want_losses);
        assert!(d <= 1e-5, "{case}: losses {losses:?} vs one device {want_losses:?} ({d:e})");
        let d = off(&out, &want_out);
        assert!(d <= 1e-5, "{case}: the trained model's output off by {d:e}");
    }
    let _ = std::fs::remove_dir_all(&dir);
}

#[test]
fn burn_adam_state_resumes_at_another_world_size() {
    check_resume::<AB, FB, _, _>("adam", || AdamConfig::new().init(), || AdamConfig::new().init());
}

#[test]
fn burn_sgd_momentum_and_rmsprop_state_resume_at_another_world_size() {
    fn sgd<B: AutodiffBackend, M: AutodiffModule<B>>() -> impl Optimizer<M, B> {
        SgdConfig::new().with_momentum(Some(MomentumConfig::new().with_nesterov(true))).init()
    }
    fn rmsprop<B: AutodiffBackend, M: AutodiffModule<B>>() -> impl Optimizer<M, B> {
        RmsPropConfig::new().with_momentum(0.9).init()
    }
    check_resume::<AB, FB, _, _>("sgd", sgd::<AB, Net<AB>>, sgd::<FB, Net<FB>>);
    check_resume::<AB, FB, _, _>("rmsprop", rmsprop::<AB, Net<AB>>, rmsprop::<FB, Net<FB>>);
}

/// What users get by default: Flex, Burn's AdamW.
#[test]
fn burn_adamw_state_resumes_at_another_world_size_on_flex_the_default_backend() {
    type S = Autodiff<Flex>;
    type F = Autodiff<Flex, BalancedCheckpointing>;
    check_resume::<S, F, _, _>(
        "adamw-flex",
        || AdamWConfig::new().with_weight_decay(0.1).init(),
        || AdamWConfig::new().with_weight_decay(0.1).init(),
    );
}

/// BatchNorm's running statistics go into the checkpoint and come back (rank 0's), and the
/// resumed run continues as the uninterrupted one does, bit for bit.
#[test]
fn buffers_are_saved_and_restored() {
    let dir = fresh_dir("buffers");
    let run = |resume: bool| {
        let dir = dir.clone();
        launch(2, Duration::from_secs(60), move |group| {
            let device = Default::default();
            let mesh = DeviceMesh::new_1d(group, device);
            let salt = usize::from(resume);
            let mut fsdp = Fsdp::wrap(Net::<FB>::new(salt, true, &device), &mesh, FsdpConfig::default())?;
            let mut optim = AdamConfig::new().init();
            let mut losses = Vec::new();
            if resume {
                optim = fsdp.load_records(&dir, SAVED_AT, optim)?;
            } else {
                losses = train(&mut fsdp, &mut optim, 0..SAVED_AT)?;
                fsdp.save_records(&dir, SAVED_AT, &optim)?;
            }
            let norm = fsdp.module().norm.as_ref().expect("norm");
            let stats = (values(norm.running_mean.value()), values(norm.running_var.value()));
            losses.extend(train(&mut fsdp, &mut optim, SAVED_AT..STEPS)?);
            Ok::<_, FsdpError>((stats, losses))
        })
        .expect("ranks")
        .remove(0)
    };
    let (saved_stats, uninterrupted) = run(false);
    let (loaded_stats, resumed) = run(true);
    assert_ne!(saved_stats.0, vec![0.0; DIMS[2]], "the running mean moved from its initial zeros");
    assert_eq!(loaded_stats, saved_stats, "running mean and variance restored");
    assert_eq!(resumed, uninterrupted[SAVED_AT..], "the resumed steps repeat the uninterrupted ones");
    let _ = std::fs::remove_dir_all(&dir);
}

/// The trained model saved by rank 0 with Burn's recorder loads into the single-device model
/// with Burn's own `load_file`, and computes what one device trained computes.
#[test]
fn full_module_is_a_burn_record_the_single_device_model_loads() {
    let (_, want_out) = single::<AB, _>(AdamConfig::new().init());
    let dir = fresh_dir("full");
    std::fs::create_dir_all(&dir).expect("dir");
    let file = dir.join("model");
    let recorder = NamedMpkFileRecorder::<FullPrecisionSettings>::new();
    {
        let file = file.clone();
        launch(3, Duration::from_secs(60), move |group| {
            let device = Default::default();
            let mesh = DeviceMesh::new_1d(group, device);
            let mut fsdp = Fsdp::wrap(Net::<FB>::new(0, false, &device), &mesh, FsdpConfig::default())?;
            let mut optim = AdamConfig::new().init();
            train(&mut fsdp, &mut optim, 0..STEPS)?;
            let model = fsdp.full_module()?;
            if fsdp.rank() == 0 {
                model.save_file(&file, &NamedMpkFileRecorder::<FullPrecisionSettings>::new()).expect("save");
            }
            Ok::<_, FsdpError>(())
        })
        .expect("ranks");
    }
    let device = Default::default();
    let model =
        Net::<NdArray<f32>>::new(1, false, &device).load_file(&file, &recorder, &device).expect("load_file");
    let out = values(model.forward(batch::<NdArray<f32>>(0, &device).0));
    let d = off(&out, &want_out);
    assert!(d <= 1e-5, "the loaded model's output off by {d:e}");
    let _ = std::fs::remove_dir_all(&dir);
}

fn load_error(dir: &Path, step: usize, dims_of_first: usize) -> String {
    let dir = dir.to_path_buf();
    launch(2, Duration::from_secs(60), move |group| {
        let device = Default::default();
        let mesh = DeviceMesh::new_1d(group, device);
        let mut model = Net::<FB>::new(0, false, &device);
        if dims_of_first != DIMS[1] {
            model.hidden[0] = FsdpUnit::new(LinearConfig::new(DIMS[0], dims_of_first).init(&device));
            model.hidden[1] = FsdpUnit::new(LinearConfig::new(dims_of_first, DIMS[2]).init(&device));
        }
        let mut fsdp = Fsdp::wrap(model, &mesh, FsdpConfig::default())?;
        Ok::<_, FsdpError>(match fsdp.load_records(&dir, step, AdamConfig::new().init()) {
            Ok(_) => "loaded".to_owned(),
            Err(e) => e.to_string(),
        })
    })
    .expect("ranks")
    .remove(0)
}

#[test]
fn bad_checkpoints_are_errors_that_name_the_file_or_parameter() {
    let dir = fresh_dir("bad");
    {
        let dir = dir.clone();
        launch(2, Duration::from_secs(60), move |group| {
            let device = Default::default();
            let mesh = DeviceMesh::new_1d(group, device);
            let fsdp = Fsdp::wrap(Net::<FB>::new(0, false, &device), &mesh, FsdpConfig::default())?;
            fsdp.save_records(&dir, 1, &AdamConfig::new().init::<FB, Net<FB>>())
        })
        .expect("save");
    }
    assert_eq!(load_error(&dir, 1, DIMS[1]), "loaded");
    let missing = load_error(&dir, 2, DIMS[1]);
    assert!(missing.contains("step-2.json") && missing.contains("not completely saved"), "{missing}");
    let shape = load_error(&dir, 1, DIMS[1] + 1);
    assert!(shape.contains("hidden.0.weight") && shape.contains("shape"), "{shape}");
    // A damaged rank file: the load names it, and nothing else.
    let file = dir.join("rank-00001-of-00002").join("optim-1.mpk");
    let bytes = std::fs::read(&file).expect("optim file");
    std::fs::write(&file, &bytes[..bytes.len() / 2]).expect("truncate");
    let damaged = load_error(&dir, 1, DIMS[1]);
    assert!(damaged.contains("rank-00001-of-00002") && damaged.contains("optim-1"), "{damaged}");
    let _ = std::fs::remove_dir_all(&dir);
}
