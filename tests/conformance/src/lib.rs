//! Backend conformance suite (issue #6): every tensor and autodiff op that Qwen3 training and
//! burn-fsdp use, plus the broad Burn tensor API, each compared with a float64 reference
//! computed on the host from the same (seeded) inputs.
//!
//! ```no_run
//! use burn::backend::{Autodiff, NdArray};
//! let report = burn_conformance::run::<Autodiff<NdArray<f32>>>(&Default::default(), None);
//! println!("{report}");
//! assert_eq!(report.failed(), 0);
//! ```
//!
//! # Cases
//!
//! Case names are `<backend>/<dtype>/<op>`:
//! - `inner/…` — forward cases on the plain backend (`B::InnerBackend`), and `autodiff/…` —
//!   the same cases through the autodiff decorator (`B`), which must not change results.
//!   Float cases run once per float dtype `f32`, `f64`, `bf16`, `f16`; a dtype the backend
//!   does not support (`Backend::supports_dtype`) is reported as skipped, with the reason.
//! - `…/int/…`, `…/bool/…` — int (default int dtype) and bool ops; `…/random/…` — random ops.
//! - `grad/f32/…` — gradients on `B`.
//!
//! Inputs are uploaded in the case's dtype and read back, so a reference starts from exactly
//! the values the backend holds (rounded to bf16, for instance); only the op's own error is
//! measured.
//!
//! # Error measure and tolerances
//!
//! The error of a case is `max |a − e| / max(|e|, sᵢ, 10⁻³·max|e|)` over its elements (`a`:
//! backend, `e`: f64 reference, `sᵢ` a per-element scale for the families that have one).
//! Tolerances per family (f32; f64 tolerances are these ×10⁻⁷; for bf16/f16 they are
//! `max(f32 tolerance, k·u)` with `u` the unit roundoff, 2⁻⁸ for bf16, 2⁻¹¹ for f16):
//!
//! | family | ops | f32 tol | k |
//! |---|---|---|---|
//! | exact | creation, from/into data, casts, reshape/permute/slice/cat/select/gather/mask, comparisons, argmax, max/min, int, bool | 0 | 0 |
//! | elementwise | `+ − × ÷` (broadcast and scalar), neg, abs, recip, square, sqrt, clamp, relu, max/min pair | 1e-6 | 2 |
//! | transcendental | exp, log, log1p, sin, cos, tanh, erf, powf, sigmoid, silu, gelu | 1e-5 | 4 |
//! | reduction (`sᵢ = Σ|xₖ|` of the reduced values) | sum, sum_dim, mean, mean_dim, var, cumsum | 1e-5 | 8 |
//! | matmul (`sᵢⱼ = Σₖ|aᵢₖbₖⱼ|`) | 2-D, batched 3-D/4-D, transposed/strided operands, broadcast batch | 1e-5·√K | 4·√K |
//! | composite | softmax, log-softmax, cross-entropy, RMSNorm, RoPE, causal attention | 2e-5 | 16 |
//! | gradient | autodiff vs f64 central differences of the host formula | 1e-4 | 32 |
//!
//! Random ops are checked by sample statistics (N = 100 000): the sample mean and variance
//! must lie within 5 standard errors of the distribution's (error = deviation in standard
//! errors, tolerance 5), every sample within the support, Bernoulli samples in {0, 1}.
//!
//! # Isolation
//!
//! Each case runs under `catch_unwind`: a backend that panics in one op fails that case (with
//! the panic message) and the run goes on. The default panic hook still prints the panic.
#![warn(missing_docs)]

#[cfg(feature = "cube")]
mod cube;
mod forward;
mod grads;
mod harness;
mod host;
mod int_bool;
mod random;

use burn::tensor::DType;
use burn::tensor::backend::{AutodiffBackend, Backend};

#[cfg(feature = "cube")]
pub use cube::run_cube_matmul;
use harness::Runner;
pub use harness::{Case, FailureClass, KNOWN_CUBECL_0_21, KnownBug, Outcome, Report, set_progress};

