#!/usr/bin/env bash
# The wgmma backward with 80 queries per step at head_dim 128 (KP_SM90_BWD_BM) against 64, and
# its tail split (KP_SM90_BWD_TAIL) on and off (kernels/TUNING.md, "The wgmma backward: 80
# queries a step, and the last wave split"): the GPU tests with both, the float64 test's own
# timings, the stage probe per setting, then runner rows (flash beside cuDNN, flash alone
# alternating the settings). On the GPU machine, from the repository root, with the release
# `attention` binary, the gpu_attention test binary (as gpu_attention_test) and runners/ copied
# into .carry-h/: `bash kernels/tuning/bwd_m80.sh OUT [DEADLINE_S]`.
out=$1; n=.carry-h; T0=$(date +%s); DL=${2:-570}
export LD_LIBRARY_PATH=/usr/local/cuda/targets/x86_64-linux/lib:/usr/local/cuda/lib64:${LD_LIBRARY_PATH:-}
export KP_RUNNERS_DIR=$PWD/$n/runners PYTHONUNBUFFERED=1
nvidia-smi --query-gpu=name,clocks.sm,clocks.max.sm,power.limit,temperature.gpu --format=csv,noheader
nvidia-smi --query-compute-apps=pid,process_name --format=csv,noheader
step() { local name=$1 lim=$2 log=$3; shift 3; local t0=$(date +%s)
  local left=$(( DL - (t0 - T0) )); [ $left -lt 10 ] && { echo "$name: skipped (deadline)"; return; }
  [ $lim -gt $left ] && lim=$left
  timeout --kill-after=5 $lim "$@" > "$log" 2>&1; echo "$name: rc=$? in $(( $(date +%s)-t0 )) s"; }
T=$n/gpu_attention_test
KP_SM90_BWD_BM=80c KP_SM90_BWD_TAIL=1 step "tests80c" 150 $out/tests80c.log $T --include-ignored --test-threads 1 --nocapture --exact wgmma_backward_matches_float64 wgmma_fp16_forward_and_backward_match_float64 outputs_are_bit_identical_over_five_runs flash_dispatches_to_the_wgmma_forward_on_sm_90a
grep -E "^test |test result|panicked|wgmma fwd\+bwd" $out/tests80c.log | head -40
KP_SM90_BWD_BM=64 KP_SM90_BWD_TAIL=1 step "tests64" 60 $out/tests64.log $T --include-ignored --test-threads 1 --nocapture --exact wgmma_backward_matches_float64
grep -E "^test |test result|panicked|wgmma fwd\+bwd" $out/tests64.log | head -20
KP_SM90_BWD_BM=64 KP_SM90_BWD_TAIL=0 step "tests64notail" 60 $out/tests64notail.log $T --include-ignored --test-threads 1 --nocapture --exact wgmma_backward_matches_float64
grep -E "^test |test result|panicked|wgmma fwd\+bwd" $out/tests64notail.log | head -20
for cfg in 64:0 64:1 80c:1 80c:0; do bm=${cfg%:*}; tl=${cfg#*:}
  KP_SM90_BWD_BM=$bm KP_SM90_BWD_TAIL=$tl step "stages $cfg" 45 $out/stages_${bm}_$tl.log $T --ignored --test-threads 1 --nocapture --exact wgmma_backward_stage_probe
  grep -o "stages.*\|panicked.*" $out/stages_${bm}_$tl.log
done
A="--grids main --batch 4 --heads 8 --seq-lens 4096,16384 --head-dims 128 --passes fwd+bwd"
C="--compare torch --exclude torch_math,torch_efficient,torch_flash"
i=0
for cfg in 80c:1:c 64:0 64:1 80c:1 80c:0 64:0 80c:1:c; do bm=$(echo $cfg | cut -d: -f1); tl=$(echo $cfg | cut -d: -f2); cmp=""; [ "$(echo $cfg | cut -d: -f3)" = c ] && cmp=$C
  i=$((i+1)); KP_SM90_BWD_BM=$bm KP_SM90_BWD_TAIL=$tl step "table $cfg" 90 $out/t${i}_${bm}_$tl.log $n/attention $A --implementations flash $cmp --output $out/t${i}_${bm}_$tl.json
done
for cfg in 80c:1 64:0; do bm=${cfg%:*}; tl=${cfg#*:}
  KP_SM90_BWD_BM=$bm KP_SM90_BWD_TAIL=$tl step "grouped $cfg" 60 $out/g_${bm}_$tl.log $n/attention --grids shapes --implementations flash --filter "head_dim=128,pass=fwd+bwd,dtype=bf16,kv_heads<=8,batch=4" --output $out/g_${bm}_$tl.json
done
python3 - "$out" <<'PY' | tee $out/summary.txt
import json,sys,glob,os
out=sys.argv[1]
rows={}
for p in sorted(glob.glob(out+"/*.json")):
    tag=os.path.basename(p)[:-5]
    for r in json.load(open(p)).get("rows",[]):
        c=r["case"]; key=(c["heads"],c.get("kv_heads"),c.get("seq_len",c.get("seq_len_q")),c["head_dim"],c["causal"],c["pass"])
        ms=r.get("median_ms"); tf=r["flops"]/ms/1e9 if ms and r.get("flops") else None
        rows.setdefault(key,[]).append((tag,r["implementation"],r["status"],ms,tf,(r.get("machine") or {}).get("sm_clock_mhz")))
for k,d in sorted(rows.items(),key=str):
    print("H%s:%s T%s D%s causal=%s %s"%k)
    for tag,i,st,ms,tf,clk in d:
        print("   %-8s %-12s %-6s %9s ms %7s TFLOP/s clk %s"%(tag,i,st,"%.4f"%ms if ms else "-","%.1f"%tf if tf else "-",clk))
PY
cd $out && tar czf results.tgz *.log *.json 2>/dev/null && rm -f *.log *.json
echo "total $(( $(date +%s) - T0 )) s"
