//! Cases, outcomes, the report, and the runner that isolates each case.

use std::fmt;
use std::panic::{AssertUnwindSafe, catch_unwind};
use std::sync::atomic::{AtomicBool, Ordering};

use burn::tensor::DType;

/// How one case ended.
#[derive(Debug, Clone, PartialEq)]
pub enum Outcome {
    /// The backend's result is within the tolerance of the float64 reference.
    Passed,
    /// The result is wrong (or has the wrong shape/dtype), or the backend panicked.
    Failed(String),
    /// The backend lacks a capability the case needs (a dtype, for instance); the reason says which.
    Skipped(String),
    /// A wrong result that a known bug of a crate this backend is built on explains — the
    /// reason names it, then what the case measured. Counted apart from failures (like
    /// pytest's `xfail`): still printed in every report, and no reason for a run to fail.
    /// Only cases listed for the backend by exact name ([`KNOWN_CUBECL_0_21`]), failing the
    /// way the list says ([`FailureClass`]), can end this way.
    KnownFailure(String),
    /// A case listed as a known failure that passed (pytest's `xpass`): counted as passed,
    /// reported apart, so that a fixed bug is seen and its entry removed.
    UnexpectedPass(String),
}

/// How a case failed, for matching it against a known failure: a known bug that starts failing
/// another way (a panic where wrong values were known) is a failure, not a known one.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum FailureClass {
    /// Values off: above the tolerance, NaN, or an element that differs.
    WrongValues,
    /// The result has the wrong shape.
    WrongShape,
    /// The backend panicked.
    Panicked,
    /// Anything else (a wrong dtype, …).
    Other,
}

impl FailureClass {
    /// The class of a [`Outcome::Failed`] message.
    pub fn of(what: &str) -> Self {
        if what.starts_with("panicked") {
            Self::Panicked
        } else if what.starts_with("shape ") {
            Self::WrongShape
        } else if what == "error above tolerance" || what.starts_with("NaN") || what.starts_with("element ") {
            Self::WrongValues
        } else {
            Self::Other
        }
    }
}

/// A known upstream bug and the cases it fails, by exact name: every
/// `<family>/<dtype>/<op>` of the lists, each failing only as `classes` say.
#[derive(Debug, Clone, Copy)]
pub struct KnownBug {
    /// The ops (the last part of the case name).
    pub ops: &'static [&'static str],
    /// The case families (`inner`, `autodiff`).
    pub families: &'static [&'static str],
    /// The dtype labels (`f32`, `f64`, `bf16`, `f16`).
    pub dtypes: &'static [&'static str],
    /// How the cases may fail.
    pub classes: &'static [FailureClass],
    /// The bug.
    pub bug: &'static str,
}

impl KnownBug {
    /// Whether `name` is one of this bug's cases (exactly).
    pub fn covers(&self, name: &str) -> bool {
        let mut parts = name.splitn(3, '/');
        let (Some(family), Some(dtype), Some(op)) = (parts.next(), parts.next(), parts.next()) else {
            return false;
        };
        self.families.contains(&family) && self.dtypes.contains(&dtype) && self.ops.contains(&op)
    }

    /// Every case name this bug covers.
    pub fn cases(&self) -> Vec<String> {
        let mut out = Vec::new();
        for family in self.families {
            for dtype in self.dtypes {
                for op in self.ops {
                    out.push(format!("{family}/{dtype}/{op}"));
                }
            }
        }
        out
    }
}

