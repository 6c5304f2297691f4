//! The predictions of `cargo xtask plan`: per rank, the bytes every collective of a training
//! step moves, the memory, and the step time, for a Qwen3 config on a layout.
//!
//! The collective bytes follow what burn-fsdp and `train-qwen3` issue, counted as
//! [`CommStats`](burn_fsdp::CommStats) counts them (the bytes of each call's input on this
//! rank), and are checked against it exactly (`xtask/tests/plan.rs`). The memory and the step
//! time are models, stated term by term below.

use qwen3_burn::Qwen3Config;

/// How the ranks are arranged.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Mesh {
    /// FSDP over all `W` ranks.
    Flat(usize),
    /// HSDP: `replicate` copies, each sharded over `shard` ranks.
    Hsdp { replicate: usize, shard: usize },
    /// Data × tensor parallelism: FSDP over `dp`, tensor parallelism over `tp`.
    DpTp { dp: usize, tp: usize },
}

impl Mesh {
    /// Ranks in all.
    pub fn world(&self) -> usize {
        match *self {
            Mesh::Flat(w) => w,
            Mesh::Hsdp { replicate, shard } => replicate * shard,
            Mesh::DpTp { dp, tp } => dp * tp,
        }
    }

    /// Ranks a parameter is sharded over.
    pub fn shard(&self) -> usize {
        match *self {
            Mesh::Flat(w) => w,
            Mesh::Hsdp { shard, .. } => shard,
            Mesh::DpTp { dp, .. } => dp,
        }
    }

    /// Tensor-parallel ranks (1 without).
    pub fn tp(&self) -> usize {
        match *self {
            Mesh::DpTp { tp, .. } => tp,
            _ => 1,
        }
    }

    /// Data-parallel ranks (ranks that see different rows).
    pub fn data_parallel(&self) -> usize {
        self.world() / self.tp()
    }

    /// The mesh as `train-qwen3` and `plan` take it.
    pub fn flag(&self) -> String {
        match *self {
            Mesh::Flat(w) => format!("--world-size {w}"),
            Mesh::Hsdp { replicate, shard } => format!("--hsdp {replicate}x{shard}"),
            Mesh::DpTp { dp, tp } => format!("--mesh {dp}x{tp}"),
        }
    }

    /// A short name: `FSDP 8`, `HSDP 2×4`, `DP×TP 4×2`.
    pub fn name(&self) -> String {
        match *self {
            Mesh::Flat(w) => format!("FSDP {w}"),
            Mesh::Hsdp { replicate, shard } => format!("HSDP {replicate}×{shard}"),
            Mesh::DpTp { dp, tp } => format!("DP×TP {dp}×{tp}"),
        }
    }
}

/// Everything a prediction depends on besides the model.
#[derive(Debug, Clone, PartialEq)]
pub struct Layout {
    /// The mesh.
    pub mesh: Mesh,
    /// Rows per data-parallel rank per step (all micro-batches together).
    pub rows: usize,
    /// Tokens per row (the model sees `seq - 1` positions, the last token being a label).
    pub seq: usize,
    /// Micro-batches per step (gradient accumulation).
    pub grad_accum: usize,
    /// bf16 all-gathers and compute (FSDP2 `MixedPrecisionPolicy`), fp32 reduction.
    pub bf16: bool,
    /// Shards, gradients and optimizer state on the host.
    pub offload: bool,
    /// Block activation checkpointing (each layer run again in backward).
    pub activation_checkpointing: bool,
    /// Layers freed after forward and gathered again in backward (the root never is).
    pub reshard_after_forward: bool,
}

impl Layout {
    /// `rows` rows of `seq` tokens per data-parallel rank on `mesh`, with the defaults of
    /// `train-qwen3`: one micro-batch, fp32, no offload, no activation checkpointing, layers
    /// resharded after forward.
    pub fn new(mesh: Mesh, rows: usize, seq: usize) -> Self {
        Self {
            mesh,
            rows,
            seq,
            grad_accum: 1,
            bf16: false,
            offload: false,
            activation_checkpointing: false,
            reshard_after_forward: true,
        }
    }
}

