#!/usr/bin/env bash
# Per-kernel times of math (cuBLAS + softmax kernels) at seq_len 4092 / 4096 / 4097, fwd+bwd,
# B1 H24 D64 bf16, full mask (issue 9: which product costs the non-aligned lengths).
out=$1; n=.carry-ab
export LD_LIBRARY_PATH=/usr/local/cuda/targets/x86_64-linux/lib:/usr/local/cuda/lib64:${LD_LIBRARY_PATH:-}
export KP_RUNNERS_DIR=$PWD/.carry-ab/runners PYTHONUNBUFFERED=1
NSYS=$(command -v nsys || ls /usr/local/cuda/bin/nsys /opt/nvidia/nsight-systems/*/bin/nsys 2>/dev/null | head -1)
NCU=/usr/local/cuda/bin/ncu
echo "nsys: ${NSYS:-none}"
for T in 4092 4096 4097; do
  args=(--grids main --batch 1 --heads 24 --head-dims 64 --seq-lens $T --masks full --implementations math --repeats 3 --warmup-ms 20)
  t0=$(date +%s)
  if [ -n "$NSYS" ]; then
    for p in fwd fwd+bwd; do
      timeout 120 $NSYS profile -t cuda --force-overwrite true -o $out/m$T${p/+/_} $n/attention "${args[@]}" --passes $p --output $out/m$T.json > $out/m$T.nsys.log 2>&1
      $NSYS stats --force-export=true --report cuda_gpu_kern_sum --format csv -o $out/k$T${p/+/_} $out/m$T${p/+/_}.nsys-rep >> $out/m$T.nsys.log 2>&1
      rm -f $out/m$T${p/+/_}.nsys-rep $out/m$T${p/+/_}.sqlite
    done
  else
    for p in fwd+bwd; do
      timeout 150 $NCU --clock-control none --cache-control none --target-processes all --metrics gpu__time_duration.sum \
        --graph-profiling node --launch-skip 30 --launch-count 45 --csv $n/attention "${args[@]}" --passes $p --output $out/m$T.json > $out/k$T${p/+/_}.ncu.csv 2> $out/m$T.ncu.err
    done
  fi
  echo "T=$T rc=$? in $(( $(date +%s)-t0 )) s"
done
python3 - "$out" <<'PY' | tee $out/mathprobe.txt
import csv,glob,io,os,re,statistics,sys
out=sys.argv[1]
res={}
for p in sorted(glob.glob(out+"/k*")):
    name=os.path.basename(p); m=re.match(r"k(\d+)(fwd(?:_bwd)?)",name); T,ps=m.group(1),m.group(2)
    txt=open(p).read()
    d={}
    if p.endswith(".ncu.csv"):
        lines=[l for l in txt.splitlines() if l.startswith('"')]
        for r in csv.DictReader(io.StringIO("\n".join(lines))):
            if r.get("Metric Name")=="gpu__time_duration.sum":
                v=float(r["Metric Value"].replace(",","")); u=r.get("Metric Unit","")
                v = v/1e3 if u in("nsecond","ns") else v*1e3 if u in("msecond","ms") else v
                d.setdefault(r["Kernel Name"][:60],[]).append(v)
        d={k:(statistics.median(v),len(v)) for k,v in d.items()}
    else:
        for r in csv.DictReader(io.StringIO(txt)):
            d[r["Name"][:60]]=(float(r["Med (ns)"])/1e3,int(r["Instances"]))
    res[(ps,T)]=d
for (ps,T),d in sorted(res.items()):
    print(f"== {ps} T={T} (median us, count)")
    for k,(v,c) in sorted(d.items(), key=lambda x:-x[1][0]):
        print(f"   {v:9.1f} x{c:<5} {k}")
PY