/// Cases that fail on burn-cubecl 0.21 backends (CubeCL runtimes, fused or not), by exact
/// name (32: `mask_where.broadcast_{input,mask}`, `{max,min}_pair.broadcast` in the `inner` and
/// `autodiff` families, f32, f64, bf16, f16), and the upstream bug that explains them. burn-cubecl 0.21's `mask_where`
/// sizes its launch from the input tensor instead of the broadcast output and may reuse, as
/// the output, an input smaller than it: with an input (or input and value) smaller than the
/// mask, the tail of the output is never written, or the output keeps the input's shape.
/// `max_pair`/`min_pair` are `mask_where` with the first operand as input. Reported as
/// tracel-ai/cubecl#1674, fixed by tracel-ai/burn#5767 (Burn 0.22; the project is pinned to 0.21).
/// Found by the GPU check (stop 37): `max_pair.broadcast` failed on an H200 in bf16/f16; on f32
/// and on the emulated MetaX device the case had passed only because the output buffer reused
/// memory that held the same values.
/// The wrong values and wrong shapes are the classes seen (the emulated MetaX device: 8 wrong
/// shapes, 8 wrong values; the H200: wrong values); a panic is not this bug.
pub const KNOWN_CUBECL_0_21: &[KnownBug] = &[KnownBug {
    ops: &[
        "mask_where.broadcast_input",
        "mask_where.broadcast_mask",
        "max_pair.broadcast",
        "min_pair.broadcast",
    ],
    families: &["inner", "autodiff"],
    dtypes: &["f32", "f64", "bf16", "f16"],
    classes: &[FailureClass::WrongValues, FailureClass::WrongShape],
    bug: MASK_WHERE_0_21,
}];

const MASK_WHERE_0_21: &str = "known burn-cubecl 0.21 bug: mask_where launches over the input, not the broadcast \
     output (tracel-ai/cubecl#1674, fixed by tracel-ai/burn#5767 after 0.21)";

/// One checked operation (or group of closely related operations).
#[derive(Debug, Clone, PartialEq)]
pub struct Case {
    /// `<backend>/<dtype>/<op>`, for instance `inner/f32/matmul.batched4d` or `grad/f32/rms_norm`.
    pub name: String,
    /// The largest allowed error (see the crate docs for the error measure of each family).
    pub tolerance: f64,
    /// The measured error, when the case ran to the comparison.
    pub error: Option<f64>,
    /// How it ended.
    pub outcome: Outcome,
}

/// The cases of one run.
#[derive(Debug, Clone, Default, PartialEq)]
pub struct Report {
    /// Every case that matched the filter, in the order run.
    pub cases: Vec<Case>,
}

impl Report {
    /// Number of passed cases.
    pub fn passed(&self) -> usize {
        self.cases
            .iter()
            .filter(|c| matches!(c.outcome, Outcome::Passed | Outcome::UnexpectedPass(_)))
            .count()
    }

    /// Number of failed cases.
    pub fn failed(&self) -> usize {
        self.cases.iter().filter(|c| matches!(c.outcome, Outcome::Failed(_))).count()
    }

    /// Number of cases that failed for a known upstream bug ([`Outcome::KnownFailure`]).
    pub fn known_failures(&self) -> usize {
        self.cases.iter().filter(|c| matches!(c.outcome, Outcome::KnownFailure(_))).count()
    }

    /// Number of cases listed as known failures that passed ([`Outcome::UnexpectedPass`]).
    pub fn unexpected_passes(&self) -> usize {
        self.cases.iter().filter(|c| matches!(c.outcome, Outcome::UnexpectedPass(_))).count()
    }

    /// Number of skipped cases.
    pub fn skipped(&self) -> usize {
        self.cases.iter().filter(|c| matches!(c.outcome, Outcome::Skipped(_))).count()
    }

    /// The failed cases.
    pub fn failures(&self) -> impl Iterator<Item = &Case> {
        self.cases.iter().filter(|c| matches!(c.outcome, Outcome::Failed(_)))
    }

    /// The final `passed: N failed: M skipped: K` line, with `known upstream failures: J` and
    /// `known failures that passed: P` after it when there are any.
    pub fn summary(&self) -> String {
        let mut line =
            format!("passed: {} failed: {} skipped: {}", self.passed(), self.failed(), self.skipped());
        if self.known_failures() > 0 {
            line += &format!(" known upstream failures: {}", self.known_failures());
        }
        if self.unexpected_passes() > 0 {
            line += &format!(" known failures that passed: {}", self.unexpected_passes());
        }
        line
    }
}

