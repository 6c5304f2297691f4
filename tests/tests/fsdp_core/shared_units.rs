//! Units used more than once per forward (issue #16): a block called twice (weight sharing
//! across depth, as in ALBERT or a looped transformer) and a block whose parameters are tied to
//! another unit's (two `Vec` entries holding clones of one module, which share parameter ids in
//! Burn). Each use adds its gradient: under FSDP, with prefetch on and off, with gradient
//! accumulation (no sync on the first micro-batch), and at W = 2 and 3, training matches one
//! device within 1e-5.

use std::time::Duration;

use burn::backend::{Autodiff, NdArray};
use burn::module::{Module, Param};
use burn::nn::Linear;
use burn::optim::{GradientsAccumulator, GradientsParams};
use burn::tensor::backend::Backend;
use burn::tensor::{Tensor, TensorData};
use burn_fsdp::UnitPolicy;
use burn_fsdp::{DeviceMesh, Direct, Fsdp, FsdpConfig, TorchAdamWConfig, UnitRunner, launch};
use tests::max_rel_diff;

use super::any_model::FB;

type AB = Autodiff<NdArray<f32>>;

const ROWS: usize = 12;
const WIDTH: usize = 5; // rows of the [5, 5] weights shard unevenly at W = 2 and 3
const STEPS: usize = 5;
const ADAM: TorchAdamWConfig =
    TorchAdamWConfig { lr: 0.02, betas: (0.9, 0.95), eps: 1e-8, weight_decay: 0.01 };

/// `layers[0]` → `layers[1]` twice → `layers[2]`, `layers[3]` (clones: tied parameters) →
/// `head`. Each element of `layers` is an FSDP unit (the default policy); `layers[3]`'s
/// parameters are `layers[2]`'s, so they belong to that unit.
#[derive(Module, Debug)]
struct Shared<B: Backend> {
    layers: Vec<Linear<B>>,
    head: Linear<B>,
}

fn linear<B: Backend>(d_in: usize, d_out: usize, salt: usize, device: &B::Device) -> Linear<B> {
    let w: Vec<f32> = (0..d_in * d_out).map(|i| (((i * 7 + salt * 3) % 11) as f32 - 5.0) * 0.08).collect();
    let b: Vec<f32> = (0..d_out).map(|i| ((i + salt) % 3) as f32 * 0.05).collect();
    Linear {
        weight: Param::from_tensor(Tensor::from_data(TensorData::new(w, [d_in, d_out]), device)),
        bias: Some(Param::from_tensor(Tensor::from_data(TensorData::new(b, [d_out]), device))),
    }
}

impl<B: Backend> Shared<B> {
    fn new(device: &B::Device) -> Self {
        let tied = linear(WIDTH, WIDTH, 4, device);
        Self {
            layers: vec![
                linear(WIDTH, WIDTH, 1, device),
                linear(WIDTH, WIDTH, 2, device),
                tied.clone(),
                tied,
            ],
            head: linear(WIDTH, 1, 3, device),
        }
    }

    fn loss(&self, x: Tensor<B, 2>, y: Tensor<B, 2>, r: &mut impl UnitRunner<B>) -> Tensor<B, 1> {
        let l = &self.layers;
        let mut h = x;
        for layer in [&l[0], &l[1], &l[1], &l[2], &l[3]] {
            h = r.run(layer, h, |l, h| l.forward(h).tanh());
        }
        (self.head.forward(h) - y).powf_scalar(2.0).mean()
    }
}

fn batch<B: Backend>(step: usize, device: &B::Device) -> (Tensor<B, 2>, Tensor<B, 2>) {
    let x: Vec<f32> = (0..ROWS * WIDTH).map(|i| (((i * 5 + step * 11) % 17) as f32 - 8.0) * 0.1).collect();
    let y: Vec<f32> = (0..ROWS).map(|i| (((i * 3 + step) % 7) as f32 - 3.0) * 0.2).collect();
    (
        Tensor::from_data(TensorData::new(x, [ROWS, WIDTH]), device),
        Tensor::from_data(TensorData::new(y, [ROWS, 1]), device),
    )
}