/// The float dtypes the forward cases run in.
pub const FLOAT_DTYPES: [DType; 4] = [DType::F32, DType::F64, DType::BF16, DType::F16];

/// Runs every case whose name contains `filter` (all cases when `None`) on `device`:
/// forward cases on `B::InnerBackend` and on `B`, gradient cases on `B`.
pub fn run<B: AutodiffBackend>(device: &B::Device, filter: Option<&str>) -> Report {
    run_excluding::<B>(device, filter, &[], "")
}

/// [`run`] with dtypes the backend claims but cannot run reported as skipped, with `why`,
/// instead of run: e.g. f64 under Burn's kernel fusion, whose code generator panics on it in
/// the device thread — after which every later case would fail too.
///
/// ```no_run
/// # fn f<B: burn::tensor::backend::AutodiffBackend>(device: &B::Device) {
/// use burn::tensor::DType;
/// let report = burn_conformance::run_excluding::<B>(device, None, &[DType::F64], "fusion has no f64");
/// # }
/// ```
pub fn run_excluding<B: AutodiffBackend>(
    device: &B::Device,
    filter: Option<&str>,
    excluded: &[DType],
    why: &str,
) -> Report {
    run_known::<B>(device, filter, excluded, why, &[])
}

/// [`run_excluding`] on a backend with known upstream bugs: a failed case whose name contains
/// is one of `known`'s cases, failing as listed, is reported as [`Outcome::KnownFailure`] with that bug (e.g.
/// [`KNOWN_CUBECL_0_21`] for burn-cubecl backends, fused or not); a listed case that passes is [`Outcome::UnexpectedPass`] (counted as passed, reported).
pub fn run_known<B: AutodiffBackend>(
    device: &B::Device,
    filter: Option<&str>,
    excluded: &[DType],
    why: &str,
    known: &'static [KnownBug],
) -> Report {
    let mut r = Runner::new(filter);
    r.known = known;
    r.excluded = excluded.iter().map(|d| (*d, why.to_string())).collect();
    plain_cases::<B::InnerBackend>(&mut r, "inner", device);
    plain_cases::<B>(&mut r, "autodiff", device);
    grads::grad_cases::<B>(&mut r, device);
    r.report
}

/// Runs the whole suite ([`run`]) on a CubeCL runtime's backend, `CubeBackend<R, f32, i32, u8>`
/// (the element types of burn-metax-backend's `Metax`), burn-cubecl 0.21's known bugs
/// ([`KNOWN_CUBECL_0_21`]) reported as known failures, then the kernel-strategy cases
/// `cube/…`: every cubek reduce routine (plane and cube reductions included) and the matmul
/// kernels burn-cubecl does not pick by default, so that kernels with plane (wave)
/// operations run on the device too. Feature `cube`.
///
/// ```no_run
/// # fn f<R: burn_cubecl::CubeRuntime>(device: &R::Device) {
/// let report = burn_conformance::run_cube::<R>(device, None);
/// assert_eq!(report.failed(), 0, "{report}");
/// # }
/// ```
#[cfg(feature = "cube")]
pub fn run_cube<R: burn_cubecl::CubeRuntime>(device: &R::Device, filter: Option<&str>) -> Report {
    use burn::backend::Autodiff;
    let mut report = run_known::<Autodiff<burn_cubecl::CubeBackend<R, f32, i32, u8>>>(
        device,
        filter,
        &[],
        "",
        KNOWN_CUBECL_0_21,
    );
    let mut r = Runner::new(filter);
    cube::strategy_cases::<R>(&mut r, device);
    report.cases.extend(r.report.cases);
    report
}

/// Runs only the forward cases (no autodiff) of a plain backend, named `<label>/…`.
pub fn run_forward<B: Backend>(device: &B::Device, label: &str, filter: Option<&str>) -> Report {
    let mut r = Runner::new(filter);
    plain_cases::<B>(&mut r, label, device);
    r.report
}

