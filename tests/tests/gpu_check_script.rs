//! `scripts/gpu-check.sh` on a machine without a GPU: it stops at once with "no GPU" (exit 2),
//! and, with a stand-in `nvidia-smi` and a stand-in pack, runs every step from the pack, writes
//! `gpu-report.json` and one log per step, refuses a pack whose binary does not match its
//! manifest, and fails a run whose `summary.json` is off the PyTorch fixture. Its verdict is
//! asserted exactly: "failed" when a selected step did not run (no pack, a name in
//! `GPU_CHECK_STEPS` that is no step) or the throughput is below its floor.
#![allow(clippy::unwrap_used)]

use std::io::Write;
use std::os::unix::fs::PermissionsExt;
use std::path::{Path, PathBuf};
use std::process::{Command, Output};

fn script() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("../scripts/gpu-check.sh")
}

fn executable(path: &Path, text: &str) {
    std::fs::write(path, text).unwrap();
    std::fs::set_permissions(path, std::fs::Permissions::from_mode(0o755)).unwrap();
}

/// Runs the script with `bin` first on PATH (where the stand-in `nvidia-smi` lives).
fn run(bin: &Path, pack: &Path, out: &Path) -> Output {
    run_env(bin, pack, out, &[])
}

/// [`run`] with extra environment variables (`GPU_CHECK_STEPS`, `GPU_CHECK_SCALE`). Stand-in
/// CUDA libraries (in `bin`) make the environment step pass wherever the test runs.
fn run_env(bin: &Path, pack: &Path, out: &Path, env: &[(&str, &str)]) -> Output {
    let path = format!("{}:{}", bin.display(), std::env::var("PATH").unwrap_or_default());
    let mut cmd = Command::new("bash");
    cmd.arg(script())
        .arg(pack)
        .arg(out)
        .env("PATH", path)
        .env("GPU_CHECK_LIBCUDA", bin.join("libcuda.so.1"))
        .env("GPU_CHECK_LIBNVRTC", bin.join("libnvrtc.so.13"))
        .env_remove("GPU_CHECK_STEPS")
        .env_remove("GPU_CHECK_MIN_TOKENS_PER_SEC");
    cmd.envs(env.iter().copied()).output().unwrap()
}

fn report(out: &Path) -> serde_json::Value {
    serde_json::from_str(&std::fs::read_to_string(out.join("gpu-report.json")).unwrap()).unwrap()
}

fn status_of<'a>(report: &'a serde_json::Value, step: &str) -> &'a str {
    report["steps"]
        .as_array()
        .unwrap()
        .iter()
        .find(|s| s["name"] == step)
        .and_then(|s| s["status"].as_str())
        .unwrap_or_else(|| panic!("no step {step} in {report}"))
}

#[test]
fn no_gpu_exits_at_once_with_status_2_and_says_so() {
    let dir = tempfile::tempdir().unwrap();
    let bin = dir.path().join("bin");
    std::fs::create_dir(&bin).unwrap();
    // An nvidia-smi that lists no device (as on a machine with the tools but no GPU).
    executable(&bin.join("nvidia-smi"), "#!/bin/sh\necho 'No devices were found' >&2\nexit 6\n");
    let out = dir.path().join("out");
    let o = run(&bin, &dir.path().join("no-pack"), &out);
    assert_eq!(o.status.code(), Some(2), "{o:?}");
    let stderr = String::from_utf8_lossy(&o.stderr);
    assert!(stderr.contains("no GPU"), "{stderr}");
    let r = report(&out);
    assert!(r["verdict"].as_str().unwrap().starts_with("no GPU"), "{r}");
    assert!(r["steps"].as_array().unwrap().is_empty(), "{r}");
}

