//! `cargo xtask gpu-bench` (feature `cuda-proxy`): Qwen3 training throughput on an NVIDIA GPU
//! through the MetaX runtime's CUDA proxy — tokens/s, MFU, the overhead of FSDP at W = 1 — and,
//! with feature `burn-cuda`, the same steps side by side on Burn's own CUDA backend
//! (`CubeBackend<CudaRuntime>`: the same CubeCL kernels on Tracel's server), so that
//! `cuda_proxy_vs_burn_cuda_fsdp_w1_bf16_tokens_per_sec_ratio` measures our server alone; and
//! both under Burn's kernel fusion.
//!
//! Run by `scripts/gpu-check.sh` from the GPU pack; where no CUDA device is present it says so
//! and exits with status 3. `--device metax` runs our server's variants on a MetaX GPU instead,
//! and `--device metax-emu` on the emulated MetaX device (a CPU: its figures say nothing of a
//! GPU's speed; CI runs it so that every line the GPU run prints is produced and checked). A variant that fails (an error or a panic in a kernel) prints
//! `name: failed (why)` and the others still run; the command then exits non-zero.
//!
//! MFU = 6 · Ψ · tokens / time / peak, with `--peak-tflops` the device's dense peak for the
//! dtype (H200 SXM: 989 TFLOPS bf16, 67 TFLOPS fp32 without TF32).
//!
//! For the proxy's runs, one more step runs with the device's kernel timers on (a timing event
//! before and after each launch, `burn_metax_backend::runtime::set_kernel_timing`), and
//! `{run}_kernel_share` is that step's kernel time over the timed steps' mean wall time: the
//! share of a step the device spends in kernels, the rest being time it waits for the host.
//! Collective libraries' own kernels and copies are not in it (none at W = 1).

use std::sync::Arc;
use std::time::Instant;

use anyhow::{Context, Result, bail};
use burn::backend::Autodiff;
use burn::backend::autodiff::checkpoint::strategy::BalancedCheckpointing;
use burn::module::{Module, ModuleMapper, Param};
use burn::optim::GradientsParams;
use burn::tensor::backend::{AutodiffBackend, Backend};
use burn::tensor::{DType, Int, Tensor, TensorData};
use burn_fsdp::{DeviceMesh, Fsdp, FsdpConfig, LocalGroup, MixedPrecisionPolicy, ProcessGroup};
use burn_metax_backend::runtime::{
    KernelTime, MacaPlatform, MetaxEmuPlatform, Platform, set_kernel_timing, take_kernel_time,
};
#[cfg(feature = "cuda-proxy")]
use burn_metax_backend::{CudaProxy, CudaProxyDevice, CudaProxyRuntime};
use burn_metax_backend::{MacaRuntime, Metax, MetaxDevice, MetaxEmu, MetaxEmuDevice, MetaxEmuRuntime};
use qwen3_burn::Qwen3Config;
use qwen3_burn::train::{cross_entropy, inputs_and_labels};

/// Where the runs of our server go (`--device`).
#[derive(Debug, Clone, Copy, PartialEq, Eq, clap::ValueEnum)]
pub enum BenchDevice {
    /// An NVIDIA GPU through the MetaX runtime's CUDA proxy (builds with feature `cuda-proxy`).
    CudaProxy,
    /// A MetaX GPU (the MACA runtime, loaded at run time).
    Metax,
    /// The emulated MetaX device (kernels run on the CPU).
    MetaxEmu,
}