/// One parameter as a rank holds it before FSDP sharding (after tensor parallelism).
#[derive(Debug, Clone)]
struct ParamShape {
    /// Rows (dim 0) and elements per row.
    rows: usize,
    row: usize,
    /// A tensor-parallel gradient summed over `tp` (q/k norms).
    partial: bool,
}

impl ParamShape {
    fn new(shape: &[usize]) -> Self {
        Self { rows: shape[0], row: shape[1..].iter().product(), partial: false }
    }

    /// Elements of one rank's padded shard over `s` ranks (FSDP2: `ceil(rows / s)` rows).
    fn shard(&self, s: usize) -> u64 {
        (self.rows.div_ceil(s) * self.row) as u64
    }
}

/// The FSDP units of Qwen3 (root first, then one per layer), each a list of its parameters as
/// one tensor-parallel rank holds them: weights `[out, in]`, q/k/v and gate/up split on `out`
/// and o/down on `in` over `tp` (`qwen3_burn::parallelize::tp_plan`).
fn units(c: &Qwen3Config, tp: usize) -> Vec<Vec<ParamShape>> {
    let (h, i, v, hd) = (c.hidden_size, c.intermediate_size, c.vocab_size, c.head_dim);
    let (qd, kvd) = (c.num_attention_heads * hd, c.num_key_value_heads * hd);
    let mut root = vec![ParamShape::new(&[v, h]), ParamShape::new(&[h])];
    if !c.tie_word_embeddings {
        root.push(ParamShape::new(&[v, h]));
    }
    let norm = |n| ParamShape { partial: tp > 1, ..ParamShape::new(&[n]) };
    let layer = vec![
        ParamShape::new(&[qd / tp, h]),
        ParamShape::new(&[kvd / tp, h]),
        ParamShape::new(&[kvd / tp, h]),
        ParamShape::new(&[h, qd / tp]),
        norm(hd),
        norm(hd),
        ParamShape::new(&[h]),
        ParamShape::new(&[h]),
        ParamShape::new(&[i / tp, h]),
        ParamShape::new(&[i / tp, h]),
        ParamShape::new(&[h, i / tp]),
    ];
    std::iter::once(root).chain(std::iter::repeat_n(layer, c.num_hidden_layers)).collect()
}

/// The collective kinds, as `CommStats` names them.
pub const KINDS: [&str; 3] = ["all_gather", "reduce_scatter", "all_reduce"];

/// Calls and input bytes per kind ([`KINDS`] order) of one mesh dimension, per rank and step.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct DimTraffic {
    /// Calls per kind.
    pub calls: [u64; 3],
    /// Bytes of the calls' inputs on this rank, per kind (what `CommStats` counts).
    pub bytes: [u64; 3],
}

impl DimTraffic {
    fn add(&mut self, kind: usize, calls: u64, bytes: u64) {
        self.calls[kind] += calls;
        self.bytes[kind] += bytes;
    }
}

/// One mesh dimension's traffic: its name (as `train-qwen3`'s summary names it), its size
/// and what it moves.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Dim {
    /// `dp`, `replicate`, `shard` or `tp`.
    pub name: &'static str,
    /// Ranks in the dimension's groups.
    pub size: usize,
    /// Calls and bytes per step.
    pub traffic: DimTraffic,
}

const AG: usize = 0;
const RS: usize = 1;
const AR: usize = 2;

