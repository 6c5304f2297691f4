//! `cargo xtask conformance`: the backend conformance suite (issue #6) on one backend.
//!
//! Prints one line per case and `passed: N failed: M skipped: K`. Exit status: 0 when no
//! case failed, 1 when one did (or on error), [`EXIT_UNAVAILABLE`] when the backend is not
//! available in this build.

use anyhow::Result;
use burn::backend::{Autodiff, Flex, NdArray};

/// Exit status when the requested backend is not available in this build.
pub const EXIT_UNAVAILABLE: i32 = 3;

/// The backends the suite can be asked to run on.
#[derive(Debug, Clone, Copy, PartialEq, Eq, clap::ValueEnum)]
pub enum ConformanceBackend {
    /// `Autodiff<NdArray<f32>>`, the CPU backend every command runs on (no bf16/f16).
    Ndarray,
    /// `Autodiff<Flex>`, burn's CPU backend with bf16 and f16.
    Flex,
    /// The CUDA proxy of burn-metax-backend.
    CudaProxy,
    /// MetaX GPUs through burn-metax-backend.
    Metax,
    /// The `Metax` server and MACA dialect on the emulated MetaX device: the generated kernels
    /// compiled by the host C++ compiler and run on the CPU at wave 64.
    MetaxEmu,
    /// `metax-emu` under Burn's kernel fusion (`MetaxEmuFused`): the fused kernels through the
    /// MACA dialect, on the CPU. xtask built with `--features burn-cuda` (the GPU pack).
    MetaxEmuFused,
    /// `cuda-proxy` under Burn's kernel fusion (`CudaProxyFused`). xtask built with
    /// `--features burn-cuda`.
    CudaProxyFused,
    /// Burn's own CUDA backend (`burn_cuda::Cuda`, fusion on), as a baseline for the proxy.
    /// xtask built with `--features burn-cuda`.
    Cuda,
}

impl ConformanceBackend {
    /// The name as given to `--backend`.
    pub fn name(self) -> &'static str {
        match self {
            Self::Ndarray => "ndarray",
            Self::Flex => "flex",
            Self::CudaProxy => "cuda-proxy",
            Self::Metax => "metax",
            Self::MetaxEmu => "metax-emu",
            Self::MetaxEmuFused => "metax-emu-fused",
            Self::CudaProxyFused => "cuda-proxy-fused",
            Self::Cuda => "cuda",
        }
    }
}

/// Arguments of `conformance`.
#[derive(Debug, Clone, clap::Args)]
pub struct ConformanceArgs {
    /// Backend to check.
    #[arg(long, value_enum)]
    pub backend: ConformanceBackend,
    /// Run only the cases whose name contains this substring (e.g. `matmul`, `grad/`, `bf16`).
    #[arg(long)]
    pub filter: Option<String>,
    /// Print only failed cases, known upstream failures (`XFAIL`), known failures that passed
    /// (`XPASS`) and the summary line.
    #[arg(long)]
    pub quiet: bool,
    /// Also print each case to stderr as it starts and ends, so a run cut short (a timeout, a
    /// kernel that never returns) shows how far it got.
    #[arg(long)]
    pub progress: bool,
    /// Fail (exit 1) when fewer cases than this passed: cases that went missing (a filter, a
    /// dtype the backend stopped claiming) count against the run, as in the CPU tiers.
    #[arg(long, value_name = "N", default_value_t = 0)]
    pub min_pass: usize,
}

impl ConformanceArgs {
    /// Parses a command line (`argv[0]` is the command name), as the binary does.
    pub fn parse_from_args(argv: &[&str]) -> std::result::Result<Self, clap::Error> {
        use clap::Parser;
        #[derive(Parser)]
        struct Wrap {
            #[command(flatten)]
            args: ConformanceArgs,
        }
        Wrap::try_parse_from(argv).map(|w| w.args)
    }
}

/// How a run ended.
#[derive(Debug, Clone, PartialEq)]
pub enum Status {
    /// The suite ran on the backend.
    Ran(burn_conformance::Report),
    /// The backend is not available in this build; the line says why.
    Unavailable(String),
}

