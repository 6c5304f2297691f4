#!/usr/bin/env bash
# Installs the system packages the full build and test suite need, when missing:
# - OpenMPI and libclang (for `--features mpi`: the `mpi` crate binds the MPI library at build time);
# - a C++ compiler (g++): the emulated MetaX device (`metax-emu`) compiles the kernels the MACA
#   dialect generates with it, and the dialect tests syntax-check them.
# Debian/Ubuntu only (apt-get); elsewhere it says what to install and carries on.
set -euo pipefail
have_mpi() { command -v mpicc >/dev/null 2>&1 && command -v mpirun >/dev/null 2>&1; }
have_clang() { ls /usr/lib/llvm-*/lib/libclang*.so* >/dev/null 2>&1 || ldconfig -p 2>/dev/null | grep -q libclang; }
have_cxx() { command -v g++ >/dev/null 2>&1 || command -v clang++ >/dev/null 2>&1; }
if have_mpi && have_clang && have_cxx; then
  exit 0
fi
if command -v apt-get >/dev/null 2>&1; then
  SUDO=""
  if [ "$(id -u)" != 0 ]; then SUDO="sudo"; fi
  echo "setup: installing openmpi-bin libopenmpi-dev libclang-dev g++"
  $SUDO apt-get update -qq
  DEBIAN_FRONTEND=noninteractive $SUDO apt-get install -y -qq --no-install-recommends \
    openmpi-bin libopenmpi-dev libclang-dev g++ >/dev/null
else
  echo "setup: no apt-get here; install an MPI library (OpenMPI or MPICH), libclang and g++ (or clang++)" >&2
fi
