#!/usr/bin/env bash
# One call on the GPU machine: GPU tests, flash configuration tuning, then the full grid with
# the fastest correct configuration per head_dim, with the PyTorch comparison.
# Usage (from the repository root, binaries under .carry/): bash runners/device_run.sh OUTDIR
# Leaves in OUTDIR: gpu_tests.log, tune_<config>.json, choice.txt, gpu_attention.json, run.log.
set -uo pipefail
out=${1:?output folder}
bin=./.carry
export LD_LIBRARY_PATH=/usr/local/cuda/targets/x86_64-linux/lib:/usr/local/cuda/lib64:${LD_LIBRARY_PATH:-}
"$bin/gpu_attention_test" --test-threads 1 > "$out/gpu_tests.log" 2>&1
echo "gpu tests: exit $? ($(grep -c 'rel_err' "$out/gpu_tests.log") checks)"
grep -E "^test |test result" "$out/gpu_tests.log"
configs=${CONFIGS:-"v2w4 v2w8 v3w4m2b64 v3w4m2b32 v3w8m2b32"}
for c in $configs; do
  "$bin/attention" --implementations flash --seq-lens 4096,16384 --repeats 5 \
    --flash-config "64=$c,128=$c" --output "$out/tune_$c.json" > /dev/null 2>&1
done
python3 - "$out" $configs > "$out/choice.txt" <<'PY'
import json, sys
out, configs = sys.argv[1], sys.argv[2:]
best = {}
for c in configs:
    try:
        rows = json.load(open(f"{out}/tune_{c}.json"))["rows"]
    except Exception as e:
        print(f"# {c}: no document ({e})"); continue
    for d in (64, 128):
        rs = [r for r in rows if r["case"]["head_dim"] == d]
        ok = rs and all(r["status"] == "ok" and r["accuracy"]["rel_err"] <= r["accuracy"]["tolerance"] for r in rs)
        t = sum(r["median_ms"] for r in rs if r["case"]["seq_len"] == 16384) if ok else float("inf")
        print(f"# head_dim {d} {c}: {'ok' if ok else 'FAILED'} sum of T=16384 medians {t:.4f} ms")
        if t < best.get(d, ("", float("inf")))[1]:
            best[d] = (c, t)
print(",".join(f"{d}={best[d][0]}" for d in sorted(best)))
PY
cat "$out/choice.txt"
choice=$(tail -1 "$out/choice.txt")
"$bin/attention" --compare torch --compare-memory "${COMPARE_MEMORY:-in-process}" \
  --flash-config "$choice" --output "$out/gpu_attention.json" > "$out/run.log" 2>&1
echo "full run: exit $?"
grep -E "head_dim=128.*seq_len=16384|T16384 D128" "$out/run.log" | grep -E "^\[(compare\]|[0-9])" | cut -c1-160
