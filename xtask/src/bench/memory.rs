//! Memory per rank and activation memory.

use std::sync::atomic::Ordering;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use anyhow::{Context, Result};
use burn_fsdp::{DeviceMesh, Direct, Fsdp, LocalGroup, ProcessGroup, Tag, launch};
use qwen3_burn::train::{chunked_cross_entropy, cross_entropy, inputs_and_labels, loss_chunk_rows};
use qwen3_burn::{Qwen3, Qwen3Config};

use super::alloc::{LIVE, PEAK, live_bytes};
use crate::Backend;
use crate::data::synthetic_batches;
use crate::train::{FsdpTrainBackend, LOSS_CHUNK_BYTES, TrainArgs, fsdp_config};

/// Per-rank memory of FSDP training at one world size (bytes).
struct RankMemory {
    /// 16 bytes × the rank's shard elements (fp32 parameters, gradients, AdamW m and v), from
    /// the FSDP units' shard lengths (padding included).
    model_16psi: usize,
    /// Live bytes between steps (after the optimizer step), process-wide above the baseline,
    /// divided by the world size.
    between_steps: isize,
    /// Peak live bytes during the steps, process-wide above the baseline, / world size.
    peak: isize,
}

/// Trains `steps` steps of FSDP over `world` in-process ranks (global batch `rows × seq`) and
/// reads the counting allocator. The baseline is taken before the ranks start (it holds the
/// initial weights and the batches, which every rank reads); the peak is reset once every rank
/// has wrapped its model, so that the full replicas built before sharding are not counted.
fn rank_memory(
    config: &Qwen3Config,
    world: usize,
    rows: usize,
    seq: usize,
    steps: usize,
) -> Result<RankMemory> {
    type Ad = FsdpTrainBackend<Backend>;
    let device = crate::device();
    let init = qwen3_burn::Qwen3Init::new(0);
    let batches = synthetic_batches(steps, rows, seq, config.vocab_size, 0);
    let args = TrainArgs::parse_from_args(&["train-qwen3", "--world-size", &world.to_string(), "--quiet"])?;
    let baseline = live_bytes().context("the counting allocator is not installed")?;
    let between = Mutex::new(0isize);
    let peak = Mutex::new(0isize);
    let chunk = loss_chunk_rows(config.vocab_size, LOSS_CHUNK_BYTES);
    let shard_elems = launch(world, Duration::from_secs(600), |group: Arc<LocalGroup>| {
        let rank = group.rank();
        let rows_per_rank = rows / world;
        // Each rank creates only its shards: nothing of the full model is ever resident.
        let skeleton = Qwen3::<Ad>::new_seeded(config, init, &device);
        let mesh = DeviceMesh::new_1d(group.clone(), device);
        let mut fsdp = Fsdp::wrap_deferred(skeleton, &mesh, fsdp_config(&args), &init)?;
        let mut optim = args.adamw().init();
        let shard_elems: usize = fsdp.units().iter().map(|u| u.shard_len()).sum();
        let sync = |name: &str| ProcessGroup::<Backend>::barrier(&*group, &Tag::new(name));
        sync("wrapped")?;
        if rank == 0 {
            PEAK.store(LIVE.load(Ordering::Relaxed), Ordering::Relaxed);
        }
        sync("measure")?;
        for step in 0..steps {
            let tokens = batches.rows::<Ad>(step, rank * rows_per_rank..(rank + 1) * rows_per_rank, &device);
            let (inputs, labels) = inputs_and_labels(tokens);
            let loss = fsdp.forward(|m, r| {
                let hidden = m.hidden_with(inputs, r);
                chunked_cross_entropy(hidden, m.head_weight(), labels, chunk)
            });
            let grads = fsdp.gradients(loss.backward());
            fsdp.step(&mut optim, grads);
            sync("stepped")?;
            if rank == 0 {
                *between.lock().unwrap_or_else(|p| p.into_inner()) = LIVE.load(Ordering::Relaxed);
                *peak.lock().unwrap_or_else(|p| p.into_inner()) = PEAK.load(Ordering::Relaxed);
            }
            sync("read")?;
        }
        Ok::<_, anyhow::Error>(shard_elems)
    })
    .map_err(|e| anyhow::anyhow!("{e}"))?;
    let per_rank = |b: isize| (b - baseline) / world as isize;
    let between = *between.lock().unwrap_or_else(|p| p.into_inner());
    let peak = *peak.lock().unwrap_or_else(|p| p.into_inner());
    Ok(RankMemory {
        model_16psi: 16 * shard_elems[0],
        between_steps: per_rank(between),
        peak: per_rank(peak),
    })
}

