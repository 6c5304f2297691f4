//! burn-fsdp core against single-device Burn and the PyTorch FSDP2 fixtures.
#![allow(clippy::unwrap_used)]

/// FSDP on models Burn users write (issue #16): buffers, replicas, runner errors.
#[path = "fsdp_core/any_model.rs"]
mod any_model;
#[path = "fsdp_core/as_written.rs"]
/// Models left as written (issue #42): no runner, units marked with `FsdpUnit` or none.
mod as_written;
/// FSDP inside burn-train's Learner (issue #42).
#[path = "fsdp_core/learner.rs"]
mod learner;
#[path = "fsdp_core/optimizers.rs"]
mod optimizers;
/// Burn records of a sharded model: checkpoints of any Burn optimizer, the whole model (#42).
#[path = "fsdp_core/records.rs"]
mod records;
#[path = "fsdp_core/shared_units.rs"]
mod shared_units;
/// `Fsdp::train_step`: the generic step of a hand-written loop (#42).
#[path = "fsdp_core/train_step.rs"]
mod train_step;

use std::time::{Duration, Instant};

use burn::backend::autodiff::checkpoint::strategy::BalancedCheckpointing;
use burn::backend::{Autodiff, NdArray};
use burn::module::AutodiffModule;
use burn::optim::{GradientsAccumulator, GradientsParams};
use burn::tensor::Tensor;
use burn_fsdp::UnitPolicy;
use burn_fsdp::{
    CollectiveKind, CommStats, DeviceMesh, Direct, Fsdp, FsdpConfig, ProcessGroup, Tag, TorchAdamWConfig,
    launch,
};
use tests::toy::{Toy, toy_batch};
use tests::{max_rel_diff, reference, train_args};

type B = NdArray<f32>;
type AB = Autodiff<B>;
type FB = Autodiff<B, BalancedCheckpointing>;

const ROWS: usize = 24; // divisible by 1, 2, 3, 4, 8
const STEPS: usize = 10;
const ADAM: TorchAdamWConfig =
    TorchAdamWConfig { lr: 0.01, betas: (0.9, 0.95), eps: 1e-8, weight_decay: 0.1 };

struct Run {
    losses: Vec<f64>,
    norms: Vec<f64>,
    params: Vec<(String, Vec<f32>)>,
    prefetch: Option<burn_fsdp::prefetch::PrefetchStats>,
}

/// Single-device toy training: `micro` micro-batches per step, optional clipping.
fn toy_single(micro: usize, clip: f64) -> Run {
    let device = Default::default();
    let mut model = Toy::<AB>::new(3, &device);
    let mut adam = ADAM.init();
    let (mut losses, mut norms) = (Vec::new(), Vec::new());
    for step in 0..STEPS {
        let mut accum = GradientsAccumulator::<Toy<AB>>::new();
        let mut total = 0.0;
        for m in 0..micro {
            let (x, y) = toy_batch::<AB>(step, ROWS, &device);
            let per = ROWS / micro;
            let loss = model
                .loss(x.narrow(0, m * per, per), y.narrow(0, m * per, per), &mut Direct)
                .div_scalar(micro as f64);
            total += loss.clone().into_scalar() as f64;
            accum.accumulate(&model, GradientsParams::from_grads(loss.backward(), &model));
        }
        let mut grads = accum.grads();
        norms.push(burn_fsdp::clip_grad_norm(&model, &mut grads, clip));
        losses.push(total);
        model = adam.step(model, grads);
    }
    let params = qwen3_burn::checkpoint::parameter_names::<AB, _>(&model)
        .into_iter()
        .zip(collect_values(&model.valid()))
        .collect();
    Run { losses, norms, params, prefetch: None }
}

fn collect_values(m: &Toy<B>) -> Vec<Vec<f32>> {
    let mut out = vec![
        m.head.val().into_data().to_vec::<f32>().unwrap(),
        m.scale.val().into_data().to_vec::<f32>().unwrap(),
    ];
    for b in &m.blocks {
        for t in [b.a.val().into_data(), b.b.val().into_data(), b.bias.val().into_data()] {
            out.push(t.to_vec::<f32>().unwrap());
        }
    }
    out
}

