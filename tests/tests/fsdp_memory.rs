//! `reshard_after_forward` really frees, and nothing is kept alive between steps: live bytes
//! counted by a global allocator (in the `memory` test binary, whose tests run one at a time
//! through `tests::alloc::exclusive`, so nothing else allocates).
#![allow(clippy::unwrap_used)]

use std::sync::Mutex;
use std::sync::atomic::Ordering;
use std::time::Duration;

use burn::backend::autodiff::checkpoint::strategy::BalancedCheckpointing;
use burn::backend::{Autodiff, NdArray};
use burn::module::Module;
use burn::tensor::{Int, Tensor};
use burn_fsdp::UnitPolicy;
use burn_fsdp::{DeviceMesh, Fsdp, FsdpConfig, UnitRunner, launch};
use qwen3_burn::{Qwen3, Qwen3Config};
use tests::alloc::{CURRENT, PEAK};

type FB = Autodiff<NdArray<f32>, BalancedCheckpointing>;

/// Records the live bytes when each unit starts computing (its parameters gathered), with
/// every rank stopped at the same point (barriers before and after the reading).
struct Probe<'a, R> {
    inner: &'a mut R,
    at_entry: &'a Mutex<Vec<isize>>,
    group: &'a burn_fsdp::LocalGroup,
}

impl<B: burn::tensor::backend::Backend, R: UnitRunner<B>> UnitRunner<B> for Probe<'_, R> {
    fn run<M: Module<B>, const D: usize>(
        &mut self,
        unit: &M,
        x: Tensor<B, D>,
        f: impl FnOnce(&M, Tensor<B, D>) -> Tensor<B, D>,
    ) -> Tensor<B, D> {
        let (at_entry, group) = (self.at_entry, self.group);
        self.inner.run(unit, x, |m, x| {
            burn_fsdp::ProcessGroup::<NdArray<f32>>::barrier(group, &"probe-in".into()).unwrap();
            if group.rank() == 0 {
                at_entry.lock().unwrap().push(CURRENT.load(Ordering::Relaxed));
            }
            burn_fsdp::ProcessGroup::<NdArray<f32>>::barrier(group, &"probe-out".into()).unwrap();
            f(m, x)
        })
    }
}

struct Measured {
    baseline: isize,
    max_at_entry: isize,
    peak: isize,
    unit_bytes: isize,
    root_bytes: isize,
}

fn config() -> Qwen3Config {
    Qwen3Config {
        vocab_size: 64,
        hidden_size: 128,
        intermediate_size: 512,
        num_hidden_layers: 4,
        num_attention_heads: 4,
        num_key_value_heads: 4,
        head_dim: 32,
        max_position_embeddings: 16,
        rms_norm_eps: 1e-6,
        rope_theta: 10_000.0,
        tie_word_embeddings: true,
    }
}

