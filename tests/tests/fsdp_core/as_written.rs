//! Models left as written (issue #42): no `UnitRunner` in any forward signature.
//!
//! - A model that marks nothing is wrapped whole as one unit (the root), its forward called as
//!   written inside `Fsdp::forward`.
//! - A model that marks its blocks with `FsdpUnit` (and calls them through `FsdpUnit::run`,
//!   its forward's signature unchanged) gets one unit per block.
//!
//! Both train with Burn's AdamW as one device does (losses and final parameters ≤ 1e-5) at
//! W = 1, 2, 3, prefetch on and off, with the gradients taken each of three ways: FSDP's
//! `Fsdp::gradients`, Burn's `from_grads` on `fsdp.module()`, and Burn's `from_grads` on the
//! model the forward hands out — what a burn-train `TrainStep` does when it runs inside the
//! forward.

use std::collections::HashMap;
use std::time::Duration;

use burn::module::{AutodiffModule, Module, Param};
use burn::nn::Linear;
use burn::optim::{AdamWConfig, GradientsParams, Optimizer};
use burn::tensor::backend::Backend;
use burn::tensor::{ElementConversion, Tensor, TensorData};
use burn_fsdp::{CollectiveKind, DeviceMesh, Fsdp, FsdpConfig, FsdpUnit, launch};
use tests::max_rel_diff;

use super::any_model::FB;
use super::optimizers::parameters;

type AB = burn::backend::Autodiff<burn::backend::NdArray<f32>>;

const ROWS: usize = 12;
const DIMS: [usize; 4] = [7, 10, 5, 3];
const STEPS: usize = 4;

fn linear<B: Backend>(d_in: usize, d_out: usize, salt: usize, device: &B::Device) -> Linear<B> {
    let w: Vec<f32> = (0..d_in * d_out).map(|i| (((i * 7 + salt * 5) % 17) as f32 - 8.0) * 0.05).collect();
    let b: Vec<f32> = (0..d_out).map(|i| (((i + salt) % 5) as f32 - 2.0) * 0.03).collect();
    Linear {
        weight: Param::from_tensor(Tensor::from_data(TensorData::new(w, [d_in, d_out]), device)),
        bias: Some(Param::from_tensor(Tensor::from_data(TensorData::new(b, [d_out]), device))),
    }
}

/// A model as a Burn user writes it: no marks, no runner.
#[derive(Module, Debug)]
struct Plain<B: Backend> {
    hidden: Vec<Linear<B>>,
    head: Linear<B>,
}

/// The same model with its hidden layers marked as units.
#[derive(Module, Debug)]
struct Marked<B: Backend> {
    hidden: Vec<FsdpUnit<Linear<B>>>,
    head: Linear<B>,
}

trait Task<B: Backend>: Module<B> {
    fn new(device: &B::Device) -> Self;
    fn forward(&self, x: Tensor<B, 2>) -> Tensor<B, 2>;
    fn loss(&self, x: Tensor<B, 2>, y: Tensor<B, 2>) -> Tensor<B, 1> {
        (self.forward(x) - y).powf_scalar(2.0).mean()
    }
}

impl<B: Backend> Task<B> for Plain<B> {
    fn new(device: &B::Device) -> Self {
        Self {
            hidden: vec![linear(DIMS[0], DIMS[1], 1, device), linear(DIMS[1], DIMS[2], 2, device)],
            head: linear(DIMS[2], DIMS[3], 3, device),
        }
    }
    fn forward(&self, x: Tensor<B, 2>) -> Tensor<B, 2> {
        let mut h = x;
        for layer in &self.hidden {
            h = layer.forward(h).tanh();
        }
        self.head.forward(h)
    }
}

impl<B: Backend> Task<B> for Marked<B> {
    fn new(device: &B::Device) -> Self {
        let Plain { hidden, head } = Plain::new(device);
        Self { hidden: hidden.into_iter().map(FsdpUnit::new).collect(), head }
    }
    fn forward(&self, x: Tensor<B, 2>) -> Tensor<B, 2> {
        let mut h = x;
        for layer in &self.hidden {
            h = layer.run(h, |l, h| l.forward(h).tanh());
        }
        self.head.forward(h)
    }
}

