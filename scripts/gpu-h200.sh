#!/usr/bin/env bash
# One prepared run for an H200-class NVIDIA machine (issue #8; budget: under 8 minutes after the
# build). Results go to ${OUT:-./gpu-out}/gpu-bench.txt for docs/performance.md.
#   1. the MetaX runtime's tier-3 checks on the CUDA proxy (conformance, Qwen3 FSDP steps);
#   2. Qwen3-0.6B shapes: tokens/s in f32 and bf16 (FSDP W=1, MixedPrecisionPolicy bf16/fp32),
#      MFU against the H200's 989 TFLOPS bf16 dense peak, FSDP W=1 vs no FSDP.
# Needs the crates already in ~/.cargo (offline machine): run `cargo fetch` beforehand.
set -uo pipefail
cd "$(dirname "$0")/.."
OUT="${OUT:-./gpu-out}"
mkdir -p "$OUT"
nvidia-smi > "$OUT/nvidia-smi.txt" 2>&1 || true
cargo build --offline -p xtask --features cuda-proxy 2>&1 | tail -3 | tee "$OUT/build.txt"
timeout 300 cargo run --offline -q -p xtask --features cuda-proxy -- conformance --backend cuda-proxy --quiet \
  > "$OUT/conformance.txt" 2>&1; echo "conformance exit $?" | tee -a "$OUT/summary.txt"
# NCCL DeviceGroup on the CUDA proxy (issue #5): cudarc opens `libnccl.so`; expose a versioned
# library under that name when only `libnccl.so.2` exists.
if ! ldconfig -p 2>/dev/null | grep -q 'libnccl\.so '; then
  NCCL2="$(ldconfig -p 2>/dev/null | awk '/libnccl\.so\.2 /{print $NF; exit}')"
  [ -z "$NCCL2" ] && NCCL2="$(find /usr /opt /root/.local -name 'libnccl.so.2*' 2>/dev/null | head -n 1)"
  if [ -n "$NCCL2" ]; then mkdir -p "$OUT/nccl-lib"; ln -sf "$NCCL2" "$OUT/nccl-lib/libnccl.so"; export LD_LIBRARY_PATH="$OUT/nccl-lib:${LD_LIBRARY_PATH:-}"; fi
fi
CUDA_PROXY_TESTS=1 timeout 180 cargo test --offline -q -p burn-metax-backend --features cuda --test nccl_gpu -- --nocapture --test-threads=1 \
  > "$OUT/nccl.txt" 2>&1; echo "nccl exit $?" | tee -a "$OUT/summary.txt"
timeout 300 cargo run --offline -q -p xtask --features cuda-proxy -- gpu-bench --preset 0.6b --batch 4 --seq 1024 \
  --steps 5 --out "$OUT/gpu-bench.txt" 2>&1 | tee "$OUT/gpu-bench.log"; echo "gpu-bench exit ${PIPESTATUS[0]}" | tee -a "$OUT/summary.txt"
cat "$OUT/gpu-bench.txt" 2>/dev/null
