#!/usr/bin/env bash
# Runs shards of the whole attention grid on the GPU machine, one after another, while time is
# left: `bash .carry/grid_shards.sh OUTDIR COUNT BUDGET_S I [I ...]` runs
# `attention --compare torch,jax --shard I/COUNT` for each I into OUTDIR/gpu_attention_I.json
# (log beside it), and starts a shard only when BUDGET_S seconds minus the time spent leave
# at least $KP_SHARD_RESERVE_S (default 220 s: a 16th of the grid took 105-202 s on an H200). The shards of one build are one run
# (`config.command` differs only in --shard and --output), so they may span machine calls.
set -uo pipefail
out=${1:?output folder}; count=${2:?shard count}; budget=${3:?budget, s}; shift 3
mkdir -p "$out"
here=$(cd "$(dirname "$0")" && pwd)
export LD_LIBRARY_PATH=/usr/local/cuda/targets/x86_64-linux/lib:/usr/local/cuda/lib64:${LD_LIBRARY_PATH:-}
export KP_RUNNERS_DIR=$here/runners
export PYTHONUNBUFFERED=1
t_start=$(date +%s); longest=0
for i in "$@"; do
  spent=$(( $(date +%s) - t_start ))
  left=$(( budget - spent ))
  if [ "${KP_SHARD_RESERVE_S:-220}" -gt "$left" ]; then
    echo "shard $i/$count: not started ($left s left, longest shard so far $longest s)"; continue
  fi
  t0=$(date +%s)
  timeout --kill-after=10 "$left" "$here/attention" --compare torch,jax --shard "$i/$count" \
    --output "$out/gpu_attention_$i.json" > "$out/gpu_attention_$i.log" 2>&1
  rc=$?; took=$(( $(date +%s) - t0 ))
  [ $took -gt $longest ] && longest=$took
  echo "shard $i/$count: exit $rc in $took s ($(grep -c '^\[' "$out/gpu_attention_$i.log") rows)"
done
echo "total: $(( $(date +%s) - t_start )) s"
