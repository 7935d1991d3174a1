#!/usr/bin/env bash
# The GPU check (docs/gpu.md) for a task that is lent a device: one command, under 8 minutes on one H200, installing
# nothing (the device image has torch, triton, transformers and pytest, and cannot fetch anything). Parts, each in
# its own process under its own timeout, all capped by one deadline (BUDGET_S, default 470 s from the start), so a
# failing or slow part does not hide the others:
#   1. the kernel tests on the GPU for real (no interpreter; tensors on cuda), file by file;
#   2. parity: a model through LLM on CUDA vs HF transformers on the same GPU (bench/gpu_engine.py parity), and
#      how many Triton compiles a 4k-token generation triggers after the warm steps (bench/gpu_engine.py compiles);
#   3. start: an engine start at GPU_MEMORY_UTILIZATION=0.9 on a Llama-3-8B-shaped checkpoint, 64 requests, then
#      4. the same with fp8 weights (bench/gpu_engine.py start);
#   5. decode steps at batch 1, 8, 64, eager vs CUDA graphs, bf16 and fp8 (bench/decode_step.py);
#      and the kernel bandwidth tables (bench/kernel_bench.py -> docs/kernels.md);
#   6. cold start (bench/coldstart_gpu.py) in the time left, skipped under 90 s.
# Results: docs/gpu.md and docs/kernels.md, .gpu-results/ (a log per part, summary.txt), all copied to $OUT when
# it is set. The summary (one PASS / FAIL / SKIP line per check) is printed last.
# Usage there, from the repo root: bash bench/gpu_check.sh
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
# rerun skips the cold compiles. Each kernel test file runs under its own timeout inside a 120 s share (below),
# and prints its own result line, so one slow or failing file does not hide the others.
export TRITON_CACHE_DIR=${TRITON_CACHE_DIR:-$PWD/.triton-cache}
RES=.gpu-results; rm -rf "$RES"; mkdir -p "$RES"; SUM=$RES/summary.txt; : >"$SUM"
# part NAME CAP CMD...: run CMD under min(CAP, the time left); its log in $RES/NAME.log; a timeout, or a failure
# that printed no FAIL line of its own, gets one in the summary
part() {
  local name=$1 cap=$2; shift 2; local t; t=$(left "$cap")
  if [ "$t" -lt 20 ]; then echo "SKIP $name: only ${t} s left of the budget" >>"$SUM"; return; fi
  echo "== $name (up to ${t} s)"
  local before; before=$(wc -l <"$SUM")
  timeout "$t" "$@" >"$RES/$name.log" 2>&1; local rc=$?
  tail -n 40 "$RES/$name.log"
  local fails; fails=$(tail -n +$((before + 1)) "$SUM" | grep -c ^FAIL)
  if [ "$rc" -eq 124 ]; then echo "FAIL $name: timed out after ${t} s" >>"$SUM"
  elif [ "$rc" -ne 0 ] && [ "$fails" -eq 0 ]; then echo "FAIL $name: exit $rc, see $RES/$name.log" >>"$SUM"
  elif [ "$rc" -eq 0 ] && [ "$(wc -l <"$SUM")" -eq "$before" ]; then echo "PASS $name" >>"$SUM"; fi
}
# 1. Compiled kernels are kept in the repo's .triton-cache (ignored by git; the device keeps it between calls), so
# a rerun skips the ~200 cold compiles. Each test file runs under its own timeout inside a 120 s share.
KT_END=$((SECONDS + 120))
for f in tests/kernels/test_*.py; do
  share=$((KT_END - SECONDS)); [ "$share" -gt 60 ] && share=60
  if [ "$share" -lt 5 ]; then echo "SKIP $f: the kernel tests' 120 s are used up" >>"$SUM"; continue; fi
  out=$(timeout "$(left "$share")" $PY -m pytest -q -x "$f" -p no:cacheprovider 2>&1); rc=$?
  last=$(echo "$out" | tail -n 1)
  if [ "$rc" -eq 0 ]; then echo "PASS $f: $last" >>"$SUM"
  elif [ "$rc" -eq 124 ]; then echo "FAIL $f: timed out after ${share} s" >>"$SUM"
  else echo "FAIL $f: $last" >>"$SUM"; echo "$out" | grep -E "^(FAILED|ERROR|E )" | head -n 8 | tee -a "$RES/kernel-tests.log"; fi
done
# in order of importance: when the deadline nears, the later parts are the ones cut (SKIP lines)
part parity 60 $PY -m bench.gpu_engine parity
part start 150 $PY -m bench.gpu_engine start
part decode 80 $PY -m bench.decode_step
part compiles 40 $PY -m bench.gpu_engine compiles
part kernel-bench 40 $PY -m bench.kernel_bench
T=$(left 200)
if [ "$T" -ge 90 ]; then
  part coldstart "$T" $PY -m bench.coldstart_gpu --layers 8 --child-timeout $((T - 30))
else
  echo "SKIP cold start: only ${T} s left of the 8-minute budget" >>"$SUM"
fi
if [ -n "${OUT:-}" ]; then cp docs/gpu.md docs/kernels.md "$SUM" "$OUT/" 2>/dev/null; fi
echo; echo "== summary ($(grep -c ^PASS "$SUM") passed, $(grep -c ^FAIL "$SUM") failed, $(grep -c ^SKIP "$SUM") skipped)"
cat "$SUM"
