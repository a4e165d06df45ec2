#!/usr/bin/env bash
# Builds the sequence_mixers runner at several commits (each in a git worktree under
# target/frozen-COMMIT, one shared target folder, as runners/frozen_build.sh does) and packs
# them, stripped and xz-compressed, into DEST/.carry/bins.tar.xz (default: this checkout) with
# this checkout's device_run.sh, device_verdict.py and grid_shards.sh beside it: the carry of
# `device_run.sh gdn`, which unpacks it and measures every build on one card. The first
# argument is the build under test (.carry/sequence_mixers, and its gpu_sequence_mixers test
# as .carry/gpu_sequence_mixers_test); each further LABEL=COMMIT goes to .carry/mix_LABEL/,
# with its GPU test too when suffixed :test. Example (kernels/TUNING-sequence-mixers.md,
# the gated delta rule's version 8 entry):
#   bash runners/mix_carry.sh 6811a67 v71=def6be7 v7=1a0f36a v6=901acce v5=81753c8:test
# then on the GPU machine (carry: [".carry"]): bash .carry/device_run.sh gdn $OUT
# The tracked tree and .carry must stay under the device tool's 64 MiB: a runner is about
# 4 MB stripped, 1 MB compressed. Nothing in .carry is replaced unless every build works.
set -euo pipefail
[ $# -ge 1 ] || { sed -n '2,14p' "$0"; exit 2; }
repo=$(git rev-parse --show-toplevel)
dest=${DEST:-$repo}/.carry
export CARGO_TARGET_DIR=$repo/target/frozen
git -C "$repo" worktree prune
stage=$(mktemp -d)
trap 'rm -rf "$stage"' EXIT

# build COMMIT OUTDIR WITH_TEST: the runner (and the GPU test) of COMMIT into OUTDIR.
build() {
  local commit tree exe
  commit=$(git -C "$repo" rev-parse --verify "$1^{commit}")
  tree=$repo/target/frozen-${commit:0:7}
  [ -d "$tree" ] || git -C "$repo" worktree add --detach "$tree" "$commit" > /dev/null
  if [ -n "$(git -C "$tree" status --porcelain --untracked-files=no)" ]; then
    echo "$tree has uncommitted changes: its binaries would not be $commit's" >&2
    exit 1
  fi
  (cd "$tree" && cargo build --locked --release --bin sequence_mixers)
  mkdir -p "$2"
  cp "$CARGO_TARGET_DIR/release/sequence_mixers" "$2/"
  if [ "$3" = 1 ]; then
    exe=$(cd "$tree" && bash "$repo/runners/test_binary.sh" gpu_sequence_mixers)
    cp "$exe" "$2/gpu_sequence_mixers_test"
  fi
  command -v strip > /dev/null && strip "$2"/*
  return 0
}

build "$1" "$stage/bins" 1
shift
for spec in "$@"; do
  label=${spec%%=*}
  rest=${spec#*=}
  [ "$label" != "$spec" ] || { echo "expected LABEL=COMMIT[:test], got $spec" >&2; exit 2; }
  with_test=0
  case $rest in *:test) with_test=1; rest=${rest%:test} ;; esac
  build "$rest" "$stage/bins/mix_$label" "$with_test"
done
(cd "$stage/bins" && tar cJf "$stage/bins.tar.xz" ./*)
mkdir -p "$dest"
cp "$stage/bins.tar.xz" "$dest/"
cp "$repo/runners/device_run.sh" "$repo/runners/device_verdict.py" "$repo/runners/grid_shards.sh" \
  "$dest/"
tar tJvf "$dest/bins.tar.xz"
du -sh "$dest"