fn plain_cases<B: Backend>(r: &mut Runner<'_>, label: &str, device: &B::Device) {
    for dtype in FLOAT_DTYPES {
        let skip = r.unsupported(dtype, B::supports_dtype(device, dtype));
        r.skip_all(skip);
        forward::float_cases::<B>(r, label, device, dtype);
    }
    r.skip_all(None);
    int_bool::int_cases::<B>(r, label, device);
    int_bool::bool_cases::<B>(r, label, device);
    random::random_cases::<B>(r, label, device);
}

#[cfg(test)]
mod tests {
    use super::*;
    use burn::backend::{Autodiff, NdArray};
    use burn::prelude::*;

    type B = Autodiff<NdArray<f32>>;

    /// Excluded dtypes are reported as skipped with the reason, and no case of theirs runs;
    /// the others still run.
    #[test]
    fn excluded_dtypes_are_skipped_with_the_reason() {
        let device = Default::default();
        let r = run_excluding::<B>(&device, Some("/add_scalar"), &[DType::F32], "no f32 here");
        let f32_cases: Vec<_> = r.cases.iter().filter(|c| c.name.contains("/f32/")).collect();
        assert!(!f32_cases.is_empty(), "{r}");
        for c in f32_cases {
            assert_eq!(c.outcome, Outcome::Skipped("no f32 here".into()), "{c}");
        }
        assert!(r.cases.iter().any(|c| c.name.contains("/f64/") && c.outcome == Outcome::Passed), "{r}");
        let g = run_excluding::<B>(&device, Some("cast.f64_roundtrip"), &[DType::F64], "no f64 here");
        assert_eq!(g.cases.len(), 1, "{g}");
        assert_eq!(g.cases[0].outcome, Outcome::Skipped("no f64 here".into()));
    }

    /// A backend whose result is wrong must be reported as failed: here, the check itself
    /// is fed a deliberately wrong reference.
    #[test]
    fn a_wrong_result_fails() {
        let dev = Default::default();
        let mut r = Runner::new(None);
        r.case("wrong", harness::tol(harness::Family::Elementwise, DType::F32), || {
            let t = Tensor::<NdArray<f32>, 1>::from_floats([1.0, 2.0, 3.0], &dev).exp();
            host::check(t, &host::H::new(&[3], vec![1f64.exp(), 2f64.exp(), 3f64.exp() * (1.0 + 1e-4)]), None)
        });
        r.case("right", harness::tol(harness::Family::Elementwise, DType::F32), || {
            let t = Tensor::<NdArray<f32>, 1>::from_floats([1.0, 2.0, 3.0], &dev).mul_scalar(2.0);
            host::check(t, &host::H::new(&[3], vec![2.0, 4.0, 6.0]), None)
        });
        r.case("wrong_shape", 0.0, || {
            let t = Tensor::<NdArray<f32>, 2>::zeros([2, 3], &dev);
            host::check(t, &host::H::new(&[3, 2], vec![0.0; 6]), None)
        });
        r.case("panicking_op", 0.0, || {
            // Shape mismatch in matmul: the backend panics inside the op.
            let a = Tensor::<NdArray<f32>, 2>::zeros([2, 3], &dev);
            let t = a.clone().matmul(a);
            host::check(t, &host::H::new(&[2, 2], vec![0.0; 4]), None)
        });
        let rep = r.report;
        assert_eq!((rep.passed(), rep.failed()), (1, 3), "{rep}");
        assert!(rep.to_string().contains("FAIL panicking_op: panicked"), "{rep}");
    }

    #[test]
    fn filter_runs_a_subset() {
        let rep = run::<B>(&Default::default(), Some("matmul.2d_odd"));
        // inner and autodiff × f32 and f64 pass; bf16 and f16 are skipped on NdArray.
        assert_eq!(rep.passed(), 4, "{rep}");
        assert_eq!(rep.skipped(), 4, "{rep}");
        assert!(rep.cases.iter().all(|c| c.name.contains("matmul.2d_odd")));
    }
}
