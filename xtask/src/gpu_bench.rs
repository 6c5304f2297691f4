//! `cargo xtask gpu-bench` (feature `cuda-proxy`): Qwen3 training throughput on an NVIDIA GPU
//! through the MetaX runtime's CUDA proxy — tokens/s, MFU, and the overhead of FSDP at W = 1.
//!
//! Prepared for an H200-class machine (`scripts/gpu-h200.sh` runs it and writes the figures
//! to a file for docs/); where no CUDA device is present it says so and exits with status 3.
//!
//! MFU = 6 · Ψ · tokens / time / peak, with `--peak-tflops` the device's dense peak for the
//! dtype (H200 SXM: 989 TFLOPS bf16, 67 TFLOPS fp32 without TF32).

use std::sync::Arc;
use std::time::Instant;

use anyhow::{Context, Result, bail};
use burn::backend::Autodiff;
use burn::backend::autodiff::checkpoint::strategy::BalancedCheckpointing;
use burn::optim::GradientsParams;
use burn::tensor::backend::Backend as _;
use burn::tensor::{DType, Int, Tensor, TensorData};
use burn_fsdp::{DeviceMesh, Fsdp, FsdpConfig, LocalGroup, MixedPrecisionPolicy, ProcessGroup};
use burn_metax_backend::{CudaProxy, CudaProxyRuntime};
use qwen3_burn::Qwen3Config;
use qwen3_burn::train::{cross_entropy, inputs_and_labels};

/// Arguments of `gpu-bench`.
#[derive(Debug, Clone, clap::Args)]
pub struct GpuBenchArgs {
    /// Model shapes (a `--preset` of train-qwen3).
    #[arg(long, default_value = "0.6b")]
    pub preset: String,
    /// Sequences per step.
    #[arg(long, default_value_t = 4)]
    pub batch: usize,
    /// Tokens per sequence.
    #[arg(long, default_value_t = 1024)]
    pub seq: usize,
    /// Timed steps (after one warm-up step).
    #[arg(long, default_value_t = 5)]
    pub steps: usize,
    /// Dense peak of the device in TFLOPS for bf16 (MFU denominator).
    #[arg(long, default_value_t = 989.0)]
    pub peak_tflops: f64,
    /// Write the figures (`name: value` lines) to this file as well.
    #[arg(long)]
    pub out: Option<std::path::PathBuf>,
}

type Gpu = CudaProxy<f32>;
type Train = Autodiff<Gpu, BalancedCheckpointing>;

fn tokens(
    config: &Qwen3Config,
    batch: usize,
    seq: usize,
    step: usize,
    device: &burn::tensor::Device<Gpu>,
) -> Tensor<Train, 2, Int> {
    let v: Vec<i64> =
        (0..batch * (seq + 1)).map(|i| ((i * 7919 + step * 104_729) % config.vocab_size) as i64).collect();
    Tensor::from_data(TensorData::new(v, [batch, seq + 1]), device)
}

/// Seconds per step of `steps` timed steps (one warm-up first), for no FSDP (`fsdp` = None)
/// or FSDP over one rank with `mp` mixed precision.
fn time_steps(config: &Qwen3Config, args: &GpuBenchArgs, fsdp: Option<MixedPrecisionPolicy>) -> Result<f64> {
    let device = CudaProxyRuntime::first_device().map_err(|e| anyhow::anyhow!("{e}"))?;
    let model = config.init::<Train>(&device);
    let mut optim =
        burn_fsdp::TorchAdamWConfig { lr: 1e-4, betas: (0.9, 0.95), eps: 1e-8, weight_decay: 0.1 }.init();
    let group: Arc<dyn ProcessGroup<Gpu>> =
        LocalGroup::new_group(1, std::time::Duration::from_secs(600)).pop().context("no rank")?;
    let mesh = DeviceMesh::new_1d(group, device);
    let (mut wrapped, mut plain) = match fsdp {
        Some(mp_policy) => {
            (Some(Fsdp::wrap(model, &mesh, FsdpConfig { mp_policy, ..FsdpConfig::default() })?), None)
        }
        None => (None, Some(model)),
    };
    let mut start = Instant::now();
    for step in 0..=args.steps {
        if step == 1 {
            Gpu::sync(&device).map_err(|e| anyhow::anyhow!("{e:?}"))?;
            start = Instant::now();
        }
        let (inputs, labels) = inputs_and_labels(tokens(config, args.batch, args.seq, step, &device));
        if let Some(f) = wrapped.as_mut() {
            let logits = f.forward(|m, runner| m.forward_with(inputs, runner));
            let grads = f.gradients(cross_entropy(logits, labels).backward());
            f.step(&mut optim, grads);
        } else if let Some(m) = plain.take() {
            let loss = cross_entropy(m.forward(inputs), labels);
            let grads = GradientsParams::from_grads(loss.backward(), &m);
            plain = Some(optim.step(m, grads));
        }
    }
    Gpu::sync(&device).map_err(|e| anyhow::anyhow!("{e:?}"))?;
    Ok(start.elapsed().as_secs_f64() / args.steps.max(1) as f64)
}

/// Runs the benchmark; `Ok(false)` when no CUDA device is present (after saying why).
pub fn run(args: &GpuBenchArgs) -> Result<bool> {
    if let Err(e) = CudaProxyRuntime::first_device() {
        println!("gpu-bench: skipped: {e}");
        return Ok(false);
    }
    if args.steps == 0 || args.batch == 0 || args.seq == 0 {
        bail!("--steps, --batch and --seq must be at least 1");
    }
    let config = Qwen3Config::preset(&args.preset)
        .with_context(|| format!("--preset `{}` is unknown (tiny, 0.6b, 1.7b, 4b, 8b)", args.preset))?;
    let psi = config.num_params() as f64;
    let tokens = (args.batch * args.seq) as f64;
    let single = time_steps(&config, args, None)?;
    let fsdp_f32 = time_steps(&config, args, Some(MixedPrecisionPolicy::default()))?;
    let bf16 = MixedPrecisionPolicy {
        param_dtype: Some(DType::BF16),
        reduce_dtype: Some(DType::F32),
        output_dtype: None,
    };
    let fsdp_bf16 = time_steps(&config, args, Some(bf16))?;
    let mfu = |secs: f64, peak: f64| 6.0 * psi * tokens / secs / (peak * 1e12);
    let lines = [
        format!("gpu_bench_params: {psi:.0}"),
        format!("gpu_bench_tokens_per_step: {tokens:.0}"),
        format!("cuda_proxy_no_fsdp_f32_tokens_per_sec: {:.1}", tokens / single),
        format!("cuda_proxy_fsdp_w1_f32_tokens_per_sec: {:.1}", tokens / fsdp_f32),
        format!("cuda_proxy_fsdp_w1_bf16_tokens_per_sec: {:.1}", tokens / fsdp_bf16),
        format!("fsdp_w1_vs_no_fsdp_tokens_per_sec_ratio: {:.3}", single / fsdp_f32),
        format!("cuda_proxy_fsdp_w1_bf16_mfu: {:.4}", mfu(fsdp_bf16, args.peak_tflops)),
    ];
    for l in &lines {
        println!("{l}");
    }
    if let Some(path) = &args.out {
        std::fs::write(path, lines.join("\n") + "\n")
            .with_context(|| format!("writing {}", path.display()))?;
    }
    Ok(true)
}
