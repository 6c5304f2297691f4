//! Burn's own optimizers and learning-rate schedulers on FSDP shards (issue #16): each of
//! Adam, AdamW, SGD with momentum and RmsProp, driven by a Burn `LrScheduler`, trains a model
//! at W = 2 and 3 as it trains the whole model on one device (losses and final parameters
//! within 1e-5, parameters relative to each tensor's largest entry), on shapes that do not divide by the world size (padded shards).

use std::collections::HashMap;
use std::time::Duration;

use burn::backend::autodiff::checkpoint::strategy::BalancedCheckpointing;
use burn::backend::{Autodiff, Flex, NdArray};
use burn::module::{AutodiffModule, Module, ModuleVisitor, Param};
use burn::nn::Linear;
use burn::optim::decay::WeightDecayConfig;
use burn::optim::lr_scheduler::LrScheduler;
use burn::optim::lr_scheduler::cosine::CosineAnnealingLrSchedulerConfig;
use burn::optim::momentum::MomentumConfig;
use burn::optim::{AdamConfig, AdamWConfig, GradientsParams, Optimizer, RmsPropConfig, SgdConfig};
use burn::tensor::backend::{AutodiffBackend, Backend};
use burn::tensor::{ElementConversion, Tensor, TensorData};
use burn_fsdp::UnitPolicy;
use burn_fsdp::{DeviceMesh, Direct, Fsdp, FsdpBackend, FsdpConfig, PathStack, UnitRunner, launch};
use tests::max_rel_diff;

type AB = Autodiff<NdArray<f32>>;
type FB = Autodiff<NdArray<f32>, BalancedCheckpointing>;

const ROWS: usize = 12; // divisible by 2 and 3: each rank takes ROWS / W rows
const DIMS: [usize; 4] = [7, 10, 5, 3]; // 7 and 10 rows shard unevenly at W = 2 and 3
const STEPS: usize = 5;

/// An MLP: each hidden layer is an FSDP unit, the head is in the root unit.
#[derive(Module, Debug)]
struct Mlp<B: Backend> {
    hidden: Vec<Linear<B>>,
    head: Linear<B>,
}

fn linear<B: Backend>(d_in: usize, d_out: usize, salt: usize, device: &B::Device) -> Linear<B> {
    let w: Vec<f32> = (0..d_in * d_out).map(|i| (((i * 7 + salt * 5) % 17) as f32 - 8.0) * 0.05).collect();
    let b: Vec<f32> = (0..d_out).map(|i| (((i + salt) % 5) as f32 - 2.0) * 0.03).collect();
    Linear {
        weight: Param::from_tensor(Tensor::from_data(TensorData::new(w, [d_in, d_out]), device)),
        bias: Some(Param::from_tensor(Tensor::from_data(TensorData::new(b, [d_out]), device))),
    }
}

impl<B: Backend> Mlp<B> {
    fn new(device: &B::Device) -> Self {
        Self {
            hidden: vec![linear(DIMS[0], DIMS[1], 1, device), linear(DIMS[1], DIMS[2], 2, device)],
            head: linear(DIMS[2], DIMS[3], 3, device),
        }
    }