/// FSDP toy training on `world` in-process ranks; returns rank 0's view.
fn toy_fsdp(world: usize, micro: usize, clip: f64, reshard: bool) -> Run {
    toy_fsdp_with(
        world,
        micro,
        clip,
        FsdpConfig {
            units: UnitPolicy::VecElements,
            reshard_after_forward: reshard,
            ..FsdpConfig::default()
        },
    )
}

/// [`toy_fsdp`] with any config.
fn toy_fsdp_with(world: usize, micro: usize, clip: f64, config: FsdpConfig) -> Run {
    let runs = launch(world, Duration::from_secs(60), |group| {
        let device = Default::default();
        let rank = group.rank();
        let mesh = DeviceMesh::new_1d(group, device);
        let mut fsdp = Fsdp::wrap(Toy::<FB>::new(3, &device), &mesh, config.clone())?;
        // Every parameter is sharded: local numel = ceil(rows / W) · cols.
        for unit in fsdp.units() {
            for p in &unit.params {
                assert_eq!(p.shard_numel(), p.global_shape[0].div_ceil(world) * p.row_numel());
            }
        }
        let mut adam = ADAM.init();
        let (mut losses, mut norms) = (Vec::new(), Vec::new());
        let per_rank = ROWS / world;
        for step in 0..STEPS {
            let mut total = 0.0;
            let mut grads = None;
            for m in 0..micro {
                fsdp.set_requires_gradient_sync(m + 1 == micro);
                let (x, y) = toy_batch::<FB>(step, ROWS, &device);
                let per = per_rank / micro;
                let start = rank * per_rank + m * per;
                let loss = fsdp
                    .forward(|model, r| model.loss(x.narrow(0, start, per), y.narrow(0, start, per), r))
                    .div_scalar(micro as f64);
                total += loss.clone().into_scalar() as f64;
                grads = Some(fsdp.gradients(loss.backward()));
            }
            let mut grads = grads.unwrap();
            norms.push(fsdp.clip_grad_norm(&mut grads, clip)?);
            losses.push(fsdp.all_reduce_scalar(total, burn_fsdp::ReduceOp::Avg, "loss")?);
            fsdp.step(&mut adam, grads);
        }
        let params = fsdp
            .full_parameters()?
            .into_iter()
            .map(|(path, _, data)| (path, data.to_vec::<f32>().unwrap()))
            .collect();
        Ok::<_, burn_fsdp::FsdpError>(Run { losses, norms, params, prefetch: fsdp.prefetch_stats() })
    })
    .unwrap();
    runs.into_iter().next().unwrap()
}

fn assert_close(a: &Run, b: &Run, tol: f64, what: &str) {
    let dl = max_rel_diff(&a.losses, &b.losses);
    let dn = max_rel_diff(&a.norms, &b.norms);
    assert!(dl <= tol && dn <= tol, "{what}: loss {dl:e}, grad norm {dn:e}");
    assert_eq!(a.params.len(), b.params.len());
    for ((pa, va), (pb, vb)) in a.params.iter().zip(&b.params) {
        assert_eq!(pa, pb);
        let num: f64 = va.iter().zip(vb).map(|(x, y)| ((x - y) as f64).powi(2)).sum();
        let den: f64 = vb.iter().map(|y| (*y as f64).powi(2)).sum();
        assert!((num / den).sqrt() <= tol, "{what}: parameter {pa} differs by {:e}", (num / den).sqrt());
    }
}

#[test]
fn toy_model_with_awkward_shapes_matches_single_device_at_every_world_size() {
    let single = toy_single(1, 0.0);
    assert!(single.losses[STEPS - 1] < single.losses[0], "the toy model must learn");
    for world in [1, 2, 3, 4, 8] {
        let fsdp = toy_fsdp(world, 1, 0.0, true);
        assert_close(&fsdp, &single, 1e-5, &format!("W = {world}"));
    }
}

