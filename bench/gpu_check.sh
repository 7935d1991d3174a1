#!/usr/bin/env bash
# The GPU check (docs/gpu.md) for a task that is lent a device: one command, under 9 minutes on one H200. The device
# image has torch, triton, pytest and pytest-xdist and fetches nothing; our pinned transformers, xgrammar and pydantic
# travel as wheels (bash bench/gpu_wheels.sh here first, then the call carries .whl), installed under /tmp only.
# Parts, each in its own process under its own cap, so a failing or slow part does not hide the others:
#   1. the kernel tests on the GPU for real (no interpreter; tensors on cuda), one line per test file;
#   2. parity: a model through LLM on CUDA vs HF transformers on the same GPU (bench/gpu_engine.py parity), and
#      how many Triton compiles a 4k-token generation triggers after the warm steps (bench/gpu_engine.py compiles);
#   3. start: an engine start at GPU_MEMORY_UTILIZATION=0.9 on a Llama-3-8B-shaped checkpoint, 64 requests, then
#      4. the same with fp8 weights (bench/gpu_engine.py start);
#   4b. a hybrid (a small random Qwen3-Next) vs HF on the GPU: eager, chunked prefill, CUDA graphs (bench/gpu_hybrid.py);
#   5. decode steps at batch 1, 8, 64, eager vs CUDA graphs, bf16 and fp8 (bench/decode_step.py);
#      and the kernel bandwidth tables (bench/kernel_bench.py -> docs/kernels.md);
#   6. cold start (bench/coldstart_gpu.py) in the time held back for it.
# The caps below add up to the budget (BUDGET_S, 535 s from the start), so every part gets its whole cap even when
# each part before it uses all of its own, and the cold start's share is held back from the others.
# Results: docs/gpu.md (the versions this ran with first) and docs/kernels.md, .gpu-results/ (a log per part,
# summary.txt), all copied to $OUT when it is set (the logs as gpu-results.tgz). The summary (one PASS / FAIL / SKIP line per check, INFO for the
# versions) is printed last.
# Usage there, from the repo root: bash bench/gpu_check.sh
set -uo pipefail
cd "$(dirname "$0")/.."
PY=${PY:-python3}
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}" PYTHONUNBUFFERED=1
export TRITON_INTERPRET=0 KERNEL_TEST_DEVICE=cuda HF_HUB_OFFLINE=1
KERNEL_S=90 PARITY_S=55 START_S=100 HYBRID_S=40 DECODE_S=50 COMPILES_S=80 BENCH_S=30 COLD_S=90
BUDGET_S=${BUDGET_S:-$((KERNEL_S + PARITY_S + START_S + HYBRID_S + DECODE_S + COMPILES_S + BENCH_S + COLD_S))}
DEADLINE=$((SECONDS + BUDGET_S))
COLD_FROM=$((DEADLINE - COLD_S))  # the parts before the cold start end by then
left() {  # min($1, seconds to $2 (default: the cold start's share)), at least 1 (`timeout 0` would mean no limit)
  local l=$((${2:-$COLD_FROM} - SECONDS)); [ "$l" -gt "$1" ] && l=$1; [ "$l" -lt 1 ] && l=1; echo "$l"; }
