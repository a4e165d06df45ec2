#!/usr/bin/env bash
# Copies what the GPU machine needs into DEST/.carry (default: ../main, the checkout the
# device tool sends; `runners/carry.sh .` for this checkout): the attention, kernel_sums,
# sequence_mixers and moe runners, the GPU and comparison test binaries (attention, kernel sums, sequence mixers, MoE), the Python comparison package, device_run.sh,
# device_verdict.py and grid_shards.sh, and the wheels in .whl/ (runners/fetch_wheels.sh) into
# .carry/whl/. Build first:
#   cargo build --release --bin attention --bin kernel_sums --bin sequence_mixers --bin moe --tests
# The device tool sends at most 64 MiB (the tracked tree, about 36 MiB with site/ and data/, plus
# what `carry` names), and the whole .carry/ is about 43 MiB: name only what a call needs, e.g.
# for kernel sums .carry/kernel_sums, .carry/gpu_kernel_sums_test, .carry/device_run.sh,
# .carry/device_verdict.py, .carry/runners and .carry/whl.
set -euo pipefail
dest=${1:-../main}/.carry
rm -rf "$dest" && mkdir -p "$dest/runners"
cp target/release/attention target/release/kernel_sums target/release/sequence_mixers \
  target/release/moe "$dest/"
newest() { ls -t target/release/deps/$1-* | grep -v '\.d$' | head -1; }
cp "$(newest gpu_attention)" "$dest/gpu_attention_test"
cp "$(newest compare_script)" "$dest/compare_script_test"
cp "$(newest gpu_kernel_sums)" "$dest/gpu_kernel_sums_test"
cp "$(newest gpu_sequence_mixers)" "$dest/gpu_sequence_mixers_test"
cp "$(newest gpu_moe)" "$dest/gpu_moe_test"
cp -r runners/compare "$dest/runners/"
rm -rf "$dest/runners/compare/__pycache__"
cp runners/device_run.sh runners/device_verdict.py runners/grid_shards.sh \
  runners/jax_init_probe.py "$dest/"
if ls .whl/*.whl > /dev/null 2>&1; then
  mkdir -p "$dest/whl" && cp .whl/*.whl "$dest/whl/"
fi
# Without their symbol tables the binaries are about a third smaller: the tracked tree and the
# seven binaries a call needs then fit the device tool's 64 MiB (they did not on 2026-12-05).
if command -v strip > /dev/null; then
  strip "$dest"/attention "$dest"/kernel_sums "$dest"/sequence_mixers "$dest"/moe "$dest"/*_test
fi
du -sh "$dest"