fn measure(world: usize, reshard: bool, prefetch: bool) -> Measured {
    let config = config();
    let weights = config.init::<NdArray<f32>>(&Default::default()).to_hf_tensors();
    let at_entry = Mutex::new(Vec::new());
    let baseline = Mutex::new(0isize);
    let forward_peak = Mutex::new(0isize);
    // The test's own barriers use a group of their own: the FSDP group's collectives run on
    // each rank's communication thread, in an order the test must not interleave with.
    let probes = burn_fsdp::LocalGroup::new_group(world, Duration::from_secs(60));
    let sizes = launch(world, Duration::from_secs(60), |fsdp_group| {
        let group = probes[fsdp_group.rank()].clone();
        let device = Default::default();
        let model = Qwen3::<FB>::from_weights(&config, weights.as_slice(), &device).unwrap();
        let mesh = DeviceMesh::new_1d(fsdp_group, device);
        let fsdp = Fsdp::wrap(
            model,
            &mesh,
            FsdpConfig {
                units: UnitPolicy::VecElements,
                reshard_after_forward: reshard,
                prefetch,
                ..FsdpConfig::default()
            },
        )?;
        let ids = Tensor::<FB, 2, Int>::from_ints([[1, 2]], &device);
        // A warm-up step, so that lazily created buffers (thread pools, kernels' scratch) are
        // in the baseline rather than counted as gathered parameters. `gradients` waits for the
        // reduce-scatters still running on the communication thread: their full-size gradient
        // buffers must not be in the baseline and then freed during the measurement.
        let _ = fsdp.gradients(fsdp.forward(|m, r| m.forward_with(ids.clone(), r)).sum().backward());
        // Everyone has built its shards; take the baseline once all ranks got here.
        burn_fsdp::ProcessGroup::<NdArray<f32>>::barrier(&*group, &"built".into())?;
        if group.rank() == 0 {
            *baseline.lock().unwrap() = CURRENT.load(Ordering::Relaxed);
            PEAK.store(0, Ordering::Relaxed);
        }
        burn_fsdp::ProcessGroup::<NdArray<f32>>::barrier(&*group, &"measure".into())?;
        let logits = fsdp
            .forward(|m, r| m.forward_with(ids, &mut Probe { inner: r, at_entry: &at_entry, group: &group }));
        burn_fsdp::ProcessGroup::<NdArray<f32>>::barrier(&*group, &"forward done".into())?;
        if group.rank() == 0 {
            *forward_peak.lock().unwrap() = PEAK.load(Ordering::Relaxed);
        }
        let _ = logits.sum().backward();
        let unit_bytes = 4 * fsdp.units()[1].numel() as isize;
        let root_bytes = 4 * fsdp.units()[0].numel() as isize;
        Ok::<_, burn_fsdp::FsdpError>((unit_bytes, root_bytes))
    })
    .unwrap();
    let (unit_bytes, root_bytes) = sizes[0];
    let baseline = *baseline.lock().unwrap();
    let max_at_entry = at_entry.lock().unwrap().iter().copied().max().unwrap() - baseline;
    Measured {
        baseline,
        max_at_entry,
        peak: *forward_peak.lock().unwrap() - baseline,
        unit_bytes,
        root_bytes,
    }
}

/// Live bytes while each unit computes, above the shards: without prefetch (collectives
/// inline, so the reading is deterministic) only the computing unit is gathered; with prefetch
/// the next unit too, and that unit's all-gather may still be in flight on the communication
/// thread (host staging of the shard and of the gathered unit), so the reading varies with
/// timing and the bound counts that staging.
#[test]
fn reshard_after_forward_keeps_at_most_two_units_gathered() {
    let _serial = tests::alloc::exclusive();
    let world = 2;
    let inline = measure(world, true, false);
    let prefetched = measure(world, true, true);
    let without = measure(world, false, false);
    let mib = |b: isize| b as f64 / (1 << 20) as f64;
    eprintln!(
        "world {world}, unit {:.2} MiB, root {:.2} MiB, shards (all ranks) {:.2} MiB\n\
         live above shards while a unit computes: reshard {:.2} MiB (prefetch {:.2} MiB), no reshard {:.2} MiB\n\
         peak above shards during forward (incl. communication staging): reshard {:.2} MiB (prefetch {:.2} MiB), \
         no reshard {:.2} MiB",
        mib(inline.unit_bytes),
        mib(inline.root_bytes),
        mib(inline.baseline),
        mib(inline.max_at_entry),
        mib(prefetched.max_at_entry),
        mib(without.max_at_entry),
        mib(inline.peak),
        mib(prefetched.peak),
        mib(without.peak),
    );
    let (unit, root, shard) = (inline.unit_bytes, inline.root_bytes, inline.unit_bytes / world as isize);
    // Per rank: the root (never resharded) + the computing unit + the staged copy of the shard.
    let one = world as isize * (root + unit + shard);
    assert!(inline.max_at_entry < one, "reshard: {} ≥ bound {one}", inline.max_at_entry);
    // With prefetch: + the prefetched unit + the in-flight gather's staging (≤ unit + shard).
    let two = world as isize * (root + 3 * unit + 2 * shard);
    assert!(prefetched.max_at_entry < two, "reshard, prefetch: {} ≥ bound {two}", prefetched.max_at_entry);
    // The measurement can fail: without resharding, gathered layers pile up past the bounds.
    assert!(without.max_at_entry > two, "no reshard: {} ≤ bound {two}", without.max_at_entry);
}

