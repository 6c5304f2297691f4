#!/usr/bin/env bash
# Tier 3: the MetaX backend's CubeCL server on an NVIDIA GPU (H200), through the CUDA proxy
# (`--features cuda-proxy`: CUDA driver API + NVRTC via cudarc, cubecl-cpp's CUDA dialect).
#
# Usage (from anywhere; needs an NVIDIA driver, libnvrtc, and the crates already in the cargo
# cache/vendor dir since the GPU machine is offline):
#     OUT=/path/to/results burn-metax-backend/scripts/tier3-cuda-proxy.sh
# Results go under ${OUT:-./gpu-out}: one log per step and summary.txt. Exit status: 0 only if
# every step passed.
set -uo pipefail

ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/../.." && pwd)"
OUT="${OUT:-./gpu-out}"
mkdir -p "$OUT"
OUT="$(cd "$OUT" && pwd)"
cd "$ROOT"

export CUDA_PROXY_TESTS=1
export CARGO_TARGET_DIR="${CARGO_TARGET_DIR:-$ROOT/target-tier3}"
export RUST_BACKTRACE=1
SUMMARY="$OUT/summary.txt"
: > "$SUMMARY"
FAILED=0

step() { # step NAME TIMEOUT_SECONDS COMMAND...
    local name="$1" limit="$2"; shift 2
    local start=$SECONDS
    echo "== $name: $*" | tee -a "$SUMMARY"
    if timeout "$limit" "$@" > "$OUT/$name.log" 2>&1; then
        echo "   PASS ($((SECONDS - start)) s)" | tee -a "$SUMMARY"
    else
        local rc=$?
        echo "   FAIL rc=$rc ($((SECONDS - start)) s), see $name.log; last lines:" | tee -a "$SUMMARY"
        tail -n 30 "$OUT/$name.log" | sed 's/^/   | /' | tee -a "$SUMMARY"
        FAILED=1
    fi
}

{ date -u; nvidia-smi || true; ls -l /usr/local/cuda/include/cuda_fp16.h 2>&1 || true; } > "$OUT/environment.txt" 2>&1

# Per-step limits in seconds (the device machine's own per-command limit may be lower: size them).
BUILD_TIMEOUT="${BUILD_TIMEOUT:-1500}"
TEST_TIMEOUT="${TEST_TIMEOUT:-900}"

# NCCL for the `cuda` feature's NcclCommunicator: cudarc opens `libnccl.so` (not `libnccl.so.2`).
# If only the versioned library is installed (e.g. the `nvidia-nccl-cu12` Python wheel), expose
# it under the unversioned name in a private directory on LD_LIBRARY_PATH.
if ! ldconfig -p 2>/dev/null | grep -q 'libnccl\.so '; then
    NCCL_SO2="$(ldconfig -p 2>/dev/null | awk '/libnccl\.so\.2 /{print $NF; exit}')"
    if [ -z "$NCCL_SO2" ]; then
        NCCL_SO2="$(find /usr /opt /root/.local -name 'libnccl.so.2*' 2>/dev/null | head -n 1)"
    fi
    if [ -n "$NCCL_SO2" ]; then
        mkdir -p "$OUT/nccl-lib"
        ln -sf "$NCCL_SO2" "$OUT/nccl-lib/libnccl.so"
        export LD_LIBRARY_PATH="$OUT/nccl-lib:${LD_LIBRARY_PATH:-}"
    fi
fi
echo "libnccl: $(ldconfig -p 2>/dev/null | grep libnccl || true) LD_LIBRARY_PATH=${LD_LIBRARY_PATH:-}" >> "$OUT/environment.txt"

# `--features cuda` = cuda-proxy + collectives + NCCL: one build for every step below.
step build "$BUILD_TIMEOUT" cargo build --offline -p burn-metax-backend --features cuda --tests
step gpu-tests "$TEST_TIMEOUT" cargo test --offline -p burn-metax-backend --features cuda --test cuda_proxy_gpu -- --nocapture --test-threads=1
step nccl-tests "$TEST_TIMEOUT" cargo test --offline -p burn-metax-backend --features cuda --test nccl_gpu -- --nocapture --test-threads=1
step mock-tests "$TEST_TIMEOUT" cargo test --offline -p burn-metax-backend --features cuda

# The backend conformance suite on the CUDA proxy (f64 host references), then Qwen3 FSDP
# training steps on it against the PyTorch trajectory.
step conformance "$TEST_TIMEOUT" cargo run --offline -p xtask --features cuda-proxy -- conformance --backend cuda-proxy
step qwen3-fsdp-step "$TEST_TIMEOUT" env CUDA_PROXY_TESTS=1 cargo test --offline -p tests --features cuda-proxy --test integration gpu_cuda_proxy:: -- --nocapture

echo "overall: $([ $FAILED -eq 0 ] && echo PASS || echo FAIL)" | tee -a "$SUMMARY"
exit $FAILED
