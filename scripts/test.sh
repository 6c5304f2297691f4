#!/usr/bin/env bash
# README's test command: installs what the tests need, then runs the whole test suite,
# including the 4-process MPI tests (xtask's `mpi` feature) when an MPI library is present.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
FEATURES=()
if command -v mpicc >/dev/null 2>&1 && command -v mpirun >/dev/null 2>&1; then
  FEATURES=(--features xtask/mpi)
else
  echo "test: no MPI library found: the multi-process tests are skipped" >&2
fi
exec cargo test --workspace "${FEATURES[@]}" "$@"