/// A stand-in pack: `xtask` is a shell script that answers each step as the real binary would
/// on a GPU, writing `summary.json` with the given worst loss difference for the Qwen3 runs.
fn stand_in_pack(dir: &Path, worst_loss_rel_diff: &str, digest_ok: bool) -> PathBuf {
    let pack = dir.join("pack");
    std::fs::create_dir_all(pack.join("bin")).unwrap();
    std::fs::create_dir_all(pack.join("fixtures/qwen3-tiny-a")).unwrap();
    let xtask = format!(
        r#"#!/bin/sh
# Stand-in for the pack's xtask: records its arguments, answers like the real one.
echo "$@" >> "$(dirname "$0")/../calls.txt"
case "$1" in
  conformance) echo "passed: 3 failed: 0 skipped: 0";;
  train-qwen3)
    while [ $# -gt 0 ]; do [ "$1" = --out-dir ] && out="$2"; shift; done
    mkdir -p "$out"
    echo '{{"worst_loss_rel_diff": {worst_loss_rel_diff}, "worst_grad_norm_rel_diff": 2e-6}}' > "$out/summary.json";;
  gpu-bench)
    tune=""
    while [ $# -gt 0 ]; do [ "$1" = --out ] && out="$2"; [ "$1" = --autotune-log ] && tune="$2"; shift; done
    echo "cuda_proxy_fsdp_w1_bf16_tokens_per_sec: 6400.0" > "$out"
    if [ -n "$tune" ]; then echo "Fastest result matmul" > "$tune"; fi;;
esac
"#
    );
    let mut gz = flate2::write::GzEncoder::new(
        std::fs::File::create(pack.join("bin/xtask.gz")).unwrap(),
        flate2::Compression::default(),
    );
    gz.write_all(xtask.as_bytes()).unwrap();
    gz.finish().unwrap();
    let digest = if digest_ok {
        let file = dir.join("xtask-plain");
        std::fs::write(&file, xtask.as_bytes()).unwrap();
        let o = Command::new("sha256sum").arg(&file).output().unwrap();
        String::from_utf8_lossy(&o.stdout).split_whitespace().next().unwrap().to_string()
    } else {
        "0".repeat(64)
    };
    std::fs::write(pack.join("manifest.json"), format!("{{\n  \"binary_sha256\": \"{digest}\"\n}}\n"))
        .unwrap();
    pack
}

fn gpu_bin(dir: &Path) -> PathBuf {
    let bin = dir.join("fake-bin");
    std::fs::create_dir_all(&bin).unwrap();
    executable(
        &bin.join("nvidia-smi"),
        "#!/bin/sh\ncase \"$*\" in\n  -L) echo 'GPU 0: stand-in';;\n  *name*) echo stand-in;;\n  \
         *driver*) echo 0.0;;\n  *) echo 'CUDA Version: 13.0';;\nesac\n",
    );
    for lib in ["libcuda.so.1", "libnvrtc.so.13"] {
        std::fs::write(bin.join(lib), b"stand-in").unwrap();
    }
    bin
}

#[test]
fn every_step_runs_from_the_pack_and_is_reported() {
    let dir = tempfile::tempdir().unwrap();
    let pack = stand_in_pack(dir.path(), "1e-6", true);
    let out = dir.path().join("out");
    let archive = dir.path().join("gpu-out.tgz");
    let o = run_env(&gpu_bin(dir.path()), &pack, &out, &[("GPU_CHECK_ARCHIVE", archive.to_str().unwrap())]);
    let r = report(&out);
    for step in [
        "pack",
        "conformance",
        "qwen3-tiny-single",
        "qwen3-tiny-fsdp4",
        "qwen3-tiny-offload",
        "qwen3-tiny-burn-cuda-single",
        "qwen3-tiny-fsdp4-burn-cuda",
        "qwen3-tiny-single-vs-pytorch",
        "qwen3-tiny-burn-cuda-single-vs-pytorch",
        "qwen3-tiny-fsdp4-burn-cuda-vs-pytorch",
        "throughput",
        "throughput-floor",
        "environment",
    ] {
        assert_eq!(status_of(&r, step), "passed", "{step}: {r}");
        assert!(out.join(format!("{step}.log")).is_file(), "{step}.log");
    }
    assert_eq!(status_of(&r, "conformance-fused"), "skipped: only when GPU_CHECK_STEPS names it", "{r}");
    // The archive holds the report and every log, not the unpacked binary.
    let listing = Command::new("tar").arg("tzf").arg(&archive).output().unwrap();
    let listing = String::from_utf8_lossy(&listing.stdout);
    for file in [
        "./gpu-report.json",
        "./conformance.log",
        "./run-fsdp4/summary.json",
        "./gpu-bench.txt",
        "./autotune.log",
    ] {
        assert!(listing.lines().any(|l| l == file), "{file} not in the archive: {listing}");
    }
    assert!(!listing.contains("bin/xtask"), "{listing}");
    // Each step ran the unpacked binary with the flags docs/gpu.md lists.
    let calls = std::fs::read_to_string(out.join("calls.txt")).unwrap();
    for expected in [
        "conformance --backend cuda-proxy --quiet --progress --min-pass 650",
        "train-qwen3 --device cuda-proxy --no-fsdp",
        "train-qwen3 --device cuda --no-fsdp",
        "train-qwen3 --device cuda-proxy --world-size 4 --offload",
        "train-qwen3 --device cuda --world-size 4",
        "gpu-bench --preset 0.6b --batch 4 --seq 1024 --steps 3 --variants cuda_proxy,burn_cuda,bf16",
        "--autotune-log",
    ] {
        assert!(calls.contains(expected), "{expected} not in {calls}");
    }
    assert_eq!(r["verdict"], "passed", "{r}");
    assert_eq!(o.status.code(), Some(0), "{o:?}");
}

