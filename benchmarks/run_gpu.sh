#!/usr/bin/env bash
# Every goal of docs/design.md section 4 measured in one run on one GPU (H200, Qwen2.5-7B shape, bf16), at most
# 8 minutes: the sum of the part limits below (the machine's start comes on top). Results go to $1 (default
# benchmarks/results): run.log (everything printed), kernels-<gpu>.json/.png, goals-compare.json,
# goals-reduced.json, summary.json, summary.md, goals.png — 8 files; the goal table (summary.md) is printed last.
# Every row is printed and written to its JSON as it is measured, so a run cut short keeps its rows.
#   bash benchmarks/run_gpu.sh "$OUT"               # the goals: checks kernels compare reduced summary
#   bash benchmarks/run_gpu.sh "$OUT" tiles profile  # other parts by name: tiles, profile, gather, stress, scaling, windows, latent — in a
#                                                   # call of their own: the device tool brings back 8 files a call
#   OOMB_BENCH_TINY=1 bash benchmarks/run_gpu.sh /tmp/out  # every part at tiny shapes on the CPU (a dry run of
#                                                           # the script itself; tests/test_benchmarks.py runs it)
#
# Part limits, sized by FLOP counts (lightning_oomb.engine.step_time) at ~500 TFLOP/s for matmuls and ~300 for
# attention (HF's measured 5.2 s at 32K is ~1.3x faster than that): a 7B step is ~7e10 matmul FLOPs per token
# with OOMB's recomputation, attention 4 * d * 28 heads * N^2 / 2 per layer and pass, 5.5 passes. A 28-layer
# step is ~8 s at 32K, ~25 s at 64K, ~5 min at 256K: longer contexts run 4 (or 2) layers and scale per layer.
#   checks   45 s  tests/engine/test_cuda_paths.py: the side streams, events and page-locked buffers of
#                  reuse_attention, float32-host and offload (also OOMB_OFFLOAD_GATHER's page-copy kernel on
#                  mapped host memory) on this GPU, each against the step without it (25 s on the H200 before
#                  the gather checks, imports and the first CUDA calls included)
#   kernels  95 s  2 key lengths x (our dense and sparse kernels and offload's merged key blocks at default
#                  tiles — a group of 4 key blocks per call, as steps run them, and one block per call —, then
#                  dense and sparse tuned; SDPA x2;
#                  FlexAttention, compiled once per length: ~20 s each); tuning capped at 2 configs per kernel
#                  and key (a compilation each, ~1-3 s); rows end by 75 s, then the accuracy check and the
#                  kernel records (chosen config, n_regs, n_spills); 67 s on the H200 (2026-12-04)
#   compare 140 s  28 layers: HF 32K warm-up + 3 steps (~25 s), OOMB 32K warm-up + 3 (~35 s + compilation),
#                  OOMB 64K 1 step (~25 s: the check of the layer scaling), model build and imports (~20 s);
#                  then, if time is left, OOMB 32K with reuse_attention and with every layer offloaded
#                  (warm-up + 3, ~30 s each)
#   reduced 180 s  the gradient check (2 layers at 32K against float32), 4 then 2 layers at 64K (the fit, ~17 s);
#                  2 layers: 128K without and with offload (3 + 3 steps, ~42 s), 256K offloaded (~24 s), 256K
#                  sparse (~6 s), 256K with the strategies' defaults (~19 s), 1M sparse with one HBM and one host
#                  layer (49 s on the H200); if time is left, 256K offloaded with reuse_attention, with
#                  float32-host gradient sums and with mlp_tile=1024 (~20-24 s each); the rest for model builds
#                  and pinning
#   summary  20 s  the planner (1M tokens, the longest step), this GPU's step rates (fitted on the rows; a 1 GiB
#                  pinned copy timed), the goal table
# Each Python part starts a row only if its predicted time is left of its budget (limit - 20 s; the prediction is
# calibrated on the rows before it; a skipped row says why); `timeout` is the backstop. The steps use each
# kernel's default tile (OOMB_TRITON_AUTOTUNE=0): no tuning inside a step. Each part's log starts with its command
# and versions (torch, triton, transformers, lightning, GPU, commit).
set -uo pipefail
out="${1:-benchmarks/results}"
shift $(($# > 0 ? 1 : 0))
parts=("$@")
[ ${#parts[@]} -gt 0 ] || parts=(checks kernels compare reduced summary)
mkdir -p "$out"
# OOMB_BENCH_TINY=1: the same commands at tiny shapes on the CPU (kernels through the Triton interpreter)
tiny=()
smoke=()
scaling_tiny=()
if [ "${OOMB_BENCH_TINY:-0}" != "0" ]; then
  tiny=(--tiny --device cpu)
  smoke=(--smoke)
  scaling_tiny=(--tiny --device cpu --hf-max 256 --contexts 128,256 --offload-contexts 128,256 --chunk-size 128)
fi
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
log="$out/run.log"  # one log for everything: the device tool brings back only a handful of files
: >"$log"
{ nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv 2>&1 || true; } | tee -a "$log"
status=0
run() {  # run NAME LIMIT_S CMD...: keeps going when one part fails, so every part reports
  local name=$1 limit=$2
  shift 2
  echo "== $name (limit ${limit} s, $(date +%T))" | tee -a "$log"
  local start=$SECONDS
  timeout --kill-after=10 "$limit" "$@" 2>&1 | tee -a "$log"
  local rc=${PIPESTATUS[0]}
  echo "== $name: exit $rc after $((SECONDS - start)) s" | tee -a "$log"
  [ "$rc" -eq 0 ] || { echo "!! $name failed (exit $rc; 124: over its limit)" | tee -a "$log"; status=1; }
}
# the steps compile into their own Triton cache, so the first OOMB step (the "first step" goal) compiles from cold
# rather than reusing what the kernel benchmark compiled; outside "$out", which comes back as files
steps_cache=$(mktemp -d "${TMPDIR:-/tmp}/oomb-triton-cache.XXXXXX")
trap 'rm -rf "$steps_cache"' EXIT
goals() {  # goals PART LIMIT_S: a part of benchmarks/goals.py that plans its rows for LIMIT_S - 20 s
  run "$1" "$2" env OOMB_TRITON_AUTOTUNE=0 TRITON_CACHE_DIR="$steps_cache" python3 benchmarks/goals.py --part "$1" \
    --out-dir "$out" \
    --budget-s $(($2 - 20)) ${tiny[@]+"${tiny[@]}"}
}
for part in "${parts[@]}"; do
  case "$part" in
    checks) run checks 45 python3 -m pytest -q -p no:cacheprovider tests/engine/test_cuda_paths.py \
      tests/kernels/test_page_copy.py ;;
    kernels) run kernels 95 env TRITON_PRINT_AUTOTUNING=1 python3 benchmarks/attention_kernels.py --out "$out/kernels-h200.json" \
      --methods paged,sparse,merged,merged-block,sdpa-repeat,sdpa-gqa,flex --default-tiles --tune-configs 2 --warmup 2 --iters 5 \
      --budget-s 75 ${smoke[@]+"${smoke[@]}"} ;;
    compare) goals compare 140 ;;
    reduced) goals reduced 180 ;;
    summary) goals summary 20 ;;
    # optional parts (not in the 8 minutes): each kernel's candidate tiles (the data for SM90_DEFAULTS) and the
    # dK/dV kernel computing dQ too (OOMB_TRITON_FUSED_DQ; ~100 s on the H200), steps profiled (128K without and with offload: where offload's overhead goes; the 1M sparse step,
    # 1.6x its planned time: where does it go? ~170 s), that 1M step with OOMB_OFFLOAD_GATHER=1 (its scattered
    # pages by the page-copy kernel: compare its wall time with the profile's 1m-sparse-host), the offload race
    # check, the context sweep, the window layers' tails on the device vs in host memory (6 layers of the
    # Gemma-3-27B shape at 64K: ~60 s predicted), a latent attention model's pages expanded vs as latents (2 layers
    # of the GLM-4.7-Flash shape at 32K: ~40 s predicted, its kernels' compilation at head dim 1,024 included)
    tiles) run tiles 150 python3 benchmarks/tile_sweep.py --out "$out/tile-sweep-h200.json" --budget-s 130 \
      ${smoke[@]+"${smoke[@]}"} ;;
    profile) run profile 200 env OOMB_TRITON_AUTOTUNE=0 python3 benchmarks/profile_step.py \
      --row 128k-dense,128k-offload,1m-sparse-host --plain --out "$out/profile-h200.md" ${tiny[@]+"${tiny[@]}"} ;;
    gather) run gather 150 env OOMB_TRITON_AUTOTUNE=0 OOMB_OFFLOAD_GATHER=1 python3 benchmarks/profile_step.py \
      --row 1m-sparse-host --plain --out "$out/profile-gather-h200.md" ${tiny[@]+"${tiny[@]}"} ;;
    stress) run stress 120 python3 benchmarks/offload_stress.py --steps 5 --out "$out/offload-stress-h200.json" \
      ${tiny[@]+"${tiny[@]}"} ;;
    scaling) run scaling 300 env OOMB_TRITON_AUTOTUNE=0 python3 benchmarks/memory_scaling.py --warmup-once \
      --hf-max 32768 --contexts 8192,32768 --offload-contexts 32768,65536 --out "$out/memory-scaling-h200.json" \
      ${scaling_tiny[@]+"${scaling_tiny[@]}"} ;;
    windows) run windows 150 env OOMB_TRITON_AUTOTUNE=0 python3 benchmarks/window_tails.py \
      --out "$out/window-tails-h200.json" ${tiny[@]+"${tiny[@]}"} ;;
    latent) run latent 150 env OOMB_TRITON_AUTOTUNE=0 python3 benchmarks/latent_pages.py \
      --out "$out/latent-pages-h200.json" ${tiny[@]+"${tiny[@]}"} ;;
    *) echo "!! unknown part '$part' (checks kernels compare reduced summary tiles profile gather stress scaling windows latent)" | tee -a "$log"; status=1 ;;
  esac
done
exit $status
