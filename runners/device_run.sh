#!/usr/bin/env bash
# One call on the GPU machine. Binaries and the Python package travel under .carry/ (built on
# the development machine: `cargo build --release --bin attention --bin kernel_sums
# --bin sequence_mixers --bin moe --tests`, then `bash runners/fetch_wheels.sh` and `runners/carry.sh .`).
#
#   bash .carry/device_run.sh smoke OUTDIR        # < 9 min: GPU tests, comparison tests,
#                                                 # non-aligned lengths and the T=16384 headline
#   bash .carry/device_run.sh tests OUTDIR        # the GPU and comparison tests only
#   bash .carry/device_run.sh nonaligned OUTDIR   # math's GPU tests, then flash and math at
#                                                 # seq_len 4092/4096/4097 beside cuDNN (< 6 min)
#   bash .carry/device_run.sh mixers OUTDIR       # the sequence-mixer GPU tests (SSD, scan,
#                                                 # Based, gated delta rule forwards against
#                                                 # float64); KP_FLA_TEST=1 adds the fla module
#                                                 # test (it did not finish in 180 s on
#                                                 # 2026-12-02: Triton autotunes every shape)
#   bash .carry/device_run.sh jaxinit OUTDIR      # where a JAX row's start-up goes
#                                                 # (runners/jax_init_probe.py, < 1 min)
#   bash .carry/device_run.sh gdn OUTDIR          # (carry: runners/mix_carry.sh) the gated
#                                                 # delta rule forward's GPU test,
#                                                 # its bf16 forward rows up to T16384 and ncu's
#                                                 # time per kernel at T16384, for
#                                                 # .carry/sequence_mixers and, where present,
#                                                 # the builds of other commits in
#                                                 # .carry/mix_*/ (e.g. mix_old/; with its GPU test
#                                                 # where gpu_sequence_mixers_test is there too), then ncu's sections (stall
#                                                 # reasons, traffic) of each kernel at K = V =
#                                                 # 128 and 64 for the carried one (about 1 min
#                                                 # a build; packs its own results.tgz: append
#                                                 # nothing that writes there; TUNING-sequence-
#                                                 # mixers.md, the gated delta rule's entries)
#   bash .carry/device_run.sh mixers_grid OUTDIR [i/n]  # the sequence_mixers grid (or shard i
#                                                 # of n) with --compare torch,fla (fla-core
#                                                 # from .carry/whl/, see runners/carry.sh;
#                                                 # KP_MIXERS_COMPARE overrides the list, empty
#                                                 # for the kernels alone; KP_MIXERS_FILTER
#                                                 # narrows the grid; KP_MIXERS_TAG names the
#                                                 # files gpu_sequence_mixers_TAG.json and
#                                                 # sequence_mixers_TAG.log; KP_MIXERS_LIMIT_S
#                                                 # caps the step, default 540 s)
#   bash .carry/device_run.sh mixers_rerun OUTDIR PART  # the whole sequence-mixer grid at
#                                                 # one commit, part 1 to 6 of six calls
#                                                 # (the README's run plan)
#   bash .carry/device_run.sh kernel_sums OUTDIR  # the kernel-sum GPU tests, then the
#                                                 # kernel_sums grid with --compare
#                                                 # torch,jax,ott,geomloss (data/gpu_kernel_sums.json;
#                                                 # KP_KS_TAG, KP_KS_TESTS, KP_KS_ARGS and
#                                                 # KP_KS_LIMIT_S split it over calls)
#   bash .carry/device_run.sh unverified OUTDIR   # the GPU tests never run on a GPU yet (math's
#                                                 # padded backward, the wgmma backward's
#                                                 # split heads), the non-aligned and MQA/GQA
#                                                 # probes and the SASS check
#   bash .carry/device_run.sh cta_order OUTDIR    # the wgmma backward's tests, its CTA-order
#                                                 # and stage probes, MQA/GQA fwd and fwd+bwd
#                                                 # beside cuDNN, SASS
#   bash .carry/device_run.sh ks_shards OUTDIR BUDGET_S I[:NEED_S] ...  # kernel-sum shards
#                                                 # I/8 while BUDGET_S allows (README)
#   bash .carry/device_run.sh moe OUTDIR          # the MoE GPU tests (the timing probe
#                                                 # apart, KP_MOE_PROBE=1), then the moe grid
#                                                 # with --compare torch (data/gpu_moe.json;
#                                                 # KP_MOE_TAG, KP_MOE_TESTS and KP_MOE_ARGS
#                                                 # for one part of a run: README, MoE)
#   bash .carry/device_run.sh decode OUTDIR [i/n] # the decoding GPU test (KP_DECODE_TESTS=0:
#                                                 # none), then the decoding grid or shard i of
#                                                 # n (240 rows, 128k-key caches: more than one
#                                                 # call; try 1/3)
#   bash .carry/device_run.sh flex OUTDIR         # the flex GPU tests, then flex beside flash
#                                                 # and PyTorch's SDPA backends on the main
#                                                 # grid's bf16 forward cases at head_dim 128
#   bash .carry/device_run.sh flex_bwd OUTDIR     # flex's backward GPU test (both backward
#                                                 # kernels on sm_90a), then flex fwd+bwd on
#                                                 # the masks grid with the wgmma backward
#                                                 # (the default) and the portable one
#                                                 # (KP_FLEX_BWD_SM90=0)
#   bash .carry/device_run.sh masks OUTDIR [i/n]  # the flex GPU tests and PyTorch flex module
#                                                 # test, then the masks grid (or shard i of
#                                                 # n): flex, flash, torch_flex, torch_cudnn
#   bash .carry/device_run.sh hopper OUTDIR       # the sm_90a tests: the wgmma probe, the
#                                                 # wgmma forwards and backward against
#                                                 # float64, then flash (the wgmma kernels
#                                                 # there) beside flash_sm80 and SDPA, fwd and
#                                                 # fwd+bwd at T = 4096 and 16384
#   bash .carry/device_run.sh full OUTDIR [i/n]   # the committed grid (or shard i of n)
#   bash .carry/device_run.sh grid_gpus OUTDIR [fwd|bwd|all]  # the committed grid's parts
#                                                 # (gpu_attention_{fwd,bwd}_*.json) over every
#                                                 # GPU of a multi-GPU host at once
#   bash .carry/device_run.sh part OUTDIR NAME LIMIT_S FILTER [i/n]
#                                                 # one part of a run split over calls or GPUs:
#                                                 # `attention --compare torch,jax --filter
#                                                 # FILTER [--shard i/n]` into OUTDIR/NAME.json
#                                                 # (CUDA_VISIBLE_DEVICES picks the GPU)
#
# Leaves in OUTDIR: gpu_attention.tests.log, compare_script.tests.log, and per runner call a
# document (*.json) and its log (*.log), packed into results.tgz past 8 files (pack_results).
# Every step has a time limit, so the verdict table (runners/device_verdict.py: test results, TFLOP/s at 4092/4096/4097 and at T=16384, failed
# rows) is always printed last.
set -uo pipefail
mode=${1:?smoke, tests or full}
out=${2:?output folder}
shard=${3:-}
mkdir -p "$out"
here=$(cd "$(dirname "$0")" && pwd)
bin=$here
export LD_LIBRARY_PATH=/usr/local/cuda/targets/x86_64-linux/lib:/usr/local/cuda/lib64:${LD_LIBRARY_PATH:-}
export KP_RUNNERS_DIR=$here/runners
export PYTHONUNBUFFERED=1
t_start=$(date +%s)
# The files and folders OUTDIR held before this run (relative paths): pack_results leaves them
# alone.
before=$(mktemp); find "$out" -mindepth 1 -printf '%P\n' | LC_ALL=C sort > "$before"
nvidia-smi --query-gpu=name,clocks.sm,clocks.max.sm,power.limit,temperature.gpu --format=csv,noheader
nvidia-smi --query-compute-apps=pid,process_name --format=csv,noheader