#[test]
fn no_pack_fails_the_check_with_every_step_not_run() {
    let dir = tempfile::tempdir().unwrap();
    let out = dir.path().join("out");
    let o = run(&gpu_bin(dir.path()), &dir.path().join("no-such-pack"), &out);
    let r = report(&out);
    assert_eq!(r["verdict"], "failed", "{r}");
    assert_eq!(o.status.code(), Some(1), "{o:?}");
    assert!(status_of(&r, "pack").starts_with("not run: no pack"), "{r}");
    assert_eq!(status_of(&r, "conformance"), "not run: no pack", "{r}");
    assert_eq!(status_of(&r, "conformance-fused"), "skipped: only when GPU_CHECK_STEPS names it", "{r}");
}

#[test]
fn a_step_name_that_is_no_step_fails_the_check() {
    let dir = tempfile::tempdir().unwrap();
    let pack = stand_in_pack(dir.path(), "1e-6", true);
    let out = dir.path().join("out");
    let o = run_env(&gpu_bin(dir.path()), &pack, &out, &[("GPU_CHECK_STEPS", "conformance throughtput")]);
    let r = report(&out);
    assert_eq!(r["verdict"], "failed", "{r}");
    assert_eq!(o.status.code(), Some(1), "{o:?}");
    assert!(status_of(&r, "steps").contains("no such step: throughtput"), "{r}");
    assert_eq!(status_of(&r, "conformance"), "passed", "{r}");
}

#[test]
fn a_throughput_below_its_floor_fails_the_check() {
    let dir = tempfile::tempdir().unwrap();
    let pack = stand_in_pack(dir.path(), "1e-6", true);
    let out = dir.path().join("out");
    let o = run_env(
        &gpu_bin(dir.path()),
        &pack,
        &out,
        &[("GPU_CHECK_STEPS", "throughput"), ("GPU_CHECK_MIN_TOKENS_PER_SEC", "10000")],
    );
    let r = report(&out);
    assert_eq!(r["verdict"], "failed", "{r}");
    assert_eq!(o.status.code(), Some(1), "{o:?}");
    assert_eq!(status_of(&r, "throughput"), "passed", "{r}");
    assert!(status_of(&r, "throughput-floor").starts_with("failed"), "{r}");
    let log = std::fs::read_to_string(out.join("throughput-floor.log")).unwrap();
    assert!(log.contains("6400.0") && log.contains("floor 10000"), "{log}");
}

