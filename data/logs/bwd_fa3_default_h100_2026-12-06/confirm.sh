#!/usr/bin/env bash
# The wgmma backward with FlashAttention-3's product order at head_dim 128 (the default now):
# tests, stage probe, the Hopper fwd+bwd table and MQA/GQA beside cuDNN and FA2; math's kernels
# timed apart at 4092/4096/4097 (ncu, graph nodes).
out=$1; n=.carry-ab; T0=$(date +%s); DL=${2:-575}
export LD_LIBRARY_PATH=/usr/local/cuda/targets/x86_64-linux/lib:/usr/local/cuda/lib64:${LD_LIBRARY_PATH:-}
export KP_RUNNERS_DIR=$PWD/$n/runners PYTHONUNBUFFERED=1
nvidia-smi --query-gpu=name,clocks.sm,clocks.max.sm,power.limit,temperature.gpu --format=csv,noheader
nvidia-smi --query-compute-apps=pid,process_name --format=csv,noheader
step() { local name=$1 lim=$2 log=$3; shift 3; local t0=$(date +%s)
  local left=$(( DL - (t0 - T0) )); [ $left -lt 10 ] && { echo "$name: skipped (deadline)"; return; }
  [ $lim -gt $left ] && lim=$left
  timeout --kill-after=5 $lim "$@" > "$log" 2>&1; echo "$name: rc=$? in $(( $(date +%s)-t0 )) s"; }
step "tests" 60 $out/tests.log $n/gpu_attention_test --include-ignored --test-threads 1 --exact wgmma_backward_matches_float64 outputs_are_bit_identical_over_five_runs flash_dispatches_to_the_wgmma_forward_on_sm_90a
grep -E "^test |test result" $out/tests.log
step "stages" 30 $out/stages.log $n/gpu_attention_test --ignored --test-threads 1 --nocapture --exact wgmma_backward_stage_probe
grep -o "stages.*" $out/stages.log
step "table" 200 $out/table.log $n/attention --grids main --batch 4 --heads 8 --seq-lens 4096,16384 --head-dims 64,128 --passes fwd+bwd --implementations flash --compare torch --exclude torch_math,torch_efficient --output $out/table.json
for g in 'heads=8,kv_heads=1' 'heads=32,kv_heads=8'; do t=${g//[=,]/_}
  step "grouped $g" 80 $out/g_$t.log $n/attention --grids shapes --implementations flash --compare torch --exclude torch_math,torch_efficient --filter "$g,pass=fwd+bwd" --output $out/g_$t.json
done
left=$(( DL - ($(date +%s) - T0) ))
if [ $left -gt 60 ]; then mkdir -p $out/mp && timeout $((left-10 < 150 ? left-10 : 150)) bash $n/mathprobe.sh $out/mp > $out/mp/run.log 2>&1; tail -60 $out/mp/run.log; fi
python3 - "$out" <<'PY' | tee $out/summary.txt
import json,sys,glob,os
out=sys.argv[1]
rows={}
for p in sorted(glob.glob(out+"/*.json")):
    for r in json.load(open(p)).get("rows",[]):
        c=r["case"]; key=(c["heads"],c.get("kv_heads"),c["seq_len"],c["head_dim"],c["causal"],c["pass"],c.get("batch"))
        ms=r.get("median_ms"); tf=r["flops"]/ms/1e9 if ms and r.get("flops") else None
        rows.setdefault(key,{})[r["implementation"]]=(r["status"],ms,tf)
for k,d in sorted(rows.items()):
    ref=d.get("torch_cudnn",(0,None,0))[1]
    print("H%s:%s T%s D%s causal=%s %s B%s"%k)
    for i,(st,ms,tf) in sorted(d.items()):
        print("   %-14s %-6s %8s ms %7s TFLOP/s %s"%(i,st,"%.4f"%ms if ms else "-","%.1f"%tf if tf else "-","cudnn/this %.3f"%(ref/ms) if ref and ms else ""))
PY
cd $out && tar czf results.tgz *.log *.json mp 2>/dev/null && rm -rf *.log *.json mp
echo "total $(( $(date +%s) - T0 )) s"