#[test]
fn zero2_mode_matches_too() {
    let single = toy_single(1, 0.0);
    assert_close(&toy_fsdp(3, 1, 0.0, false), &single, 1e-5, "W = 3, reshard_after_forward = false");
}

#[test]
fn clipping_and_accumulation_match_single_device() {
    let single = toy_single(2, 0.015);
    // The clip must actually bite for this test to mean anything.
    assert!(single.norms.iter().all(|&n| n > 0.015), "{:?}", single.norms);
    let unclipped = toy_single(2, 0.0);
    assert!(max_rel_diff(&single.losses, &unclipped.losses) > 1e-4);
    for world in [2, 3, 4] {
        assert_close(&toy_fsdp(world, 2, 0.015, true), &single, 1e-5, &format!("clip + accum, W = {world}"));
    }
}

#[test]
fn world_size_one_is_bit_identical_to_no_fsdp() {
    let single = toy_single(1, 1.0);
    let fsdp = toy_fsdp(1, 1, 1.0, true);
    assert_eq!(single.losses, fsdp.losses);
    assert_eq!(single.norms, fsdp.norms);
    assert_eq!(single.params, fsdp.params);
}

fn check_qwen3(reference_name: &str, extra: &[&str]) {
    check_case("qwen3-tiny-a", reference_name, extra);
}

fn check_case(case: &str, reference_name: &str, extra: &[&str]) {
    let args = train_args(case, extra);
    let metrics = xtask::train::run(&args).unwrap();
    let mut r = reference(case, reference_name);
    r.losses.truncate(metrics.len());
    r.grad_norms.truncate(metrics.len());
    let losses: Vec<f64> = metrics.iter().map(|m| m.loss).collect();
    let norms: Vec<f64> = metrics.iter().map(|m| m.grad_norm).collect();
    let (dl, dn) = (max_rel_diff(&losses, &r.losses), max_rel_diff(&norms, &r.grad_norms));
    eprintln!("{case} {extra:?} vs {reference_name}: loss {dl:.3e}, grad norm {dn:.3e}");
    assert!(dl <= 1e-4 && dn <= 1e-4, "{reference_name} {extra:?}: loss {dl:e}, grad norm {dn:e}");
}

#[test]
fn qwen3_tiny_a_w4_reproduces_pytorch_fsdp2_and_single() {
    check_qwen3("fsdp4", &["--world-size", "4"]);
    check_qwen3("single", &["--world-size", "4"]);
}

#[test]
fn qwen3_tiny_a_w4_clip_accum_reproduces_pytorch_fsdp2() {
    check_qwen3("fsdp4_clip_accum", &["--world-size", "4", "--clip", "1.0", "--grad-accum", "2"]);
}

#[test]
fn qwen3_tiny_b_untied_w3_and_w4_clip_accum_reproduce_pytorch_fsdp2() {
    check_case("qwen3-tiny-b", "fsdp3", &["--world-size", "3"]);
    check_case(
        "qwen3-tiny-b",
        "fsdp4_clip_accum",
        &["--world-size", "4", "--clip", "0.5", "--grad-accum", "3"],
    );
}

#[test]
fn qwen3_tiny_a_other_world_sizes_and_zero2_match_single() {
    check_qwen3("single", &["--world-size", "2", "--steps", "10"]);
    check_qwen3("single", &["--world-size", "8", "--steps", "10", "--reshard-after-forward", "false"]);
}