/// Live bytes (all ranks) after each of `steps` training steps, every rank stopped there, and
/// the shard bytes of all ranks.
fn between_steps(world: usize, prefetch: bool, steps: usize) -> (Vec<isize>, isize) {
    let config = config();
    let weights = config.init::<NdArray<f32>>(&Default::default()).to_hf_tensors();
    let readings = Mutex::new(Vec::new());
    let probes = burn_fsdp::LocalGroup::new_group(world, Duration::from_secs(60));
    let shard_bytes = launch(world, Duration::from_secs(60), |fsdp_group| {
        let group = probes[fsdp_group.rank()].clone();
        let device = Default::default();
        let model = Qwen3::<FB>::from_weights(&config, weights.as_slice(), &device).unwrap();
        let mesh = DeviceMesh::new_1d(fsdp_group, device);
        let mut fsdp = Fsdp::wrap(
            model,
            &mesh,
            FsdpConfig { units: UnitPolicy::VecElements, prefetch, ..FsdpConfig::default() },
        )?;
        let mut adam = burn_fsdp::TorchAdamWConfig::default().init();
        let ids = Tensor::<FB, 2, Int>::from_ints([[1, 2, 3, 4]], &device);
        for _ in 0..steps {
            let loss = fsdp.forward(|m, r| m.forward_with(ids.clone(), r)).sum();
            let grads = fsdp.gradients(loss.backward());
            fsdp.step(&mut adam, grads);
            burn_fsdp::ProcessGroup::<NdArray<f32>>::barrier(&*group, &"stepped".into())?;
            if group.rank() == 0 {
                readings.lock().unwrap().push(CURRENT.load(Ordering::Relaxed));
            }
            burn_fsdp::ProcessGroup::<NdArray<f32>>::barrier(&*group, &"read".into())?;
        }
        let shard_elems: usize = fsdp.units().iter().map(|u| u.shard_len()).sum();
        Ok::<_, burn_fsdp::FsdpError>(4 * shard_elems as isize)
    })
    .unwrap();
    (readings.into_inner().unwrap(), shard_bytes.iter().sum())
}

/// Between steps only shards, gradients-free optimizer state and fixed buffers live: the
/// prefetcher must not keep the previous step's shards (or gathered buffers) alive until the
/// next forward — a leak `bench` once found and no test caught. With prefetch the live bytes
/// between steps equal those without (which holds no such references) within a quarter of
/// the shards, and do not grow from step to step.
#[test]
fn nothing_is_kept_alive_between_steps() {
    let _serial = tests::alloc::exclusive();
    let world = 2;
    let (with, shards) = between_steps(world, true, 5);
    let (without, _) = between_steps(world, false, 5);
    let mib = |b: isize| b as f64 / (1 << 20) as f64;
    eprintln!(
        "shards (all ranks) {:.2} MiB; live after steps 3..5, prefetch: {:?} MiB, no prefetch: {:?} MiB",
        mib(shards),
        with[2..].iter().map(|b| mib(*b)).collect::<Vec<_>>(),
        without[2..].iter().map(|b| mib(*b)).collect::<Vec<_>>()
    );
    // Steady state from the third step on (AdamW state exists after the first).
    let growth = with[4] - with[2];
    assert!(growth < shards / 8, "live bytes grow between steps: +{growth} bytes over two steps");
    let extra = with[4] - without[4];
    assert!(extra < shards / 4, "prefetch keeps {extra} more bytes alive between steps (shards: {shards})");
}