    fn loss(&self, x: Tensor<B, 2>, y: Tensor<B, 2>, r: &mut impl UnitRunner<B>) -> Tensor<B, 1> {
        let mut h = x;
        for layer in &self.hidden {
            h = r.run(layer, h, |l, h| l.forward(h).tanh());
        }
        (self.head.forward(h) - y).powf_scalar(2.0).mean()
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

fn schedule() -> impl LrScheduler {
    CosineAnnealingLrSchedulerConfig::new(0.05, STEPS).with_min_lr(0.005).init().expect("valid schedule")
}

/// Every float parameter as `path → values`.
pub(crate) fn parameters<B: Backend, M: Module<B>>(module: &M) -> HashMap<String, Vec<f64>> {
    struct Collect(PathStack, HashMap<String, Vec<f64>>);
    impl<B: Backend> ModuleVisitor<B> for Collect {
        fn enter_module(&mut self, name: &str, _: &str) {
            self.0.push(name);
        }
        fn exit_module(&mut self, _: &str, _: &str) {
            self.0.pop();
        }
        fn visit_float<const D: usize>(&mut self, param: &Param<Tensor<B, D>>) {
            let values = param.val().into_data().convert::<f64>().to_vec::<f64>().expect("f64");
            self.1.insert(self.0.current(), values);
        }
    }
    let mut c = Collect(PathStack::default(), HashMap::new());
    module.visit(&mut c);
    c.1
}

/// Losses and final parameters of one device training on the whole batch.
fn single<S: AutodiffBackend, O: Optimizer<Mlp<S>, S>>(
    mut optim: O,
) -> (Vec<f64>, HashMap<String, Vec<f64>>) {
    let device = Default::default();
    let mut model = Mlp::<S>::new(&device);
    let mut lr = schedule();
    let mut losses = Vec::new();
    for step in 0..STEPS {
        let (x, y) = batch::<S>(step, &device);
        let loss = model.loss(x, y, &mut Direct);
        losses.push(loss.clone().into_scalar().elem::<f64>());
        let grads = GradientsParams::from_grads(loss.backward(), &model);
        model = optim.step(lr.step(), model, grads);
    }
    (losses, parameters::<S::InnerBackend, _>(&model.valid()))
}

/// How a training loop takes its gradients.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Grads {
    /// `fsdp.gradients(loss.backward())`.
    Fsdp,
    /// Burn's own `GradientsParams::from_grads(loss.backward(), fsdp.module())`, as burn-train's
    /// `TrainOutput::new` does (issue #42: with reduce-scatters on the communication thread
    /// these once lost every unit's gradient but the root's, without a word).
    Burn,
}

/// The same under FSDP at `world` ranks, each on its rows of the batch.
fn fsdp<F: FsdpBackend, O: Optimizer<Mlp<F>, F> + 'static>(
    world: usize,
    prefetch: bool,
    how: Grads,
    make: fn() -> O,
) -> (Vec<f64>, HashMap<String, Vec<f64>>) {
    let mut out = launch(world, Duration::from_secs(60), move |group| {
        let device: burn::tensor::Device<F> = Default::default();
        let rank = group.rank();
        let mesh = DeviceMesh::new_1d(group, device.clone());
        let config = FsdpConfig { units: UnitPolicy::VecElements, prefetch, ..FsdpConfig::default() };
        let mut fsdp = Fsdp::wrap(Mlp::<F>::new(&device), &mesh, config)?;
        let mut optim = make();
        let mut lr = schedule();
        let mut losses = Vec::new();
        let per = ROWS / world;
        for step in 0..STEPS {
            let (x, y) = batch::<F>(step, &device);
            let (x, y) = (x.narrow(0, rank * per, per), y.narrow(0, rank * per, per));
            let loss = fsdp.forward(|m, r| m.loss(x, y, r));
            let local = loss.clone().into_scalar().elem::<f64>();
            losses.push(fsdp.all_reduce_scalar(local, burn_fsdp::ReduceOp::Avg, "loss")?);
            let grads = match how {
                Grads::Fsdp => fsdp.gradients(loss.backward()),
                Grads::Burn => GradientsParams::from_grads(loss.backward(), fsdp.module()),
            };
            fsdp.step_with(&mut optim, lr.step(), grads)?;
        }
        let params = fsdp
            .full_parameters()?
            .into_iter()
            .map(|(path, _, data)| (path, data.convert::<f64>().to_vec::<f64>().expect("f64")))
            .collect::<HashMap<_, _>>();
        Ok::<_, burn_fsdp::FsdpError>((losses, params))
    })
    .unwrap();
    out.remove(0)
}

/// `max |a - b| / max |b|` over a tensor: per-element relative errors of entries near zero
/// only measure f32 rounding (a 0.027 bias entry 3.7e-7 off after five RmsProp steps of ~0.05
/// is 1.4e-5 "relative"); relative to the tensor's scale they are ~1e-7.
fn max_abs_diff_over_max(a: &[f64], b: &[f64]) -> f64 {
    assert_eq!(a.len(), b.len(), "lengths differ");
    let scale = b.iter().fold(0.0f64, |m, v| m.max(v.abs())).max(f64::MIN_POSITIVE);
    a.iter().zip(b).map(|(x, y)| (x - y).abs()).fold(0.0, f64::max) / scale
}

fn check<O1, O2>(name: &str, single_optim: fn() -> O1, fsdp_optim: fn() -> O2)
where
    O1: Optimizer<Mlp<AB>, AB>,
    O2: Optimizer<Mlp<FB>, FB> + 'static,
{
    check_on::<AB, FB, O1, O2>(name, single_optim, fsdp_optim);
}