/// One device, the whole batch as `micro` micro-batches.
fn single(micro: usize) -> Vec<f64> {
    let device = Default::default();
    let mut model = Shared::<AB>::new(&device);
    let mut adam = ADAM.init();
    let per = ROWS / micro;
    let mut losses = Vec::new();
    for step in 0..STEPS {
        let (x, y) = batch::<AB>(step, &device);
        let mut accum = GradientsAccumulator::<Shared<AB>>::new();
        let mut total = 0.0;
        for m in 0..micro {
            let (x, y) = (x.clone().narrow(0, m * per, per), y.clone().narrow(0, m * per, per));
            let loss = model.loss(x, y, &mut Direct).div_scalar(micro as f64);
            total += loss.clone().into_scalar() as f64;
            accum.accumulate(&model, GradientsParams::from_grads(loss.backward(), &model));
        }
        losses.push(total);
        model = adam.step(model, accum.grads());
    }
    losses
}

/// FSDP at `world` ranks, each rank's rows as `micro` micro-batches (sync on the last).
fn fsdp(world: usize, prefetch: bool, micro: usize) -> Vec<f64> {
    launch(world, Duration::from_secs(60), move |group| {
        let device = Default::default();
        let rank = group.rank();
        let mesh = DeviceMesh::new_1d(group, device);
        let config = FsdpConfig { units: UnitPolicy::VecElements, prefetch, ..FsdpConfig::default() };
        let mut fsdp = Fsdp::wrap(Shared::<FB>::new(&device), &mesh, config)?;
        let mut adam = ADAM.init();
        let per = ROWS / world / micro;
        let mut losses = Vec::new();
        for step in 0..STEPS {
            let (x, y) = batch::<FB>(step, &device);
            let mut total = 0.0;
            let mut grads = None;
            for m in 0..micro {
                fsdp.set_requires_gradient_sync(m + 1 == micro);
                let first = rank * per * micro + m * per;
                let (x, y) = (x.clone().narrow(0, first, per), y.clone().narrow(0, first, per));
                let loss = fsdp.forward(|model, r| model.loss(x, y, r)).div_scalar(micro as f64);
                total += loss.clone().into_scalar() as f64;
                grads = Some(fsdp.gradients(loss.backward()));
            }
            losses.push(fsdp.all_reduce_scalar(total, burn_fsdp::ReduceOp::Avg, "loss")?);
            fsdp.step(&mut adam, grads.expect("a micro-batch ran"));
        }
        // The tie holds: both places hold one tensor.
        let l = &fsdp.module().layers;
        assert_eq!(l[2].weight.val().into_data(), l[3].weight.val().into_data());
        Ok::<_, burn_fsdp::FsdpError>(losses)
    })
    .unwrap()
    .remove(0)
}

#[test]
fn a_unit_run_twice_and_weights_tied_across_units_get_every_use_s_gradient() {
    // On one device the tie holds through TorchAdamW's steps too.
    let device = Default::default();
    let mut model = Shared::<AB>::new(&device);
    let (x, y) = batch::<AB>(0, &device);
    let loss = model.loss(x, y, &mut Direct);
    let grads = GradientsParams::from_grads(loss.backward(), &model);
    model = ADAM.init().step(model, grads);
    assert_eq!(model.layers[2].weight.val().into_data(), model.layers[3].weight.val().into_data());

    for world in [2, 3] {
        let want = single(world);
        for prefetch in [false, true] {
            let got = fsdp(world, prefetch, 1);
            let d = max_rel_diff(&got, &want);
            assert!(d < 1e-5, "W = {world}, prefetch {prefetch}: {d:e}\n{got:?}\n{want:?}");
        }
    }
}

#[test]
fn shared_units_accumulate_without_sync() {
    let want = single(4);
    for prefetch in [true, false] {
        let got = fsdp(2, prefetch, 2);
        let d = max_rel_diff(&got, &want);
        assert!(d < 1e-5, "prefetch {prefetch}: {d:e}\n{got:?}\n{want:?}");
    }
}
