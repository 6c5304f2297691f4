//! `cargo xtask plan`: per-rank memory, collective traffic and step time of Qwen3 training on
//! a layout, before renting the cluster; which layouts fit and the best one found.
//!
//! ```text
//! cargo xtask plan --model 8b --world-size 64 --mixed-precision bf16 --seq 4096 --batch 2
//! ```
//!
//! The collective bytes are exact (checked against `CommStats` of real runs in
//! `xtask/tests/plan.rs`); the memory and the step time are the models of [`model`].

pub mod model;

use std::fmt::Write as _;
use std::path::{Path, PathBuf};

use anyhow::{Context, Result, bail, ensure};
use qwen3_burn::Qwen3Config;

use crate::train::{ActivationCheckpointing, Precision, parse_mesh};
use model::{Device, Efficiency, KINDS, Layout, Mesh};

const GIB: f64 = (1u64 << 30) as f64;

/// `cargo xtask plan` flags.
#[derive(Debug, Clone, clap::Args)]
pub struct PlanArgs {
    /// A Qwen3 preset (`tiny`, `0.6b`, `1.7b`, `4b`, `8b`, `32b`) or an HF `config.json`.
    #[arg(long, default_value = "0.6b")]
    pub model: String,
    /// Ranks (GPUs) of flat FSDP (default 8).
    #[arg(long, conflicts_with_all = ["hsdp", "mesh"])]
    pub world_size: Option<usize>,
    /// HSDP `RxS`: R replicas, each sharded over S ranks.
    #[arg(long, value_parser = parse_mesh, conflicts_with = "mesh")]
    pub hsdp: Option<(usize, usize)>,
    /// Data × tensor parallelism `DPxTP`.
    #[arg(long, value_parser = parse_mesh)]
    pub mesh: Option<(usize, usize)>,
    /// Rows per data-parallel rank per step (as `train-qwen3 --batch`).
    #[arg(long, default_value_t = 2)]
    pub batch: usize,
    /// Tokens per row (as `train-qwen3 --seq`; the model sees one position fewer).
    #[arg(long, default_value_t = 4096)]
    pub seq: usize,
    /// `fp32` or `bf16` (FSDP2 MixedPrecisionPolicy: bf16 gathers and compute).
    #[arg(long, value_enum, default_value_t = Precision::Fp32)]
    pub mixed_precision: Precision,
    /// Shards, gradients and optimizer state on the host.
    #[arg(long)]
    pub offload: bool,
    /// `none` or `block` (each decoder layer run again in backward).
    #[arg(long, value_enum, default_value_t = ActivationCheckpointing::None)]
    pub activation_checkpointing: ActivationCheckpointing,
    /// Free each layer's gathered parameters after forward (`true`, the default).
    #[arg(long, action = clap::ArgAction::Set, default_value_t = true)]
    pub reshard_after_forward: bool,
    /// Micro-batches per step.
    #[arg(long, default_value_t = 1)]
    pub grad_accum: usize,
    /// `h200`, `c500`, or `custom` with every `--device-*` figure given.
    #[arg(long, default_value = "h200")]
    pub device: String,
    /// Dense bf16 TFLOPS per GPU (overrides the device's).
    #[arg(long)]
    pub device_tflops: Option<f64>,
    /// Memory per GPU, GB (overrides the device's).
    #[arg(long)]
    pub device_memory_gb: Option<f64>,
    /// Bandwidth between the GPUs of a node, GB/s per GPU and direction.
    #[arg(long)]
    pub device_intra_node_gbs: Option<f64>,
    /// Bandwidth between nodes, Gb/s per GPU.
    #[arg(long)]
    pub device_inter_node_gbits: Option<f64>,
    /// GPUs per node.
    #[arg(long)]
    pub gpus_per_node: Option<usize>,
    /// Fraction of the peak FLOP/s the compute achieves (step-time model).
    #[arg(long, default_value_t = 0.6)]
    pub compute_efficiency: f64,
    /// Write the docs table (Qwen3 0.6B/1.7B/8B/32B × 8/64/512/1024 GPUs) to this file
    /// instead of planning one run.
    #[arg(long)]
    pub scaling_table: Option<PathBuf>,
}