/// Collective counts of one training step on rank 0 of a `world`-rank toy run.
fn counts(world: usize, micro: usize, reshard: bool) -> Vec<CommStats> {
    launch(world, Duration::from_secs(60), |group| {
        let device = Default::default();
        let rank = group.rank();
        let mesh = DeviceMesh::new_1d(group, device);
        let config = FsdpConfig {
            units: UnitPolicy::VecElements,
            reshard_after_forward: reshard,
            ..FsdpConfig::default()
        };
        let fsdp = Fsdp::wrap(Toy::<FB>::new(3, &device), &mesh, config)?;
        let per = ROWS / world / micro;
        let mut stats = vec![fsdp.comm_stats()];
        for m in 0..micro {
            fsdp.set_requires_gradient_sync(m + 1 == micro);
            let (x, y) = toy_batch::<FB>(0, ROWS, &device);
            let start = rank * per * micro + m * per;
            let loss =
                fsdp.forward(|model, r| model.loss(x.narrow(0, start, per), y.narrow(0, start, per), r));
            stats.push(fsdp.comm_stats());
            // Reduce-scatters run on the communication thread; `gradients` collects them.
            let _grads = fsdp.gradients(loss.backward());
            stats.push(fsdp.comm_stats());
        }
        Ok::<_, burn_fsdp::FsdpError>(stats)
    })
    .unwrap()
    .remove(0)
}

#[test]
fn collective_counts_per_step_are_exact() {
    use CollectiveKind::{AllGather as AG, AllReduce as AR, ReduceScatter as RS};
    let units = 4; // root + 3 blocks
    for (reshard, bwd_gathers) in [(true, units - 1), (false, 0)] {
        let s = counts(4, 1, reshard);
        let (fwd, bwd) = (s[1].since(&s[0]), s[2].since(&s[1]));
        assert_eq!(fwd.calls(AG), units as u64, "forward all-gathers, reshard {reshard}");
        assert_eq!(fwd.calls(RS), 0);
        assert_eq!(bwd.calls(AG), bwd_gathers as u64, "backward all-gathers, reshard {reshard}");
        assert_eq!(bwd.calls(RS), units as u64, "backward reduce-scatters");
        assert_eq!(bwd.calls(AR) + fwd.calls(AR), 0);
    }
    // World size 1 issues no collective at all.
    let s = counts(1, 1, true);
    assert_eq!(s[2].since(&s[0]), CommStats::default());
}

#[test]
fn accumulation_issues_no_reduce_scatter_before_the_last_micro_batch() {
    use CollectiveKind::{AllGather as AG, ReduceScatter as RS};
    let s = counts(2, 3, true);
    for m in 0..3 {
        let bwd = s[2 * m + 2].since(&s[2 * m + 1]);
        let expected = if m == 2 { 4 } else { 0 };
        assert_eq!(bwd.calls(RS), expected, "micro-batch {m}");
        assert_eq!(bwd.calls(AG), 3, "re-gathers still happen in micro-batch {m}");
    }
}

#[test]
fn a_rank_that_panics_makes_the_others_fail_within_the_timeout() {
    let timeout = Duration::from_secs(5);
    let start = Instant::now();
    let err = launch(3, timeout, |group| {
        let device = Default::default();
        let rank = group.rank();
        let mesh = DeviceMesh::new_1d(group, device);
        let fsdp = Fsdp::wrap(
            Toy::<FB>::new(3, &device),
            &mesh,
            FsdpConfig { units: UnitPolicy::VecElements, ..FsdpConfig::default() },
        )?;
        for step in 0..3 {
            if rank == 2 && step == 1 {
                panic!("rank 2 dies on purpose");
            }
            let (x, y) = toy_batch::<FB>(step, 3, &device);
            let loss = fsdp.forward(|model, r| model.loss(x.narrow(0, rank, 1), y.narrow(0, rank, 1), r));
            let _ = loss.backward();
        }
        Ok::<_, burn_fsdp::FsdpError>(())
    })
    .unwrap_err();
    assert_eq!(err.rank, 2, "{err}");
    assert!(err.message.contains("dies on purpose"), "{err}");
    assert!(start.elapsed() < timeout, "peers waited for the timeout: {:?}", start.elapsed());
}