/// Per-rank memory of FSDP training (2 steps of a global batch `rows × seq`) at each world
/// size, as ratios to 16Ψ/W, and the process's peak in GiB at the largest world size.
pub(super) fn memory_figures(
    name: &str,
    config: &Qwen3Config,
    worlds: &[usize],
    rows: usize,
    seq: usize,
) -> Result<Vec<(String, f64)>> {
    let mut figures = Vec::new();
    if live_bytes().is_none() {
        println!(
            "[memory] skipped: the counting allocator is not installed (run through the `xtask` binary)"
        );
        return Ok(figures);
    }
    let gib = |b: f64| b / f64::from(1 << 30);
    let mib = |b: f64| b / f64::from(1 << 20);
    for &world in worlds {
        let m = rank_memory(config, world, rows, seq, 2)?;
        println!(
            "[memory {name}] W={world}: 16Ψ/W (params + grads + AdamW m, v; from the shard sizes) {:.1} MiB; \
             measured per rank: between steps {:.1} MiB, peak during a step {:.1} MiB; \
             all ranks at peak {:.2} GiB (16Ψ = {:.2} GiB)",
            mib(m.model_16psi as f64),
            mib(m.between_steps as f64),
            mib(m.peak as f64),
            gib((m.peak * world as isize) as f64),
            gib((m.model_16psi * world) as f64),
        );
        figures.push((
            format!("{name}_w{world}_rank_peak_vs_16psi_over_w"),
            m.peak as f64 / m.model_16psi as f64,
        ));
        figures.push((
            format!("{name}_w{world}_rank_between_steps_vs_16psi_over_w"),
            m.between_steps as f64 / m.model_16psi as f64,
        ));
        // `cargo xtask plan`'s prediction of the same run (issue #46: within 10 %).
        let layout =
            crate::plan::model::Layout::new(crate::plan::model::Mesh::Flat(world), rows / world, seq + 1);
        let planned = crate::plan::model::memory(config, &layout);
        println!(
            "[memory {name}] W={world}: cargo xtask plan predicts between steps {:.1} MiB, peak {:.1} MiB",
            mib(planned.between_steps()),
            mib(planned.peak()),
        );
        figures.push((format!("{name}_w{world}_rank_peak_plan_vs_measured"), planned.peak() / m.peak as f64));
        figures.push((
            format!("{name}_w{world}_rank_between_steps_plan_vs_measured"),
            planned.between_steps() / m.between_steps as f64,
        ));
        if Some(&world) == worlds.last() {
            figures
                .push((format!("{name}_w{world}_process_peak_gib"), gib((m.peak * world as isize) as f64)));
        }
    }
    Ok(figures)
}

/// Activation memory of one long sequence at Qwen3-0.6B width (2 of its layers), with the
/// loss over full-vocabulary logits, in chunks, and in chunks with block checkpointing.
pub(super) fn activation_memory() -> Result<Vec<(String, f64)>> {
    let mut figures = Vec::new();
    if live_bytes().is_none() {
        println!(
            "[activation memory] skipped: the counting allocator is not installed (run through the `xtask` binary)"
        );
        return Ok(figures);
    }
    let mut config = Qwen3Config::qwen3_0_6b();
    config.num_hidden_layers = 2;
    let seq = 2048;
    let mib = |b: isize| b as f64 / f64::from(1 << 20);
    let mut peaks = Vec::new();
    for paths in [
        ActivationPaths::FullLogits,
        ActivationPaths::ChunkedLoss,
        ActivationPaths::ChunkedLossAndCheckpointing,
    ] {
        let peak = activation_peak(&config, seq, paths)?;
        println!("[activation memory] {paths:?}: peak {:.0} MiB above the model", mib(peak));
        peaks.push(peak);
    }
    let [full, chunked, ac] = peaks[..] else { anyhow::bail!("three measurements expected") };
    println!(
        "[activation memory] Qwen3-0.6B width, 2 layers ({} parameters; their gradients {:.0} MiB), one {seq}-token \
         sequence, forward + backward on one device, peak above the model: {:.0} MiB with the loss over \
         full-vocabulary logits, {:.0} MiB with the chunked loss (pieces of {} MiB), {:.0} MiB with the chunked \
         loss and block activation checkpointing",
        config.num_params(),
        mib(4 * config.num_params() as isize),
        mib(full),
        mib(chunked),
        LOSS_CHUNK_BYTES >> 20,
        mib(ac),
    );
    figures.push((
        "qwen3_06b_2layer_seq2048_chunked_loss_vs_full_logits_peak_ratio".into(),
        chunked as f64 / full as f64,
    ));
    figures.push((
        "qwen3_06b_2layer_seq2048_chunked_loss_and_checkpointing_vs_full_logits_peak_ratio".into(),
        ac as f64 / full as f64,
    ));
    Ok(figures)
}

/// Which activation-memory paths [`activation_peak`] uses.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum ActivationPaths {
    /// Loss over the full-vocabulary logits (`cross_entropy`).
    FullLogits,
    /// `chunked_cross_entropy`.
    ChunkedLoss,
    /// `chunked_cross_entropy` and block activation checkpointing.
    ChunkedLossAndCheckpointing,
}

/// Peak live bytes above the model (built eagerly before measuring) of one forward and
/// backward of one `seq`-token sequence through `config` on one device. The gradients
/// themselves (4Ψ bytes) are part of every peak.
fn activation_peak(config: &Qwen3Config, seq: usize, paths: ActivationPaths) -> Result<isize> {
    type Ad = burn::backend::Autodiff<Backend>;
    let device = crate::device();
    let model = config.init::<Ad>(&device);
    let tokens = synthetic_batches(1, 1, seq, config.vocab_size, 0).rows::<Ad>(0, 0..1, &device);
    let (inputs, labels) = inputs_and_labels(tokens);
    let chunk = loss_chunk_rows(config.vocab_size, LOSS_CHUNK_BYTES);
    let baseline = live_bytes().context("the counting allocator is not installed")?;
    PEAK.store(baseline, Ordering::Relaxed);
    match paths {
        ActivationPaths::FullLogits => drop(cross_entropy(model.forward(inputs), labels).backward()),
        ActivationPaths::ChunkedLoss => {
            let hidden = model.hidden_with(inputs, &mut Direct);
            drop(chunked_cross_entropy(hidden, model.head_weight(), labels, chunk).backward())
        }
        ActivationPaths::ChunkedLossAndCheckpointing => {
            let run = burn_fsdp::activation_checkpointing::checkpointed(|r| {
                chunked_cross_entropy(model.hidden_with(inputs, r), model.head_weight(), labels, chunk)
            });
            drop(run.backward())
        }
    }
    Ok(PEAK.load(Ordering::Relaxed) - baseline)
}