impl PlanArgs {
    fn config(&self) -> Result<Qwen3Config> {
        if let Some(c) = Qwen3Config::preset(&self.model) {
            return Ok(c);
        }
        let path = Path::new(&self.model);
        ensure!(
            path.exists(),
            "--model {}: neither a preset (tiny, 0.6b, 1.7b, 4b, 8b, 32b) nor an existing config.json",
            self.model
        );
        let c = Qwen3Config::from_file(path).with_context(|| format!("--model {}", path.display()))?;
        Ok(c)
    }

    fn mesh(&self) -> Mesh {
        match (self.hsdp, self.mesh) {
            (Some((replicate, shard)), _) => Mesh::Hsdp { replicate, shard },
            (_, Some((dp, tp))) => Mesh::DpTp { dp, tp },
            _ => Mesh::Flat(self.world_size.unwrap_or(8)),
        }
    }

    fn layout(&self) -> Layout {
        Layout {
            mesh: self.mesh(),
            rows: self.batch,
            seq: self.seq,
            grad_accum: self.grad_accum,
            bf16: self.mixed_precision == Precision::Bf16,
            offload: self.offload,
            activation_checkpointing: self.activation_checkpointing == ActivationCheckpointing::Block,
            reshard_after_forward: self.reshard_after_forward,
        }
    }

    fn device(&self) -> Result<Device> {
        let mut d = match self.device.to_ascii_lowercase().as_str() {
            "h200" => Device::h200(),
            "c500" => Device::c500(),
            "custom" => {
                let missing: Vec<&str> = [
                    ("--device-tflops", self.device_tflops.is_none()),
                    ("--device-memory-gb", self.device_memory_gb.is_none()),
                    ("--device-intra-node-gbs", self.device_intra_node_gbs.is_none()),
                    ("--device-inter-node-gbits", self.device_inter_node_gbits.is_none()),
                ]
                .into_iter()
                .filter_map(|(f, m)| m.then_some(f))
                .collect();
                ensure!(missing.is_empty(), "--device custom needs {}", missing.join(", "));
                Device { name: "custom".into(), ..Device::h200() }
            }
            other => bail!("--device {other}: h200, c500 or custom"),
        };
        if let Some(t) = self.device_tflops {
            d.flops = t * 1e12;
        }
        if let Some(m) = self.device_memory_gb {
            d.memory = m * 1e9;
        }
        if let Some(b) = self.device_intra_node_gbs {
            d.intra_node = b * 1e9;
        }
        if let Some(b) = self.device_inter_node_gbits {
            d.inter_node = b * 1e9 / 8.0;
        }
        if let Some(n) = self.gpus_per_node {
            ensure!(n > 0, "--gpus-per-node must be positive");
            d.per_node = n;
        }
        Ok(d)
    }

    fn efficiency(&self) -> Result<Efficiency> {
        ensure!(
            self.compute_efficiency > 0.0 && self.compute_efficiency <= 1.0,
            "--compute-efficiency {} is not in (0, 1]",
            self.compute_efficiency
        );
        Ok(Efficiency { compute: self.compute_efficiency, ..Efficiency::default() })
    }
}

/// Why `layout` cannot run `c`, if it cannot (shapes, not memory).
pub fn invalid(c: &Qwen3Config, l: &Layout) -> Option<String> {
    let tp = l.mesh.tp();
    if l.mesh.world() == 0 || l.mesh.shard() == 0 || tp == 0 {
        return Some("a mesh dimension of size 0".into());
    }
    if !c.num_attention_heads.is_multiple_of(tp) || !c.num_key_value_heads.is_multiple_of(tp) {
        return Some(format!(
            "{} query and {} key/value heads do not split over tp = {tp}",
            c.num_attention_heads, c.num_key_value_heads
        ));
    }
    if !c.intermediate_size.is_multiple_of(tp) {
        return Some(format!("intermediate size {} does not split over tp = {tp}", c.intermediate_size));
    }
    if l.rows == 0 || l.grad_accum == 0 || !l.rows.is_multiple_of(l.grad_accum) {
        return Some(format!("{} rows per rank do not split into {} micro-batches", l.rows, l.grad_accum));
    }
    if l.seq < 2 {
        return Some("--seq must be at least 2 (inputs and labels)".into());
    }
    None
}