#[test]
fn a_rank_that_never_arrives_gives_a_timeout_naming_it() {
    let timeout = Duration::from_millis(300);
    let groups = burn_fsdp::LocalGroup::new_group(2, timeout);
    let g0 = groups[0].clone();
    let x = Tensor::<B, 1>::ones([4], &Default::default());
    let err = ProcessGroup::<B>::all_gather(&*g0, x, &Tag::new("unit-7:fwd")).unwrap_err().to_string();
    assert!(err.contains("all_gather") && err.contains("unit-7:fwd") && err.contains("[1]"), "{err}");
}

#[test]
fn mismatched_collectives_are_reported() {
    let err = launch(2, Duration::from_secs(5), |group| {
        let x = Tensor::<B, 1>::ones([2], &Default::default());
        let tag = Tag::new(if group.rank() == 0 { "layer-0" } else { "layer-1" });
        ProcessGroup::<B>::all_gather(&*group, x, &tag).map(|_| ())
    })
    .unwrap_err();
    assert!(err.message.contains("mismatch"), "{err}");
}

#[test]
fn reshard_needs_balanced_checkpointing() {
    let groups = burn_fsdp::LocalGroup::new_group(2, Duration::from_secs(1));
    let mesh = DeviceMesh::<B>::new_1d(groups[0].clone(), Default::default());
    let err = Fsdp::wrap(
        Toy::<AB>::new(1, &Default::default()),
        &mesh,
        FsdpConfig { units: UnitPolicy::VecElements, ..FsdpConfig::default() },
    )
    .unwrap_err();
    assert!(err.to_string().contains("BalancedCheckpointing"), "{err}");
    // Wrapping is collective (rank 0's values are broadcast): both ranks wrap.
    launch(2, Duration::from_secs(30), |group| {
        let mesh = DeviceMesh::<B>::new_1d(group, Default::default());
        let ok = FsdpConfig {
            units: UnitPolicy::VecElements,
            reshard_after_forward: false,
            ..FsdpConfig::default()
        };
        Fsdp::wrap(Toy::<AB>::new(1, &Default::default()), &mesh, ok).map(|_| ())
    })
    .unwrap();
}

/// A unit with more parameters than the op takes as direct parents (the flat fallback).
#[derive(burn::module::Module, Debug)]
struct Wide<B: burn::tensor::backend::Backend> {
    blocks: Vec<WideBlock<B>>,
}

#[derive(burn::module::Module, Debug)]
struct WideBlock<B: burn::tensor::backend::Backend> {
    ps: Vec<burn::module::Param<Tensor<B, 1>>>,
}

impl<B: burn::tensor::backend::Backend> Wide<B> {
    fn new(device: &B::Device) -> Self {
        let block = |k: usize| WideBlock {
            ps: (0..burn_fsdp::op::MAX_DIRECT_PARENTS + 9)
                .map(|i| {
                    let v: Vec<f32> = (0..5).map(|j| 1.0 + ((i * 5 + j + k) % 7) as f32 * 0.01).collect();
                    burn::module::Param::from_tensor(Tensor::from_floats(v.as_slice(), device))
                })
                .collect(),
        };
        Self { blocks: vec![block(0), block(3)] }
    }

    fn loss<R: burn_fsdp::UnitRunner<B>>(&self, x: Tensor<B, 2>, r: &mut R) -> Tensor<B, 1> {
        let mut x = x;
        for b in &self.blocks {
            x = r.run(b, x, |b, mut x| {
                for p in &b.ps {
                    x = (x * p.val().unsqueeze()).tanh() + 0.1;
                }
                x
            });
        }
        x.powf_scalar(2.0).mean()
    }
}

