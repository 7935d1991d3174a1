#!/usr/bin/env bash
# The GPU check for a task that is lent a device (one command, < 8 minutes on one H200):
#   1. the kernel tests on the GPU for real (no interpreter; tensors on cuda),
#   2. kernel timings at Llama-3-8B serving shapes vs a D2D copy, then one engine decode step at batch 1 for an
#      8B-shaped random model (bf16, then fp8 weights) vs the weight-bytes / copy-bandwidth floor -> docs/kernels.md,
#      printed last. The kernel tables are written before the decode step, so a failure there keeps them.
# The device image already has torch, triton, transformers and pytest, and cannot fetch anything: nothing is
# installed here. Usage there, from the repo root: bash bench/gpu_check.sh  (set OUT to also copy results out)
set -uo pipefail
cd "$(dirname "$0")/.."
PY=${PY:-python3}
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}" PYTHONUNBUFFERED=1
export TRITON_INTERPRET=0 KERNEL_TEST_DEVICE=cuda HF_HUB_OFFLINE=1
$PY -c "import torch, triton; print('torch', torch.__version__, 'triton', triton.__version__, torch.cuda.get_device_name())"
timeout 210 $PY -m pytest -q tests/kernels -p no:cacheprovider 2>&1 | tail -n 25
timeout 250 $PY bench/kernel_bench.py  # 8 minutes in all, at most
if [ -n "${OUT:-}" ]; then cp docs/kernels.md "$OUT/"; fi
