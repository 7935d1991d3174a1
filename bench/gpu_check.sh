#!/usr/bin/env bash
# The GPU check for a task that is lent a device (one command, < 8 minutes on one H200):
#   1. the kernel tests on the GPU for real (no interpreter; tensors on cuda), file by file,
#   2. kernel timings at Llama-3-8B serving shapes vs a D2D copy, then one engine decode step at batch 1 for an
#      8B-shaped random model (bf16, then fp8 weights) vs the weight-bytes / copy-bandwidth floor -> docs/kernels.md,
#      printed last. The kernel tables are written before the decode step, so a failure there keeps them.
#   3. cold start (bench/coldstart_gpu.py) in the time left: an 8B-shaped random model written to local disk as
#      safetensors, shrunk to 8 of its 32 layers (~5.6 GB instead of 16 GB) to fit; the loader and `cat` (the
#      read floor), then fresh-process engine starts: fp8 online (writes the snapshot), fp8 from the snapshot,
#      bf16 -> docs/kernels.md (gpu-coldstart). Skipped if under 90 s are left.
# Every step's timeout is capped by one deadline (BUDGET_S, default 470 s from the start), so the whole check
# stays under 8 minutes whatever the earlier steps take.
# The device image already has torch, triton, transformers and pytest, and cannot fetch anything: nothing is
# installed here. Usage there, from the repo root: bash bench/gpu_check.sh  (set OUT to also copy results out)
set -uo pipefail
cd "$(dirname "$0")/.."
PY=${PY:-python3}
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}" PYTHONUNBUFFERED=1
export TRITON_INTERPRET=0 KERNEL_TEST_DEVICE=cuda HF_HUB_OFFLINE=1
DEADLINE=$((SECONDS + ${BUDGET_S:-470}))
left() {  # min($1, seconds to the deadline), at least 1 (`timeout 0` would mean no limit)
  local l=$((DEADLINE - SECONDS)); [ "$l" -gt "$1" ] && l=$1; [ "$l" -lt 1 ] && l=1; echo "$l"; }
$PY -c "import torch, triton; print('torch', torch.__version__, 'triton', triton.__version__, torch.cuda.get_device_name())"
# Compiled kernels are kept in the repo's .triton-cache (ignored by git; the device keeps it between calls), so a
# rerun skips the ~200 cold compiles. Each test file runs under its own timeout inside a 210 s share, and prints
# its own result line, so one slow or failing file does not hide the others.
export TRITON_CACHE_DIR=${TRITON_CACHE_DIR:-$PWD/.triton-cache}
KT_END=$((SECONDS + 210))
for f in tests/kernels/test_*.py; do
  share=$((KT_END - SECONDS)); [ "$share" -gt 90 ] && share=90
  if [ "$share" -lt 5 ]; then echo "$f: skipped (the kernel tests' 210 s are used up)"; continue; fi
  out=$(timeout "$(left "$share")" $PY -m pytest -q -x "$f" -p no:cacheprovider 2>&1); rc=$?
  echo "$f: $(echo "$out" | tail -n 1)$([ "$rc" -eq 124 ] && echo " (TIMED OUT after ${share} s)")"
  [ "$rc" -ne 0 ] && [ "$rc" -ne 124 ] && echo "$out" | grep -E "^(FAILED|ERROR|E )" | head -n 8
done
timeout "$(left 250)" $PY -m bench.kernel_bench
if [ -n "${OUT:-}" ]; then cp docs/kernels.md "$OUT/"; fi
T=$(left 200)
if [ "$T" -ge 90 ]; then
  echo "== cold start (${T} s left): Llama-3-8B shape, 8 of 32 layers (shrunk to fit the 8-minute budget)"
  timeout "$T" $PY -m bench.coldstart_gpu --layers 8 --child-timeout $((T - 30))
else
  echo "== cold start skipped: only ${T} s left of the 8-minute budget"
fi
if [ -n "${OUT:-}" ]; then cp docs/kernels.md "$OUT/"; fi