fn batch<B: Backend>(step: usize, device: &B::Device) -> (Tensor<B, 2>, Tensor<B, 2>) {
    let x: Vec<f32> = (0..ROWS * DIMS[0]).map(|i| (((i * 5 + step * 11) % 19) as f32 - 9.0) * 0.1).collect();
    let y: Vec<f32> = (0..ROWS * DIMS[3]).map(|i| (((i * 3 + step) % 7) as f32 - 3.0) * 0.2).collect();
    (
        Tensor::from_data(TensorData::new(x, [ROWS, DIMS[0]]), device),
        Tensor::from_data(TensorData::new(y, [ROWS, DIMS[3]]), device),
    )
}

fn adamw() -> AdamWConfig {
    AdamWConfig::new().with_weight_decay(0.01)
}

fn single<T: Task<AB> + AutodiffModule<AB>>() -> (Vec<f64>, HashMap<String, Vec<f64>>) {
    let device = Default::default();
    let mut model = T::new(&device);
    let mut optim = adamw().init::<AB, T>();
    let mut losses = Vec::new();
    for step in 0..STEPS {
        let (x, y) = batch::<AB>(step, &device);
        let loss = model.loss(x, y);
        losses.push(loss.clone().into_scalar().elem::<f64>());
        let grads = GradientsParams::from_grads(loss.backward(), &model);
        model = optim.step(0.05, model, grads);
    }
    (losses, parameters::<burn::backend::NdArray<f32>, _>(&model.valid()))
}

#[derive(Debug, Clone, Copy)]
enum Grads {
    Fsdp,
    BurnOnModule,
    /// Inside the forward, on the model it hands out (a `TrainStep` run there).
    BurnOnView,
}

type Run = (Vec<f64>, HashMap<String, Vec<f64>>, usize);

fn fsdp<T: Task<FB> + AutodiffModule<FB> + 'static>(world: usize, prefetch: bool, how: Grads) -> Run {
    let mut out = launch(world, Duration::from_secs(60), move |group| {
        let device = Default::default();
        let rank = group.rank();
        let mesh = DeviceMesh::new_1d(group, device);
        let config = FsdpConfig { prefetch, ..FsdpConfig::default() };
        let mut fsdp = Fsdp::wrap(T::new(&device), &mesh, config)?;
        let mut optim = adamw().init::<FB, T>();
        let per = ROWS / world;
        let mut losses = Vec::new();
        for step in 0..STEPS {
            let (x, y) = batch::<FB>(step, &device);
            let (x, y) = (x.narrow(0, rank * per, per), y.narrow(0, rank * per, per));
            let (local, grads) = match how {
                Grads::BurnOnView => fsdp.try_forward(|m, _| {
                    let loss = m.loss(x, y);
                    let local = loss.clone().into_scalar().elem::<f64>();
                    (local, GradientsParams::from_grads(loss.backward(), m))
                })?,
                _ => {
                    let loss = fsdp.try_forward(|m, _| m.loss(x, y))?;
                    let local = loss.clone().into_scalar().elem::<f64>();
                    let grads = match how {
                        Grads::Fsdp => fsdp.gradients(loss.backward()),
                        _ => GradientsParams::from_grads(loss.backward(), fsdp.module()),
                    };
                    (local, grads)
                }
            };
            losses.push(fsdp.all_reduce_scalar(local, burn_fsdp::ReduceOp::Avg, "loss")?);
            fsdp.step_with(&mut optim, 0.05, grads)?;
        }
        let params = fsdp
            .full_parameters()?
            .into_iter()
            .map(|(path, _, data)| (path, data.convert::<f64>().to_vec::<f64>().expect("f64")))
            .collect::<HashMap<_, _>>();
        Ok::<_, burn_fsdp::FsdpError>((losses, params, fsdp.units().len()))
    })
    .expect("FSDP ranks");
    out.remove(0)
}

fn check<S, F>(name: &str, units: usize)
where
    S: Task<AB> + AutodiffModule<AB>,
    F: Task<FB> + AutodiffModule<FB> + 'static,
{
    let (want_losses, want_params) = single::<S>();
    for world in [1, 2, 3] {
        for prefetch in [true, false] {
            for how in [Grads::Fsdp, Grads::BurnOnModule, Grads::BurnOnView] {
                let (losses, params, n_units) = fsdp::<F>(world, prefetch, how);
                let case = format!("{name}, W = {world}, prefetch {prefetch}, {how:?}");
                assert_eq!(n_units, units, "{case}: units");
                let dl = max_rel_diff(&losses, &want_losses);
                assert!(dl <= 1e-5, "{case}: losses {losses:?} vs one device {want_losses:?} ({dl:e})");
                for (path, want) in &want_params {
                    let got = &params[path];
                    // Relative to the tensor's scale, as `optimizers.rs` measures: Adam's
                    // normalised step turns the f32 rounding of a near-zero gradient (summed
                    // in another order over 3 ranks) into a relative error of entries near 0.
                    let scale = want.iter().fold(0.0f64, |m, v| m.max(v.abs()));
                    let d = got.iter().zip(want).map(|(a, b)| (a - b).abs()).fold(0.0, f64::max) / scale;
                    assert!(d <= 1e-5, "{case}: `{path}` off by {d:e}");
                }
            }
        }
    }
}