#[test]
fn units_with_many_parameters_use_the_flat_fallback_and_still_match() {
    let device = Default::default();
    let data = |step: usize| {
        let v: Vec<f32> = (0..8 * 5).map(|i| ((i * 3 + step) % 11) as f32 / 11.0 - 0.3).collect();
        Tensor::<FB, 2>::from_data(burn::tensor::TensorData::new(v, [8, 5]), &device)
    };
    let mut single = Wide::<AB>::new(&device);
    let mut adam = ADAM.init();
    let mut want = Vec::new();
    for step in 0..3 {
        let x = Tensor::<AB, 2>::from_data(data(step).into_data(), &device);
        let loss = single.loss(x, &mut Direct);
        want.push(loss.clone().into_scalar() as f64);
        let g = GradientsParams::from_grads(loss.backward(), &single);
        single = adam.step(single, g);
    }
    let got = launch(2, Duration::from_secs(60), |group| {
        let rank = group.rank();
        let mesh = DeviceMesh::new_1d(group, device);
        let mut fsdp = Fsdp::wrap(
            Wide::<FB>::new(&device),
            &mesh,
            FsdpConfig { units: UnitPolicy::VecElements, ..FsdpConfig::default() },
        )?;
        let mut adam = ADAM.init();
        let mut losses = Vec::new();
        for step in 0..3 {
            let x = data(step).narrow(0, rank * 4, 4);
            let loss = fsdp.forward(|m, r| m.loss(x, r));
            losses.push(fsdp.all_reduce_scalar(
                loss.clone().into_scalar() as f64,
                burn_fsdp::ReduceOp::Avg,
                "l",
            )?);
            let g = fsdp.gradients(loss.backward());
            fsdp.step(&mut adam, g);
        }
        Ok::<_, burn_fsdp::FsdpError>(losses)
    })
    .unwrap()
    .remove(0);
    assert!(max_rel_diff(&got, &want) < 1e-5, "{got:?} vs {want:?}");
}

#[test]
fn prefetch_and_async_reduce_scatter_change_nothing_but_the_order_of_waiting() {
    let inline = |micro, clip| {
        toy_fsdp_with(
            4,
            micro,
            clip,
            FsdpConfig { units: UnitPolicy::VecElements, prefetch: false, ..FsdpConfig::default() },
        )
    };
    for (micro, clip) in [(1, 0.0), (2, 0.015)] {
        let a = toy_fsdp(4, micro, clip, true);
        let b = inline(micro, clip);
        assert_eq!(a.losses, b.losses, "micro {micro}: losses");
        assert_eq!(a.norms, b.norms, "micro {micro}: grad norms");
        assert_eq!(a.params, b.params, "micro {micro}: parameters");
        assert!(b.prefetch.is_none());
    }
}

#[test]
fn only_the_first_gather_of_each_pass_is_exposed_once_the_order_is_known() {
    // Toy: root + 3 blocks; the root is not resharded, so backward re-gathers 3 units.
    let (units, regathers) = (4u64, 3u64);
    let steps = STEPS as u64;
    let s = toy_fsdp(4, 1, 0.0, true).prefetch.expect("prefetch is on by default");
    // Step 0 records the orders (everything on demand); every later step prefetches all but
    // the first gather of forward and of backward.
    assert_eq!(s.forward_on_demand, units + (steps - 1), "{s:?}");
    assert_eq!(s.forward_prefetched, (steps - 1) * (units - 1), "{s:?}");
    assert_eq!(s.backward_on_demand, regathers + (steps - 1), "{s:?}");
    assert_eq!(s.backward_prefetched, (steps - 1) * (regathers - 1), "{s:?}");
    assert_eq!(s.async_reduce_scatters, steps * units, "{s:?}");
}