/// The whole prediction of one layout.
#[derive(Debug, Clone)]
pub struct Prediction {
    /// The layout.
    pub layout: Layout,
    /// Collective traffic per dimension.
    pub traffic: Vec<model::Dim>,
    /// Memory per rank.
    pub memory: model::Memory,
    /// The step-time model.
    pub time: model::StepTime,
    /// Whether the peak fits the device's usable memory.
    pub fits: bool,
}

/// Predicts `layout` for `c` on `device`.
pub fn predict(c: &Qwen3Config, layout: &Layout, device: &Device, e: &Efficiency) -> Prediction {
    let memory = model::memory(c, layout);
    Prediction {
        layout: layout.clone(),
        traffic: model::traffic(c, layout),
        time: model::step_time(c, layout, device, e),
        fits: memory.peak() <= device.memory * e.usable_memory,
        memory,
    }
}

/// The layouts of `world` ranks worth comparing with `base` (same global batch, precision,
/// offload): flat FSDP, HSDP with shards of up to 4 nodes, data × tensor parallelism within
/// a node; each without and with block activation checkpointing.
pub fn candidates(c: &Qwen3Config, base: &Layout, per_node: usize) -> Vec<Layout> {
    let world = base.mesh.world();
    let global_rows = base.rows * base.mesh.data_parallel();
    let mut meshes = vec![Mesh::Flat(world)];
    for shard in (2..world).filter(|s| world.is_multiple_of(*s) && *s <= 4 * per_node) {
        meshes.push(Mesh::Hsdp { replicate: world / shard, shard });
    }
    for tp in [2, 4, 8].into_iter().filter(|t| *t <= per_node && world.is_multiple_of(*t) && *t < world) {
        meshes.push(Mesh::DpTp { dp: world / tp, tp });
    }
    let mut out = Vec::new();
    for mesh in meshes {
        let dp = mesh.data_parallel();
        if !global_rows.is_multiple_of(dp) {
            continue;
        }
        for ac in [false, true] {
            let l = Layout { mesh, rows: global_rows / dp, activation_checkpointing: ac, ..base.clone() };
            if invalid(c, &l).is_none() {
                out.push(l);
            }
        }
    }
    out
}

/// The best of `predictions`: the highest predicted MFU among those that fit; on a tie, the
/// smaller peak, then the earlier (simpler: activation checkpointing comes after the same
/// layout without it).
pub fn best(predictions: &[Prediction]) -> Option<&Prediction> {
    predictions.iter().filter(|p| p.fits).fold(None, |best: Option<&Prediction>, p| match best {
        Some(b) if (b.time.mfu, -b.memory.peak()) >= (p.time.mfu, -p.memory.peak()) => Some(b),
        _ => Some(p),
    })
}

fn describe(l: &Layout) -> String {
    let mut s = l.mesh.name();
    if l.activation_checkpointing {
        s += " + act. ckpt";
    }
    if l.offload {
        s += " + offload";
    }
    s
}

/// `cargo xtask plan`.
pub fn run(args: &PlanArgs) -> Result<()> {
    if let Some(path) = &args.scaling_table {
        let table = scaling_table(args)?;
        burn_fsdp::io::write_atomic(path, table.as_bytes())
            .with_context(|| format!("--scaling-table {}", path.display()))?;
        println!("wrote {}", path.display());
        return Ok(());
    }
    let c = args.config()?;
    let layout = args.layout();
    if let Some(why) = invalid(&c, &layout) {
        bail!("this layout cannot run {}: {why}", args.model);
    }
    let (device, e) = (args.device()?, args.efficiency()?);
    let p = predict(&c, &layout, &device, &e);
    print!("{}", report(&c, &args.model, &p, &device, &e));
    Ok(())
}