/// Activation checkpointing keeps only each layer's input through forward: the live bytes
/// when forward ends (before backward) fall by the activations of the layers, and the
/// gradients are the same (single device; tests/tests/fsdp_core.rs checks FSDP training).
#[test]
fn activation_checkpointing_keeps_only_layer_inputs() {
    let _serial = tests::alloc::exclusive();
    use burn::optim::GradientsParams;
    use qwen3_burn::train::{chunked_cross_entropy, inputs_and_labels};
    type AB = Autodiff<NdArray<f32>>;
    let device = Default::default();
    let mut config = config();
    config.num_hidden_layers = 4;
    config.max_position_embeddings = 256;
    let model = Qwen3::<AB>::new_seeded(&config, qwen3_burn::Qwen3Init::new(3), &device);
    let (rows, seq) = (2, 256);
    let v = config.vocab_size as i64;
    let tokens: Vec<i64> = (0..rows * (seq + 1)).map(|i| (i as i64 * 7 + 3) % v).collect();
    let tokens =
        Tensor::<AB, 2, Int>::from_data(burn::tensor::TensorData::new(tokens, [rows, seq + 1]), &device);
    let (inputs, labels) = inputs_and_labels(tokens);
    // Touch every parameter once (lazy initialisation) before measuring.
    let _ = model.forward(inputs.clone().narrow(1, 0, 1));
    let loss_of =
        |m: &Qwen3<AB>, h: Tensor<AB, 3>| chunked_cross_entropy(h, m.head_weight(), labels.clone(), 64);
    let base = tests::alloc::live();
    let loss = loss_of(&model, model.hidden_with(inputs.clone(), &mut burn_fsdp::Direct));
    let kept_plain = tests::alloc::live() - base;
    let plain = GradientsParams::from_grads(loss.backward(), &model);
    let base = tests::alloc::live();
    let run = burn_fsdp::activation_checkpointing::checkpointed(|r| {
        loss_of(&model, model.hidden_with(inputs.clone(), r))
    });
    let kept_ac = tests::alloc::live() - base;
    assert_eq!(run.num_checkpointed(), config.num_hidden_layers);
    let ac = run.gradients(&model);
    // What checkpointing may keep: each layer's input and output leaf ([rows, seq, hidden]
    // each), the final norm's input and output, the loss's gradient of the hidden states
    // (hidden-sized) and of the logits ([rows · seq, vocab], kept for the head's gradient,
    // which backward makes).
    let act = (rows * seq * config.hidden_size * 4) as isize;
    let logits = (rows * seq * config.vocab_size * 4) as isize;
    eprintln!("kept after forward: {kept_plain} B without checkpointing, {kept_ac} B with");
    assert!(
        kept_ac <= 2 * act * config.num_hidden_layers as isize + 3 * act + logits,
        "checkpointed forward kept {kept_ac} B"
    );
    assert!(kept_ac * 3 < kept_plain, "checkpointing kept {kept_ac} B, plain {kept_plain} B");
    // Same gradients.
    struct Compare<'a>(&'a GradientsParams, &'a GradientsParams, usize);
    impl burn::module::ModuleVisitor<AB> for Compare<'_> {
        fn visit_float<const D: usize>(&mut self, p: &burn::module::Param<Tensor<AB, D>>) {
            let a = self.0.get::<NdArray<f32>, D>(p.id).unwrap().into_data().to_vec::<f32>().unwrap();
            let b = self.1.get::<NdArray<f32>, D>(p.id).unwrap().into_data().to_vec::<f32>().unwrap();
            let num: f64 = a.iter().zip(&b).map(|(a, b)| ((a - b) as f64).powi(2)).sum();
            let den: f64 = a.iter().map(|a| (*a as f64).powi(2)).sum();
            assert!((num / den.max(1e-30)).sqrt() < 1e-6, "a gradient differs: {}", (num / den).sqrt());
            self.2 += 1;
        }
    }
    let mut cmp = Compare(&plain, &ac, 0);
    model.visit(&mut cmp);
    assert!(cmp.2 > 0);
}

/// Burn's `XConfig::init` makes every parameter lazy; `Fsdp::wrap` materialises them one at a
/// time, broadcasting rank 0's value and cutting this rank's rows before the next: the live
/// bytes during the wrap never exceed each rank's shards plus a few full parameters (the
/// value, its broadcast copy, the rows cut out). Materialising the model first — what the
/// wrap did before — holds the whole model on every rank: `LAYERS` full parameters each.
#[test]
fn wrapping_a_model_fresh_from_config_init_holds_one_full_parameter_at_a_time() {
    use burn::nn::{Linear, LinearConfig};
    const LAYERS: usize = 16;
    const WIDTH: usize = 256;
    const WORLD: usize = 4;
    #[derive(Module, Debug)]
    struct Stack<B: burn::tensor::backend::Backend> {
        layers: Vec<Linear<B>>,
    }
    let _serial = tests::alloc::exclusive();
    let param = (WIDTH * WIDTH * 4) as isize;
    let probes = burn_fsdp::LocalGroup::new_group(WORLD, Duration::from_secs(60));
    let baseline = Mutex::new(0isize);
    let peaks = launch(WORLD, Duration::from_secs(60), |fsdp_group| {
        let group = probes[fsdp_group.rank()].clone();
        let device = Default::default();
        let model = Stack::<FB> {
            layers: (0..LAYERS)
                .map(|_| LinearConfig::new(WIDTH, WIDTH).with_bias(false).init(&device))
                .collect(),
        };
        let mesh = DeviceMesh::new_1d(fsdp_group, device);
        burn_fsdp::ProcessGroup::<NdArray<f32>>::barrier(&*group, &"built".into())?;
        if group.rank() == 0 {
            *baseline.lock().unwrap() = tests::alloc::live();
            tests::alloc::reset_peak();
        }
        burn_fsdp::ProcessGroup::<NdArray<f32>>::barrier(&*group, &"measure".into())?;
        let fsdp = Fsdp::wrap(model, &mesh, FsdpConfig { prefetch: false, ..FsdpConfig::default() })?;
        burn_fsdp::ProcessGroup::<NdArray<f32>>::barrier(&*group, &"wrapped".into())?;
        let peak = tests::alloc::peak();
        let shard_bytes = 4 * fsdp.units().iter().map(|u| u.numel()).sum::<usize>() as isize / WORLD as isize;
        Ok::<_, burn_fsdp::FsdpError>((peak, shard_bytes))
    })
    .unwrap();
    let (peak, shard_bytes) = peaks[0];
    let grew = peak - *baseline.lock().unwrap();
    let whole_models = (WORLD * LAYERS) as isize * param;
    let bound = WORLD as isize * (shard_bytes + 4 * param);
    assert_eq!(shard_bytes, LAYERS as isize * param / WORLD as isize);
    eprintln!("the wrap grew the live bytes by {grew} ({:.1} full parameters)", grew as f64 / param as f64);
    assert!(
        grew <= bound,
        "the wrap's live bytes grew by {grew} (≈ {:.1} full parameters); the shards and four full \
         parameters per rank are {bound}, a whole model per rank {whole_models}",
        grew as f64 / param as f64
    );
}