#[test]
fn a_model_that_marks_nothing_trains_as_written_as_one_unit() {
    check::<Plain<AB>, Plain<FB>>("unmarked", 1);
}

#[test]
fn blocks_marked_fsdp_unit_are_units_and_train_like_one_device() {
    check::<Marked<AB>, Marked<FB>>("marked", 3);
}

#[test]
fn marked_units_gather_one_at_a_time_and_evaluate_with_forward_valid() {
    let device = Default::default();
    let x = batch::<burn::backend::NdArray<f32>>(0, &device).0;
    let want = Marked::<AB>::new(&device).valid().forward(x.clone());
    let want = want.into_data().convert::<f64>().to_vec::<f64>().expect("f64");
    let out = launch(2, Duration::from_secs(60), move |group| {
        let device = Default::default();
        let mesh = DeviceMesh::new_1d(group, device);
        let fsdp = Fsdp::wrap(Marked::<FB>::new(&device), &mesh, FsdpConfig::default())?;
        let names: Vec<String> = fsdp.units().iter().map(|u| u.name.clone()).collect();
        let before = fsdp.comm_stats();
        let y = fsdp.forward_valid(|m, _| m.forward(x.clone()))?;
        let gathers =
            fsdp.comm_stats().calls(CollectiveKind::AllGather) - before.calls(CollectiveKind::AllGather);
        let y = y.into_data().convert::<f64>().to_vec::<f64>().expect("f64");
        Ok::<_, burn_fsdp::FsdpError>((names, gathers, y))
    })
    .expect("ranks");
    for (names, gathers, y) in out {
        assert_eq!(names, ["", "hidden.0", "hidden.1"]);
        assert_eq!(gathers, 3, "one all-gather per unit");
        let d = max_rel_diff(&y, &want);
        assert!(d <= 1e-6, "evaluation off by {d:e}");
    }
}

/// Qwen3 marks its decoder layers `FsdpUnit`: the default config makes one unit per layer (as
/// `UnitPolicy::VecElements` does), and its plain `forward` (no runner) inside `fsdp.forward`
/// computes the same logits, bit for bit, as `forward_with` through FSDP's runner.
#[test]
fn qwen3_as_written_runs_under_the_default_config_one_unit_per_layer() {
    use burn::tensor::Int;
    let config = qwen3_burn::Qwen3Config::tiny();
    let weights = config.init::<burn::backend::NdArray<f32>>(&Default::default()).to_hf_tensors();
    let layers = config.num_hidden_layers;
    let out = launch(2, Duration::from_secs(60), move |group| {
        let device = Default::default();
        let model =
            qwen3_burn::Qwen3::<FB>::from_weights(&config, weights.as_slice(), &device).expect("weights");
        let mesh = DeviceMesh::new_1d(group, device);
        let fsdp = Fsdp::wrap(model, &mesh, FsdpConfig::default())?;
        let names: Vec<String> = fsdp.units().iter().map(|u| u.name.clone()).collect();
        let ids =
            Tensor::<FB, 2, Int>::from_data(TensorData::new(vec![1i64, 5, 9, 2, 7, 3], [2, 3]), &device);
        let plain = fsdp.try_forward(|m, _| m.forward(ids.clone()))?;
        let runner = fsdp.try_forward(|m, r| m.forward_with(ids, r))?;
        let (a, b): (Vec<f32>, Vec<f32>) =
            (plain.into_data().to_vec().expect("f32"), runner.into_data().to_vec().expect("f32"));
        Ok::<_, burn_fsdp::FsdpError>((names, a == b))
    })
    .expect("ranks");
    for (names, same) in out {
        assert_eq!(names.len(), layers + 1, "{names:?}");
        assert_eq!(names[1], "model.layers.0");
        assert!(same, "plain forward and forward_with differ");
    }
}
