#!/usr/bin/env bash
# The GPU check for a task that is lent a device (one command, < 8 minutes on one H200):
#   1. the kernel tests on the GPU for real (no interpreter; tensors on cuda),
#   2. kernel timings at Llama-3-8B serving shapes vs a D2D copy -> docs/kernels.md, printed last.
# Usage on the device machine: bash bench/gpu_check.sh
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PY:-python3}
if ! $PY -c "import torch, triton" 2>/dev/null; then
  $PY -m pip install -q torch==2.13.0 triton==3.9.0 pytest==9.2.0 pytest-timeout==2.4.0 numpy
fi
$PY -m pip install -q --no-deps -e . >/dev/null 2>&1 || true
export TRITON_INTERPRET=0 KERNEL_TEST_DEVICE=cuda
$PY -m pytest -q tests/kernels -x -p no:cacheprovider 2>&1 | tail -n 15
$PY bench/kernel_bench.py
