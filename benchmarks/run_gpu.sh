#!/usr/bin/env bash
# All GPU checks of this version in one run (H200: about 10 minutes). Results (JSON + PNG + logs) go to $1
# (default benchmarks/results); copy the ones you cite into benchmarks/results/.
#   bash benchmarks/run_gpu.sh "$OUT"
set -uo pipefail
out="${1:-benchmarks/results}"
mkdir -p "$out"
export TRITON_CACHE_AUTOTUNING=1  # kernels.py tunes once; the later scripts reuse it
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv | tee "$out/gpu.txt"
python3 -c "import torch, triton, transformers, lightning; print(torch.__version__, triton.__version__, transformers.__version__, lightning.__version__)" | tee -a "$out/gpu.txt"
status=0
run() {  # run NAME TIMEOUT_S CMD...: keeps going when one check fails, so every check reports
  local name=$1 limit=$2
  shift 2
  echo "== $name"
  timeout "$limit" "$@" 2>&1 | tee "$out/$name.log"
  local rc=${PIPESTATUS[0]}
  [ "$rc" -eq 0 ] || { echo "!! $name exited $rc"; status=1; }
}
run kernels 300 python3 benchmarks/kernels.py --out "$out/kernels-h200.json"
run memory-scaling 300 python3 benchmarks/memory_scaling.py --out "$out/memory-scaling-h200.json"
run offload-stress 120 python3 benchmarks/offload_stress.py --out "$out/offload-stress-h200.json"
exit $status