/// `--activation-checkpointing block` (segmented backward, each layer run again with a fresh
/// all-gather) trains exactly as without it, against PyTorch FSDP2 and single device: tied
/// W = 4 (also clipping + accumulation without sync), untied W = 3, without prefetch at W = 2
/// and 4 (ZeRO-2 and resharded), and `--no-fsdp`.
#[test]
fn activation_checkpointing_reproduces_pytorch_fsdp2_and_single() {
    let with = |flags: &[&'static str]| [flags, &["--activation-checkpointing", "block"][..]].concat();
    check_qwen3("fsdp4", &with(&["--world-size", "4"]));
    check_qwen3("fsdp4_clip_accum", &with(&["--world-size", "4", "--clip", "1.0", "--grad-accum", "2"]));
    check_case("qwen3-tiny-b", "fsdp3", &with(&["--world-size", "3", "--steps", "8"]));
    // Without the communication thread, collectives block inside backward: the pieces of the
    // segmented backward are fenced by barriers (this deadlocked before they were).
    for world in ["2", "4"] {
        check_qwen3(
            "single",
            &with(&[
                "--world-size",
                world,
                "--steps",
                "6",
                "--reshard-after-forward",
                "false",
                "--no-prefetch",
            ]),
        );
        check_qwen3("single", &with(&["--world-size", world, "--steps", "4", "--no-prefetch"]));
    }
    check_case("qwen3-tiny-b", "single", &with(&["--no-fsdp", "--steps", "6"]));
    // And step for step the same numbers as without checkpointing: from the fixture's
    // checkpoint, and from a seeded preset whose parameters are lazy until first used.
    let preset = ["train-qwen3", "--preset", "tiny", "--quiet"];
    for (fixture_model, flags) in [
        (true, &["--world-size", "4", "--steps", "4"][..]),
        (true, &["--no-fsdp", "--steps", "4"][..]),
        (false, &["--no-fsdp", "--steps", "3"][..]),
        (false, &["--world-size", "2", "--steps", "3"][..]),
    ] {
        let args = |flags: &[&str]| match fixture_model {
            true => train_args("qwen3-tiny-a", flags),
            false => tests::parse_train(&[&preset[..], flags].concat()).unwrap(),
        };
        let plain = xtask::train::run(&args(flags)).unwrap();
        let ac = xtask::train::run(&args(&with(flags))).unwrap();
        let series = |m: &[xtask::train::StepMetrics]| -> (Vec<f64>, Vec<f64>) {
            (m.iter().map(|m| m.loss).collect(), m.iter().map(|m| m.grad_norm).collect())
        };
        let ((l0, n0), (l1, n1)) = (series(&plain), series(&ac));
        let (dl, dn) = (max_rel_diff(&l0, &l1), max_rel_diff(&n0, &n1));
        eprintln!("{flags:?} with vs without checkpointing: loss {dl:.3e}, grad norm {dn:.3e}");
        assert!(
            dl <= 1e-6 && dn <= 1e-6,
            "{flags:?}: checkpointing changed loss by {dl:e}, grad norm by {dn:e}"
        );
    }
}

/// A run with nothing to re-gather in backward (W = 1, or units kept gathered) trains on
/// `Autodiff<B>` without balanced checkpointing (`xtask::train::regathers`): exactly the same
/// numbers, step for step, as `--no-fsdp` and as the resharded run on balanced checkpointing.
#[test]
fn runs_without_regathering_skip_recomputation_and_train_bit_identically() {
    let args = |flags: &[&str]| train_args("qwen3-tiny-a", &[flags, &["--steps", "3"][..]].concat());
    let series = |flags: &[&str]| -> Vec<(f64, f64)> {
        xtask::train::run(&args(flags)).unwrap().iter().map(|m| (m.loss, m.grad_norm)).collect()
    };
    let (w1, w2, w2_kept) = (
        args(&["--world-size", "1"]),
        args(&["--world-size", "2"]),
        args(&["--world-size", "2", "--reshard-after-forward", "false"]),
    );
    assert!(!xtask::train::regathers(&w1, 1));
    assert!(xtask::train::regathers(&w2, 2));
    assert!(!xtask::train::regathers(&w2_kept, 2));
    assert!(xtask::train::regathers(&args(&["--world-size", "1", "--offload"]), 1));
    assert!(xtask::train::regathers(&args(&["--world-size", "1", "--activation-checkpointing", "block"]), 1));
    assert_eq!(series(&["--world-size", "1"]), series(&["--no-fsdp"]));
    assert_eq!(
        series(&["--world-size", "2", "--reshard-after-forward", "false"]),
        series(&["--world-size", "2"])
    );
}