step() {  # step NAME LIMIT_S LOG COMMAND...: runs COMMAND under a time limit, its output in LOG
  local name=$1 limit=$2 log=$3; shift 3
  local t0; t0=$(date +%s)
  timeout --kill-after=10 "$limit" "$@" > "$log" 2>&1
  local rc=$?
  local why="exit $rc"; [ $rc -eq 124 ] && why="TIMED OUT after ${limit} s"
  echo "$name: $why in $(( $(date +%s) - t0 )) s"
}

install_wheels() {  # Python packages the image lacks, carried as wheels in .carry/whl/
  if ls "$here"/whl/*.whl > /dev/null 2>&1; then
    python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
      --target /tmp/kp-site "$here"/whl/*.whl \
      && export PYTHONPATH=/tmp/kp-site${PYTHONPATH:+:$PYTHONPATH} \
      && echo "installed: $(cd "$here/whl" && ls ./*.whl | tr '\n' ' ')" \
      || echo "wheel install failed: the rows of the libraries in $here/whl will say 'not installed'"
  fi
}

sass_check() {  # sass_check CACHE: HGMMA and local-memory (LDL/STL) counts and the kernels'
  # names of every cubin kept in CACHE (KP_KERNEL_CACHE), into OUTDIR/sass.txt
  for f in $(find "$1" -type f -name "*.cubin" | head -40); do
    sass=$(/usr/local/cuda/bin/cuobjdump --dump-sass "$f" 2>&1)
    echo "$(basename "$f"): $(grep -c HGMMA <<< "$sass") HGMMA, $(grep -cE '\b(LDL|STL)\b' <<< "$sass") LDL/STL, $(grep -c 'Function :' <<< "$sass") functions: $(grep -o 'Function : [A-Za-z0-9_]*' <<< "$sass" | cut -d' ' -f3 | tr '\n' ' ')"
  done | tee "$out/sass.txt"
}

grouped() {  # grouped FILTER LIMIT_S [MORE]: the shapes grid's cases matching FILTER (MORE
  # appended, e.g. ",pass=fwd+bwd"): flash and flash_sm80 beside SDPA's cuDNN and
  # FlashAttention-2, into OUTDIR/grouped_<FILTER>.json and .log
  local g=$1 limit=$2 more=${3:-}
  step "grouped $g" "$limit" "$out/grouped_${g//[=,]/_}.log" "$bin/attention" --grids shapes \
    --implementations flash,flash_sm80 --compare torch --exclude torch_math,torch_efficient \
    --filter "$g$more" --output "$out/grouped_${g//[=,]/_}.json"
}

tests() {
  # Correctness first; the configuration sweep (the heaviest compile) last.
  step "gpu tests" "$1" "$out/gpu_attention.tests.log" "$bin/gpu_attention_test" \
    --include-ignored --test-threads 1 --nocapture --skip every_flash_configuration
  step "compare tests" "$2" "$out/compare_script.tests.log" "$bin/compare_script_test" \
    --include-ignored --test-threads 1 --nocapture
 [ "$3" = 0 ] || step "gpu config tests" "$3" "$out/gpu_configs.tests.log" "$bin/gpu_attention_test" \
    --include-ignored --test-threads 1 --nocapture --exact every_flash_configuration_matches_float64
}

quick_timing=(--warmup-ms 50 --repeats 7 --case-timeout 40)
case $mode in
tests)
  # Optional limits: gpu tests, comparison tests, configuration test (0 skips it), s.
  tests "${3:-300}" "${4:-150}" "${5:-150}"
  ;;
nonaligned)
  # The math path at non-aligned lengths (issue 9: at most 3 % below the aligned length next to
  # it): math's GPU tests, then B1 H24 D64 at seq_len 4092, 4096 and 4097, fwd and fwd+bwd,
  # both masks, flash and math beside cuDNN (kernels/TUNING.md, "math: S and P rows padded").
  step "math gpu tests" 200 "$out/gpu_math.tests.log" "$bin/gpu_attention_test" \
    --include-ignored --test-threads 1 --nocapture math non_aligned
  step "non-aligned" 150 "$out/nonaligned.log" "$bin/attention" --compare torch \
    --exclude torch_math,torch_efficient,torch_flash --filter 'heads=24,seq_len>=4092' \
    --output "$out/nonaligned.json"
  ;;
smoke)
  tests 200 90 60
  # Non-aligned lengths (issue 9: at most 3 % below the aligned length next to them): flash,
  # B1 H24 D64, seq_len 4092, 4096, 4097, fwd and fwd+bwd, both masks.
  step "non-aligned" 60 "$out/nonaligned.log" "$bin/attention" --grids shapes \
    --implementations flash --filter 'heads=24,seq_len>=4092' "${quick_timing[@]}" \
    --output "$out/nonaligned.json"
  # The headline: head_dim 128, T=16384, non-causal, fwd and fwd+bwd, flash against PyTorch's
  # FlashAttention-2 and cuDNN backends.
  step "headline" 75 "$out/headline.log" "$bin/attention" --grids main --implementations flash \
    --compare torch --exclude torch_efficient,torch_math \
    --filter seq_len=16384,head_dim=128,causal=false "${quick_timing[@]}" \
    --output "$out/headline.json"
  ;;
part)
  name=${3:?part name}; limit=${4:?time limit, s}; filter=${5:?filter}; part_shard=${6:-}
  extra=(); [ -n "$part_shard" ] && extra=(--shard "$part_shard")
  step "part $name" "$limit" "$out/$name.log" "$bin/attention" --compare torch,jax \
    --filter "$filter" "${extra[@]}" --output "$out/$name.json"
  ;;
jaxinit)
  step "jax start-up probe" 120 "$out/jax_init.log" python3 "$here/jax_init_probe.py" --repeats 3
  cat "$out/jax_init.log"
  ;;
mixers)
  install_wheels
  # KP_MIXERS_TEST_ARGS: extra test-harness arguments (e.g. `--skip large`).
  # shellcheck disable=SC2086
  step "sequence-mixer gpu tests" "${KP_MIXERS_TEST_LIMIT_S:-420}" \
    "$out/gpu_sequence_mixers.tests.log" "$bin/gpu_sequence_mixers_test" --include-ignored \
    --test-threads 1 --nocapture ${KP_MIXERS_TEST_ARGS:-}
  if [ "${KP_FLA_TEST:-0}" = 1 ]; then
    step "fla module test" 300 "$out/fla_mixers.tests.log" "$bin/compare_script_test" \
      --include-ignored --exact fla_module_runs_on_the_gpu --nocapture
  fi
  ;;
gdn)
  # runners/mix_carry.sh packs the builds as bins.tar.xz beside this script. Every build that
  # has version 10's walks takes them on a Hopper GPU (src/sequence_mixers/delta_cuda.rs,
  # WGMMA_ENV) unless the caller sets KP_GDN_WGMMA=0; the GPU test runs both walks anyway.
  export KP_GDN_WGMMA=${KP_GDN_WGMMA:-1}
  if [ -f "$here/bins.tar.xz" ]; then tar xJf "$here/bins.tar.xz" -C "$here"; fi
  step "gated delta gpu test" 150 "$out/gdn.tests.log" "$bin/gpu_sequence_mixers_test" \
    --include-ignored --test-threads 1 --nocapture gated_delta_rule_matches
  labels=(carry)
  for d in "$here"/mix_*/; do [ -x "$d/sequence_mixers" ] && labels+=("$(basename "$d")"); done
  ncu=$(command -v ncu || echo /usr/local/cuda/bin/ncu)
  for label in "${labels[@]}"; do
    r=$bin/sequence_mixers; [ "$label" != carry ] && r=$here/$label/sequence_mixers
    name=gdn_$label
    if [ "$label" != carry ] && [ -x "$here/$label/gpu_sequence_mixers_test" ]; then
      step "gated delta gpu test ($label)" 150 "$out/$name.tests.log" \
        "$here/$label/gpu_sequence_mixers_test" --include-ignored --test-threads 1 --nocapture \
        gated_delta_rule_matches
    fi
    step "gated delta rows ($r)" 90 "$out/$name.log" "$r" \
      --filter "mixer=gated_delta,dtype=bf16,pass=fwd,seq_len<=16384" --output "$out/$name.json"
    for d in 64 128; do
      step "ncu d$d ($r)" 60 "$out/${name}_ncu_d$d.log" "$ncu" --target-processes all \
        --metrics gpu__time_duration.sum -k regex:gdn -c 3 "$r" --warmup-ms 1 \
        --filter "mixer=gated_delta,dtype=bf16,pass=fwd,seq_len=16384,head_dim=$d" \
        --output "/tmp/${name}_ncu_d$d.json"
    done
  done
  # Where each kernel of the carried runner's forward spends its time (K = V = 128 and 64,
  # T16384): throughput against the card's peaks, warp stall reasons, memory traffic,
  # occupancy.
  for d in 128 64; do
    step "ncu details d$d" 120 "$out/gdn_carry_ncu_details_d$d.log" "$ncu" --target-processes all \
      --section SpeedOfLight --section WarpStateStats --section MemoryWorkloadAnalysis \
      --section Occupancy --section LaunchStats --section SchedulerStats \
      --metrics dram__bytes_read.sum,dram__bytes_write.sum,l1tex__data_bank_conflicts_pipe_lsu_mem_shared.sum \
      -k regex:gdn -c 3 "$bin/sequence_mixers" --warmup-ms 1 \
      --filter "mixer=gated_delta,dtype=bf16,pass=fwd,seq_len=16384,head_dim=$d" \
      --output "/tmp/gdn_ncu_details_d$d.json"
  done
  ;;
mixers_grid)
  # The sequence-mixer grid, or shard $3 (e.g. 1/2) of it; KP_MIXERS_LIMIT_S caps the step,
  # KP_MIXERS_FILTER narrows the grid (`--filter`), KP_MIXERS_TAG names the document and log
  # (gpu_sequence_mixers_TAG.json; default: the shard's number).
  install_wheels
  shard=(); [ -n "${3:-}" ] && shard=(--shard "$3")
  filter=(); [ -n "${KP_MIXERS_FILTER:-}" ] && filter=(--filter "$KP_MIXERS_FILTER")
  tag=${KP_MIXERS_TAG:-${3%%/*}}
  # KP_MIXERS_COMPARE="" measures the project's kernels alone.
  compare=(); [ -n "${KP_MIXERS_COMPARE-torch,fla}" ] && compare=(--compare "${KP_MIXERS_COMPARE-torch,fla}")
  step "sequence_mixers grid ${tag}" "${KP_MIXERS_LIMIT_S:-540}" \
    "$out/sequence_mixers${tag:+_$tag}.log" \
    "$bin/sequence_mixers" "${compare[@]}" "${shard[@]}" "${filter[@]}" --output "$out/gpu_sequence_mixers${tag:+_$tag}.json"
  ;;
mixers_rerun)
  # The whole sequence-mixer grid at one commit in six calls of at most 560 s (the README's
  # run plan): part 1 to 6 (the third argument). Each piece is one --filter, its document
  # gpu_sequence_mixers_TAG.json and log sequence_mixers_TAG.log in OUTDIR. Expected times
  # (H200): from the run at 8c04704, plus SSD's fwd+bwd rows measured at 6712000 (cuda 15 s
  # a row at 16,384, 20-60 s at 65,536, mostly the float64 backward reference on the host).
  install_wheels
  piece() {  # piece TAG LIMIT_S COMPARE FILTER
    local compare=(); [ -n "$3" ] && compare=(--compare "$3")
    step "sequence_mixers $1" "$2" "$out/sequence_mixers_$1.log" "$bin/sequence_mixers" \
      "${compare[@]}" --filter "$4" --output "$out/gpu_sequence_mixers_$1.json"
  }
  case ${3:?part 1 to 6} in
  1)
    # 312 and 82 s at 806217e
    piece t16384_ssd 420 torch,fla 'seq_len=16384,mixer=ssd'
    piece t16384_selective_scan 110 torch,fla 'seq_len=16384,mixer=selective_scan'
    ;;
  2)
    # the forward rows: about 212 and 227 s at 8c04704
    piece t16384_gated_delta 270 torch,fla 'seq_len=16384,mixer=gated_delta,pass=fwd'
    piece t16384_based 260 torch,fla 'seq_len=16384,mixer=based,pass=fwd'
    ;;
  3)
    # 73, 128 and 243 s at 806217e (the grid's fwd+bwd rows at 1024 and 4096 included)
    piece t1024 120 '' 'seq_len=1024'
    piece t4096 180 '' 'seq_len=4096'
    piece t65536_ssd 300 '' 'seq_len=65536,mixer=ssd'
    ;;
  4)
    # the selective scan's fwd+bwd rows at 65,536 spend most of their time in the float64
    # backward reference on the host: 186 s for the first 5 of 8 rows at 8c04704
    piece t65536_based 180 '' 'seq_len=65536,mixer=based'
    piece t65536_selective_scan 370 '' 'seq_len=65536,mixer=selective_scan'
    ;;
  5)
    # about 121 s for the forward rows at 76114f2; the fwd+bwd rows (newer) not yet timed at
    # this length (23 s a row at 16,384 with the kernels alone, most of it the float64
    # backward reference on the host)
    piece t65536_gated_delta 400 '' 'seq_len=65536,mixer=gated_delta'
    ;;
  6)
    # the fwd+bwd rows of the gated delta rule and Based at 16,384: the kernels' rows about
    # 23 s and 10 s each (the probes at 4a1c2e8 and 65fe0b1), flash-linear-attention's gated
    # backward refused at once (#640), its Based fwd+bwd rows autotuning over a minute each,
    # PyTorch's step loop for the gated delta rule likely its case time limit
    piece t16384_gated_delta_bwd 270 torch,fla 'seq_len=16384,mixer=gated_delta,pass=fwd+bwd'
    piece t16384_based_bwd 280 torch,fla 'seq_len=16384,mixer=based,pass=fwd+bwd'
    ;;
  *) echo "mixers_rerun: part 1 to 6, not $3"; exit 2 ;;
  esac
  ;;
kernel_sums)
  # KP_KS_ARGS: runner arguments (default --compare torch,jax,ott,geomloss); KP_KS_TAG names the files
  # gpu_kernel_sums_TAG.json and kernel_sums_TAG.log (one part of a run split over calls);
  # KP_KS_TESTS=0 skips the GPU tests; KP_KS_LIMIT_S caps the grid step (default 300 s).
  install_wheels
  if [ "${KP_KS_TESTS:-1}" != 0 ]; then
    step "kernel-sum gpu tests" 240 "$out/gpu_kernel_sums.tests.log" "$bin/gpu_kernel_sums_test" \
      --include-ignored --test-threads 1 --nocapture
  fi
  ks_tag=${KP_KS_TAG:+_$KP_KS_TAG}
  # shellcheck disable=SC2086
  step "kernel_sums grid" "${KP_KS_LIMIT_S:-300}" "$out/kernel_sums$ks_tag.log" "$bin/kernel_sums" \
    ${KP_KS_ARGS:---compare torch,jax,ott,geomloss} --output "$out/gpu_kernel_sums$ks_tag.json"
  ;;
unverified)
  # The GPU tests of code that has not run on a GPU yet, then timings and a look at the machine
  # code, each step only while KP_CALL_BUDGET_S (default 530 s, from this script's start)
  # allows: math's GPU tests (its backward over the padded keys, issue 9) and the five-run
  # repeat test (math's dK, dV; the wgmma backward's split heads, whose dK and dV must repeat
  # bit for bit), the wgmma attention tests with their cubins kept (KP_KERNEL_CACHE; the split
  # backward), the wgmma backward's CTA-order probe (every order's outputs the same, then
  # forward + backward per order at causal MQA, GQA and MHA), the non-aligned probe beside cuDNN, the MQA and GQA forward + backward cases of
  # the shapes grid (flash, flash_sm80, cuDNN, FlashAttention-2: the split's timing, issue 11),
  # then for every cubin kept HGMMA and local-memory (LDL/STL) counts and the kernels' names
  # from cuobjdump into OUTDIR/sass.txt. (The fp16 grouped GEMM and the mixers' public
  # functions this mode ran first passed at 9a3c050.)
  budget=${KP_CALL_BUDGET_S:-530}; kc=/tmp/kp-kernel-cache; mkdir -p "$kc"
  left() { echo $(( budget - ($(date +%s) - t_start) )); }
  step "math gpu tests" 200 "$out/gpu_math.tests.log" "$bin/gpu_attention_test" \
    --include-ignored --test-threads 1 --nocapture math non_aligned outputs_are_bit_identical
  l=$(left)
  [ "$l" -gt 50 ] && KP_KERNEL_CACHE=$kc step "wgmma tests" $(( l < 140 ? l - 20 : 120 )) \
    "$out/wgmma.tests.log" "$bin/gpu_attention_test" --include-ignored --test-threads 1 \
    --exact wgmma_forward_matches_float64 wgmma_backward_matches_float64
  l=$(left)
  [ "$l" -gt 60 ] && step "cta order probe" $(( l < 120 ? l - 20 : 100 )) "$out/cta_order.tests.log" \
    "$bin/gpu_attention_test" --ignored --test-threads 1 --nocapture --exact \
    wgmma_backward_cta_order_probe
  l=$(left)
  [ "$l" -gt 120 ] && step "non-aligned" $(( l < 170 ? l - 20 : 150 )) "$out/nonaligned.log" \
    "$bin/attention" --compare torch --exclude torch_math,torch_efficient,torch_flash \
    --filter 'heads=24,seq_len>=4092' --output "$out/nonaligned.json"
  for g in 'heads=8,kv_heads=1' 'heads=32,kv_heads=8'; do
    l=$(left)
    [ "$l" -gt 80 ] && grouped "$g" $(( l < 140 ? l - 20 : 120 )) ",pass=fwd+bwd"
  done
  sass_check "$kc"
  ;;
cta_order)
  # The wgmma backward's CTA order (kernels/TUNING.md, "CTA order"): its float64 tests with the
  # cubins kept, the order probe (every order's outputs the same, then forward + backward per
  # order at causal MQA, GQA and MHA), the stage probe (the backward's kernels timed apart by
  # CUDA events, wgmma_backward_stage_probe), the chunk probe (the chunked order's sizes swept,
  # wgmma_backward_chunk_probe), the MQA and GQA cases of the shapes grid beside cuDNN and
  # FlashAttention-2, forward and forward + backward (the forward alone says how much of a
  # fwd+bwd gap is the backward's), and the SASS check: at most 500 s of limits, 560 s with
  # each step's 10 s to be killed (on 2026-12-05 the tests, the order probe, the stage and chunk
  # probes and the grouped fwd+bwd cases alone took 13–16, 3, 3–7, 5 and 42–46 s).
  kc=/tmp/kp-kernel-cache; mkdir -p "$kc"
  KP_KERNEL_CACHE=$kc step "wgmma backward tests" 120 "$out/wgmma.tests.log" \
    "$bin/gpu_attention_test" --include-ignored --test-threads 1 --exact \
    wgmma_backward_matches_float64
  step "cta order probe" 80 "$out/cta_order.tests.log" "$bin/gpu_attention_test" --ignored \
    --test-threads 1 --nocapture --exact wgmma_backward_cta_order_probe
  step "stage probe" 50 "$out/stages.tests.log" "$bin/gpu_attention_test" --ignored \
    --test-threads 1 --nocapture --exact wgmma_backward_stage_probe
  step "chunk probe" 50 "$out/chunks.tests.log" "$bin/gpu_attention_test" --ignored \
    --test-threads 1 --nocapture --exact wgmma_backward_chunk_probe
  for g in 'heads=8,kv_heads=1' 'heads=32,kv_heads=8'; do
    grouped "$g" 100
  done
  sass_check "$kc"
  ;;
ks_shards)
  # The kernel-sum grid in eight shards over several calls (README, Kernel sums):
  # `ks_shards OUTDIR BUDGET_S I[:NEED_S] ...` runs each shard I/8 through grid_shards.sh while
  # BUDGET_S allows (NEED_S: the shard's expected time), into gpu_kernel_sums_I.json;
  # KP_KS_TESTS=1 runs the kernel-sum GPU tests first (inside the budget, which counts from
  # this script's start: the wheels' install and nvidia-smi included).
  install_wheels
  budget=${3:?budget, s}; shift 3
  if [ "${KP_KS_TESTS:-0}" = 1 ]; then
    step "kernel-sum gpu tests" 120 "$out/gpu_kernel_sums.tests.log" "$bin/gpu_kernel_sums_test" \
      --include-ignored --test-threads 1 --nocapture
  fi
  KP_SHARD_RUNNER=kernel_sums KP_SHARD_NAME=gpu_kernel_sums \
    KP_SHARD_ARGS="--compare torch,jax,ott,geomloss --case-timeout 60" \
    bash "$here/grid_shards.sh" "$out" 8 $(( budget - ($(date +%s) - t_start) )) "$@"
  ;;
moe)
  # KP_MOE_ARGS: runner arguments (default --compare torch), e.g. "--quick" or
  # "--filter tokens=16384"; KP_MOE_LIMIT_S: the grid step's limit (default 420 s);
  # KP_MOE_TAG: names the files gpu_moe_TAG.json and moe_TAG.log (one part of a run split
  # over calls); KP_MOE_TESTS=0 skips the GPU tests (a later part, the first call ran them;
  # with the tests the two limits add up to more than a call's 600 s, so give the grid less);
  # KP_MOE_TESTS_LIMIT_S: the tests' limit (default 240 s). The timing probe
  # (grouped_wgmma_shape_probe, over 120 s) runs apart, after the tests and only with
  # KP_MOE_PROBE=1: on 2026-12-05 it ran first in name order and the 230 s limit stopped the
  # tests before the MoE layer's.
  if [ "${KP_MOE_TESTS:-1}" != 0 ]; then
    step "moe gpu tests" "${KP_MOE_TESTS_LIMIT_S:-240}" "$out/gpu_moe.tests.log" "$bin/gpu_moe_test" \
      --include-ignored --test-threads 1 --nocapture --skip grouped_wgmma_shape_probe
  fi
  if [ "${KP_MOE_PROBE:-0}" = 1 ]; then
    step "moe probe" "${KP_MOE_PROBE_LIMIT_S:-200}" "$out/gpu_moe.probe.log" "$bin/gpu_moe_test" \
      --ignored --test-threads 1 --nocapture --exact grouped_wgmma_shape_probe
  fi
  moe_tag=${KP_MOE_TAG:+_$KP_MOE_TAG}
  # shellcheck disable=SC2086
  step "moe grid" "${KP_MOE_LIMIT_S:-420}" "$out/moe$moe_tag.log" "$bin/moe" \
    ${KP_MOE_ARGS:---compare torch} --output "$out/gpu_moe$moe_tag.json"
  ;;
decode)
  # KP_DECODE_TESTS=0 skips the GPU test (a later shard's call).
  if [ "${KP_DECODE_TESTS:-1}" != 0 ]; then
    step "decode gpu test" 240 "$out/gpu_decode.tests.log" "$bin/gpu_attention_test" \
      --include-ignored --test-threads 1 --nocapture --exact split_kv_decoding_matches_float64
  fi
  extra=(); [ -n "$shard" ] && extra=(--shard "$shard")
  # KP_DECODE_LIMIT_S: the grid step's time limit (330 s: a third of the grid fits);
  # KP_DECODE_ARGS: more runner arguments, e.g. "--exclude flash".
  # shellcheck disable=SC2086
  step "decode grid" "${KP_DECODE_LIMIT_S:-330}" "$out/decode.log" "$bin/attention" \
    --grids decode --compare torch,jax "${extra[@]}" ${KP_DECODE_ARGS:-} \
    --output "$out/gpu_attention_decode.json"
  ;;
flex)
  step "flex gpu tests" 240 "$out/gpu_flex.tests.log" "$bin/gpu_attention_test" \
    --include-ignored --test-threads 1 --nocapture flex_attention public_entry
  step "flex grid" 300 "$out/flex.log" "$bin/attention" --grids main \
    --implementations flash,flex --compare torch --exclude torch_math,torch_efficient \
    --filter 'pass=fwd,head_dim=128,dtype=bf16' --output "$out/gpu_attention_flex.json"
  ;;
hopper)
  step "hopper gpu tests" 240 "$out/gpu_hopper.tests.log" "$bin/gpu_attention_test" \
    --include-ignored --test-threads 1 --nocapture wgmma_
  # Then flash (the wgmma kernels on these cases) beside flash_sm80 and SDPA's cuDNN and
  # FlashAttention-2 backends on the main grid's bf16 cases at head_dim 64 and 128, T = 4096
  # and 16384, forward and forward + backward (not site data until it is a full run).
  step "sm90 grid" 420 "$out/sm90.log" "$bin/attention" --grids main \
    --implementations flash,flash_sm80 --compare torch --exclude torch_math,torch_efficient \
    --filter "head_dim<=128,dtype=bf16,seq_len>=4096,seq_len!=8192" \
    --output "$out/gpu_attention_sm90.json"
  ;;
flex_bwd)
  # Flex's backward inside the wgmma backward (the default on sm_90a; KP_FLEX_BWD_SM90=0 keeps
  # the portable one): its GPU test, then the masks grid's forward + backward rows of flex on
  # each backward (the forward the same), one after the other on the same card.
  step "flex backward gpu test" 300 "$out/gpu_flex_bwd.tests.log" "$bin/gpu_attention_test" \
    --include-ignored --test-threads 1 --nocapture flex_backward_matches_float64
  step "flex wgmma backward" 150 "$out/flex_bwd_sm90.log" "$bin/attention" --grids masks --implementations flex --filter pass=fwd+bwd \
    --output "$out/flex_bwd_sm90.json"
  step "flex portable backward" 150 "$out/flex_bwd_portable.log" env KP_FLEX_BWD_SM90=0 \
    "$bin/attention" \
    --grids masks --implementations flex --filter pass=fwd+bwd \
    --output "$out/flex_bwd_portable.json"
  ;;
masks)
  # KP_MASKS_TESTS=0 skips the GPU tests (a second shard's call): flex's forward and backward
  # tests (flex_attention_matches_float64, flex_backward_matches_float64).
  if [ "${KP_MASKS_TESTS:-1}" != 0 ]; then
    step "flex gpu tests" 300 "$out/gpu_flex.tests.log" "$bin/gpu_attention_test" \
      --include-ignored --test-threads 1 --nocapture flex_
    step "torch_flex module test" 200 "$out/compare_flex.tests.log" "$bin/compare_script_test" \
      --include-ignored --test-threads 1 --nocapture flex_module
  fi
  extra=(); [ -n "$shard" ] && extra=(--shard "$shard")
  step "masks grid" "${KP_MASKS_LIMIT_S:-420}" "$out/masks.log" "$bin/attention" --grids masks \
    --compare torch_flex,torch --exclude torch_flash,torch_math,torch_efficient "${extra[@]}" \
    --output "$out/gpu_attention_masks.json"
  ;;
grid_gpus)
  # The committed grid's parts (data/gpu_attention_{fwd,bwd}_*.json: `--compare torch,jax
  # --filter pass=fwd --shard i/8` and `--filter pass=fwd+bwd --shard i/16`) on every GPU that
  # nvidia-smi lists at once, PART (the third argument) `fwd`, `bwd` or `all` (default): the
  # shards, forward + backward first (the longer), dealt to the GPUs in turn, each GPU running
  # its shards one after another (CUDA_VISIBLE_DEVICES), KP_GRID_LIMIT_S per shard (default
  # 300 s). A shard took 103-144 s forward and 121-230 s forward + backward on one H200
  # (kernels/TUNING.md), so on 8 GPUs `bwd` (2 shards each) and `fwd` (1 each) fit one call
  # apiece, at one commit.
  part=${3:-all}
  ngpu=$(nvidia-smi --query-gpu=index --format=csv,noheader | wc -l)
  [ "$ngpu" -ge 1 ] || { echo "no GPU listed"; exit 2; }
  shards=()
  case $part in bwd|all) for i in $(seq 1 16); do shards+=("bwd:pass=fwd+bwd:$i/16"); done ;; esac
  case $part in fwd|all) for i in $(seq 1 8); do shards+=("fwd:pass=fwd:$i/8"); done ;; esac
  [ ${#shards[@]} -gt 0 ] || { echo "part $part: not fwd, bwd or all"; exit 2; }
  echo "${#shards[@]} shards on $ngpu GPUs"
  for g in $(seq 0 $((ngpu - 1))); do
    (
      for k in $(seq "$g" "$ngpu" $((${#shards[@]} - 1))); do
        IFS=: read -r kind filter sh <<< "${shards[$k]}"
        name=gpu_attention_${kind}_${sh%/*}
        CUDA_VISIBLE_DEVICES=$g step "GPU $g: $name" "${KP_GRID_LIMIT_S:-300}" "$out/$name.log" \
          "$bin/attention" --compare torch,jax --filter "$filter" --shard "$sh" \
          --output "$out/$name.json"
      done
    ) &
  done
  wait
  ;;
full)
  extra=(); [ -n "$shard" ] && extra=(--shard "$shard")
  step "full grid" 3600 "$out/run.log" "$bin/attention" --compare torch,jax "${extra[@]}" \
    --output "$out/gpu_attention.json"
  ;;
*)
  echo "unknown mode $mode (smoke, tests, nonaligned, unverified, cta_order, ks_shards, moe, part, jaxinit, mixers, mixers_grid, mixers_rerun, kernel_sums, decode, flex, flex_bwd, hopper, masks, full, grid_gpus)"; exit 2
  ;;
esac
echo "total: $(( $(date +%s) - t_start )) s"
python3 "$here/device_verdict.py" "$out"

# The device tool returns at most 8 files from its output folder (on 2026-12-05 five of an
# `unverified` call's ten did not come back): past 8 files, the ones this run wrote go into
# OUTDIR/results.tgz (results-2.tgz, ... when that name is taken; `tar -xzf` unpacks them), and
# only those files, and the folders this run made once empty, are removed. KP_PACK=0 leaves
# everything as it is.
pack_results() {
  local new; new=$(mktemp)
  find "$out" -mindepth 1 -type f -printf '%P\n' | LC_ALL=C sort | LC_ALL=C comm -13 "$before" - \
    > "$new"
  local n; n=$(wc -l < "$new")
  if [ "${KP_PACK:-1}" = 1 ] && [ "$(find "$out" -type f | wc -l)" -gt 8 ] && [ "$n" -gt 0 ]; then
    local name=results.tgz i=2
    while [ -e "$out/$name" ] || [ -L "$out/$name" ]; do name=results-$i.tgz; i=$(( i + 1 )); done
    local tgz; tgz=$(mktemp --suffix=.tgz)
    if tar -czf "$tgz" -C "$out" --verbatim-files-from -T "$new" && mv "$tgz" "$out/$name"; then
      (cd "$out" && xargs -d '\n' rm -f -- < "$new")
      # The folders this run made, deepest first, each removed if it is empty by then.
      find "$out" -mindepth 1 -type d -printf '%P\n' | LC_ALL=C sort \
        | LC_ALL=C comm -13 "$before" - | LC_ALL=C sort -r \
        | (cd "$out" && xargs -r -d '\n' rmdir --ignore-fail-on-non-empty --)
      echo "packed the $n files this run wrote into $out/$name (tar -xzf to unpack)"
    else
      rm -f "$tgz"
      echo "could not pack the files this run wrote; they are left in $out"
    fi
  fi
  rm -f "$new"
}
pack_results
rm -f "$before"
