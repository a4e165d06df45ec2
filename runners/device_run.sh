#!/usr/bin/env bash
# One call on the GPU machine. Binaries and the Python package travel under .carry/ (built on
# the development machine: `cargo build --release --bin attention --tests`, then
# runners/carry.sh).
#
#   bash .carry/device_run.sh smoke OUTDIR   # GPU tests, comparison tests, --quick grid twice
#   bash .carry/device_run.sh full OUTDIR    # the committed grid (fresh process per case)
#
# Leaves in OUTDIR: tests.log, quick.json + quick.log (smoke); gpu_attention.json + run.log
# (full).
set -uo pipefail
mode=${1:?smoke or full}
out=${2:?output folder}
here=$(cd "$(dirname "$0")" && pwd)
bin=$here
export LD_LIBRARY_PATH=/usr/local/cuda/targets/x86_64-linux/lib:/usr/local/cuda/lib64:${LD_LIBRARY_PATH:-}
export KP_RUNNERS_DIR=$here/runners
export PYTHONUNBUFFERED=1
nvidia-smi --query-gpu=name,clocks.sm,clocks.max.sm,power.limit,temperature.gpu --format=csv
nvidia-smi --query-compute-apps=pid,process_name --format=csv
case $mode in
smoke)
  t0=$(date +%s)
  "$bin/gpu_attention_test" --include-ignored --test-threads 1 > "$out/tests.log" 2>&1
  echo "gpu_attention tests: exit $?"
  "$bin/compare_script_test" --include-ignored --test-threads 1 --nocapture >> "$out/tests.log" 2>&1
  echo "compare_script tests: exit $?"
  grep -E "^test |test result" "$out/tests.log"
  echo "tests took $(( $(date +%s) - t0 )) s"
  t0=$(date +%s)
  "$bin/attention" --quick --runs 2 --compare torch --output "$out/quick.json" > /dev/null 2> "$out/quick.log"
  echo "quick grid (2 runs): exit $? in $(( $(date +%s) - t0 )) s"
  grep -E "^\[" "$out/quick.log" | cut -c1-400 | tail -60
  ;;
full)
  t0=$(date +%s)
  "$bin/attention" --compare torch --output "$out/gpu_attention.json" > /dev/null 2> "$out/run.log"
  echo "full grid: exit $? in $(( $(date +%s) - t0 )) s"
  grep -E "^\[" "$out/run.log" | grep -E "T512 |T1024 |T16384 " | grep "D128\|torch" | cut -c1-300
  ;;
esac
