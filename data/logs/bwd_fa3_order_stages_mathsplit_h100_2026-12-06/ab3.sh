#!/usr/bin/env bash
# A/B/C on one card (issue 11): the wgmma backward by default, with KP_SM90_BWD_ORDER=fa3 and
# with KP_SM90_BWD_STAGES=3; then math's per-kernel times at 4092/4096/4097 (issue 9).
out=$1; n=.carry-ab; T0=$(date +%s); DL=${2:-575}
export LD_LIBRARY_PATH=/usr/local/cuda/targets/x86_64-linux/lib:/usr/local/cuda/lib64:${LD_LIBRARY_PATH:-}
export KP_RUNNERS_DIR=$PWD/$n/runners PYTHONUNBUFFERED=1
nvidia-smi --query-gpu=name,clocks.sm,clocks.max.sm,power.limit,temperature.gpu --format=csv,noheader
nvidia-smi --query-compute-apps=pid,process_name --format=csv,noheader
step() { local name=$1 lim=$2 log=$3; shift 3; local t0=$(date +%s)
  local left=$(( DL - (t0 - T0) )); [ $left -lt 10 ] && { echo "$name: skipped (deadline)"; return; }
  [ $lim -gt $left ] && lim=$left
  timeout --kill-after=5 $lim "$@" > "$log" 2>&1; echo "$name: rc=$? in $(( $(date +%s)-t0 )) s"; }
variant() { unset KP_SM90_BWD_ORDER KP_SM90_BWD_STAGES
  case $1 in fa3) export KP_SM90_BWD_ORDER=fa3;; st3) export KP_SM90_BWD_STAGES=3;; esac; }
for v in fa3 st3; do variant $v
  step "$v tests" 60 $out/$v.tests.log $n/gpu_attention_test --include-ignored --test-threads 1 --exact wgmma_backward_matches_float64 outputs_are_bit_identical_over_five_runs
  grep -E "^test |test result" $out/$v.tests.log
done
for v in def fa3 st3; do variant $v
  step "$v stages" 30 $out/$v.stages1.log $n/gpu_attention_test --ignored --test-threads 1 --nocapture --exact wgmma_backward_stage_probe
  grep -o "stages.*" $out/$v.stages1.log
done
common=(--grids main --batch 4 --heads 8 --seq-lens 4096,16384 --head-dims 64,128)
for v in fa3 st3; do variant $v
  step "$v table" 80 $out/$v.table.log $n/attention "${common[@]}" --passes fwd+bwd --implementations flash --output $out/${v}_table.json
done
variant def
step "def table" 200 $out/def.table.log $n/attention "${common[@]}" --passes fwd+bwd --implementations flash,flash_sm80 --compare torch --exclude torch_math,torch_efficient --output $out/def_table.json
# math with its GEMMs' short tails split off (KP_MATH_TAIL_SPLIT=1) against without (issue 9).
KP_MATH_TAIL_SPLIT=1 step "split tests" 90 $out/split.tests.log $n/gpu_attention_test --include-ignored --test-threads 1 --exact math_matches_float64_on_every_shape non_aligned_lengths_match_float64 outputs_are_bit_identical_over_five_runs
grep -E "^test |test result" $out/split.tests.log
margs=(--grids main --batch 1 --heads 24 --head-dims 64 --seq-lens 4092,4096,4097 --implementations math)
step "math nosplit" 60 $out/mathns.log $n/attention "${margs[@]}" --output $out/mathns_rows.json
KP_MATH_TAIL_SPLIT=1 step "math split" 60 $out/mathsp.log $n/attention "${margs[@]}" --output $out/mathsp_rows.json
left=$(( DL - ($(date +%s) - T0) ))
if [ $left -gt 70 ]; then mkdir -p $out/mp && timeout $((left-10 < 150 ? left-10 : 150)) bash $n/mathprobe.sh $out/mp > $out/mp/run.log 2>&1; tail -40 $out/mp/run.log; fi
for v in fa3 st3 def; do variant $v
  cmp=(); [ $v = def ] && cmp=(--compare torch --exclude torch_math,torch_efficient)
  step "$v mqa" 60 $out/$v.mqa.log $n/attention --grids shapes --implementations flash "${cmp[@]}" --filter 'heads=8,kv_heads=1,pass=fwd+bwd' --output $out/${v}_mqa.json
done
variant def
step "def fwd table" 150 $out/deffwd.table.log $n/attention "${common[@]}" --passes fwd --implementations flash,flash_sm80 --compare torch --exclude torch_math,torch_efficient --output $out/deffwd_table.json
variant def
python3 - "$out" <<'PY' | tee $out/summary.txt
import json,sys,glob,os
out=sys.argv[1]
rows={}
for p in sorted(glob.glob(out+"/*.json")):
    v=os.path.basename(p).split("_")[0]
    for r in json.load(open(p)).get("rows",[]):
        c=r["case"]; key=(c["heads"],c.get("kv_heads"),c["seq_len"],c["head_dim"],c["causal"],c["pass"],c.get("batch"))
        impl=r["implementation"]; impl=impl+"_"+v if impl in ("flash","math") else impl
        ms=r.get("median_ms"); tf=r["flops"]/ms/1e9 if ms and r.get("flops") else None
        rows.setdefault(key,{})[impl]=(r["status"],ms,tf)
for k,d in sorted(rows.items()):
    ref=d.get("torch_cudnn",(0,None,0))[1]
    print("H%s:%s T%s D%s causal=%s %s B%s"%k)
    for i,(st,ms,tf) in sorted(d.items()):
        print("   %-14s %-6s %8s ms %7s TFLOP/s %s"%(i,st,"%.4f"%ms if ms else "-","%.1f"%tf if tf else "-","cudnn/this %.3f"%(ref/ms) if ref and ms else ""))
PY
cd $out && tar czf results.tgz *.log *.json mp 2>/dev/null && rm -rf *.log *.json mp
echo "total $(( $(date +%s) - T0 )) s"