impl BenchDevice {
    /// The prefix of the device's figures: `cuda_proxy`, `metax` or `metax_emu`.
    pub fn name(self) -> &'static str {
        match self {
            Self::CudaProxy => "cuda_proxy",
            Self::Metax => "metax",
            Self::MetaxEmu => "metax_emu",
        }
    }

    /// The device's platform (`runtime::Platform::NAME`), whose kernel timers our runs read.
    fn platform(self) -> &'static str {
        match self {
            #[cfg(feature = "cuda-proxy")]
            Self::CudaProxy => burn_metax_backend::runtime::CudaProxyPlatform::NAME,
            // Not in this build: no run reads its timers.
            #[cfg(not(feature = "cuda-proxy"))]
            Self::CudaProxy => "cuda-proxy",
            Self::Metax => MacaPlatform::NAME,
            Self::MetaxEmu => MetaxEmuPlatform::NAME,
        }
    }

    /// `Err` when the build lacks the device; `Ok(Err(why))` when the machine has none.
    fn available(self) -> Result<std::result::Result<(), String>> {
        let found = match self {
            #[cfg(feature = "cuda-proxy")]
            Self::CudaProxy => CudaProxyRuntime::first_device().map(|_| ()),
            #[cfg(not(feature = "cuda-proxy"))]
            Self::CudaProxy => bail!("--device cuda-proxy: not in this build (needs feature cuda-proxy)"),
            Self::Metax => MacaRuntime::first_device().map(|_| ()),
            Self::MetaxEmu => MetaxEmuRuntime::first_device().map(|_| ()),
        };
        Ok(found.map_err(|e| e.to_string()))
    }
}

/// Arguments of `gpu-bench`.
#[derive(Debug, Clone, clap::Args)]
pub struct GpuBenchArgs {
    /// The device of our server's runs (`cuda_proxy*` in `--variants`, named after the device
    /// in the figures). Burn's CUDA runs need `cuda-proxy`.
    #[arg(long, value_enum, default_value = "cuda-proxy")]
    pub device: BenchDevice,
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
    /// Write which kernel CubeCL's autotune chose for each key, with the three best candidates'
    /// times, to this file (`runtime::log_autotune_choices`; builds with autotune, such as the
    /// GPU pack): whether the tensor-core matmuls won.
    #[arg(long)]
    pub autotune_log: Option<std::path::PathBuf>,
    /// Which runs to measure, comma-separated: `cuda_proxy` (our server on `--device`),
    /// `burn_cuda`, `cuda_proxy_fused`, `burn_cuda_fused` (FSDP W = 1, bf16 mixed precision
    /// each), `bf16` (our server without FSDP, all in bf16) and `f32` (our server without FSDP
    /// and with FSDP at W = 1, f32). All by default; the two `burn_cuda*` and the fused ones
    /// need a build with `burn-cuda`.
    #[arg(
        long,
        value_delimiter = ',',
        default_value = "cuda_proxy,burn_cuda,cuda_proxy_fused,burn_cuda_fused,bf16,f32"
    )]
    pub variants: Vec<String>,
}

/// The names `--variants` accepts.
pub const VARIANTS: [&str; 6] =
    ["cuda_proxy", "burn_cuda", "cuda_proxy_fused", "burn_cuda_fused", "bf16", "f32"];

/// How long a run took: the warm-up (model init and the first step, which compiles and
/// autotunes every kernel) and each timed step after it.
#[derive(Debug, Clone, Copy)]
struct Timing {
    warmup_s: f64,
    step_s: f64,
    /// The device's kernel time in one more step, timed by the device's own timers
    /// (`burn_metax_backend::runtime::take_kernel_time`); our backends only.
    kernels: Option<KernelTime>,
}

/// How a run trains.
#[derive(Debug, Clone, Copy)]
enum Mode {
    /// Without FSDP, every parameter (hence activations, gradients and AdamW's moments) in this
    /// dtype: `BF16` is a bf16 step without FSDP's casts and f32 master weights (Burn has no
    /// autocast).
    Plain(DType),
    /// FSDP over one rank under this mixed-precision policy.
    Fsdp(MixedPrecisionPolicy),
}

/// Casts every float parameter to a dtype, keeping it trainable.
struct CastParams(DType);