impl fmt::Display for Case {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let err = |f: &mut fmt::Formatter<'_>, cmp: &str| match self.error {
            Some(e) => write!(f, " (max err {e:.1e} {cmp} tol {:.1e})", self.tolerance),
            None => Ok(()),
        };
        match &self.outcome {
            Outcome::Passed => {
                write!(f, "PASS {}", self.name)?;
                err(f, "≤")
            }
            Outcome::Failed(why) => {
                write!(f, "FAIL {}", self.name)?;
                err(f, ">")?;
                write!(f, ": {why}")
            }
            Outcome::Skipped(why) => write!(f, "SKIP {} {why}", self.name),
            Outcome::KnownFailure(why) => {
                write!(f, "XFAIL {}", self.name)?;
                err(f, ">")?;
                write!(f, ": {why}")
            }
            Outcome::UnexpectedPass(why) => {
                write!(f, "XPASS {}", self.name)?;
                err(f, "≤")?;
                write!(f, ": listed as a known failure ({why}), but passed")
            }
        }
    }
}

impl fmt::Display for Report {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        for case in &self.cases {
            writeln!(f, "{case}")?;
        }
        write!(f, "{}", self.summary())
    }
}

/// Whether each case is printed to stderr as it ends ([`set_progress`]).
static PROGRESS: AtomicBool = AtomicBool::new(false);

/// Prints every case to stderr as it ends (`[n] PASS …`), off by default: a run cut short by
/// a timeout, or stuck in one kernel, then shows how far it got and which case it was in.
///
/// ```no_run
/// burn_conformance::set_progress(true);
/// ```
pub fn set_progress(on: bool) {
    PROGRESS.store(on, Ordering::Relaxed);
}

/// Why a case did not produce a comparable error.
#[derive(Debug, Clone, PartialEq)]
pub(crate) enum Fail {
    /// Wrong shape, dtype or exact value: the case fails with this message.
    Mismatch(String),
    /// The backend lacks a capability: the case is skipped with this reason.
    Skip(String),
}

/// What a case body returns: the measured error (compared with the case's tolerance).
pub(crate) type Measured = Result<f64, Fail>;

/// Shorthand for a mismatch.
pub(crate) fn mismatch<T>(msg: impl Into<String>) -> Result<T, Fail> {
    Err(Fail::Mismatch(msg.into()))
}

/// Runs cases one by one, each isolated by `catch_unwind`.
pub(crate) struct Runner<'f> {
    filter: Option<&'f str>,
    /// Dtypes the backend claims (`supports_dtype`) but is known not to run, and why: their
    /// cases are reported as skipped with the reason instead of run.
    pub(crate) excluded: Vec<(burn::tensor::DType, String)>,
    /// While set, every case is recorded as skipped with this reason without running.
    skip: Option<String>,
    /// Known upstream bugs and the cases (by exact name) whose failure they explain.
    pub(crate) known: &'static [KnownBug],
    pub(crate) report: Report,
}

impl<'f> Runner<'f> {
    pub(crate) fn new(filter: Option<&'f str>) -> Self {
        Self { filter, excluded: Vec::new(), skip: None, known: &[], report: Report::default() }
    }

    /// Sets (or clears) the reason to skip the following cases.
    pub(crate) fn skip_all(&mut self, reason: Option<String>) {
        self.skip = reason;
    }

    /// Why `dtype`'s cases are skipped on this backend, if they are: `supports` is false
    /// (`Backend::supports_dtype`), or the run excluded it.
    pub(crate) fn unsupported(&self, dtype: burn::tensor::DType, supports: bool) -> Option<String> {
        if let Some((_, why)) = self.excluded.iter().find(|(d, _)| *d == dtype) {
            return Some(why.clone());
        }
        (!supports)
            .then(|| format!("backend does not support {} (Backend::supports_dtype)", dtype_name(dtype)))
    }

    /// Whether a case of this name is selected by the filter.
    pub(crate) fn selected(&self, name: &str) -> bool {
        self.filter.is_none_or(|f| name.contains(f))
    }

