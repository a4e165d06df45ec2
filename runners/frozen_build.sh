#!/usr/bin/env bash
# Builds the attention runner and the attention GPU test binary at COMMIT (a git worktree under
# target/frozen-COMMIT, so the checkout is untouched) and copies them, stripped, with the
# Python comparison package, device_run.sh, device_verdict.py and grid_shards.sh, into
# DEST/.carry (default: this checkout). The binaries report COMMIT (build.rs), so the shards of
# one run can be measured over several sessions, each rebuilding at the same commit:
#   bash runners/frozen_build.sh 2e4fa1b
# then on the GPU machine, e.g. forward shards 3 and 4 of 8 of the H200 grid:
#   KP_SHARD_FILTER=pass=fwd KP_SHARD_NAME=gpu_attention_fwd bash .carry/grid_shards.sh OUT 8 BUDGET_S 3 4
# The runner's Python package and scripts come from COMMIT too.
set -euo pipefail
commit=$(git rev-parse --verify "${1:?commit}^{commit}")
repo=$(git rev-parse --show-toplevel)
dest=${2:-$repo}/.carry
tree=$repo/target/frozen-${commit:0:7}
if [ ! -d "$tree" ]; then
  git -C "$repo" worktree add --detach "$tree" "$commit"
fi
# One target folder for every frozen build: the dependencies build once.
(cd "$tree" && CARGO_TARGET_DIR=$repo/target/frozen cargo build --release --bin attention \
  --test gpu_attention)
bin=$repo/target/frozen/release
rm -rf "$dest" && mkdir -p "$dest/runners"
cp "$bin/attention" "$dest/"
cp "$(ls -t "$bin"/deps/gpu_attention-* | grep -v '\.d$' | head -1)" "$dest/gpu_attention_test"
cp -r "$tree/runners/compare" "$dest/runners/"
rm -rf "$dest/runners/compare/__pycache__"
cp "$tree/runners/device_run.sh" "$tree/runners/device_verdict.py" "$tree/runners/grid_shards.sh" \
  "$dest/"
command -v strip > /dev/null && strip "$dest/attention" "$dest/gpu_attention_test"
# (grep without -q: with pipefail, strings killed by an early exit would read as no match)
if ! strings "$dest/attention" | grep -F "$commit" > /dev/null; then
  echo "the runner does not report $commit: uncommitted changes in $tree?" >&2
  exit 1
fi
du -sh "$dest"