/// The collectives of one training step per rank, per mesh dimension (dimensions of size 1
/// issue none and are left out).
///
/// - shard dimension: each micro-batch all-gathers every unit's flat shard in forward (in
///   the gather dtype) and, when resharded, every layer's again in backward; the last
///   micro-batch reduce-scatters each unit's whole gradient (fp32); two all-reduces: the
///   loss and the squared gradient norm (two parts with tensor parallelism).
/// - replicate dimension (HSDP): each unit's reduced shard gradient all-reduced, and the loss.
/// - tp dimension: per layer and micro-batch two output all-reduces in forward and two
///   input-gradient all-reduces in backward (`[rows, seq - 1, hidden]` activations); once per
///   step the q/k norms' gradient shards and the gradient norm.
pub fn traffic(c: &Qwen3Config, l: &Layout) -> Vec<Dim> {
    let (s, tp) = (l.mesh.shard(), l.mesh.tp());
    let units = units(c, tp);
    let shard_len = |u: &Vec<ParamShape>| u.iter().map(|p| p.shard(s)).sum::<u64>();
    let gather = if l.bf16 { 2 } else { 4 };
    let micro = l.grad_accum.max(1) as u64;
    let layers = c.num_hidden_layers as u64;
    let mut dims = Vec::new();
    if s > 1 {
        let mut t = DimTraffic::default();
        let forward: u64 = units.iter().map(shard_len).sum();
        let regather: u64 = if l.reshard_after_forward { units[1..].iter().map(shard_len).sum() } else { 0 };
        let regathers = if l.reshard_after_forward { layers } else { 0 };
        t.add(AG, micro * (units.len() as u64 + regathers), micro * (forward + regather) * gather);
        t.add(RS, units.len() as u64, units.iter().map(|u| s as u64 * shard_len(u) * 4).sum());
        let norm_parts = if tp > 1 { 2 } else { 1 };
        t.add(AR, 2, 4 + 4 * norm_parts);
        let name = match l.mesh {
            Mesh::Hsdp { .. } => "shard",
            _ => "dp",
        };
        dims.push(Dim { name, size: s, traffic: t });
    }
    if let Mesh::Hsdp { replicate, .. } = l.mesh
        && replicate > 1
    {
        let mut t = DimTraffic::default();
        t.add(AR, units.len() as u64 + 1, units.iter().map(|u| shard_len(u) * 4).sum::<u64>() + 4);
        dims.push(Dim { name: "replicate", size: replicate, traffic: t });
    }
    if tp > 1 {
        let mut t = DimTraffic::default();
        let act = if l.bf16 { 2 } else { 4 };
        let rows_micro = (l.rows / l.grad_accum.max(1)) as u64;
        let activation = rows_micro * (l.seq as u64 - 1) * c.hidden_size as u64 * act;
        t.add(AR, micro * 4 * layers, micro * 4 * layers * activation);
        let partial: u64 = units.iter().flatten().filter(|p| p.partial).map(|p| p.shard(s)).sum();
        t.add(AR, 2, partial * 4 + 4);
        dims.push(Dim { name: "tp", size: tp, traffic: t });
    }
    dims
}

/// Per-rank memory, bytes, term by term.
///
/// The peak is the larger of two moments: the start of backward (the shards and the optimizer
/// state, the gathered units, every activation kept for backward, two layers' whole
/// gradients on their way to the reduce-scatter) and the end of backward
/// (the shards, the optimizer state and the reduced gradient shards, the root unit still
/// gathered, its whole gradient in flight to the reduce-scatter). The terms are listed apart;
/// they do not add up to the peak.
#[derive(Debug, Clone, Copy, Default, PartialEq)]
pub struct Memory {
    /// fp32 master shards.
    pub parameters: f64,
    /// fp32 gradient shards (at the end of backward, until the step).
    pub gradients: f64,
    /// AdamW's two moments per shard element.
    pub optimizer: f64,
    /// Gathered units at the start of backward: the root (kept from forward to backward), and two
    /// layers (the one computing and the one prefetched), or every layer when none is resharded.
    pub gathered: f64,
    /// Activations kept for backward (see [`activations_per_token`]), with the chunked loss's
    /// gradient kept for the head's (see [`memory`]) and a chunk of logits.
    pub activations: f64,
    /// At the end of backward: the root unit's whole gradient as the reduce-scatter takes it
    /// (its flat buffer, the gradients of its parameters, and with a tied head whose gradient
    /// the loss made in forward, the head's contribution to the embedding's besides).
    pub comm_buffers: f64,
    /// At the start of backward: two layers' whole gradients (each its flat buffer and its
    /// parameters' gradients), the one in flight to its reduce-scatter on the communication
    /// thread and the one forming.
    pub layer_gradient: f64,
    /// One layer's activations (of [`activations`](Self::activations)): the last layer's
    /// are freed by its backward as its gradient forms.
    pub layer_activations: f64,
    /// The loss's buffers made at the end of forward (of [`activations`](Self::activations):
    /// a chunk's logits, exponentials and gradient), freed before the layers' backward.
    pub loss_made: f64,
    /// With accumulation (`grad_accum` > 1): every unit's unsharded gradient, kept on the
    /// device from the first micro-batch's backward to the last one's (FSDP2's
    /// `set_requires_gradient_sync(false)`), in the compute dtype.
    pub accumulated: f64,
    /// The root unit gathered (part of `gathered`, still held at the end of backward).
    pub root_gathered: f64,
    /// What the host holds with offload at most (shards, gradients, optimizer state): from
    /// the end of backward to the optimizer's step.
    pub host: f64,
    /// Of [`host`](Self::host), the gradient shards: on the host only from the end of
    /// backward to the step, not between steps.
    pub host_gradients: f64,
}