    /// Runs `body` as the case `name` unless filtered out or skipped.
    pub(crate) fn case(&mut self, name: impl Into<String>, tolerance: f64, body: impl FnOnce() -> Measured) {
        let name = name.into();
        if !self.selected(&name) {
            return;
        }
        let progress = PROGRESS.load(Ordering::Relaxed);
        if progress {
            eprintln!("[{}] start {name}", self.report.cases.len() + 1);
        }
        let (error, outcome) = match &self.skip {
            Some(why) => (None, Outcome::Skipped(why.clone())),
            None => judge(catch_unwind(AssertUnwindSafe(body)), tolerance),
        };
        let outcome = match (outcome, self.known.iter().find(|k| k.covers(&name))) {
            (Outcome::Failed(what), Some(known)) if known.classes.contains(&FailureClass::of(&what)) => {
                Outcome::KnownFailure(format!("{}; here: {what}", known.bug))
            }
            (Outcome::Failed(what), Some(known)) => Outcome::Failed(format!(
                "{what} — a known failure ({}) that failed otherwise: {:?}, not {:?}",
                known.bug,
                FailureClass::of(&what),
                known.classes
            )),
            (Outcome::Passed, Some(known)) => Outcome::UnexpectedPass(known.bug.to_owned()),
            (other, _) => other,
        };
        let case = Case { name, tolerance, error, outcome };
        if progress {
            eprintln!("[{}] {case}", self.report.cases.len() + 1);
        }
        self.report.cases.push(case);
    }
}

fn judge(result: std::thread::Result<Measured>, tolerance: f64) -> (Option<f64>, Outcome) {
    match result {
        Ok(Ok(err)) if err <= tolerance => (Some(err), Outcome::Passed),
        Ok(Ok(err)) if err.is_nan() => (None, Outcome::Failed("NaN in the result".into())),
        Ok(Ok(err)) => (Some(err), Outcome::Failed("error above tolerance".into())),
        Ok(Err(Fail::Mismatch(msg))) => (None, Outcome::Failed(msg)),
        Ok(Err(Fail::Skip(why))) => (None, Outcome::Skipped(why)),
        Err(panic) => {
            let msg = panic
                .downcast_ref::<String>()
                .cloned()
                .or_else(|| panic.downcast_ref::<&str>().map(|s| (*s).to_owned()))
                .unwrap_or_else(|| "non-string panic payload".into());
            (None, Outcome::Failed(format!("panicked: {msg}")))
        }
    }
}

/// The operation families and their tolerances (see the crate docs).
#[derive(Debug, Clone, Copy, PartialEq)]
pub(crate) enum Family {
    /// Data movement, creation, indexing, integer and boolean ops: bit-exact.
    Exact,
    /// One correctly rounded arithmetic op per element.
    Elementwise,
    /// exp, log, sin, tanh, erf, powf, sigmoid, silu, …
    Transcendental,
    /// Sums, means, variances, cumulative sums, relative to the sum of magnitudes.
    Reduction,
    /// Matrix products with inner dimension `K`, relative to `Σ|aᵢₖ·bₖⱼ|`.
    Matmul(usize),
    /// Multi-op formulas: softmax, log-softmax, cross-entropy, RMSNorm, RoPE, attention.
    Composite,
    /// Gradients from autodiff, against analytic or f64 finite-difference references.
    Gradient,
}

/// Unit roundoff of a float dtype.
pub(crate) fn unit_roundoff(dtype: DType) -> f64 {
    match dtype {
        DType::F64 => f64::EPSILON / 2.0,
        DType::F16 => 2f64.powi(-11),
        DType::BF16 => 2f64.powi(-8),
        _ => 2f64.powi(-24),
    }
}

/// The tolerance of a family for a dtype: the f32 base; ×1e-7 for f64; `max(base, k·u)` for
/// the half types (u: unit roundoff).
pub(crate) fn tol(family: Family, dtype: DType) -> f64 {
    let (base, k) = match family {
        Family::Exact => (0.0, 0.0),
        Family::Elementwise => (1e-6, 2.0),
        Family::Transcendental => (1e-5, 4.0),
        Family::Reduction => (1e-5, 8.0),
        Family::Matmul(k) => (1e-5 * (k as f64).sqrt(), 4.0 * (k as f64).sqrt()),
        Family::Composite => (2e-5, 16.0),
        Family::Gradient => (1e-4, 32.0),
    };
    match dtype {
        DType::F64 => base * 1e-7,
        DType::F16 | DType::BF16 => base.max(k * unit_roundoff(dtype)),
        _ => base,
    }
}

