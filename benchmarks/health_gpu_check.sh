#!/usr/bin/env bash
# The health monitor's signals on a real NVIDIA GPU, in under 5 minutes (benchmarks/health_gpu_check.py says
# what it checks): the per-rank compute signal with one rank slowed by a busy kernel, and NVML sampling.
#   bash benchmarks/health_gpu_check.sh [--steps 40] [--busy-ms 30] [--json]
# Runs under $PYTHON (default python3: on the lent GPU machines, the image's PyTorch with nvidia-ml-py);
# writes health_gpu_check.json under $OUT when set. Exit 0: both checks passed; 1: one failed; 2: no GPU.
set -euo pipefail
cd "$(dirname "$0")/.."
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}" PYTHONUNBUFFERED=1
nvidia-smi --query-gpu=index,name,driver_version,clocks.sm,clocks.max.sm,temperature.gpu,power.draw --format=csv
exec timeout 280 "${PYTHON:-python3}" benchmarks/health_gpu_check.py "$@"
