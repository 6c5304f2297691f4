//! `Fsdp::wrap` on models Burn users write (issue #16): buffers are not parameters (Burn's
//! `RunningState` tensors, BatchNorm's running statistics, and frozen parameters stay whole on
//! every rank, outside every collective, as buffers do under PyTorch FSDP2); replicas start
//! identical whatever each rank built (rank 0's values are broadcast at wrap); a unit called
//! without the runner is named in the error.

use std::time::Duration;

use burn::backend::autodiff::checkpoint::strategy::BalancedCheckpointing;
use burn::backend::{Autodiff, NdArray};
use burn::module::{Module, Param};
use burn::nn::{BatchNorm, BatchNormConfig, Linear};
use burn::optim::{GradientsAccumulator, GradientsParams};
use burn::tensor::backend::Backend;
use burn::tensor::{Tensor, TensorData};
use burn_fsdp::UnitPolicy;
use burn_fsdp::{DeviceMesh, Direct, Fsdp, FsdpConfig, TorchAdamWConfig, UnitRunner, launch};
use tests::max_rel_diff;

type AB = Autodiff<NdArray<f32>>;
pub(crate) type FB = Autodiff<NdArray<f32>, BalancedCheckpointing>;

const ROWS: usize = 12; // divisible by 1, 2, 3
const WIDTH: usize = 6;
const STEPS: usize = 6;
const ADAM: TorchAdamWConfig =
    TorchAdamWConfig { lr: 0.02, betas: (0.9, 0.95), eps: 1e-8, weight_decay: 0.0 };

#[derive(Module, Debug)]
struct Block<B: Backend> {
    linear: Linear<B>,
    norm: BatchNorm<B>,
}

/// Linear → BatchNorm → tanh blocks (each an FSDP unit), then a linear head (the root unit).
#[derive(Module, Debug)]
struct BnNet<B: Backend> {
    blocks: Vec<Block<B>>,
    head: Linear<B>,
}

fn linear<B: Backend>(d_in: usize, d_out: usize, salt: usize, device: &B::Device) -> Linear<B> {
    let w: Vec<f32> = (0..d_in * d_out).map(|i| (((i * 7 + salt * 3) % 13) as f32 - 6.0) * 0.06).collect();
    let b: Vec<f32> = (0..d_out).map(|i| ((i + salt) % 5) as f32 * 0.02).collect();
    Linear {
        weight: Param::from_tensor(Tensor::from_data(TensorData::new(w, [d_in, d_out]), device)),
        bias: Some(Param::from_tensor(Tensor::from_data(TensorData::new(b, [d_out]), device))),
    }
}

impl<B: Backend> BnNet<B> {
    fn new(device: &B::Device) -> Self {
        Self::with_salt(0, device)
    }

    /// A different model for each `salt` (0: the reference one).
    fn with_salt(salt: usize, device: &B::Device) -> Self {
        let block = |k| Block {
            linear: linear(WIDTH, WIDTH, k + salt, device),
            norm: BatchNormConfig::new(WIDTH).init(device),
        };
        Self { blocks: vec![block(1), block(2)], head: linear(WIDTH, 1, 3 + salt, device) }
    }