/// Short dtype label used in case names.
pub(crate) fn dtype_name(dtype: DType) -> &'static str {
    match dtype {
        DType::F64 => "f64",
        DType::F32 => "f32",
        DType::F16 => "f16",
        DType::BF16 => "bf16",
        DType::I64 => "i64",
        DType::I32 => "i32",
        _ => "other",
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn judge_passes_fails_and_catches_panics() {
        let mut r = Runner::new(None);
        r.case("ok", 1e-6, || Ok(1e-7));
        r.case("too_far", 1e-6, || Ok(1e-3));
        r.case("nan", 1e-6, || Ok(f64::NAN));
        r.case("shape", 0.0, || mismatch("shape [2] ≠ [3]"));
        r.case("panics", 0.0, || panic!("kernel exploded"));
        r.case("skip", 0.0, || Err(Fail::Skip("no bf16".into())));
        r.skip_all(Some("dtype bf16 unsupported".into()));
        r.case("skipped_block", 0.0, || panic!("must not run"));
        r.skip_all(None);
        const KNOWN: &[KnownBug] = &[KnownBug {
            ops: &["known_bug.case", "known_bug.fine", "known_bug.panics"],
            families: &["inner"],
            dtypes: &["f32"],
            classes: &[FailureClass::WrongValues],
            bug: "upstream bug #1",
        }];
        r.known = KNOWN;
        r.case("inner/f32/known_bug.case", 1e-6, || Ok(1e-3));
        r.case("inner/f32/known_bug.fine", 1e-6, || Ok(1e-8));
        // Another class than the list's: a failure. A name that only contains a listed one: not covered.
        r.case("inner/f32/known_bug.panics", 1e-6, || panic!("boom"));
        r.case("inner/f32/known_bug.case.other", 1e-6, || Ok(1e-3));
        let rep = r.report;
        assert_eq!((rep.passed(), rep.failed(), rep.skipped()), (2, 6, 2), "{rep}");
        assert_eq!((rep.known_failures(), rep.unexpected_passes()), (1, 1), "{rep}");
        let text = rep.to_string();
        assert!(text.contains("XFAIL inner/f32/known_bug.case (max err 1.0e-3 > tol 1.0e-6): upstream bug #1; here: error above tolerance"), "{text}");
        assert!(text.contains("XPASS inner/f32/known_bug.fine (max err 1.0e-8 ≤ tol 1.0e-6): listed as a known failure (upstream bug #1), but passed"), "{text}");
        assert!(text.contains("FAIL inner/f32/known_bug.panics: panicked: boom — a known failure (upstream bug #1) that failed otherwise: Panicked, not [WrongValues]"), "{text}");
        assert!(text.contains("FAIL inner/f32/known_bug.case.other"), "{text}");
        assert!(
            text.ends_with(
                "passed: 2 failed: 6 skipped: 2 known upstream failures: 1 known failures that passed: 1"
            ),
            "{text}"
        );
        assert!(text.contains("FAIL panics: panicked: kernel exploded"), "{text}");
        assert!(text.contains("FAIL too_far (max err 1.0e-3 > tol 1.0e-6)"), "{text}");
        assert!(text.contains("PASS ok (max err 1.0e-7 ≤ tol 1.0e-6)"), "{text}");
        assert!(text.contains("SKIP skip no bf16"), "{text}");
    }

    #[test]
    fn filter_selects_by_substring() {
        let mut r = Runner::new(Some("matmul"));
        r.case("inner/f32/matmul.2d", 1.0, || Ok(0.0));
        r.case("inner/f32/add", 1.0, || panic!("filtered out, must not run"));
        assert_eq!(r.report.cases.len(), 1);
    }

    #[test]
    fn half_tolerances_are_looser() {
        assert!(tol(Family::Elementwise, DType::BF16) > 100.0 * tol(Family::Elementwise, DType::F32));
        assert!(tol(Family::Elementwise, DType::F64) < tol(Family::Elementwise, DType::F32));
        assert_eq!(tol(Family::Exact, DType::BF16), 0.0);
    }
}