/// The printout of one plan: memory, traffic, step time, the layouts compared, and the
/// `name: value` lines.
pub fn report(c: &Qwen3Config, model: &str, p: &Prediction, device: &Device, e: &Efficiency) -> String {
    let l = &p.layout;
    let mut o = String::new();
    let world = l.mesh.world();
    let _ = writeln!(
        o,
        "plan: Qwen3 {model} ({:.2}B parameters), {} on {world} × {} ({} node{}), {} rows × {} tokens per \
         data-parallel rank, {} micro-batch(es), {}{}{}",
        c.num_params() as f64 / 1e9,
        l.mesh.name(),
        device.name,
        world.div_ceil(device.per_node),
        if world > device.per_node { "s" } else { "" },
        l.rows,
        l.seq,
        l.grad_accum,
        if l.bf16 { "bf16" } else { "fp32" },
        if l.offload { ", offload" } else { "" },
        if l.activation_checkpointing { ", block activation checkpointing" } else { "" },
    );
    let m = &p.memory;
    let _ = writeln!(o, "\nmemory per rank (GiB):");
    for (name, v) in [
        ("parameters (fp32 shards)", m.parameters),
        ("gradients (fp32 shards)", m.gradients),
        ("optimizer state (AdamW)", m.optimizer),
        ("gathered units", m.gathered),
        ("activations", m.activations),
        ("communication buffers", m.comm_buffers),
        ("unsharded gradients (accum.)", m.accumulated),
    ] {
        let _ = writeln!(o, "  {name:<28} {:>9.2}", v / GIB);
    }
    let _ = writeln!(
        o,
        "  {:<28} {:>9.2}   (parameters, optimizer, gathered units, activations, two layers' gradients{})",
        "start of backward",
        m.start_of_backward() / GIB,
        if m.accumulated > 0.0 { ", unsharded gradients of the earlier micro-batches" } else { "" }
    );
    let _ = writeln!(
        o,
        "  {:<28} {:>9.2}   (parameters, optimizer, gradients, root unit and its gradient buffers)",
        "end of backward",
        m.end_of_backward() / GIB
    );
    let _ = writeln!(
        o,
        "  {:<28} {:>9.2}   (usable: {:.2})",
        "peak",
        m.peak() / GIB,
        device.memory * e.usable_memory / GIB
    );
    let _ = writeln!(o, "  {:<28} {:>9.2}", "between steps", m.between_steps() / GIB);
    if l.offload {
        let _ = writeln!(o, "  {:<28} {:>9.2}", "on the host (offload)", m.host / GIB);
    }
    let _ = writeln!(
        o,
        "\ncollectives per rank and step (input bytes as CommStats counts them; sent: ring algorithms):"
    );
    let _ = writeln!(
        o,
        "  {:<10} {:>5}  {:<15} {:>6} {:>16} {:>16}  link",
        "dimension", "size", "kind", "calls", "input bytes", "sent bytes"
    );
    let mut total = 0u64;
    let (mut intra, mut inter) = (0.0, 0.0);
    for d in &p.traffic {
        let crosses = model::dim_crosses_nodes(l, d, device);
        for (k, kind) in KINDS.iter().enumerate() {
            if d.traffic.calls[k] == 0 {
                continue;
            }
            let sent = model::sent(k, d.traffic.bytes[k] as f64, d.size);
            total += d.traffic.bytes[k];
            if crosses {
                inter += sent
            } else {
                intra += sent
            }
            let _ = writeln!(
                o,
                "  {:<10} {:>5}  {:<15} {:>6} {:>16} {:>16.0}  {}",
                d.name,
                d.size,
                kind,
                d.traffic.calls[k],
                d.traffic.bytes[k],
                sent,
                if crosses { "between nodes" } else { "within the node" }
            );
        }
    }
    let _ = writeln!(
        o,
        "  sent per rank and step: {:.3} GB within the node, {:.3} GB between nodes",
        intra / 1e9,
        inter / 1e9
    );
    let t = &p.time;
    let _ = writeln!(
        o,
        "\nstep time model (compute at {:.0}% of peak, links at {:.0}%):",
        e.compute * 100.0,
        e.link * 100.0
    );
    let _ = writeln!(
        o,
        "  compute                 {:>10.2} ms  ({:.3} PFLOP model)",
        t.compute * 1e3,
        t.model_flops / 1e15
    );
    let _ =
        writeln!(o, "  FSDP communication      {:>10.2} ms  (prefetched under compute)", t.fsdp_comm * 1e3);
    let _ = writeln!(o, "  TP communication        {:>10.2} ms  (on the critical path)", t.tp_comm * 1e3);
    let _ = writeln!(o, "  exposed communication   {:>10.2} ms", t.exposed_comm * 1e3);
    let _ = writeln!(o, "  optimizer step          {:>10.2} ms", t.optimizer * 1e3);
    let _ = writeln!(
        o,
        "  step                    {:>10.2} ms  predicted MFU {:.1}%",
        t.step * 1e3,
        t.mfu * 100.0
    );
    let _ = writeln!(o, "  tokens/s per data-parallel rank {:>10.0}", tokens_per_second(p));
    let cands: Vec<Prediction> =
        candidates(c, l, device.per_node).iter().map(|x| predict(c, x, device, e)).collect();
    let usable = device.memory * e.usable_memory;
    let _ = writeln!(
        o,
        "\nlayouts of {world} ranks, same global batch ({} rows):",
        l.rows * l.mesh.data_parallel()
    );
    let _ = writeln!(o, "  {:<32} {:>9} {:>7} {:>6}  ", "layout", "peak GiB", "MFU %", "fits");
    for x in &cands {
        let why = if x.fits {
            String::new()
        } else {
            format!("peak {:.1} GiB > {:.1} GiB usable", x.memory.peak() / GIB, usable / GIB)
        };
        let _ = writeln!(
            o,
            "  {:<32} {:>9.2} {:>7.1} {:>6}  {why}",
            describe(&x.layout),
            x.memory.peak() / GIB,
            x.time.mfu * 100.0,
            if x.fits { "yes" } else { "no" }
        );
    }
    match best(&cands) {
        Some(b) => {
            let _ = writeln!(
                o,
                "best: {} ({:.1}% MFU, {:.1} GiB)",
                describe(&b.layout),
                b.time.mfu * 100.0,
                b.memory.peak() / GIB
            );
        }
        None => {
            let _ = writeln!(
                o,
                "best: none of these fits; try --offload, a smaller --batch or --seq, or more ranks"
            );
        }
    }
    let _ = writeln!(o);
    let _ = writeln!(o, "peak_memory_per_rank_gib: {:.4}", m.peak() / GIB);
    let _ = writeln!(o, "between_steps_memory_per_rank_gib: {:.4}", m.between_steps() / GIB);
    let _ = writeln!(o, "comm_bytes_per_rank_per_step: {total}");
    let _ = writeln!(o, "predicted_mfu: {:.4}", t.mfu);
    let _ = writeln!(o, "fits: {}", p.fits);
    o
}

