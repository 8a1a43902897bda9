#!/usr/bin/env bash
# All GPU checks of this version in one run (H200: at most 10 minutes, the sum of the limits below; the machine's
# start comes on top). Results (run.log, JSON, PNG, a stream timeline: 7 files) go to $1 (default
# benchmarks/results); copy the ones you cite into benchmarks/results/.
#   bash benchmarks/run_gpu.sh "$OUT"
set -uo pipefail
out="${1:-benchmarks/results}"
mkdir -p "$out"
export TRITON_CACHE_AUTOTUNING=1  # kernels.py tunes once; the later scripts reuse it
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
log="$out/run.log"  # one log for everything: the device tool brings back at most 8 files
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv | tee "$log"
python3 -c "import torch, triton, transformers, lightning; print(torch.__version__, triton.__version__, transformers.__version__, lightning.__version__)" | tee -a "$log"
status=0
run() {  # run NAME TIMEOUT_S CMD...: keeps going when one check fails, so every check reports
  local name=$1 limit=$2
  shift 2
  echo "== $name ($(date +%T))" | tee -a "$log"
  timeout "$limit" "$@" 2>&1 | tee -a "$log"
  local rc=${PIPESTATUS[0]}
  [ "$rc" -eq 0 ] || { echo "!! $name exited $rc" | tee -a "$log"; status=1; }
}
# the kernel tests on CUDA first (bf16 included; the CPU suite runs them under the interpreter only), at each
# kernel's default tile: tuning every test shape would take minutes
run gpu-tests 90 env OOMB_TRITON_AUTOTUNE=0 python3 -m pytest -q -x -p no:cacheprovider tests/kernels
run kernels 180 python3 benchmarks/kernels.py --out "$out/kernels-h200.json"  # tunes; later scripts reuse it
run memory-scaling 240 python3 benchmarks/memory_scaling.py --warmup-once --hf-max 32768 \
  --contexts 8192,32768,131072 --offload-contexts 32768,131072 --out "$out/memory-scaling-h200.json"
run offload-stress 80 python3 benchmarks/offload_stress.py --steps 5 --out "$out/offload-stress-h200.json" \
  --trace "$out/offload-timeline.json.gz"
exit $status
