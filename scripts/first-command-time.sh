#!/usr/bin/env bash
# How long a newcomer waits for the first training step (issue #45): the README's first command,
# `cargo xtask train-qwen3`, on a fresh clone with an empty cargo cache (downloads included),
# timestamping each line of its output. The build is also run with `--timings` beforehand
# (the same build: the command itself then starts at once), whose report shows where the
# minutes go: DIR/target/cargo-timings/cargo-timing.html.
#
#   scripts/first-command-time.sh [REV] [DIR]    # REV default HEAD, DIR default a new temp dir
set -euo pipefail
repo=$(cd "$(dirname "$0")/.." && pwd)
rev=${1:-HEAD}
dir=${2:-$(mktemp -d)}
git clone -q "$repo" "$dir/src" && git -C "$dir/src" checkout -q "$rev"
# An empty cargo home (the registry is downloaded again), with this toolchain's cargo.
export CARGO_HOME="$dir/cargo-home" CARGO_TERM_COLOR=never
mkdir -p "$CARGO_HOME"
cd "$dir/src"
start=$(date +%s.%N)
since() { echo "$(date +%s.%N) - $start" | bc; }
echo "rev $(git rev-parse --short HEAD), $(nproc) cores, empty CARGO_HOME, started $(date -Is)"
cargo build -p xtask --timings 2>&1 | tail -2
echo "build done after $(since) s"
cargo xtask train-qwen3 2>&1 | while IFS= read -r line; do printf '%8.1f %s\n' "$(since)" "$line"; done
echo "timings: $dir/src/target/cargo-timings/cargo-timing.html"