    fn loss(&self, x: Tensor<B, 2>, y: Tensor<B, 2>, r: &mut impl UnitRunner<B>) -> Tensor<B, 1> {
        let mut h = x;
        for block in &self.blocks {
            h = r.run(block, h, |b, h| {
                let h = b.linear.forward(h).unsqueeze_dim::<3>(2);
                b.norm.forward(h).squeeze_dim::<2>(2).tanh()
            });
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

/// Single device, each step's batch as `world` micro-batches (BatchNorm statistics per
/// micro-batch, as each FSDP rank computes them on its own rows), gradients averaged.
fn single(world: usize) -> Vec<f64> {
    let device = Default::default();
    let mut model = BnNet::<AB>::new(&device);
    let mut adam = ADAM.init();
    let mut losses = Vec::new();
    let per = ROWS / world;
    for step in 0..STEPS {
        let (x, y) = batch::<AB>(step, &device);
        let mut accum = GradientsAccumulator::<BnNet<AB>>::new();
        let mut total = 0.0;
        for m in 0..world {
            let loss =
                model.loss(x.clone().narrow(0, m * per, per), y.clone().narrow(0, m * per, per), &mut Direct);
            let loss = loss.div_scalar(world as f64);
            total += loss.clone().into_scalar() as f64;
            accum.accumulate(&model, GradientsParams::from_grads(loss.backward(), &model));
        }
        losses.push(total);
        model = adam.step(model, accum.grads());
    }
    losses
}

fn fsdp(world: usize, prefetch: bool) -> Vec<f64> {
    fsdp_with(world, prefetch, |_| 0)
}

/// FSDP training; rank `r` builds its replica with `salt(r)` (rank 0's must be 0).
fn fsdp_with(
    world: usize,
    prefetch: bool,
    salt: impl Fn(usize) -> usize + Send + Sync + Copy + 'static,
) -> Vec<f64> {
    launch(world, Duration::from_secs(60), move |group| {
        let device = Default::default();
        let rank = group.rank();
        let mesh = DeviceMesh::new_1d(group, device);
        let model = BnNet::<FB>::with_salt(salt(rank), &device);
        let mut fsdp = Fsdp::wrap(
            model,
            &mesh,
            FsdpConfig { units: UnitPolicy::VecElements, prefetch, ..FsdpConfig::default() },
        )?;
        // The running statistics stay whole and replicated; the parameters are sharded.
        let replicated = fsdp.replicated_tensors().to_vec();
        assert_eq!(replicated.len(), 4, "{replicated:?}");
        assert!(replicated.iter().all(|p| p.contains("running_")), "{replicated:?}");
        assert_eq!(fsdp.module().blocks[0].norm.running_mean.value().dims(), [WIDTH]);
        assert!(fsdp.units().iter().flat_map(|u| &u.params).all(|p| !p.path.contains("running_")));
        let mut adam = ADAM.init();
        let mut losses = Vec::new();
        let per = ROWS / world;
        for step in 0..STEPS {
            let (x, y) = batch::<FB>(step, &device);
            let (x, y) = (x.narrow(0, rank * per, per), y.narrow(0, rank * per, per));
            let loss = fsdp.forward(|m, r| m.loss(x, y, r));
            losses.push(fsdp.all_reduce_scalar(
                loss.clone().into_scalar() as f64,
                burn_fsdp::ReduceOp::Avg,
                "loss",
            )?);
            let grads = fsdp.gradients(loss.backward());
            fsdp.step(&mut adam, grads);
        }
        // Each rank's running statistics moved away from their initial values (updated by its
        // own forward passes, with no collective).
        let rm = fsdp.module().blocks[0].norm.running_mean.value().into_data().to_vec::<f32>().unwrap();
        assert!(rm.iter().any(|v| v.abs() > 1e-4), "running mean never updated: {rm:?}");
        Ok::<_, burn_fsdp::FsdpError>(losses)
    })
    .unwrap()
    .remove(0)
}

#[test]
fn batchnorm_trains_under_fsdp_like_per_rank_micro_batches_on_one_device() {
    for world in [2, 3] {
        let want = single(world);
        for prefetch in [true, false] {
            let got = fsdp(world, prefetch);
            let d = max_rel_diff(&got, &want);
            assert!(d < 1e-5, "W = {world}, prefetch {prefetch}: {d:e}\n{got:?}\n{want:?}");
        }
    }
}

#[test]
fn replicas_built_differently_start_from_rank_0s_values() {
    // Ranks 1 and 2 build other weights (as a clone re-running lazy initialisers, or per-rank
    // seeds, would); wrap broadcasts rank 0's, so training is that of rank 0's model.
    let want = single(3);
    let got = fsdp_with(3, true, |rank| rank * 5);
    let d = max_rel_diff(&got, &want);
    assert!(d < 1e-5, "{d:e}\n{got:?}\n{want:?}");
    // Without the broadcast the run would differ: the models themselves differ.
    let other = BnNet::<AB>::with_salt(5, &Default::default());
    let base = BnNet::<AB>::new(&Default::default());
    assert_ne!(other.head.weight.val().into_data(), base.head.weight.val().into_data());
}

#[test]
fn a_model_with_nothing_to_train_is_refused_with_a_reason() {
    let device = Default::default();
    let err = launch(1, Duration::from_secs(10), move |group| {
        let mesh = DeviceMesh::new_1d(group, device);
        let frozen = BnNet::<FB>::new(&device).no_grad();
        Fsdp::wrap(frozen, &mesh, FsdpConfig { units: UnitPolicy::VecElements, ..FsdpConfig::default() })
            .map(|_| ())
    })
    .unwrap_err()
    .to_string();
    assert!(err.contains("no parameter of the model requires grad"), "{err}");
}

#[test]
fn sharded_checkpoints_refuse_models_with_buffers() {
    let device = Default::default();
    let dir = std::env::temp_dir().join(format!("fsdp-buffers-{}", std::process::id()));
    let dir2 = dir.clone();
    let err = launch(2, Duration::from_secs(30), move |group| {
        let mesh = DeviceMesh::new_1d(group, device);
        let fsdp = Fsdp::wrap(
            BnNet::<FB>::new(&device),
            &mesh,
            FsdpConfig { units: UnitPolicy::VecElements, ..FsdpConfig::default() },
        )?;
        fsdp.save_sharded(&dir2, &ADAM.init(), 0, &serde_json::json!({}))
            .map_err(|e| burn_fsdp::FsdpError::Config(e.to_string()))
    })
    .unwrap_err()
    .to_string();
    assert!(err.contains("running_mean") || err.contains("running_var"), "{err}");
    assert!(!dir.join("index.json").exists());
}

#[test]
fn a_unit_called_without_the_runner_gives_an_error_naming_it() {
    let device = Default::default();
    let msgs = launch(2, Duration::from_secs(30), move |group| {
        let rank = group.rank();
        let mesh = DeviceMesh::new_1d(group, device);
        let fsdp = Fsdp::wrap(
            BnNet::<FB>::new(&device),
            &mesh,
            FsdpConfig { units: UnitPolicy::VecElements, prefetch: false, ..FsdpConfig::default() },
        )?;
        let (x, y) = batch::<FB>(0, &device);
        let (x, y) = (x.narrow(0, rank * 6, 6), y.narrow(0, rank * 6, 6));
        // The blocks are called directly: their weights are [3, 6] shards of [6, 6].
        let err = fsdp
            .try_forward(|m, _r| {
                let mut h = x;
                for b in &m.blocks {
                    h = b.norm.forward(b.linear.forward(h).unsqueeze_dim::<3>(2)).squeeze_dim::<2>(2);
                }
                (m.head.forward(h) - y).powf_scalar(2.0).mean()
            })
            .map(|_| ())
            .unwrap_err();
        Ok::<_, burn_fsdp::FsdpError>(err.to_string())
    })
    .unwrap();
    for msg in msgs {
        assert!(msg.contains("`blocks.0`") && msg.contains("runner.run"), "{msg}");
    }
}

/// A module run through the runner that holds two units (the whole `Vec` of blocks) is an
/// `FsdpError` naming both, in training and in evaluation, not a panic.
#[test]
fn a_module_spanning_two_units_is_an_error_naming_them() {
    let device = Default::default();
    let msgs = launch(2, Duration::from_secs(30), move |group| {
        let rank = group.rank();
        let mesh = DeviceMesh::new_1d(group, device);
        let fsdp = Fsdp::wrap(
            BnNet::<FB>::new(&device),
            &mesh,
            FsdpConfig { units: UnitPolicy::VecElements, ..FsdpConfig::default() },
        )?;
        let (x, y) = batch::<FB>(0, &device);
        let (x, y) = (x.narrow(0, rank * 6, 6), y.narrow(0, rank * 6, 6));
        let all_blocks = |blocks: &Vec<Block<FB>>, mut h: Tensor<FB, 2>| {
            for b in blocks {
                h = b.linear.forward(h).tanh();
            }
            h
        };
        let train = fsdp
            .try_forward(|m, r| {
                (m.head.forward(r.run(&m.blocks, x.clone(), all_blocks)) - y).powf_scalar(2.0).mean()
            })
            .map(|_| ())
            .unwrap_err();
        let valid = fsdp
            .forward_valid(|m, r| {
                r.run(&m.blocks, x.inner(), |blocks, mut h| {
                    for b in blocks {
                        h = b.linear.forward(h).tanh();
                    }
                    h
                })
            })
            .map(|_| ())
            .unwrap_err();
        Ok::<_, burn_fsdp::FsdpError>([train.to_string(), valid.to_string()])
    })
    .unwrap();
    for msg in msgs.iter().flatten() {
        assert!(
            msg.contains("`blocks.0`") && msg.contains("`blocks.1`") && msg.contains("on its own"),
            "{msg}"
        );
    }
}

/// Evaluation (Burn's `valid()`: BatchNorm on its running statistics) of the sharded model
/// equals the whole model's: at wrap against one device, and after training against the
/// gathered parameters with the rank's own running statistics.
#[test]
fn evaluation_mode_gathers_units_and_uses_running_statistics() {
    use burn::module::{AutodiffModule, ModuleMapper};
    type I = NdArray<f32>;
    /// Replaces parameters by path.
    struct Load(burn_fsdp::PathStack, std::collections::HashMap<String, (Vec<usize>, TensorData)>);
    impl ModuleMapper<I> for Load {
        fn enter_module(&mut self, name: &str, _: &str) {
            self.0.push(name);
        }
        fn exit_module(&mut self, _: &str, _: &str) {
            self.0.pop();
        }
        fn map_float<const D: usize>(&mut self, param: Param<Tensor<I, D>>) -> Param<Tensor<I, D>> {
            let (id, tensor, mapper) = param.consume();
            let t = match self.1.get(&self.0.current()) {
                Some((shape, data)) => Tensor::<I, 1>::from_data(data.clone(), &tensor.device())
                    .reshape(burn::tensor::Shape::from(shape.clone())),
                None => tensor,
            };
            Param::from_mapped_value(id, t, mapper)
        }
    }
    for world in [2, 3] {
        let diffs = launch(world, Duration::from_secs(60), move |group| {
            let device = Default::default();
            let rank = group.rank();
            let mesh = DeviceMesh::new_1d(group, device);
            let mut fsdp = Fsdp::wrap(
                BnNet::<FB>::new(&device),
                &mesh,
                FsdpConfig { units: UnitPolicy::VecElements, ..FsdpConfig::default() },
            )?;
            let (x, _) = batch::<I>(7, &device);
            let forward = |m: &BnNet<I>, x: Tensor<I, 2>, r: &mut RunBlock<'_>| {
                let mut h = x;
                for block in &m.blocks {
                    h = r(block, h);
                }
                m.head.forward(h)
            };
            let block_fn = |b: &Block<I>, h: Tensor<I, 2>| {
                b.norm.forward(b.linear.forward(h).unsqueeze_dim::<3>(2)).squeeze_dim::<2>(2).tanh()
            };
            let run_valid = |fsdp: &Fsdp<FB, BnNet<FB>>, x: Tensor<I, 2>| {
                fsdp.forward_valid(|m, r| forward(m, x, &mut |b, h| r.run(b, h, block_fn)))
            };
            // At wrap: the one-device model in evaluation mode.
            let single = BnNet::<I>::new(&device);
            let want = forward(&single, x.clone(), &mut |b, h| block_fn(b, h));
            let at_wrap = max_rel_diff(&f64s(run_valid(&fsdp, x.clone())?), &f64s(want));
            // After training: the gathered parameters with this rank's running statistics.
            let mut adam = ADAM.init();
            let per = ROWS / world;
            for step in 0..3 {
                let (bx, by) = batch::<FB>(step, &device);
                let (bx, by) = (bx.narrow(0, rank * per, per), by.narrow(0, rank * per, per));
                let loss = fsdp.forward(|m, r| m.loss(bx, by, r));
                let grads = fsdp.gradients(loss.backward());
                fsdp.step(&mut adam, grads);
            }
            let full: std::collections::HashMap<_, _> = fsdp
                .full_parameters()?
                .into_iter()
                .map(|(path, shape, data)| (path, (shape, data)))
                .collect();
            let whole = fsdp.module().clone().valid().map(&mut Load(Default::default(), full));
            let want = forward(&whole, x.clone(), &mut |b, h| block_fn(b, h));
            let trained = max_rel_diff(&f64s(run_valid(&fsdp, x.clone())?), &f64s(want.clone()));
            // Training mode (batch statistics) would give other numbers.
            let train_mode = fsdp.forward(|m, r| {
                let mut h = Tensor::<FB, 2>::from_inner(x.clone());
                for block in &m.blocks {
                    h = r.run(block, h, |b, h| {
                        b.norm.forward(b.linear.forward(h).unsqueeze_dim::<3>(2)).squeeze_dim::<2>(2).tanh()
                    });
                }
                m.head.forward(h)
            });
            let other = max_rel_diff(&f64s(train_mode.inner()), &f64s(want));
            Ok::<_, burn_fsdp::FsdpError>((at_wrap, trained, other))
        })
        .unwrap();
        for (rank, (at_wrap, trained, other)) in diffs.into_iter().enumerate() {
            assert!(at_wrap < 1e-6, "W = {world} rank {rank}: at wrap {at_wrap:e}");
            assert!(trained < 1e-6, "W = {world} rank {rank}: after training {trained:e}");
            assert!(other > 1e-3, "W = {world} rank {rank}: training mode is not different ({other:e})");
        }
    }
}

/// How evaluation runs a block (directly, or through a runner).
type RunBlock<'a> = dyn FnMut(&Block<NdArray<f32>>, Tensor<NdArray<f32>, 2>) -> Tensor<NdArray<f32>, 2> + 'a;

fn f64s<B: Backend, const D: usize>(t: Tensor<B, D>) -> Vec<f64> {
    t.into_data().convert::<f64>().to_vec::<f64>().unwrap()
}