impl Memory {
    /// At the start of backward: the end of forward (every activation kept, the loss's
    /// gradients made), or, when larger, the first layers' backward, whose gradients form as
    /// the loss's buffers and the last layer's activations are freed.
    pub fn start_of_backward(&self) -> f64 {
        self.parameters
            + self.optimizer
            + self.gathered
            + self.activations
            + (self.layer_gradient - self.layer_activations - self.loss_made).max(0.0)
            + self.accumulated
    }

    /// At the end of backward.
    pub fn end_of_backward(&self) -> f64 {
        self.parameters + self.optimizer + self.gradients + self.root_gathered + self.comm_buffers
    }

    /// The device's peak: the larger of the two moments.
    pub fn peak(&self) -> f64 {
        self.start_of_backward().max(self.end_of_backward())
    }

    /// What stays on the device between steps: the shards and the optimizer state.
    pub fn between_steps(&self) -> f64 {
        self.parameters + self.optimizer
    }

    /// What stays on the host between steps with offload (and through forward and backward):
    /// the shards and the optimizer state.
    pub fn host_between_steps(&self) -> f64 {
        self.host - self.host_gradients
    }
}

/// Activation elements one layer keeps per token for backward, on one tensor-parallel rank,
/// as this implementation computes a layer (attention scores materialised, no fused
/// kernels): the norms' inputs and outputs (4·h), q/k/v, their norms and rotary outputs
/// (3·(q + 2·kv) widths), the attention output (q), the scores and their softmax
/// (2·heads·positions), the MLP's gate, up, activation and product (4·i), the two residual
/// outputs (2·h).
pub fn activations_per_token(c: &Qwen3Config, tp: usize, positions: usize) -> f64 {
    let (h, i, hd) = (c.hidden_size as f64, (c.intermediate_size / tp) as f64, c.head_dim as f64);
    let (heads, kv) = ((c.num_attention_heads / tp) as f64, (c.num_key_value_heads / tp) as f64);
    let (q, kvd) = (heads * hd, kv * hd);
    6.0 * h + 3.0 * (q + 2.0 * kvd) + q + 2.0 * heads * positions as f64 + 4.0 * i
}

