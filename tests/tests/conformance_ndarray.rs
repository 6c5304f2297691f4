//! The backend conformance suite (issue #6) on the CPU backends CI has: NdArray (the reference
//! backend every command runs on) and Flex (burn's CPU backend with bf16/f16, used for
//! `--mixed-precision bf16`).

use burn::backend::{Autodiff, Flex, NdArray};

/// Fewer passed cases than this means cases went missing (an empty suite must not pass).
const MIN_PASSED_NDARRAY: usize = 340;
/// Flex also runs the bf16 and f16 cases.
const MIN_PASSED_FLEX: usize = 600;

fn check(report: &burn_conformance::Report, min_passed: usize) {
    println!("{report}");
    let failures: Vec<String> = report.failures().map(|c| c.to_string()).collect();
    assert!(failures.is_empty(), "{} failed:\n{}", failures.len(), failures.join("\n"));
    assert!(report.passed() >= min_passed, "only {} cases passed (expected ≥ {min_passed})", report.passed());
}

#[test]
fn conformance_ndarray() {
    let t = std::time::Instant::now();
    let report = burn_conformance::run::<Autodiff<NdArray<f32>>>(&Default::default(), None);
    println!("ndarray: {:.1} s", t.elapsed().as_secs_f64());
    check(&report, MIN_PASSED_NDARRAY);
}

#[test]
fn conformance_flex() {
    let t = std::time::Instant::now();
    let report = burn_conformance::run::<Autodiff<Flex>>(&Default::default(), None);
    println!("flex: {:.1} s", t.elapsed().as_secs_f64());
    check(&report, MIN_PASSED_FLEX);
}