/// A link whose reduce-scatters take `delay` longer than the in-process group's.
struct SlowReduceScatter {
    inner: std::sync::Arc<burn_fsdp::LocalGroup>,
    delay: Duration,
}

impl burn_fsdp::ProcessGroup<NdArray<f32>> for SlowReduceScatter {
    fn rank(&self) -> usize {
        burn_fsdp::ProcessGroup::<NdArray<f32>>::rank(&*self.inner)
    }
    fn size(&self) -> usize {
        burn_fsdp::ProcessGroup::<NdArray<f32>>::size(&*self.inner)
    }
    fn stats(&self) -> burn_fsdp::CommStats {
        burn_fsdp::ProcessGroup::<NdArray<f32>>::stats(&*self.inner)
    }
    fn all_gather(
        &self,
        input: Tensor<NdArray<f32>, 1>,
        tag: &burn_fsdp::Tag,
    ) -> Result<Tensor<NdArray<f32>, 1>, burn_fsdp::CommError> {
        self.inner.all_gather(input, tag)
    }
    fn reduce_scatter(
        &self,
        input: Tensor<NdArray<f32>, 1>,
        op: burn_fsdp::ReduceOp,
        tag: &burn_fsdp::Tag,
    ) -> Result<Tensor<NdArray<f32>, 1>, burn_fsdp::CommError> {
        std::thread::sleep(self.delay);
        self.inner.reduce_scatter(input, op, tag)
    }
    fn all_reduce(
        &self,
        input: Tensor<NdArray<f32>, 1>,
        op: burn_fsdp::ReduceOp,
        tag: &burn_fsdp::Tag,
    ) -> Result<Tensor<NdArray<f32>, 1>, burn_fsdp::CommError> {
        self.inner.all_reduce(input, op, tag)
    }
    fn broadcast(
        &self,
        input: Tensor<NdArray<f32>, 1>,
        root: usize,
        tag: &burn_fsdp::Tag,
    ) -> Result<Tensor<NdArray<f32>, 1>, burn_fsdp::CommError> {
        self.inner.broadcast(input, root, tag)
    }
    fn barrier(&self, tag: &burn_fsdp::Tag) -> Result<(), burn_fsdp::CommError> {
        burn_fsdp::ProcessGroup::<NdArray<f32>>::barrier(&*self.inner, tag)
    }
    fn abort(&self, reason: &str) {
        burn_fsdp::ProcessGroup::<NdArray<f32>>::abort(&*self.inner, reason)
    }
}

