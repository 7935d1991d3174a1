"""Every Triton kernel the engine reaches, compiled for sm80, sm86, sm89, sm90 and sm120 on this CPU-only machine
(bench/compile_arch.py, a subprocess: this process runs Triton's interpreter). No compile error but the fp8 ones the
engine refuses, shared memory within each arch's limit, no spill in an attention kernel's loops, every kernel of ours
reached on every arch, and the engine's own runs reaching the variants they are there to find.

Cold (an empty cache) it compiles 107-142 variants per arch: about 300 s of CPU, 3 minutes on 2 cores. Its caches
(Triton's, the ptxas numbers, each arch's results by the hash of its sources) live in the user cache: a rerun after
an engine change takes ~20 s (Triton's cache serves every kernel), one with no source change ~5 s."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

from bench._standin import ARCHS
from bench.compile_arch import ATTENTION, REFUSAL, fp8_admitted, problems
from engine.config import default_cache_root

REPO = Path(__file__).resolve().parents[1]
pytestmark = pytest.mark.slow  # 3 minutes with an empty cache (a fresh machine); CI runs it

FP8_ONLY = {"_quant_rows_kernel", "_fp8_gemm_kernel", "_quant_groups_kernel", "_block_gemm_kernel"}  # fp8 cases only
XGRAMMAR = "apply_token_bitmask_inplace_kernel"


def our_kernels() -> set[str]:
    """The @jit functions of kernels/ that are launched (named *_kernel; the rest are called from them)."""
    names = set()
    for f in (REPO / "kernels").glob("*.py"):
        names |= set(re.findall(r"@jit(?:\([^)]*\))?\s*\ndef (\w+_kernel)\(", f.read_text()))
    return names


@pytest.fixture(scope="module")
def results(tmp_path_factory) -> list[dict]:
    """One run of the bench, its caches in the user cache dir (kept between runs), one worker per core."""
    out = tmp_path_factory.mktemp("compile-arch") / "results.json"
    cache = Path(default_cache_root()) / "compile-arch"
    cmd = [sys.executable, "-m", "bench.compile_arch", "--no-docs", "--json", str(out), "--cache", str(cache)]
    env = {**os.environ, "TRITON_INTERPRET": "0"}  # this process's 1 (conftest) would make no JITFunction there
    proc = subprocess.run(cmd, cwd=REPO, env=env, capture_output=True, text=True, timeout=900)
    assert out.is_file(), f"exit {proc.returncode}\n{proc.stdout[-4000:]}\n{proc.stderr[-4000:]}"
    return json.loads(out.read_text())["results"]


def test_every_arch_compiles_within_its_limits(results):
    assert [r["arch"] for r in results] == sorted(ARCHS)
    bad = problems(results)
    assert not bad, "\n".join(bad)


def test_fp8_fails_to_compile_exactly_where_the_engine_refuses_it(results):
    assert not fp8_admitted(80) and not fp8_admitted(86) and fp8_admitted(89)  # the check under test is not vacuous
    for r in results:
        fp8_cases = {name for name, c in r["cases"].items() if c["fp8"]}
        assert len(fp8_cases) >= 3
        failed = {e["case"] for e in r["errors"] if REFUSAL in e["message"]}
        assert failed == (set() if fp8_admitted(r["arch"]) else fp8_cases), r["arch"]


def test_every_kernel_is_compiled_on_every_arch(results):
    ours = our_kernels()
    assert len(ours) >= 11 and set(ATTENTION) <= ours
    for r in results:
        want = (ours | {XGRAMMAR}) - (set() if fp8_admitted(r["arch"]) else FP8_ONLY)
        assert want <= {k["kernel"] for k in r["kernels"]}, (r["arch"], want - {k["kernel"] for k in r["kernels"]})


# what the engine runs must reach on every arch (fp8: where admitted), found in the compiled variants' specs
ENGINE_REACHES = [
    ("_paged_attn_kernel", "IS_SPLIT=True", False),  # flash-decoding splits and their reduction
    ("_paged_attn_kernel", "IS_SPLIT=False", False),
    ("_paged_attn_kernel", "BLOCK_Q=1 ", False),  # pure-decode tiles
    ("_paged_attn_kernel", "HAS_SOFTCAP=True", False),  # Gemma 2
    ("_paged_attn_kernel", "q_ptr:*fp16", False),
    ("_paged_attn_kernel", "k_ptr:*fp8e4nv", True),  # fp8 KV
    ("_prefill_attn_kernel", "HEAD_D=256", False),
    ("_prefill_attn_kernel", "HEAD_D=96", False),
    ("_prefill_attn_kernel", "HEAD_D=64", False),
    ("_prefill_attn_kernel", "HAS_SOFTCAP=True", False),
    ("_prefill_attn_kernel", "k_ptr:*fp8e4nv", True),
    ("_sgmv_kernel", "DOT=native", False),  # LoRA shrink
    ("_sgmv_kernel", "DOT=tf32", False),  # LoRA expand
    ("_moe_gemm_kernel", "HAS_SCALE=True", True),  # fp8 experts
    ("_reshape_and_cache_kernel", "kc_ptr:*fp8e4nv", True),
    ("_int_gemm_kernel", "HAS_ZEROS=True", False),  # AWQ, asymmetric GPTQ / compressed-tensors
    ("_int_gemm_kernel", "HAS_ZEROS=False", False),  # symmetric
    ("_block_gemm_kernel", "a_ptr:*fp8e4nv", True),  # block fp8 (Qwen3-FP8)
]


def test_the_engine_runs_reach_every_path(results):
    for r in results:
        engine = [k for k in r["kernels"] if k["case"].startswith("engine ")]
        for name, fragment, fp8 in ENGINE_REACHES:
            if fp8 and not fp8_admitted(r["arch"]):
                continue
            assert any(k["kernel"] == name and fragment in k["spec"] + " " for k in engine), (r["arch"], name, fragment)


def test_the_checks_can_fail():
    """Doctored results: each rule the check enforces catches its own breach."""
    kernel = dict(kernel="_prefill_attn_kernel", case="c", spec="s", smem=0, warps=8, regs=128, spill_stores=0)
    kernel |= dict(spill_loads=0, stack=0, loop_spills=0, hash="h")
    ok = dict(arch=90, kernels=[kernel], errors=[], cases={"c": dict(fp8=False, seconds=0.0)})
    assert problems([ok]) == []
    assert problems([ok | dict(kernels=[kernel | dict(spill_stores=4, spill_loads=4)])]) == []  # outside loops
    breaches = [
        dict(kernels=[kernel | dict(smem=ARCHS[90].max_shared + 1)]),
        dict(kernels=[kernel | dict(spill_stores=4, spill_loads=4, loop_spills=1)]),
        dict(kernels=[kernel | dict(regs=255, warps=16)]),
        dict(errors=[dict(case="c", kernel="k", message="CompilationError: boom")]),
        dict(arch=80, cases={"c": dict(fp8=True, seconds=0.0)}),  # fp8 compiled where the engine refuses it
        dict(arch=90, cases={"c": dict(fp8=True, seconds=0.0)}, errors=[dict(case="c", kernel="k", message=REFUSAL)]),
    ]
    for breach in breaches:
        assert len(problems([ok | breach])) == 1, breach
    refused = ok | dict(arch=80, cases={"c": dict(fp8=True, seconds=0.0)})
    assert problems([refused | dict(errors=[dict(case="c", kernel="k", message=f"fp8e4nv {REFUSAL}")])]) == []