/// A measured training pace the step-time model is held against.
#[derive(Debug, Clone)]
pub struct StepTimeCheck {
    /// The run and where its figure comes from.
    pub what: String,
    /// Its measured tokens per second per GPU.
    pub measured: f64,
    /// The step-time model's tokens per second per GPU for the same run.
    pub predicted: f64,
    /// The compute efficiency at which the model predicts the measured pace.
    pub efficiency: f64,
}

impl StepTimeCheck {
    fn new(what: &str, measured: f64, c: &Qwen3Config, l: &Layout, device: &Device, e: &Efficiency) -> Self {
        let at = |compute: f64| tokens_per_second(&predict(c, l, device, &Efficiency { compute, ..*e }));
        // Tokens per second grow with the compute efficiency: bisect for the measured pace.
        let (mut lo, mut hi) = (1e-6, 1.0);
        for _ in 0..60 {
            let mid = (lo + hi) / 2.0;
            if at(mid) < measured { lo = mid } else { hi = mid }
        }
        Self { what: what.into(), measured, predicted: at(e.compute), efficiency: (lo + hi) / 2.0 }
    }
}

/// Tokens per second per data-parallel rank of a prediction.
pub fn tokens_per_second(p: &Prediction) -> f64 {
    (p.layout.rows * p.layout.seq.saturating_sub(1)) as f64 / p.time.step
}

