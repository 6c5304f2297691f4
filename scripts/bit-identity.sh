#!/usr/bin/env bash
# Are the CPU training results bit for bit what they were at an earlier commit?
#
#   scripts/bit-identity.sh <rev> [<rev2>]
#
# Builds `xtask` (default features) at <rev> in a temporary git worktree and at <rev2> (default:
# the working tree as it is), sharing this checkout's target directory, then trains the
# repository's fixture cases with both — Flex and NdArray, one device and FSDP, clipping with
# accumulation, offload, a 2 × 2 mesh, bf16, activation checkpointing, an untied head with
# uneven shards — and compares every step's loss and grad norm as written to metrics.jsonl
# (the exact f32/f64 values). Prints one line per case and exits 1 if any differs.
#
# Both builds run on this machine, so CPU-dependent kernels (Flex's vector width) are the same
# on both sides. A change that is meant to move only GPU work (stream order, uploads, kernel
# shapes) must leave every line "identical".
set -euo pipefail

old_rev=${1:?usage: scripts/bit-identity.sh <rev> [<rev2>]}
new_rev=${2:-}
repo=$(git rev-parse --show-toplevel)
target=${CARGO_TARGET_DIR:-$repo/target}
work=$(mktemp -d)
trap 'git -C "$repo" worktree remove --force "$work/tree" >/dev/null 2>&1 || true; rm -rf "$work"' EXIT

build() { # build <dir> <out binary>
    (cd "$1" && CARGO_TARGET_DIR=$target cargo build -q -p xtask)
    cp "$target/debug/xtask" "$2"
}

git -C "$repo" worktree add --detach "$work/tree" "$old_rev" >/dev/null
build "$work/tree" "$work/old"
if [ -n "$new_rev" ]; then
    git -C "$work/tree" checkout -q --detach "$new_rev"
    build "$work/tree" "$work/new"
else
    build "$repo" "$work/new"
fi

fixtures=$repo/tests/fixtures
run() { # run <bin> <out> <name> <fixture> <args...>
    local bin=$1 out=$2 name=$3 fixture=$4
    shift 4
    local c=$fixtures/$fixture
    local lr betas eps wd
    lr=$(python3 -c "import json;print(json.load(open('$c/train.json'))['lr'])")
    betas=$(python3 -c "import json;b=json.load(open('$c/train.json'))['betas'];print(f'{b[0]},{b[1]}')")
    eps=$(python3 -c "import json;print(json.load(open('$c/train.json'))['eps'])")
    wd=$(python3 -c "import json;print(json.load(open('$c/train.json'))['weight_decay'])")
    mkdir -p "$out"
    "$bin" train-qwen3 --checkpoint "$c" --batches "$c/batches.safetensors" --lr "$lr" \
        --betas "$betas" --eps "$eps" --weight-decay "$wd" --quiet --out-dir "$out/$name" "$@" \
        >"$out/$name.log" 2>&1 || { echo "$name: the run failed:"; tail -5 "$out/$name.log"; return 1; }
}

cases=(
    "flex-single qwen3-tiny-a --no-fsdp"
    "flex-w4 qwen3-tiny-a --world-size 4"
    "flex-w4-clip-accum qwen3-tiny-a --world-size 4 --clip 1.0 --grad-accum 2"
    "flex-w4-offload qwen3-tiny-a --world-size 4 --offload"
    "flex-mesh-2x2-clip qwen3-tiny-a --mesh 2x2 --clip 1.0"
    "flex-w4-bf16 qwen3-tiny-a --world-size 4 --mixed-precision bf16"
    "flex-w4-checkpointing qwen3-tiny-a --world-size 4 --activation-checkpointing block"
    "flex-untied-w3 qwen3-tiny-c --world-size 3"
    "ndarray-single-untied qwen3-tiny-c --no-fsdp --cpu-backend ndarray"
    "ndarray-w4 qwen3-tiny-a --world-size 4 --cpu-backend ndarray"
    "ndarray-w4-clip-offload qwen3-tiny-a --world-size 4 --cpu-backend ndarray --clip 1.0 --offload"
)
status=0
for spec in "${cases[@]}"; do
    read -r name fixture args <<<"$spec"
    # shellcheck disable=SC2086 # the case's flags are words
    run "$work/old" "$work/a" "$name" "$fixture" $args || { status=1; continue; }
    # shellcheck disable=SC2086
    run "$work/new" "$work/b" "$name" "$fixture" $args || { status=1; continue; }
    python3 - "$name" "$work/a/$name/metrics.jsonl" "$work/b/$name/metrics.jsonl" <<'EOF' || status=1
import json, sys
name, a, b = sys.argv[1:]
read = lambda p: [(j["step"], j["loss"], j["grad_norm"]) for j in map(json.loads, open(p))]
x, y = read(a), read(b)
if x == y and x:
    print(f"{name}: identical ({len(x)} steps)")
    sys.exit(0)
losses = sum(p[1] != q[1] for p, q in zip(x, y))
norms = sum(p[2] != q[2] for p, q in zip(x, y))
first = next((p[0] for p, q in zip(x, y) if p != q), None)
print(f"{name}: DIFFERENT ({len(x)} vs {len(y)} steps; {losses} losses and {norms} norms differ, first at step {first})")
sys.exit(1)
EOF
done
exit $status
