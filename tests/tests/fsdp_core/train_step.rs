//! `Fsdp::train_step`, the generic step of a hand-written loop (issue #42): micro-batches
//! accumulated without communication, the global norm clipped, the loss averaged over ranks,
//! the non-finite guard, collective failures as errors — what `train-qwen3` does around its
//! model, for any model.

use std::sync::Mutex;
use std::time::Duration;

use burn::optim::{AdamWConfig, GradientsParams, Optimizer};
use burn::tensor::ElementConversion;
use burn_fsdp::{DeviceMesh, Fsdp, FsdpConfig, FsdpError, launch};
use tests::max_rel_diff;

use super::any_model::FB;
use super::records::{Net, ROWS, batch};

type AB = burn::backend::Autodiff<burn::backend::NdArray<f32>>;

const STEPS: usize = 4;
const CLIP: f64 = 0.2;
const LR: f64 = 0.05;

fn adamw() -> AdamWConfig {
    AdamWConfig::new().with_weight_decay(0.01)
}

/// One device: the whole batch each step, the norm clipped to `CLIP`.
fn single() -> (Vec<f64>, Vec<f64>) {
    let device = Default::default();
    let mut model = Net::<AB>::new(0, false, &device);
    let mut optim = adamw().init::<AB, Net<AB>>();
    let (mut losses, mut norms) = (Vec::new(), Vec::new());
    for step in 0..STEPS {
        let (x, y) = batch::<AB>(step, &device);
        let loss = model.loss(x, y);
        losses.push(loss.clone().into_scalar().elem::<f64>());
        let mut grads = GradientsParams::from_grads(loss.backward(), &model);
        norms.push(burn_fsdp::clip_grad_norm(&model, &mut grads, CLIP));
        model = optim.step(LR, model, grads);
    }
    (losses, norms)
}

#[test]
fn train_step_with_micro_batches_and_clipping_matches_one_device() {
    let (want_losses, want_norms) = single();
    assert!(want_norms.iter().any(|&n| n > CLIP), "clipping applies: {want_norms:?}");
    for (world, micro) in [(1, 3), (2, 2), (3, 2), (2, 1)] {
        let reports = launch(world, Duration::from_secs(60), move |group| {
            let device = Default::default();
            let rank = group.rank();
            let mesh = DeviceMesh::new_1d(group, device);
            let mut fsdp = Fsdp::wrap(Net::<FB>::new(0, false, &device), &mesh, FsdpConfig::default())?;
            let mut optim = adamw().init();
            let (per, rows) = (ROWS / world, ROWS / world / micro);
            let mut out = Vec::new();
            for step in 0..STEPS {
                let (x, y) = batch::<FB>(step, &device);
                let micro_batches = (0..micro).map(|m| {
                    let first = rank * per + m * rows;
                    (x.clone().narrow(0, first, rows), y.clone().narrow(0, first, rows))
                });
                out.push(
                    fsdp.train_step(&mut optim, LR, Some(CLIP), micro_batches, |m, (x, y)| m.loss(x, y))?,
                );
            }
            Ok::<_, FsdpError>(out)
        })
        .expect("ranks");
        let case = format!("W = {world}, {micro} micro-batches");
        for r in &reports {
            assert!(r.iter().all(|s| s.stepped && s.nonfinite_rank.is_none()), "{case}: {r:?}");
            let losses: Vec<f64> = r.iter().map(|s| s.loss).collect();
            let norms: Vec<f64> = r.iter().map(|s| s.grad_norm).collect();
            let d = max_rel_diff(&losses, &want_losses);
            assert!(d <= 1e-5, "{case}: losses {losses:?} vs one device {want_losses:?} ({d:e})");
            let d = max_rel_diff(&norms, &want_norms);
            assert!(d <= 1e-5, "{case}: norms {norms:?} vs one device {want_norms:?} ({d:e})");
        }
    }
}

#[test]
fn a_non_finite_loss_skips_the_update_and_names_the_lowest_rank() {
    let out = launch(3, Duration::from_secs(60), |group| {
        let device = Default::default();
        let rank = group.rank();
        let mesh = DeviceMesh::new_1d(group, device);
        let mut fsdp = Fsdp::wrap(Net::<FB>::new(0, false, &device), &mesh, FsdpConfig::default())?;
        let mut optim = adamw().init();
        let mut reports = Vec::new();
        for step in 0..2 {
            let (x, y) = batch::<FB>(step, &device);
            let (x, y) = (x.narrow(0, rank * 4, 4), y.narrow(0, rank * 4, 4));
            // Step 1: ranks 1 and 2 see a NaN input.
            let x = if step == 1 && rank >= 1 { x.mul_scalar(f32::NAN) } else { x };
            let before = fsdp.full_parameters()?;
            let report = fsdp.train_step(&mut optim, LR, None, [(x, y)], |m, (x, y)| m.loss(x, y))?;
            let unchanged = before.iter().zip(fsdp.full_parameters()?).all(|(a, b)| a.2 == b.2);
            reports.push((report, unchanged));
        }
        Ok::<_, FsdpError>(reports)
    })
    .expect("ranks");
    for reports in out {
        let [(first, first_unchanged), (second, second_unchanged)] = &reports[..] else {
            panic!("two steps")
        };
        assert!(first.stepped && first.loss.is_finite() && !first_unchanged, "{first:?}");
        assert!(!second.stepped && *second_unchanged, "no update, the parameters unchanged: {second:?}");
        assert!(second.loss.is_nan());
        assert_eq!(second.nonfinite_rank, Some(1));
    }
}

#[test]
fn a_failed_peer_is_an_error_of_the_step_not_a_hang() {
    burn_fsdp::comm::quiet_collective_panics();
    let rank0 = Mutex::new(None);
    let result = launch(2, Duration::from_secs(20), |group| {
        let device = Default::default();
        let rank = group.rank();
        let mesh = DeviceMesh::new_1d(group, device);
        let mut fsdp = Fsdp::wrap(Net::<FB>::new(0, false, &device), &mesh, FsdpConfig::default())?;
        if rank == 1 {
            return Err(FsdpError::Config("rank 1 gives up".into()));
        }
        let mut optim = adamw().init();
        let (x, y) = batch::<FB>(0, &device);
        let r = fsdp.train_step(&mut optim, LR, None, [(x, y)], |m, (x, y)| m.loss(x, y));
        *rank0.lock().expect("lock") = Some(r.map(|_| ()).map_err(|e| e.to_string()));
        Ok(())
    });
    assert_eq!(result.expect_err("rank 1 failed").rank, 1);
    let got = rank0.lock().expect("lock").take().expect("rank 0 returned");
    let e = got.expect_err("rank 0's step fails");
    assert!(e.starts_with("a collective failed inside the forward or backward"), "{e}");
    assert!(e.contains("rank 1 failed: FSDP config: rank 1 gives up"), "the cause is named: {e}");
}