impl Status {
    /// The process exit status: 0 (no failure), 1 (failures) or [`EXIT_UNAVAILABLE`].
    pub fn exit_code(&self) -> i32 {
        match self {
            Status::Ran(report) if report.failed() == 0 => 0,
            Status::Ran(_) => 1,
            Status::Unavailable(_) => EXIT_UNAVAILABLE,
        }
    }
}

/// Runs the command: the suite on `--backend`, printing the report.
pub fn run(args: &ConformanceArgs) -> Result<Status> {
    let filter = args.filter.as_deref();
    burn_conformance::set_progress(args.progress);
    let mut status = match args.backend {
        ConformanceBackend::Ndarray => {
            Status::Ran(burn_conformance::run::<Autodiff<NdArray<f32>>>(&Default::default(), filter))
        }
        ConformanceBackend::Flex => {
            Status::Ran(burn_conformance::run::<Autodiff<Flex>>(&Default::default(), filter))
        }
        #[cfg(feature = "metax")]
        ConformanceBackend::MetaxEmu => {
            use burn_metax_backend::MetaxEmuRuntime;
            match MetaxEmuRuntime::first_device() {
                Ok(device) => Status::Ran(burn_conformance::run_cube::<MetaxEmuRuntime>(&device, filter)),
                Err(e) => {
                    Status::Unavailable(format!("backend metax-emu: {e} (exit status {EXIT_UNAVAILABLE})"))
                }
            }
        }
        #[cfg(not(feature = "metax"))]
        ConformanceBackend::MetaxEmu => not_built("metax-emu", "metax"),
        gpu @ (ConformanceBackend::CudaProxy | ConformanceBackend::Metax) => {
            run_gpu_backend(gpu.name(), filter)?
        }
        fused @ (ConformanceBackend::MetaxEmuFused
        | ConformanceBackend::CudaProxyFused
        | ConformanceBackend::Cuda) => run_fused_backend(fused, filter),
    };
    if let Status::Ran(report) = &mut status
        && report.passed() < args.min_pass
    {
        // The guard is a failed case of its own, so the exit status and the summary count it.
        report.cases.push(burn_conformance::Case {
            name: "guard/min-pass".into(),
            tolerance: args.min_pass as f64,
            error: Some(report.passed() as f64),
            outcome: burn_conformance::Outcome::Failed(format!(
                "only {} cases passed, --min-pass {}",
                report.passed(),
                args.min_pass
            )),
        });
    }
    match &status {
        Status::Ran(report) => {
            println!("backend {}:", args.backend.name());
            for case in &report.cases {
                if !args.quiet
                    || matches!(
                        case.outcome,
                        burn_conformance::Outcome::Failed(_)
                            | burn_conformance::Outcome::KnownFailure(_)
                            | burn_conformance::Outcome::UnexpectedPass(_)
                    )
                {
                    println!("{case}");
                }
            }
            println!("{}", report.summary());
        }
        Status::Unavailable(line) => println!("{line}"),
    }
    Ok(status)
}

/// Runs the suite on a GPU backend of burn-metax-backend: `metax` (MACA runtime, loaded from
/// `$MACA_PATH`) or `cuda-proxy` (the same CubeCL server over the CUDA driver; needs xtask built
/// with `--features cuda-proxy`). Reports the backend unavailable, with the reason, when there is
/// no such device here.
pub fn run_gpu_backend(name: &str, filter: Option<&str>) -> Result<Status> {
    #[cfg(not(feature = "metax"))]
    if name == "metax" {
        let _ = filter;
        return Ok(not_built(name, "metax"));
    }
    #[cfg(feature = "metax")]
    if name == "metax" {
        use burn_metax_backend::MacaRuntime;
        return Ok(match MacaRuntime::first_device() {
            Ok(device) => Status::Ran(burn_conformance::run_cube::<MacaRuntime>(&device, filter)),
            Err(e) => Status::Unavailable(format!("backend metax: {e} (exit status {EXIT_UNAVAILABLE})")),
        });
    }
    #[cfg(feature = "cuda-proxy")]
    {
        use burn_metax_backend::CudaProxyRuntime;
        Ok(match CudaProxyRuntime::first_device() {
            Ok(device) => Status::Ran(burn_conformance::run_cube::<CudaProxyRuntime>(&device, filter)),
            Err(e) => Status::Unavailable(format!("backend {name}: {e} (exit status {EXIT_UNAVAILABLE})")),
        })
    }
    #[cfg(not(feature = "cuda-proxy"))]
    {
        let _ = filter;
        Ok(not_built(name, "cuda-proxy"))
    }
}

