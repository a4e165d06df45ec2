#!/usr/bin/env bash
# Runs shards of a grid on the GPU machine, one after another, while time is left:
# `bash .carry/grid_shards.sh OUTDIR COUNT BUDGET_S I[:NEED_S] [I[:NEED_S] ...]` runs
# `RUNNER ARGS --shard I/COUNT` for each I into OUTDIR/NAME_I.json (log beside it); RUNNER is
# $KP_SHARD_RUNNER (default attention), ARGS $KP_SHARD_ARGS (default `--compare torch,jax`).
# A shard starts only when BUDGET_S minus the time spent leaves at least NEED_S (its expected
# time, when given), else $KP_SHARD_RESERVE_S (default 250 s: a 16th of the attention grid
# took 103-230 s on an H200) and the longest shard so far plus 20 s. A shard cut off by the
# budget leaves its document as NAME_I.partial.json. The shards of one build are one run
# (`config.command` differs only in --shard and --output), so they may span machine calls.
# Optional: KP_SHARD_FILTER (a `--filter` expression, e.g. `pass=fwd`: the shards then split
# that part of the grid) and KP_SHARD_NAME (the documents' name before `_I.json`, default
# gpu_attention). For the kernel-sum grid: KP_SHARD_RUNNER=kernel_sums KP_SHARD_NAME=gpu_kernel_sums
# KP_SHARD_ARGS="--compare torch,jax,ott,geomloss --case-timeout 60" (README, Kernel sums).
set -uo pipefail
out=${1:?output folder}; count=${2:?shard count}; budget=${3:?budget, s}; shift 3
mkdir -p "$out"
here=$(cd "$(dirname "$0")" && pwd)
export LD_LIBRARY_PATH=/usr/local/cuda/targets/x86_64-linux/lib:/usr/local/cuda/lib64:${LD_LIBRARY_PATH:-}
export KP_RUNNERS_DIR=$here/runners
export PYTHONUNBUFFERED=1
reserve=${KP_SHARD_RESERVE_S:-250}
name=${KP_SHARD_NAME:-gpu_attention}
runner=${KP_SHARD_RUNNER:-attention}
# An empty KP_SHARD_ARGS passes no arguments; unset, the attention default.
read -r -a args <<< "${KP_SHARD_ARGS---compare torch,jax}"
filter=(); [ -n "${KP_SHARD_FILTER:-}" ] && filter=(--filter "$KP_SHARD_FILTER")
t_start=$(date +%s); longest=0
for spec in "$@"; do
  i=${spec%%:*}
  left=$(( budget - ($(date +%s) - t_start) ))
  need=$(( longest + 20 > reserve ? longest + 20 : reserve ))
  [ "$spec" != "$i" ] && need=${spec#*:}
  if ! [[ "$i" =~ ^[0-9]+$ && "$need" =~ ^[0-9]+$ ]]; then
    echo "shard spec \`$spec\`: not I or I:NEED_S in whole numbers"; exit 2
  fi
  if [ "$need" -gt "$left" ] || [ "$left" -le 0 ]; then
    echo "shard $i/$count: not started ($left s left, $need s needed)"; continue
  fi
  t0=$(date +%s)
  doc="$out/${name}_$i.json"
  timeout --kill-after=10 "$left" "$here/$runner" "${args[@]}" "${filter[@]}" \
    --shard "$i/$count" --output "$doc" > "$out/${name}_$i.log" 2>&1
  rc=$?; took=$(( $(date +%s) - t0 ))
  [ $took -gt $longest ] && longest=$took
  if { [ $rc -eq 124 ] || [ $rc -eq 137 ]; } && [ -f "$doc" ]; then
    mv "$doc" "$out/${name}_$i.partial.json"
  fi
  echo "shard $i/$count: exit $rc in $took s ($(grep -c '^\[' "$out/${name}_$i.log") rows)"
done
echo "total: $(( $(date +%s) - t_start )) s"