/// The memory of one rank (see [`Memory`]'s fields for each term).
pub fn memory(c: &Qwen3Config, l: &Layout) -> Memory {
    let (s, tp) = (l.mesh.shard(), l.mesh.tp());
    let units = units(c, tp);
    let shard: f64 = units.iter().flatten().map(|p| p.shard(s) as f64).sum();
    let full = |u: &Vec<ParamShape>| u.iter().map(|p| (p.shard(s) * s as u64) as f64).sum::<f64>();
    let compute = if l.bf16 { 2.0 } else { 4.0 };
    let layer = units.get(1).map(full).unwrap_or(0.0);
    let gathered_layers = if l.reshard_after_forward {
        2.0f64.min(c.num_hidden_layers as f64)
    } else {
        c.num_hidden_layers as f64
    };
    let positions = l.seq.saturating_sub(1);
    let tokens = (l.rows / l.grad_accum.max(1) * positions) as f64;
    let per_layer = activations_per_token(c, tp, positions) * tokens * compute;
    let layers = c.num_hidden_layers as f64;
    let inputs = layers * tokens * c.hidden_size as f64 * compute;
    // The chunked loss (`qwen3_burn::train::chunked_cross_entropy`), at its peak: the head's
    // gradient, made in forward, and a chunk's logits (≤ 64 MiB) as three buffers at once
    // (shifted, exponentiated, the gradient); or, with fewer tokens than hidden units, the
    // logits' gradient of every token (the current chunk's among them), kept for the head's.
    let logits = tokens * c.vocab_size as f64 * 4.0;
    let chunk = (qwen3_burn::trainer::LOSS_CHUNK_BYTES as f64).min(logits);
    // With fewer tokens than hidden units the head's gradient is made late, from the kept
    // logits' gradient, at the end of backward (`LossBackend::deferred_gradient`).
    let head_gradient_late = qwen3_burn::train::head_gradient_made_late(tokens as usize, c.hidden_size);
    let (loss_kept, loss_made) = if head_gradient_late {
        (logits - chunk, 2.0 * chunk)
    } else {
        ((c.vocab_size * c.hidden_size) as f64 * 4.0, 3.0 * chunk)
    };
    let activations = if l.activation_checkpointing {
        // Each layer's input and the leaf holding its output, the final norm's input and
        // output and the hidden states' gradient, and what the loss keeps for backward; then
        // either the loss's chunk being made (forward) or one layer's activations while it
        // runs again (backward), never both.
        let hidden_states = tokens * c.hidden_size as f64 * compute;
        2.0 * inputs + 3.0 * hidden_states + loss_kept + loss_made.max(per_layer)
    } else {
        layers * per_layer + loss_kept + loss_made
    };
    let states = (4.0 * shard, 4.0 * shard, 8.0 * shard);
    let (on_device, host) =
        if l.offload { ((0.0, 0.0, 0.0), states.0 + states.1 + states.2) } else { (states, 0.0) };
    let root = full(&units[0]);
    // The root's gradient: its flat buffer and its parameters' gradients (two root sizes),
    // and a tied head's contribution to the embedding's gradient besides when the loss made it
    // in forward. Made late, it is added into the embedding's gradient as it is made, before
    // the flat buffer exists (Qwen3-0.6B at W = 4, 256 tokens a rank: measured 3.2 root
    // sizes at the end of backward with the gathered root, against 4 counted before).
    let tied = if c.tie_word_embeddings && !head_gradient_late {
        (c.vocab_size * c.hidden_size) as f64
    } else {
        0.0
    };
    Memory {
        parameters: on_device.0,
        gradients: on_device.1,
        optimizer: on_device.2,
        gathered: (root + gathered_layers * layer) * compute,
        activations,
        comm_buffers: (2.0 * root + tied) * 4.0,
        layer_gradient: 2.0 * 2.0 * layer * 4.0,
        layer_activations: per_layer,
        loss_made: if l.activation_checkpointing { 0.0 } else { loss_made },
        accumulated: if l.grad_accum > 1 { units.iter().map(full).sum::<f64>() * compute } else { 0.0 },
        root_gathered: root * compute,
        host,
        host_gradients: if l.offload { states.1 } else { 0.0 },
    }
}

/// A device: peak compute, memory and links.
#[derive(Debug, Clone, PartialEq)]
pub struct Device {
    /// Name.
    pub name: String,
    /// Dense bf16 peak, FLOP/s.
    pub flops: f64,
    /// Memory, bytes.
    pub memory: f64,
    /// Memory bandwidth, bytes/s.
    pub memory_bandwidth: f64,
    /// Bandwidth between GPUs of one node, per GPU and direction, bytes/s.
    pub intra_node: f64,
    /// Bandwidth between nodes, per GPU and direction, bytes/s.
    pub inter_node: f64,
    /// GPUs per node.
    pub per_node: usize,
    /// Host ↔ device bandwidth per GPU (offload), bytes/s.
    pub host_link: f64,
}