/// The step-time model against the training paces measured so far: this project's own on one
/// H200 (docs/gpu.md) and torchtitan's published Llama 3.1 8B on 8 H100s (same dense bf16
/// peak and NVLink as the H200; a Qwen3 config of Llama 3.1 8B's shape, whose q/k norms add
/// 0.003 % of the FLOPs).
pub fn step_time_checks(device: &Device, e: &Efficiency) -> Result<Vec<StepTimeCheck>> {
    let ours = Layout { bf16: true, ..Layout::new(Mesh::Flat(1), 4, 1025) };
    let llama = Qwen3Config::from_json_str(
        r#"{"vocab_size": 128256, "hidden_size": 4096, "intermediate_size": 14336,
            "num_hidden_layers": 32, "num_attention_heads": 32, "num_key_value_heads": 8,
            "head_dim": 128, "rms_norm_eps": 1e-5, "rope_theta": 500000.0,
            "tie_word_embeddings": false}"#,
        "<Llama 3.1 8B's shape as a Qwen3 config>".as_ref(),
    )?;
    let titan =
        Layout { mesh: Mesh::Flat(8), rows: 2, seq: 8193, activation_checkpointing: true, ..ours.clone() };
    Ok(vec![
        StepTimeCheck::new(
            "this project, Qwen3-0.6B, bf16, FSDP W = 1, 4 × 1024 tokens, one H200 (docs/gpu.md)",
            6400.0,
            &Qwen3Config::qwen3_0_6b(),
            &ours,
            device,
            e,
        ),
        StepTimeCheck::new(
            "torchtitan (its docs/performance.md, Table 1), Llama 3.1 8B, bf16, FSDP 8, 2 × 8192 \
             tokens, selective activation checkpointing (modelled as block), 8 H100s at 500 W",
            5762.0,
            &llama,
            &titan,
            device,
            e,
        ),
    ])
}