/// One backward over `layers` units of one 256 × 256 weight each at W = 2, with
/// reduce-scatters 20 ms slower than the backward's compute: the live bytes it adds at its
/// peak beyond the sharded gradients it returns (half a weight per unit and rank), one weight's
/// bytes, and the most reduce-scatters that were in flight at once.
fn backward_peak(layers: usize, max_inflight: usize, reshard: bool) -> (isize, isize, u64) {
    use burn::nn::Linear;
    use burn_fsdp::FsdpUnit;
    const WIDTH: usize = 256;
    #[derive(Module, Debug)]
    struct Stack<B: burn::tensor::backend::Backend> {
        layers: Vec<FsdpUnit<Linear<B>>>,
    }
    let probes = burn_fsdp::LocalGroup::new_group(2, Duration::from_secs(60));
    let baseline = Mutex::new(0isize);
    let in_flight = launch(2, Duration::from_secs(120), |fsdp_group| {
        let group = probes[fsdp_group.rank()].clone();
        let device = Default::default();
        let model = Stack::<FB> {
            layers: (0..layers)
                .map(|_| {
                    FsdpUnit::new(burn::nn::LinearConfig::new(WIDTH, WIDTH).with_bias(false).init(&device))
                })
                .collect(),
        };
        let slow =
            std::sync::Arc::new(SlowReduceScatter { inner: fsdp_group, delay: Duration::from_millis(20) });
        let mesh = DeviceMesh::new_1d(slow, device);
        let config = FsdpConfig {
            max_inflight_reduce_scatters: max_inflight,
            reshard_after_forward: reshard,
            ..FsdpConfig::default()
        };
        let fsdp = Fsdp::wrap(model, &mesh, config)?;
        let x = Tensor::<FB, 2>::ones([4, WIDTH], &device);
        let run = || {
            fsdp.forward(|m, _| {
                let mut h = x.clone();
                for layer in &m.layers {
                    h = layer.run(h, |l, h| l.forward(h));
                }
                h.sum()
            })
        };
        // A warm-up step: lazily created buffers join the baseline.
        let _ = fsdp.gradients(run().backward());
        let loss = run();
        burn_fsdp::ProcessGroup::<NdArray<f32>>::barrier(&*group, &"forward".into())?;
        if group.rank() == 0 {
            *baseline.lock().unwrap() = tests::alloc::live();
            tests::alloc::reset_peak();
        }
        burn_fsdp::ProcessGroup::<NdArray<f32>>::barrier(&*group, &"measure".into())?;
        let grads = fsdp.gradients(loss.backward());
        burn_fsdp::ProcessGroup::<NdArray<f32>>::barrier(&*group, &"backward".into())?;
        drop(grads);
        Ok::<_, burn_fsdp::FsdpError>(fsdp.prefetch_stats().map_or(0, |s| s.max_reduce_scatters_in_flight))
    })
    .unwrap();
    let unit = (WIDTH * WIDTH * 4) as isize;
    // Both ranks' sharded gradients: half a weight each, per unit.
    let sharded = layers as isize * unit;
    let most = in_flight.into_iter().max().unwrap_or(0);
    (tests::alloc::peak() - *baseline.lock().unwrap() - sharded, unit, most)
}

/// FSDP2's bound on reduce-scatters in flight. With a link slower than the backward and
/// parameters kept gathered (no re-gather in backward queues behind the reduce-scatters), an
/// unbounded queue takes up nearly every unit's full gradient; the default bound keeps 2 in
/// flight. And under the default config a backward's peak memory beyond the sharded gradients
/// it returns is the same for 4 and 16 units.
#[test]
fn reduce_scatters_in_flight_are_bounded_so_peak_memory_does_not_grow_with_units() {
    let _serial = tests::alloc::exclusive();
    let (_, _, unbounded) = backward_peak(16, usize::MAX, false);
    let (_, _, bounded) = backward_peak(16, 2, false);
    let (few, unit, _) = backward_peak(4, 2, true);
    let (many, _, _) = backward_peak(16, 2, true);
    let units = |b: isize| b as f64 / unit as f64;
    eprintln!(
        "reduce-scatters in flight at most: unbounded {unbounded}, bounded {bounded}; backward peak beyond \
         the sharded gradients (layer weights, both ranks): 4 units {:.1}, 16 units {:.1}",
        units(few),
        units(many)
    );
    assert!(unbounded >= 8, "without a bound the queue grows with the units: {unbounded} in flight");
    assert!(bounded <= 2, "the default bound: {bounded} in flight");
    assert!((many - few).abs() <= 2 * unit, "peak: 16 units {:.1}, 4 units {:.1}", units(many), units(few));
}
