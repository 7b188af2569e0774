#!/usr/bin/env bash
# Every GPU check of the project in one call of the lent machine, under 9 minutes, with the logs in $OUT:
#   1. benchmarks/gpu_check.sh         the optimizer (issue 14): Triton kernels on the GPU against eager,
#                                      training steps against eager and Inductor, the GPU cost model
#                                      against measured kernels -> $OUT/gpu_check.json, $OUT/gpu_check.log
#   2. benchmarks/health_gpu_check.sh  the health monitor (issue 18): the per-rank CUDA-event compute
#                                      signal with one slowed rank, NVML -> $OUT/health_gpu_check.json and .log
# Run from the repository root: bash benchmarks/device_check.sh
set -uo pipefail
cd "$(dirname "$0")/.."
OUT=${OUT:-$(mktemp -d)}
export OUT PYTHONUNBUFFERED=1
nvidia-smi --query-gpu=name,driver_version,clocks.sm,clocks.max.sm,temperature.gpu,power.draw --format=csv
python3 -c "import torch, triton; print('torch', torch.__version__, 'triton', triton.__version__)"
bash benchmarks/gpu_check.sh | tee "$OUT/gpu_check.json"
timeout 90 bash benchmarks/health_gpu_check.sh --steps 30 --json > "$OUT/health_gpu_check.log" 2>&1
echo "health_gpu_check rc=$?"
head -c 3000 "$OUT/health_gpu_check.log"