#[test]
fn a_pack_that_does_not_match_its_manifest_runs_nothing() {
    let dir = tempfile::tempdir().unwrap();
    let pack = stand_in_pack(dir.path(), "1e-6", false);
    let out = dir.path().join("out");
    let o = run(&gpu_bin(dir.path()), &pack, &out);
    assert_eq!(o.status.code(), Some(1), "{o:?}");
    let r = report(&out);
    assert_eq!(r["verdict"], "failed");
    assert!(status_of(&r, "pack").starts_with("failed"), "{r}");
    assert_eq!(status_of(&r, "conformance"), "not run: the pack did not unpack intact (pack.log)", "{r}");
    assert!(!out.join("calls.txt").exists(), "no step ran the binary");
}

#[test]
fn a_run_off_the_pytorch_fixture_fails_its_check() {
    let dir = tempfile::tempdir().unwrap();
    let pack = stand_in_pack(dir.path(), "3e-3", true);
    let out = dir.path().join("out");
    let o = run(&gpu_bin(dir.path()), &pack, &out);
    assert_eq!(o.status.code(), Some(1), "{o:?}");
    let r = report(&out);
    assert_eq!(status_of(&r, "qwen3-tiny-fsdp4"), "passed", "the run itself finished");
    assert!(status_of(&r, "qwen3-tiny-fsdp4-vs-pytorch").starts_with("failed"), "{r}");
    let log = std::fs::read_to_string(out.join("qwen3-tiny-fsdp4-vs-pytorch.log")).unwrap();
    assert!(log.contains("3e-3") && log.contains("1e-4"), "{log}");
    // Burn's CUDA backend runs f32 matmuls in TF32: its runs are held to TF32's 1e-2.
    assert_eq!(status_of(&r, "qwen3-tiny-burn-cuda-single-vs-pytorch"), "passed", "{r}");
    let log = std::fs::read_to_string(out.join("qwen3-tiny-fsdp4-burn-cuda-vs-pytorch.log")).unwrap();
    assert!(log.contains("3e-3") && log.contains("1e-2"), "{log}");
}

#[test]
fn a_burn_cuda_run_off_by_more_than_tf32_fails_its_check() {
    let dir = tempfile::tempdir().unwrap();
    let pack = stand_in_pack(dir.path(), "2e-2", true);
    let out = dir.path().join("out");
    let o = run(&gpu_bin(dir.path()), &pack, &out);
    assert_eq!(o.status.code(), Some(1), "{o:?}");
    let r = report(&out);
    for run in ["burn-cuda-single", "fsdp4-burn-cuda", "single"] {
        let step = format!("qwen3-tiny-{run}-vs-pytorch");
        assert!(status_of(&r, &step).starts_with("failed"), "{step}: {r}");
    }
}

#[test]
fn gpu_check_steps_selects_the_steps_that_run() {
    // A rerun of the slow steps alone, with longer timeouts: the others are reported skipped.
    let dir = tempfile::tempdir().unwrap();
    let pack = stand_in_pack(dir.path(), "1e-6", true);
    let out = dir.path().join("out");
    run_env(
        &gpu_bin(dir.path()),
        &pack,
        &out,
        &[("GPU_CHECK_STEPS", "conformance conformance-fused qwen3-tiny-fsdp4"), ("GPU_CHECK_SCALE", "2.5")],
    );
    let r = report(&out);
    for step in
        ["pack", "conformance", "conformance-fused", "qwen3-tiny-fsdp4", "qwen3-tiny-fsdp4-vs-pytorch"]
    {
        assert_eq!(status_of(&r, step), "passed", "{step}: {r}");
    }
    for step in ["qwen3-tiny-single", "qwen3-tiny-fsdp4-burn-cuda", "throughput"] {
        assert_eq!(status_of(&r, step), "skipped: not in GPU_CHECK_STEPS", "{step}: {r}");
    }
    let names: Vec<&str> =
        r["steps"].as_array().unwrap().iter().map(|s| s["name"].as_str().unwrap()).collect();
    assert!(!names.contains(&"qwen3-tiny-single-vs-pytorch"), "{names:?}");
    let calls = std::fs::read_to_string(out.join("calls.txt")).unwrap();
    assert_eq!(calls.lines().count(), 3, "{calls}");
    assert!(
        calls.contains("conformance --backend cuda-proxy-fused --quiet --progress --min-pass 480"),
        "{calls}"
    );
}