/// [`check`] on one device of backend `S` and FSDP on `F`.
fn check_on<S, F, O1, O2>(name: &str, single_optim: fn() -> O1, fsdp_optim: fn() -> O2)
where
    S: AutodiffBackend,
    F: FsdpBackend,
    O1: Optimizer<Mlp<S>, S>,
    O2: Optimizer<Mlp<F>, F> + 'static,
{
    let (want_losses, want_params) = single::<S, O1>(single_optim());
    // The optimizer moved the parameters (a test of a no-op would pass trivially).
    let start = parameters::<S, _>(&Mlp::<S>::new(&Default::default()));
    let moved = start.iter().map(|(k, v)| max_rel_diff(v, &want_params[k])).fold(0.0, f64::max);
    assert!(moved > 1e-3, "{name}: the parameters barely moved ({moved:e})");
    for world in [2, 3] {
        for (prefetch, how) in
            [(true, Grads::Fsdp), (false, Grads::Fsdp), (true, Grads::Burn), (false, Grads::Burn)]
        {
            let (losses, params) = fsdp::<F, O2>(world, prefetch, how, fsdp_optim);
            let d = max_rel_diff(&losses, &want_losses);
            assert!(
                d < 1e-5,
                "{name} W = {world} prefetch {prefetch} {how:?}: losses {d:e}\n{losses:?}\n{want_losses:?}"
            );
            let mut names: Vec<_> = params.keys().collect();
            names.sort();
            let mut want_names: Vec<_> = want_params.keys().collect();
            want_names.sort();
            assert_eq!(names, want_names, "{name}: parameter paths");
            for (path, got) in &params {
                let d = max_abs_diff_over_max(got, &want_params[path]);
                assert!(
                    d < 1e-5,
                    "{name} W = {world} prefetch {prefetch} {how:?}: {path} {d:e}\n{got:?}\n{:?}",
                    want_params[path]
                );
            }
        }
    }
}

#[test]
fn burn_adam_on_shards_matches_one_device() {
    check("Adam", || AdamConfig::new().init(), || AdamConfig::new().init());
}

#[test]
fn burn_adamw_on_shards_matches_one_device() {
    check(
        "AdamW",
        || AdamWConfig::new().with_weight_decay(0.1).init(),
        || AdamWConfig::new().with_weight_decay(0.1).init(),
    );
}

/// What users get by default: burn's Flex CPU backend (`train-qwen3`'s default), Burn's AdamW,
/// gradients taken the plain Burn way and the other, at W = 2 and 3 against one device on Flex.
#[test]
fn burn_adamw_on_flex_the_default_backend_matches_one_device() {
    type S = Autodiff<Flex>;
    type F = Autodiff<Flex, BalancedCheckpointing>;
    check_on::<S, F, _, _>(
        "AdamW on Flex",
        || AdamWConfig::new().with_weight_decay(0.1).init::<S, Mlp<S>>(),
        || AdamWConfig::new().with_weight_decay(0.1).init::<F, Mlp<F>>(),
    );
}

#[test]
fn burn_sgd_with_momentum_on_shards_matches_one_device() {
    fn sgd<B: AutodiffBackend, M: AutodiffModule<B>>() -> impl Optimizer<M, B> {
        SgdConfig::new()
            .with_momentum(Some(MomentumConfig::new().with_momentum(0.9).with_nesterov(true)))
            .with_weight_decay(Some(WeightDecayConfig::new(0.01)))
            .init()
    }
    check("SGD", sgd::<AB, Mlp<AB>>, sgd::<FB, Mlp<FB>>);
}

#[test]
fn burn_rmsprop_on_shards_matches_one_device() {
    fn rmsprop<B: AutodiffBackend, M: AutodiffModule<B>>() -> impl Optimizer<M, B> {
        RmsPropConfig::new().with_momentum(0.5).with_centered(true).init()
    }
    check("RmsProp", rmsprop::<AB, Mlp<AB>>, rmsprop::<FB, Mlp<FB>>);
}

/// A rank's FSDP-wrapped MLP with its rows of a batch (inputs, targets).
type WithRows = (Fsdp<FB, Mlp<FB>>, Tensor<FB, 2>, Tensor<FB, 2>);

