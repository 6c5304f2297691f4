//! Turns the GPU tiers' environment switches into `cfg`s, so tests that need hardware are
//! reported as *ignored, with the reason* in cargo's summary unless their switch is exactly `1`
//! (`#[cfg_attr(not(metax_tests), ignore = "…")]`). Any other value leaves them off.

fn main() {
    for (var, cfg) in [
        ("METAX_TESTS", "metax_tests"),
        ("CUDA_PROXY_TESTS", "cuda_proxy_tests"),
        ("MULTI_GPU_TESTS", "multi_gpu_tests"),
    ] {
        println!("cargo:rustc-check-cfg=cfg({cfg})");
        println!("cargo:rerun-if-env-changed={var}");
        if std::env::var(var).as_deref() == Ok("1") {
            println!("cargo:rustc-cfg={cfg}");
        }
    }
}
