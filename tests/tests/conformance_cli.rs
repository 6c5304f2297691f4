//! `cargo xtask conformance`: flags parse, an unknown backend is a clear error naming
//! `--backend`, a GPU backend absent from this build exits with its own status, and a
//! filtered CPU run prints its report.
#![allow(clippy::unwrap_used)]

use xtask::conformance::{ConformanceArgs, ConformanceBackend, EXIT_UNAVAILABLE, Status, run};

#[test]
fn flags_parse() {
    let a = ConformanceArgs::parse_from_args(&["conformance", "--backend", "ndarray"]).unwrap();
    assert_eq!((a.backend, a.filter.as_deref(), a.quiet), (ConformanceBackend::Ndarray, None, false));
    for (name, kind) in [
        ("flex", ConformanceBackend::Flex),
        ("cuda-proxy", ConformanceBackend::CudaProxy),
        ("metax", ConformanceBackend::Metax),
        ("metax-emu-fused", ConformanceBackend::MetaxEmuFused),
        ("cuda-proxy-fused", ConformanceBackend::CudaProxyFused),
        ("cuda", ConformanceBackend::Cuda),
    ] {
        let a = ConformanceArgs::parse_from_args(&["conformance", "--backend", name, "--filter", "grad/"])
            .unwrap();
        assert_eq!((a.backend, a.filter.as_deref()), (kind, Some("grad/")));
        assert_eq!(a.backend.name(), name);
    }
}

#[test]
fn unknown_or_missing_backend_names_the_flag() {
    let e = ConformanceArgs::parse_from_args(&["conformance", "--backend", "tpu"]).unwrap_err().to_string();
    assert!(e.contains("--backend") && e.contains("tpu"), "{e}");
    assert!(e.contains("ndarray") && e.contains("metax"), "the error lists the valid backends: {e}");
    let e = ConformanceArgs::parse_from_args(&["conformance"]).unwrap_err().to_string();
    assert!(e.contains("--backend"), "{e}");
}

#[test]
fn gpu_backends_without_a_device_exit_with_their_own_status() {
    // No MACA SDK and no NVIDIA driver on CI machines (skip where one is present).
    for name in ["metax", "cuda-proxy", "cuda-proxy-fused", "cuda"] {
        let args = ConformanceArgs::parse_from_args(&["conformance", "--backend", name]).unwrap();
        let status = run(&args).unwrap();
        let Status::Unavailable(line) = &status else {
            println!("{name}: a device is present here; ran the suite");
            continue;
        };
        // Says why: no SDK/driver (naming the library), or a build without the feature.
        assert!(line.starts_with(&format!("backend {name}: ")), "{line}");
        assert!(
            line.contains("libmcruntime.so")
                || line.contains("libcuda")
                || line.contains("not available in this build"),
            "{line}"
        );
        assert_eq!(status.exit_code(), EXIT_UNAVAILABLE);
        assert_ne!(EXIT_UNAVAILABLE, 1, "distinct from the failure status");
    }
}

#[test]
#[cfg(not(feature = "burn-cuda"))]
fn fused_backends_name_the_build_they_need() {
    let args = ConformanceArgs::parse_from_args(&["conformance", "--backend", "metax-emu-fused"]).unwrap();
    let status = run(&args).unwrap();
    let Status::Unavailable(line) = &status else {
        panic!("metax-emu-fused ran in a build without burn-cuda")
    };
    assert!(line.contains("--features burn-cuda") && line.contains("metax-emu-fused"), "{line}");
    assert_eq!(status.exit_code(), EXIT_UNAVAILABLE);
}

#[test]
fn filtered_cpu_run_reports_its_cases() {
    let args =
        ConformanceArgs::parse_from_args(&["conformance", "--backend", "ndarray", "--filter", "softmax"])
            .unwrap();
    let Status::Ran(report) = run(&args).unwrap() else { panic!("ndarray must run") };
    assert!(report.passed() >= 6, "{report}");
    assert_eq!(report.failed(), 0, "{report}");
    assert!(report.cases.iter().all(|c| c.name.contains("softmax")), "{report}");
    assert_eq!(Status::Ran(report).exit_code(), 0);
}

#[test]
fn min_pass_guard_fails_a_run_with_too_few_cases() {
    // 6+ softmax cases pass on NdArray: a guard of 10 000 fails the run with its own case, one
    // of 1 does not.
    let run_with = |min: &str| {
        let args = ConformanceArgs::parse_from_args(&[
            "conformance",
            "--backend",
            "ndarray",
            "--filter",
            "softmax",
            "--progress",
            "--min-pass",
            min,
        ])
        .unwrap();
        assert!(args.progress);
        run(&args).unwrap()
    };
    let status = run_with("10000");
    let Status::Ran(report) = &status else { panic!("ndarray must run") };
    let guard: Vec<_> = report.failures().collect();
    assert_eq!(guard.len(), 1, "{report}");
    assert!(guard[0].to_string().contains("--min-pass 10000"), "{}", guard[0]);
    assert_eq!(status.exit_code(), 1);
    let status = run_with("1");
    assert_eq!(status.exit_code(), 0);
    burn_conformance::set_progress(false);
}