/// docs/scaling.md: for each model and GPU count, the best layout found on H200s with bf16,
/// 2 rows × 4096 tokens per GPU (a test checks that the file is this function's output).
pub fn scaling_table(args: &PlanArgs) -> Result<String> {
    let (device, e) = (args.device()?, args.efficiency()?);
    let mut o = String::new();
    let _ = writeln!(o, "# Scaling plan: Qwen3 on {} GPUs", device.name.to_uppercase());
    let _ = writeln!(o);
    let _ = writeln!(
        o,
        "Generated by `cargo xtask plan --scaling-table docs/scaling.md` (do not edit by hand): the\n\
         predictions of `cargo xtask plan` for bf16 training (FSDP2 `MixedPrecisionPolicy`, fp32\n\
         master weights, AdamW) with 2 rows × 4096 tokens per GPU per step, every layout of\n\
         `plan`'s search (flat FSDP, HSDP, DP × TP within a node, each with and without block\n\
         activation checkpointing) compared at the same global batch. Memory is per GPU; MFU is\n\
         the step-time model's (compute at {:.0}% of the {:.0} TFLOPS peak, links at {:.0}%), not a\n\
         measurement. `comm/compute` is the FSDP and TP communication time over the compute time\n\
         of the best layout, and of flat FSDP over all GPUs: above 1, communication is no longer\n\
         hidden by prefetch and starts to dominate.\n\n\
         What is checked, and how close it came:\n\
         - collectives: the calls and bytes per rank and step `plan` predicts equal `CommStats` of\n  \
         real runs exactly (`tests/tests/plan.rs`: tied and untied heads, even and uneven shards,\n  \
         FSDP at W = 2, 3, 4, 6, 8, HSDP, DP × TP, accumulation, bf16, offload, no resharding,\n  \
         activation checkpointing);\n\
         - memory: between steps and at the peak within 10 % of the live-bytes counters of FSDP\n  \
         runs on the CPU (`tests/tests/plan_memory.rs`, W = 2, 3, 4, fewer tokens a rank than\n  \
         hidden units, accumulation, block activation checkpointing, and offload with the host's\n  \
         bytes added, the CPU's one memory holding both; `bench --qwen3-06b-memory` prints the\n  \
         ratio for the full Qwen3-0.6B at W = 4: 0.983 at the peak, 1.000 between steps). The\n  \
         activation term counts what this implementation keeps (attention scores materialised):\n  \
         fused attention would need less; bf16 and DP × TP memory are modelled but not yet\n  \
         measured;\n\
         - step time: a model of a well-tuned stack (compute at the efficiency above), held\n  \
         against the training paces measured so far:",
        e.compute * 100.0,
        device.flops / 1e12,
        e.link * 100.0
    );
    for check in step_time_checks(&device, &e)? {
        let _ = writeln!(
            o,
            "  - {}:\n    measured {:.0} tokens/s per GPU, predicted {:.0} ({:.2}× the measurement); a\n    \
             compute efficiency of {:.3} instead of {:.2} reproduces it.",
            check.what,
            check.measured,
            check.predicted,
            check.predicted / check.measured,
            check.efficiency,
            e.compute
        );
    }
    let _ = writeln!(
        o,
        "  - torchtitan publishes no figure for Qwen3 (its `torchtitan/models/qwen3/README.md`\n    \
         lists \"tested against established performance benchmarks\" as to be added; read\n    \
         2026-12-06), so there is no Qwen3-32B at FSDP 8 to compare with.\n\n\
         The MFU column says what a layout allows a well-tuned stack, not what this project's\n\
         kernels reach today (the first check above).\n"
    );
    let _ = writeln!(
        o,
        "| model | GPUs | best layout | memory/GPU (GiB) | predicted MFU | comm/compute | flat FSDP comm/compute | fitting layouts |"
    );
    let _ = writeln!(o, "|---|---|---|---|---|---|---|---|");
    for name in ["0.6b", "1.7b", "8b", "32b"] {
        let c = Qwen3Config::preset(name).context("preset")?;
        for world in [8, 64, 512, 1024] {
            let base = Layout { bf16: true, ..Layout::new(Mesh::Flat(world), 2, 4096) };
            let preds: Vec<Prediction> =
                candidates(&c, &base, device.per_node).iter().map(|l| predict(&c, l, &device, &e)).collect();
            let fitting = preds.iter().filter(|p| p.fits).count();
            let flat = predict(&c, &base, &device, &e).time;
            let flat_ratio = (flat.fsdp_comm + flat.tp_comm) / flat.compute;
            match best(&preds) {
                Some(b) => {
                    let ratio = (b.time.fsdp_comm + b.time.tp_comm) / b.time.compute;
                    let _ = writeln!(
                        o,
                        "| Qwen3-{} | {world} | {} | {:.1} | {:.1}% | {:.2} | {flat_ratio:.2} | {fitting} of {} |",
                        name.to_uppercase(),
                        describe(&b.layout),
                        b.memory.peak() / GIB,
                        b.time.mfu * 100.0,
                        ratio,
                        preds.len()
                    );
                }
                None => {
                    let least = preds.iter().map(|p| p.memory.peak()).fold(f64::INFINITY, f64::min);
                    let _ = writeln!(
                        o,
                        "| Qwen3-{} | {world} | none fits (least: {:.1} GiB) | | | | {flat_ratio:.2} | 0 of {} |",
                        name.to_uppercase(),
                        least / GIB,
                        preds.len()
                    );
                }
            }
        }
    }
    Ok(o)
}

#[cfg(test)]
mod tests {
    use super::model::{Device, Efficiency, Layout, Mesh, memory};
    use super::*;

    fn layout(mesh: Mesh) -> Layout {
        Layout::new(mesh, 2, 4097)
    }