RES=.gpu-results; rm -rf "$RES"; mkdir -p "$RES"; SUM=$RES/summary.txt; : >"$SUM"
# our pinned transformers, xgrammar and pydantic, carried as wheels (bench/gpu_wheels.sh): the image has others or none
if compgen -G ".whl/*.whl" >/dev/null; then
  $PY -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/gpu-site .whl/*.whl \
    >"$RES/wheels.log" 2>&1 && export PYTHONPATH="$PYTHONPATH:/tmp/gpu-site" || echo "FAIL wheels: see $RES/wheels.log" >>"$SUM"
fi
# the versions (and their docs section) beside the kernel tests, which leave the GPU and most cores to spare
timeout -k 5 60 $PY -m bench.gpu_engine versions >"$RES/versions.log" 2>&1 &
VERSIONS=$!
# Compiled kernels are kept in the repo's .triton-cache (ignored by git; the device keeps it between calls), so a
# rerun skips the cold compiles.
export TRITON_CACHE_DIR=${TRITON_CACHE_DIR:-$PWD/.triton-cache}
# part NAME CAP CMD...: run CMD under min(CAP, the time left); its log in $RES/NAME.log. A timeout, a non-zero exit or
# a FAIL line in its log (an error it recorded) is a FAIL in the summary unless the part wrote its own FAIL line there;
# a part that exits 0 having written no line of its own gets a PASS line.
part() {
  local name=$1 cap=$2 end=$COLD_FROM; shift 2; [ "$name" = coldstart ] && end=$DEADLINE
  local t; t=$(left "$cap" "$end")
  if [ "$t" -lt 20 ]; then echo "SKIP $name: only ${t} s left of the budget" >>"$SUM"; return; fi
  echo "== $name (up to ${t} s)"
  local before; before=$(wc -l <"$SUM")
  timeout -k 5 "$t" "$@" >"$RES/$name.log" 2>&1; local rc=$?
  tail -n 40 "$RES/$name.log"
  local own; own=$(tail -n +$((before + 1)) "$SUM" | grep -c ^FAIL)
  local logged; logged=$(grep -c ^FAIL "$RES/$name.log")
  if [ "$rc" -eq 124 ] || [ "$rc" -eq 137 ]; then echo "FAIL $name: timed out after ${t} s" >>"$SUM"
  elif [ "$own" -gt 0 ]; then :  # its own FAIL lines say what failed
  elif [ "$rc" -ne 0 ] || [ "$logged" -gt 0 ]; then
    echo "FAIL $name: exit $rc, $logged FAIL line(s) in $RES/$name.log" >>"$SUM"
  elif [ "$(wc -l <"$SUM")" -eq "$before" ]; then echo "PASS $name" >>"$SUM"; fi
}
# kernel_lines RC LIMIT: one summary line per kernel test file from pytest's -v log (a test's outcome is on its own
# line, before its id with xdist and after it without), then a FAIL line if the run timed out or failed elsewhere
kernel_lines() {
  awk -v rc="$1" -v t="$2" -v logf="$RES/kernel-tests.log" '
    match($0, /tests\/kernels\/test_[A-Za-z0-9_]+\.py::[^ ]+/) {
      id = substr($0, RSTART, RLENGTH)
      if (match($0, /(PASSED|FAILED|ERROR|SKIPPED|XFAIL|XPASS)/)) {
        o = substr($0, RSTART, RLENGTH)
        if (!(id in got) || o == "FAILED" || o == "ERROR") got[id] = o  # an error at teardown follows a pass
      }
    }
    END {
      for (id in got) {
        f = id; sub(/::.*/, "", f)
        if (!(f in seen)) { seen[f] = 1; nfiles++ }
        if (got[id] == "FAILED" || got[id] == "ERROR") { bad[f]++; nbad++ } else n[f, got[id]]++
      }
      for (f in seen)
        printf "%s %s: %d passed, %d failed, %d skipped\n", (bad[f] ? "FAIL" : "PASS"), f, n[f, "PASSED"] + n[f, "XPASS"],
          bad[f], n[f, "SKIPPED"] + n[f, "XFAIL"]
      if (rc == 124 || rc == 137) printf "FAIL kernel tests: timed out after %s s (%d files reported above)\n", t, nfiles
      else if (rc != 0 && !nbad) printf "FAIL kernel tests: pytest exit %s with no failing test named, see %s\n", rc, logf
    }' "$RES/kernel-tests.log" | sort >>"$SUM"
}
# 1. The kernel tests in one pytest run: with pytest-xdist on 8 of the 16 cores, so the ~200 cold compiles of a fresh
# machine's empty .triton-cache run 8 at a time; each test under pytest-timeout's 60 s, so a hung test fails alone.
XDIST=()
$PY -c "import xdist" 2>/dev/null && XDIST=(-n 8)
t=$(left "$KERNEL_S")
echo "== kernel tests (up to ${t} s${XDIST[*]:+, ${XDIST[*]}})"
timeout -k 5 "$t" $PY -m pytest -v "${XDIST[@]}" -o timeout=60 -p no:cacheprovider tests/kernels \
  >"$RES/kernel-tests.log" 2>&1
kernel_lines $? "$t"
grep -E "^(FAILED|ERROR) " "$RES/kernel-tests.log" | head -n 8
wait "$VERSIONS"; grep ^INFO "$RES/versions.log" >"$RES/versions.txt" || echo "INFO versions: see $RES/versions.log" >"$RES/versions.txt"
# in order of importance: when the deadline nears, the later parts are the ones cut (SKIP lines)
part parity "$PARITY_S" $PY -m bench.gpu_engine parity
part start "$START_S" $PY -m bench.gpu_engine start
part hybrid "$HYBRID_S" $PY -m bench.gpu_hybrid
part decode "$DECODE_S" $PY -m bench.decode_step
part compiles "$COMPILES_S" $PY -m bench.gpu_engine compiles
part kernel-bench "$BENCH_S" $PY -m bench.kernel_bench
T=$(left "$BUDGET_S" "$DEADLINE")  # the cold start's share, and whatever the parts before it left
part coldstart "$T" $PY -m bench.coldstart_gpu --layers 8 --child-timeout $((T > 60 ? T - 30 : T / 2))
cat "$RES/versions.txt" "$SUM" >"$RES/summary.tmp" && mv "$RES/summary.tmp" "$SUM"
# every part's log too, as one file (a device run brings back only a few files)
if [ -n "${OUT:-}" ]; then cp docs/gpu.md docs/kernels.md "$SUM" "$OUT/" 2>/dev/null; tar czf "$OUT/gpu-results.tgz" "$RES"; fi
echo; echo "== summary ($(grep -c ^PASS "$SUM") passed, $(grep -c ^FAIL "$SUM") failed, $(grep -c ^SKIP "$SUM") skipped)"
cat "$SUM"