impl<B: AutodiffBackend> ModuleMapper<B> for CastParams {
    fn map_float<const D: usize>(&mut self, param: Param<Tensor<B, D>>) -> Param<Tensor<B, D>> {
        let dtype = self.0;
        param.map(|t| {
            let grad = t.is_require_grad();
            // Cast outside the graph, so that the parameter stays a leaf.
            let t = Tensor::from_inner(t.inner().cast(dtype));
            if grad { t.require_grad() } else { t }
        })
    }
}

/// Whose kernel timers a run reads: a platform's name and the device ordinal.
type Timers = Option<(&'static str, usize)>;

/// Where one variant runs: its key in `--variants`, its name in the figures, and a function
/// timing its steps.
struct Variant {
    key: &'static str,
    name: String,
    time: fn(&Qwen3Config, &GpuBenchArgs, Mode) -> Result<Timing>,
}

fn tokens<B: Backend>(
    config: &Qwen3Config,
    batch: usize,
    seq: usize,
    step: usize,
    device: &B::Device,
) -> Tensor<Autodiff<B, BalancedCheckpointing>, 2, Int> {
    let v: Vec<i64> =
        (0..batch * (seq + 1)).map(|i| ((i * 7919 + step * 104_729) % config.vocab_size) as i64).collect();
    Tensor::from_data(TensorData::new(v, [batch, seq + 1]), device)
}

/// Seconds of the warm-up (model init and one step, which also autotunes) and per step of
/// `steps` timed steps after it, on backend `B` at `device`, as `mode` says. With `timers`, one more step runs with the
/// device's kernel timers on (two events per launch cost host time, so that step is not among
/// the timed ones) and its kernel time is returned.
fn time_steps<B: Backend>(
    device: B::Device,
    config: &Qwen3Config,
    args: &GpuBenchArgs,
    mode: Mode,
    timers: Timers,
) -> Result<Timing> {
    let begin = Instant::now();
    let mut warmup_s = 0.0;
    let model = config.init::<Autodiff<B, BalancedCheckpointing>>(&device);
    let mut optim =
        burn_fsdp::TorchAdamWConfig { lr: 1e-4, betas: (0.9, 0.95), eps: 1e-8, weight_decay: 0.1 }.init();
    let group: Arc<dyn ProcessGroup<B>> =
        LocalGroup::new_group(1, std::time::Duration::from_secs(600)).pop().context("no rank")?;
    let mesh = DeviceMesh::new_1d(group, device.clone());
    let (mut wrapped, mut plain) = match mode {
        Mode::Fsdp(mp_policy) => (
            Some(Fsdp::wrap(
                model,
                &mesh,
                FsdpConfig {
                    units: qwen3_burn::parallelize::fsdp_units(),
                    mp_policy,
                    ..FsdpConfig::default()
                },
            )?),
            None,
        ),
        Mode::Plain(DType::F32) => (None, Some(model)),
        Mode::Plain(dtype) => (None, Some(model.map(&mut CastParams(dtype)))),
    };
    let mut train_step = |step: usize| {
        let (inputs, labels) = inputs_and_labels(tokens::<B>(config, args.batch, args.seq, step, &device));
        if let Some(f) = wrapped.as_mut() {
            let logits = f.forward(|m, runner| m.forward_with(inputs, runner));
            let grads = f.gradients(cross_entropy(logits, labels).backward());
            f.step(&mut optim, grads);
        } else if let Some(m) = plain.take() {
            let loss = cross_entropy(m.forward(inputs), labels);
            let grads = GradientsParams::from_grads(loss.backward(), &m);
            plain = Some(optim.step(m, grads));
        }
    };
    let sync = || B::sync(&device).map_err(|e| anyhow::anyhow!("{e:?}"));
    let mut start = Instant::now();
    for step in 0..=args.steps {
        if step == 1 {
            sync()?;
            start = Instant::now();
            warmup_s = begin.elapsed().as_secs_f64();
        }
        train_step(step);
    }
    sync()?;
    let step_s = start.elapsed().as_secs_f64() / args.steps.max(1) as f64;
    let kernels = match timers {
        Some((platform, index)) => {
            set_kernel_timing(platform, index, true);
            let measured = take_kernel_time(platform, index)
                .map_err(anyhow::Error::from)
                .and_then(|_| {
                    train_step(args.steps + 1);
                    sync()
                })
                .and_then(|()| Ok(take_kernel_time(platform, index)?));
            set_kernel_timing(platform, index, false);
            Some(measured.context("the kernel timers")?)
        }
        None => None,
    };
    Ok(Timing { warmup_s, step_s, kernels })
}

/// Our server on `args.device`, with its kernel timers.
fn ours(config: &Qwen3Config, args: &GpuBenchArgs, mode: Mode) -> Result<Timing> {
    let timers = Some((args.device.platform(), 0));
    match args.device {
        #[cfg(feature = "cuda-proxy")]
        BenchDevice::CudaProxy => {
            time_steps::<CudaProxy<f32>>(CudaProxyDevice::new(0), config, args, mode, timers)
        }
        #[cfg(not(feature = "cuda-proxy"))]
        BenchDevice::CudaProxy => bail!("--device cuda-proxy: not in this build (needs feature cuda-proxy)"),
        BenchDevice::Metax => time_steps::<Metax<f32>>(MetaxDevice::new(0), config, args, mode, timers),
        BenchDevice::MetaxEmu => {
            time_steps::<MetaxEmu<f32>>(MetaxEmuDevice::new(0), config, args, mode, timers)
        }
    }
}

/// Our server on `args.device` under Burn's kernel fusion.
#[cfg(feature = "burn-cuda")]
fn ours_fused(config: &Qwen3Config, args: &GpuBenchArgs, mode: Mode) -> Result<Timing> {
    use burn_metax_backend::{CudaProxyFused, MetaxEmuFused, MetaxFused};
    let timers = Some((args.device.platform(), 0));
    match args.device {
        BenchDevice::CudaProxy => {
            time_steps::<CudaProxyFused<f32>>(CudaProxyDevice::new(0), config, args, mode, timers)
        }
        BenchDevice::Metax => time_steps::<MetaxFused<f32>>(MetaxDevice::new(0), config, args, mode, timers),
        BenchDevice::MetaxEmu => {
            time_steps::<MetaxEmuFused<f32>>(MetaxEmuDevice::new(0), config, args, mode, timers)
        }
    }
}

/// Burn's CUDA backend without fusion: the same CubeCL kernels as the proxy, Tracel's server.
#[cfg(feature = "burn-cuda")]
fn burn_cuda(config: &Qwen3Config, args: &GpuBenchArgs, mode: Mode) -> Result<Timing> {
    type Plain = burn_cubecl::CubeBackend<cubecl::cuda::CudaRuntime, f32, i32, u8>;
    time_steps::<Plain>(burn_cuda::CudaDevice::new(0), config, args, mode, None)
}

/// Burn's CUDA backend as users get it (`burn_cuda::Cuda`: fusion on).
#[cfg(feature = "burn-cuda")]
fn burn_cuda_fused(config: &Qwen3Config, args: &GpuBenchArgs, mode: Mode) -> Result<Timing> {
    time_steps::<burn_cuda::Cuda<f32>>(burn_cuda::CudaDevice::new(0), config, args, mode, None)
}

/// The figures: printed, and written line by line to `--out` as they come, so that a run cut
/// short by a timeout leaves the figures it has.
struct Figures {
    file: Option<(std::path::PathBuf, std::fs::File)>,
    /// The first failed write, reported by [`Figures::finish`].
    error: Option<anyhow::Error>,
}

impl Figures {
    fn create(path: Option<&std::path::Path>) -> Result<Self> {
        let file = match path {
            Some(p) => Some((
                p.to_path_buf(),
                std::fs::File::create(p).with_context(|| format!("--out: creating {}", p.display()))?,
            )),
            None => None,
        };
        Ok(Self { file, error: None })
    }

    fn emit(&mut self, line: String) {
        use std::io::Write;
        println!("{line}");
        if let (Some((path, file)), None) = (&mut self.file, &self.error)
            && let Err(e) = writeln!(file, "{line}").and_then(|()| file.flush())
        {
            self.error = Some(anyhow::Error::new(e).context(format!("writing {}", path.display())));
        }
    }

    fn finish(self) -> Result<()> {
        self.error.map_or(Ok(()), Err)
    }
}

/// Runs `f`, turning a panic (a kernel that failed to compile or launch) into an error.
fn guarded(f: impl FnOnce() -> Result<Timing>) -> Result<Timing> {
    match std::panic::catch_unwind(std::panic::AssertUnwindSafe(f)) {
        Ok(result) => result,
        Err(panic) => {
            let why = panic
                .downcast_ref::<String>()
                .cloned()
                .or_else(|| panic.downcast_ref::<&str>().map(|s| s.to_string()))
                .unwrap_or_else(|| "a panic".to_string());
            bail!("panicked: {why}")
        }
    }
}

/// Runs the benchmark; `Ok(false)` when the machine has no device of `--device` (after saying
/// why). Fails (after printing every figure it has) when a variant failed.
pub fn run(args: &GpuBenchArgs) -> Result<bool> {
    if let Some(v) = args.variants.iter().find(|v| !VARIANTS.contains(&v.as_str())) {
        bail!("--variants: unknown `{v}` (one or more of {})", VARIANTS.join(", "));
    }
    // Before any client starts: CubeCL reads its configuration once.
    if let Some(path) = &args.autotune_log {
        burn_metax_backend::runtime::log_autotune_choices(path)
            .map_err(|e| anyhow::anyhow!("--autotune-log: {e}"))?;
    }
    if let Err(e) = args.device.available()? {
        println!("gpu-bench: skipped: {e}");
        return Ok(false);
    }
    if args.steps == 0 || args.batch == 0 || args.seq == 0 {
        bail!("--steps, --batch and --seq must be at least 1");
    }
    let wanted = |name: &str| args.variants.iter().any(|v| v == name);
    let config = Qwen3Config::preset(&args.preset)
        .with_context(|| format!("--preset `{}` is unknown (tiny, 0.6b, 1.7b, 4b, 8b)", args.preset))?;
    let psi = config.num_params() as f64;
    let tokens = (args.batch * args.seq) as f64;
    let bf16 = MixedPrecisionPolicy {
        param_dtype: Some(DType::BF16),
        reduce_dtype: Some(DType::F32),
        output_dtype: None,
    };
    let mut out = Figures::create(args.out.as_deref())?;
    out.emit(format!("gpu_bench_params: {psi:.0}"));
    out.emit(format!("gpu_bench_tokens_per_step: {tokens:.0}"));
    let mfu = |secs: f64| 6.0 * psi * tokens / secs / (args.peak_tflops * 1e12);
    let mut failed = Vec::new();
    // name → seconds per step, for the ratios.
    let mut secs = std::collections::BTreeMap::new();
    let mut measure = |name: &str, run: &dyn Fn() -> Result<Timing>, out: &mut Figures| match guarded(run) {
        Ok(t) => {
            secs.insert(name.to_string(), t.step_s);
            // The warm-up (compiling and autotuning every kernel) on a line of its own.
            out.emit(format!("{name}_warmup_seconds: {:.1}", t.warmup_s));
            // The device's time in kernels against the step's wall time (the rest: the device
            // waiting for the host).
            if let Some(k) = t.kernels {
                out.emit(format!("{name}_launches_per_step: {}", k.launches + k.untimed));
                out.emit(format!("{name}_kernel_ms_per_step: {:.2}", k.busy_ms));
                out.emit(format!("{name}_step_ms: {:.2}", t.step_s * 1e3));
                out.emit(format!("{name}_kernel_share: {:.3}", k.busy_ms / (t.step_s * 1e3)));
            }
            out.emit(format!("{name}_tokens_per_sec: {:.1}", tokens / t.step_s));
            // MFU against the bf16 peak, for the bf16 runs.
            if name.ends_with("_bf16") {
                out.emit(format!("{name}_mfu: {:.4}", mfu(t.step_s)));
            }
        }
        Err(e) => {
            failed.push(name.to_string());
            out.emit(format!("{name}_tokens_per_sec: failed ({e:#})"));
        }
    };
    // The headline pair (our server and Tracel's on the same kernels) first, then fusion, then
    // f32: a run cut short by a timeout keeps the figures that matter most.
    let ours_name = args.device.name();
    // Builds with burn-cuda push Burn's CUDA runs and the fused ones.
    #[allow(unused_mut, clippy::useless_vec)]
    let mut variants = vec![Variant { key: "cuda_proxy", name: ours_name.to_string(), time: ours }];
    // Burn's CUDA backend runs on the device of the proxy only.
    #[cfg(feature = "burn-cuda")]
    {
        let on_cuda = args.device == BenchDevice::CudaProxy;
        let variant = |key, name: String, time| Variant { key, name, time };
        if on_cuda {
            variants.push(variant("burn_cuda", "burn_cuda".into(), burn_cuda));
        }
        variants.push(variant("cuda_proxy_fused", format!("{ours_name}_fused"), ours_fused));
        if on_cuda {
            variants.push(variant("burn_cuda_fused", "burn_cuda_fused".into(), burn_cuda_fused));
        }
    }
    for v in variants.iter().filter(|v| wanted(v.key)) {
        measure(&format!("{}_fsdp_w1_bf16", v.name), &|| (v.time)(&config, args, Mode::Fsdp(bf16)), &mut out);
    }
    let no_fsdp_bf16 = format!("{ours_name}_no_fsdp_bf16");
    if wanted("bf16") {
        measure(&no_fsdp_bf16, &|| ours(&config, args, Mode::Plain(DType::BF16)), &mut out);
    }
    let not_a_variant = |v: &str| v == "f32" || v == "bf16";
    for v in
        args.variants.iter().filter(|v| !variants.iter().any(|k| k.key == v.as_str()) && !not_a_variant(v))
    {
        let why = if cfg!(feature = "burn-cuda") {
            "Burn's CUDA backend runs with --device cuda-proxy only"
        } else {
            "not in this build: needs feature burn-cuda"
        };
        out.emit(format!("{v}_fsdp_w1_bf16_tokens_per_sec: skipped ({why})"));
    }
    let (no_fsdp_f32, fsdp_f32) = (format!("{ours_name}_no_fsdp_f32"), format!("{ours_name}_fsdp_w1_f32"));
    if wanted("f32") {
        measure(&no_fsdp_f32, &|| ours(&config, args, Mode::Plain(DType::F32)), &mut out);
        let f32_policy = Mode::Fsdp(MixedPrecisionPolicy::default());
        measure(&fsdp_f32, &|| ours(&config, args, f32_policy), &mut out);
    }
    if let (Some(single), Some(fsdp)) = (secs.get(&no_fsdp_f32), secs.get(&fsdp_f32)) {
        out.emit(format!("fsdp_w1_vs_no_fsdp_tokens_per_sec_ratio: {:.3}", single / fsdp));
    }
    // Our server against Tracel's on the same kernels: > 1 means the proxy is faster.
    for (ours, theirs) in [("cuda_proxy", "burn_cuda"), ("cuda_proxy_fused", "burn_cuda_fused")] {
        let key = |n: &str| format!("{n}_fsdp_w1_bf16");
        if let (Some(a), Some(b)) = (secs.get(&key(ours)), secs.get(&key(theirs))) {
            out.emit(format!("{ours}_vs_{theirs}_fsdp_w1_bf16_tokens_per_sec_ratio: {:.3}", b / a));
        }
    }
    out.finish()?;
    if !failed.is_empty() {
        bail!("gpu-bench: {} failed: {}", failed.len(), failed.join(", "));
    }
    Ok(true)
}
