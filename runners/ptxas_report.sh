#!/usr/bin/env bash
# Prints ptxas's resource report (registers, shared memory, spills) for every flash-attention
# instantiation, compiled with nvcc for sm_90a. Run on the GPU machine (it has nvcc).
set -euo pipefail
here=$(cd "$(dirname "$0")/.." && pwd)
tmp=$(mktemp -d)
for w in 4 8; do for d in 64 128; do for c in false true; do
  f=$tmp/flash_d${d}_${c}_w${w}.cu
  cat "$here/kernels/flash_attn_fwd.cu" > "$f"
  echo "extern \"C\" __global__ void __launch_bounds__($((32*w))) k(const u16* Q, const u16* K, const u16* V, u16* O, int T, int H, int KVH, float s) { flash_fwd<$d, $w, true, $c>(Q, K, V, O, T, H, KVH, s); }" >> "$f"
  echo "== warps $w head_dim $d causal $c"
  nvcc -gencode=arch=compute_90a,code=sm_90a --cubin -O3 -Xptxas -v -o "$tmp/k.cubin" "$f" 2>&1 | grep -E "registers|spill|smem" || true
done; done; done
rm -rf "$tmp"