/// `backend` is not in this build: the line says which feature brings it.
#[cfg(not(all(feature = "metax", feature = "cuda-proxy", feature = "burn-cuda")))]
fn not_built(backend: &str, feature: &str) -> Status {
    Status::Unavailable(format!(
        "backend {backend}: not available in this build: rebuild with `cargo run -p xtask --features {feature} -- \
         conformance --backend {backend}` (exit status {EXIT_UNAVAILABLE})"
    ))
}

/// Why f64 cases are skipped under fusion.
#[cfg(feature = "burn-cuda")]
const FUSION_NO_F64: &str = "burn-cubecl-fusion 0.21 has no f64 code generation";

/// The suite on a fused backend, f64 skipped ([`FUSION_NO_F64`]), burn-cubecl 0.21's known
/// bugs reported as known failures where they show.
#[cfg(feature = "burn-cuda")]
fn fused_suite<B: burn::tensor::backend::Backend>(
    device: &B::Device,
    filter: Option<&str>,
) -> burn_conformance::Report {
    burn_conformance::run_known::<Autodiff<B>>(
        device,
        filter,
        &[burn::tensor::DType::F64],
        FUSION_NO_F64,
        burn_conformance::KNOWN_CUBECL_0_21,
    )
}

/// Runs the suite (no `cube/…` strategy cases: fusion picks its own kernels) on a fused
/// backend, or reports it unavailable: not in this build, or no such device here.
#[cfg(feature = "burn-cuda")]
fn run_fused_backend(backend: ConformanceBackend, filter: Option<&str>) -> Status {
    use burn_metax_backend::{CudaProxyFused, CudaProxyRuntime, MetaxEmuFused, MetaxEmuRuntime};
    let unavailable = |e: &dyn std::fmt::Display| {
        Status::Unavailable(format!("backend {}: {e} (exit status {EXIT_UNAVAILABLE})", backend.name()))
    };
    match backend {
        // burn-cubecl-fusion 0.21 generates no f64 code (`Unsupported precision for fusion: f64`,
        // a panic in the device thread after which every later call fails), though the MetaX
        // runtimes register f64: those cases are skipped, with that reason.
        ConformanceBackend::MetaxEmuFused => match MetaxEmuRuntime::first_device() {
            Ok(device) => Status::Ran(fused_suite::<MetaxEmuFused>(&device, filter)),
            Err(e) => unavailable(&e),
        },
        ConformanceBackend::CudaProxyFused => match CudaProxyRuntime::first_device() {
            Ok(device) => Status::Ran(fused_suite::<CudaProxyFused>(&device, filter)),
            Err(e) => unavailable(&e),
        },
        _ => match CudaProxyRuntime::first_device() {
            // The proxy's device check says whether there is a CUDA GPU at all, without letting
            // CubeCL's CUDA runtime panic on a machine that has none.
            Ok(_) => {
                Status::Ran(burn_conformance::run::<Autodiff<burn_cuda::Cuda>>(&Default::default(), filter))
            }
            Err(e) => unavailable(&e),
        },
    }
}

/// Without `burn-cuda`: the fused backends and Burn's CUDA backend are not in this build.
#[cfg(not(feature = "burn-cuda"))]
fn run_fused_backend(backend: ConformanceBackend, _filter: Option<&str>) -> Status {
    not_built(backend.name(), "burn-cuda")
}
