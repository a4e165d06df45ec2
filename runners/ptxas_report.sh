#!/usr/bin/env bash
# Prints ptxas's resource report (registers, spill bytes, stack frame) of every default flash
# kernel instantiation (forward and backward, bf16, sm_90a). NVRTC runs ptxas itself with
# `--ptxas-options=-v`, so this needs only libnvrtc.so.13 (no GPU, no nvcc): on the development
# machine, LD_LIBRARY_PATH=target/ci-nvrtc/nvidia/cu13/lib (see README, Tests).
set -euo pipefail
cd "$(dirname "$0")/.."
cargo test --release --test kernels_compile default_kernels_fit_their_registers -- --nocapture 2>&1 \
  | grep -E '^\|'