    #[test]
    fn best_takes_the_highest_mfu_and_on_a_tie_the_simpler_layout() {
        let c = Qwen3Config::qwen3_0_6b();
        let (device, e) = (Device::h200(), Efficiency::default());
        let base = layout(Mesh::Flat(8));
        let preds: Vec<_> = candidates(&c, &base, 8).iter().map(|l| predict(&c, l, &device, &e)).collect();
        let b = best(&preds).expect("0.6B fits on 8 H200s");
        assert!(preds.iter().filter(|p| p.fits).all(|p| p.time.mfu <= b.time.mfu));
        // Two equal predictions: the first one (without activation checkpointing) wins.
        let mut plain = predict(&c, &base, &device, &e);
        plain.fits = true;
        let mut twin = plain.clone();
        twin.layout.activation_checkpointing = true;
        let pair = [plain, twin];
        assert!(!best(&pair).expect("fits").layout.activation_checkpointing);
        // Nothing fits: no best.
        let mut none = pair.clone();
        none.iter_mut().for_each(|p| p.fits = false);
        assert!(best(&none).is_none());
    }

    #[test]
    fn a_step_time_check_finds_the_efficiency_that_reproduces_its_measurement() {
        let (device, e) = (Device::h200(), Efficiency::default());
        let c = Qwen3Config::qwen3_0_6b();
        let l = Layout { rows: 4, seq: 1025, bf16: true, ..layout(Mesh::Flat(1)) };
        let at_03 = tokens_per_second(&predict(&c, &l, &device, &Efficiency { compute: 0.3, ..e }));
        let check = StepTimeCheck::new("a pace the model gives at 30 %", at_03, &c, &l, &device, &e);
        assert!((check.efficiency - 0.3).abs() < 1e-6, "{check:?}");
        assert!(check.predicted > at_03, "60 % is faster than 30 %: {check:?}");
        assert_eq!(step_time_checks(&device, &e).expect("built-in configs").len(), 2);
    }

    #[test]
    fn memory_moves_with_the_layout_as_fsdp_says() {
        let c = Qwen3Config::qwen3_8b();
        let flat = memory(&c, &layout(Mesh::Flat(8)));
        // Between steps: fp32 shards and AdamW's two moments, 12 bytes per parameter over W
        // (shards padded to a multiple of W, so at most W - 1 elements more per parameter).
        let ideal = 12.0 * c.num_params() as f64 / 8.0;
        assert!(flat.between_steps() >= ideal && flat.between_steps() < ideal * 1.001, "{flat:?}");
        // HSDP 2×4 shards over 4: twice the state of FSDP 8.
        let hsdp = memory(&c, &layout(Mesh::Hsdp { replicate: 2, shard: 4 }));
        assert!((hsdp.between_steps() / flat.between_steps() - 2.0).abs() < 1e-3);
        // Offload: nothing of the state on the device, all of it on the host.
        let off = memory(&c, &Layout { offload: true, ..layout(Mesh::Flat(8)) });
        assert_eq!(off.between_steps(), 0.0);
        assert_eq!(off.host, flat.parameters + flat.gradients + flat.optimizer);
        assert_eq!(off.host_between_steps(), flat.parameters + flat.optimizer);
        // bf16 gathers half the bytes; activation checkpointing keeps less.
        let bf16 = memory(&c, &Layout { bf16: true, ..layout(Mesh::Flat(8)) });
        assert!((bf16.gathered * 2.0 - flat.gathered).abs() < 1.0);
        let ckpt = memory(&c, &Layout { activation_checkpointing: true, ..layout(Mesh::Flat(8)) });
        assert!(ckpt.activations < flat.activations / 4.0, "{ckpt:?} vs {flat:?}");
        // Not resharding keeps every layer gathered.
        let kept = memory(&c, &Layout { reshard_after_forward: false, ..layout(Mesh::Flat(8)) });
        let layer = (flat.gathered - flat.root_gathered) / 2.0;
        let more = kept.gathered - flat.gathered;
        assert!((more / layer - (c.num_hidden_layers - 2) as f64).abs() < 1e-9, "{kept:?} vs {flat:?}");
    }
}