/// At W = 2: this rank's FSDP-wrapped MLP (default config) and its 6 rows of step 0's batch.
fn wrapped_with_rows(group: std::sync::Arc<burn_fsdp::LocalGroup>) -> Result<WithRows, burn_fsdp::FsdpError> {
    let device = Default::default();
    let rank = group.rank();
    let mesh = DeviceMesh::new_1d(group, device);
    let fsdp = Fsdp::wrap(
        Mlp::<FB>::new(&device),
        &mesh,
        FsdpConfig { units: UnitPolicy::VecElements, ..FsdpConfig::default() },
    )?;
    let (x, y) = batch::<FB>(0, &device);
    Ok((fsdp, x.narrow(0, rank * 6, 6), y.narrow(0, rank * 6, 6)))
}

#[test]
fn optimizers_that_need_whole_parameters_are_refused() {
    let err = launch(2, Duration::from_secs(30), |group| {
        let (mut fsdp, x, y) = wrapped_with_rows(group)?;
        let loss = fsdp.forward(|m, r| m.loss(x, y, r));
        let grads = fsdp.gradients(loss.backward());
        let mut muon = burn::optim::MuonConfig::new().init::<FB, Mlp<FB>>();
        fsdp.step_with(&mut muon, 0.01, grads)
    })
    .unwrap_err()
    .to_string();
    assert!(err.contains("Muon") && err.contains("elementwise"), "{err}");
}

/// Gradients of a backward that FSDP never saw end (here: `Checkpointed::gradients`, the
/// one-device helper, on an FSDP forward) leave the reduce-scatters of the communication thread
/// uncollected: the optimizer step and the next forward refuse to go on, naming the way that
/// works, instead of stepping on the root unit's gradients alone.
#[test]
fn uncollected_reduce_scatters_are_an_error_not_a_silent_step() {
    let errors = launch(2, Duration::from_secs(30), |group| {
        let (mut fsdp, x, y) = wrapped_with_rows(group)?;
        let run = fsdp.forward_checkpointed(|m, r| m.loss(x.clone(), y.clone(), r));
        let grads = run.gradients(fsdp.module());
        let mut adam = AdamWConfig::new().init();
        let step = fsdp.step_with(&mut adam, 0.01, grads).map(|_| ()).unwrap_err().to_string();
        let forward =
            fsdp.try_forward(|m, r| m.loss(x.clone(), y.clone(), r)).map(|_| ()).unwrap_err().to_string();
        // Reported once: the forward after the error runs, and its gradients are whole.
        let loss = fsdp.try_forward(|m, r| m.loss(x, y, r))?;
        let grads = GradientsParams::from_grads(loss.backward(), fsdp.module());
        fsdp.step_with(&mut adam, 0.01, grads)?;
        Ok::<_, burn_fsdp::FsdpError>((step, forward))
    })
    .unwrap();
    for (step, forward) in errors {
        for e in [step, forward] {
            assert!(e.contains("never collected") && e.contains("Fsdp::backward_checkpointed"), "{e}");
        }
    }
}

/// The checkpointed forward reports what the plain one reports, as an error of
/// `try_forward_checkpointed`: uncollected gradients of the previous backward, once; the
/// checkpointed step after it is whole.
#[test]
fn try_forward_checkpointed_returns_uncollected_gradients_as_an_error() {
    let errors = launch(2, Duration::from_secs(30), |group| {
        let (mut fsdp, x, y) = wrapped_with_rows(group)?;
        let run = fsdp.forward_checkpointed(|m, r| m.loss(x.clone(), y.clone(), r));
        drop(run.gradients(fsdp.module()));
        let err = fsdp
            .try_forward_checkpointed(|m, r| m.loss(x.clone(), y.clone(), r))
            .map(|_| ())
            .unwrap_err()
            .to_string();
        let run = fsdp.try_forward_checkpointed(|m, r| m.loss(x, y, r))?;
        let grads = fsdp.backward_checkpointed(run);
        let mut adam = AdamWConfig::new().init();
        fsdp.step_with(&mut adam, 0.01, grads)?;
        Ok::<_, burn_fsdp::FsdpError>(err)
    })
    .unwrap();
    for e in errors {
        assert!(e.contains("never collected") && e.contains("Fsdp::backward_checkpointed"), "{e}");
    }
}
