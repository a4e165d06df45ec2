#!/usr/bin/env bash
# Builds the attention runner and the attention GPU test binary at COMMIT (a git worktree under
# target/frozen-COMMIT, so the checkout is untouched) and copies them, stripped, with the
# Python comparison package, device_run.sh, device_verdict.py and grid_shards.sh of COMMIT, into
# DEST/.carry (default: this checkout). The binaries report COMMIT (build.rs), so the shards of
# one run can be measured over several sessions, each rebuilding at the same commit:
#   bash runners/frozen_build.sh 2e4fa1b
# then on the GPU machine, e.g. forward shards 3 and 4 of 8 of the H200 grid:
#   KP_SHARD_FILTER=pass=fwd KP_SHARD_NAME=gpu_attention_fwd bash .carry/grid_shards.sh OUT 8 BUDGET_S 3 4
# Only the files named above are replaced in .carry/; anything else there (other runners that
# runners/carry.sh copied, wheels, results) stays. Nothing is replaced unless every step works.
set -euo pipefail
commit=$(git rev-parse --verify "${1:?commit}^{commit}")
repo=$(git rev-parse --show-toplevel)
dest=${2:-$repo}/.carry
tree=$repo/target/frozen-${commit:0:7}
# A worktree whose folder `cargo clean` removed is still registered until pruned.
git -C "$repo" worktree prune
if [ ! -d "$tree" ]; then
  git -C "$repo" worktree add --detach "$tree" "$commit"
fi
if [ -n "$(git -C "$tree" status --porcelain --untracked-files=no)" ]; then
  echo "$tree has uncommitted changes: its binaries would not be COMMIT's" >&2
  exit 1
fi
# One target folder for every frozen build: the dependencies build once.
export CARGO_TARGET_DIR=$repo/target/frozen
(cd "$tree" && cargo build --locked --release --bin attention)
test_bin=$(cd "$tree" && bash "$repo/runners/test_binary.sh" gpu_attention)
stage=$(mktemp -d)
trap 'rm -rf "$stage"' EXIT
mkdir -p "$stage/runners"
cp "$CARGO_TARGET_DIR/release/attention" "$stage/"
cp "$test_bin" "$stage/gpu_attention_test"
cp -r "$tree/runners/compare" "$stage/runners/"
rm -rf "$stage/runners/compare/__pycache__"
cp "$tree/runners/device_run.sh" "$tree/runners/device_verdict.py" "$tree/runners/grid_shards.sh" \
  "$stage/"
command -v strip > /dev/null && strip "$stage/attention" "$stage/gpu_attention_test"
# The runner records its commit in every document (the test binary does not print it).
# (grep without -q: with pipefail, strings killed by an early exit would read as no match)
if ! strings "$stage/attention" | grep -F "$commit" > /dev/null \
  || strings "$stage/attention" | grep -F "$commit-dirty" > /dev/null; then
  echo "the runner does not report $commit (clean)" >&2
  exit 1
fi
mkdir -p "$dest/runners"
rm -rf "$dest/runners/compare"
cp -r "$stage/." "$dest/"
du -sh "$dest"