impl Device {
    /// NVIDIA H200 SXM: 989 TFLOPS dense bf16, 141 GB HBM3e at 4.8 TB/s, NVLink 900 GB/s
    /// (450 each way), 400 Gb/s between nodes per GPU, 8 per node, PCIe Gen5 to the host.
    pub fn h200() -> Self {
        Self {
            name: "h200".into(),
            flops: 989e12,
            memory: 141e9,
            memory_bandwidth: 4.8e12,
            intra_node: 450e9,
            inter_node: 50e9,
            per_node: 8,
            host_link: 55e9,
        }
    }

    /// MetaX C500, figures not measured here (to be checked against MetaX's datasheet for
    /// the card at hand, or given by hand): 280 TFLOPS bf16, 64 GB HBM2e at 1.8 TB/s,
    /// MetaXLink between the 8 GPUs of a node, 200 Gb/s between nodes per GPU, PCIe Gen4.
    pub fn c500() -> Self {
        Self {
            name: "c500".into(),
            flops: 280e12,
            memory: 64e9,
            memory_bandwidth: 1.8e12,
            intra_node: 112e9,
            inter_node: 25e9,
            per_node: 8,
            host_link: 25e9,
        }
    }
}

/// Assumptions of the step-time model that are not properties of the device.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct Efficiency {
    /// Fraction of the peak FLOP/s the compute achieves.
    pub compute: f64,
    /// Fraction of a link's bandwidth a collective achieves.
    pub link: f64,
    /// Latency per collective call, seconds.
    pub latency: f64,
    /// Fraction of the device memory a run may use (the rest: runtime, allocator slack).
    pub usable_memory: f64,
}

impl Default for Efficiency {
    fn default() -> Self {
        Self { compute: 0.6, link: 0.8, latency: 20e-6, usable_memory: 0.9 }
    }
}

/// The step-time model's figures, seconds and FLOPs per rank.
#[derive(Debug, Clone, Copy, Default, PartialEq)]
pub struct StepTime {
    /// Model FLOPs per rank and step (6 per parameter and token, plus attention).
    pub model_flops: f64,
    /// Compute time (the FLOPs run, recomputation included, at the assumed efficiency).
    pub compute: f64,
    /// Communication time of FSDP's collectives (overlapped with compute by prefetch).
    pub fsdp_comm: f64,
    /// Communication time of tensor parallelism's all-reduces (on the critical path).
    pub tp_comm: f64,
    /// The part of communication compute does not hide.
    pub exposed_comm: f64,
    /// The optimizer step (memory-bound: 28 bytes read and written per shard element).
    pub optimizer: f64,
    /// compute + exposed communication + optimizer.
    pub step: f64,
    /// Model FLOP utilisation: model FLOPs / (step · peak).
    pub mfu: f64,
}

/// Bytes a rank sends for one call of `kind` with `input` bytes over `n` ranks (ring
/// algorithms): all-gather `(n-1)·input`, reduce-scatter `(n-1)/n·input`, all-reduce twice that.
pub fn sent(kind: usize, input: f64, n: usize) -> f64 {
    let n = n as f64;
    match kind {
        AG => (n - 1.0) * input,
        RS => (n - 1.0) / n * input,
        _ => 2.0 * (n - 1.0) / n * input,
    }
}

/// Whether the groups of a mesh dimension cross nodes: a dimension's ranks are `stride`
/// apart (the inner dimension 1, the outer one the inner's size).
fn crosses_nodes(l: &Layout, dim: &Dim, per_node: usize) -> bool {
    let stride = match (l.mesh, dim.name) {
        (Mesh::Hsdp { shard, .. }, "replicate") => shard,
        (Mesh::DpTp { tp, .. }, "dp") => tp,
        _ => 1,
    };
    dim.size * stride > per_node
}

/// Seconds the traffic of `dim` takes on `device`.
pub fn dim_seconds(l: &Layout, dim: &Dim, device: &Device, e: &Efficiency) -> f64 {
    let bw =
        if crosses_nodes(l, dim, device.per_node) { device.inter_node } else { device.intra_node } * e.link;
    (0..3)
        .map(|k| {
            sent(k, dim.traffic.bytes[k] as f64, dim.size) / bw + dim.traffic.calls[k] as f64 * e.latency
        })
        .sum()
}

/// Which dimensions' traffic crosses nodes (for the printout).
pub fn dim_crosses_nodes(l: &Layout, dim: &Dim, device: &Device) -> bool {
    crosses_nodes(l, dim, device.per_node)
}

/// The step-time model of one rank.
///
/// FLOPs: `6·N + 12·layers·q_width·positions` per token (N the matmul parameters, the head
/// included: PaLM's count), divided among the tensor-parallel ranks; block checkpointing
/// adds one forward (`+1/3`) to the FLOPs run, not to the model FLOPs. Communication: ring
/// bytes ([`sent`]) over the node's links or the network, at [`Efficiency::link`], plus a
/// latency per call. With prefetch, FSDP's gathers and reduce-scatters run under the compute
/// of the neighbouring layer: exposed is what exceeds the compute, plus one unit's gather
/// before the first layer can start. Tensor parallelism's all-reduces are exposed whole.
pub fn step_time(c: &Qwen3Config, l: &Layout, device: &Device, e: &Efficiency) -> StepTime {
    let (s, tp) = (l.mesh.shard(), l.mesh.tp());
    let positions = l.seq.saturating_sub(1) as f64;
    let tokens = l.rows as f64 * positions;
    let (h, v) = (c.hidden_size as f64, c.vocab_size as f64);
    let layers = c.num_hidden_layers as f64;
    let q = (c.num_attention_heads * c.head_dim) as f64;
    let kv = (c.num_key_value_heads * c.head_dim) as f64;
    let matmul = layers * (2.0 * h * q + 2.0 * h * kv + 3.0 * h * c.intermediate_size as f64) + v * h;
    let per_token = 6.0 * matmul + 12.0 * layers * q * positions;
    let model_flops = per_token * tokens / tp as f64;
    let run = if l.activation_checkpointing { model_flops * 4.0 / 3.0 } else { model_flops };
    let compute = run / (device.flops * e.compute);
    let dims = traffic(c, l);
    let seconds = |name: &str| {
        dims.iter().filter(|d| d.name == name).map(|d| dim_seconds(l, d, device, e)).sum::<f64>()
    };
    let fsdp_comm = seconds("dp") + seconds("shard") + seconds("replicate");
    let tp_comm = seconds("tp") + 0.0; // an empty sum is -0.0
    let units = units(c, tp);
    let root_gather: f64 =
        units[0].iter().map(|p| p.shard(s) as f64).sum::<f64>() * if l.bf16 { 2.0 } else { 4.0 };
    let first = dims
        .iter()
        .find(|d| d.name == "dp" || d.name == "shard")
        .map(|d| {
            let bw = if crosses_nodes(l, d, device.per_node) { device.inter_node } else { device.intra_node };
            sent(AG, root_gather, d.size) / (bw * e.link) + e.latency
        })
        .unwrap_or(0.0);
    let exposed_comm = (fsdp_comm - compute).max(0.0) + first.min(fsdp_comm) + tp_comm;
    let shard: f64 = units.iter().flatten().map(|p| p.shard(s) as f64).sum();
    // Offload: the shards go up and the gradients down over the host link, and AdamW runs
    // on the host (assumed 100 GB/s of host memory bandwidth).
    let optimizer = if l.offload {
        8.0 * shard / device.host_link + 28.0 * shard / 100e9
    } else {
        28.0 * shard / device.memory_bandwidth
    };
    let step = compute + exposed_comm + optimizer;
    StepTime {
        model_flops,
        compute,
        fsdp_comm,
        tp_comm,
        exposed_comm,
        optimizer,
        step,
        mfu: model_flops / (step * device.flops),
    }
}
