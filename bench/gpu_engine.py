"""The GPU check's engine parts (bench/gpu_check.sh runs each in its own process, under its own timeout):

- `parity`: a model through `LLM` on CUDA, 32 prompts x 32 tokens. fp32 greedy must equal HF transformers run on
  the same GPU token for token; bf16 must pass vLLM's check_logprobs_close against that reference. The model is the
  embedded SmolLM2 when this machine has it; the device machine cannot carry it (its 94 MB GGUF is over the 64 MiB
  a run takes along, and the device reaches no registry), so there it is a random checkpoint of SmolLM2's shape
  (30 layers, hidden 576, 9 heads / 3 KV heads, vocab 49152) written first, with weights large enough that greedy
  choices are not near-ties.
- `compiles`: how many Triton compiles a 4k-token generation triggers after the idle-gap warm steps (target 0);
  --tiny counts the kernel variants (Triton's cache keys) the interpreter launches after them instead.
- `start`: an engine start at GPU_MEMORY_UTILIZATION=0.9 with a Llama-3-8B-shaped random checkpoint written to
  local disk (all 32 layers unless --layers): no OOM, the KV pool equals the planner's plan, 64 concurrent requests
  complete, torch.cuda.max_memory_reserved() stays within the budget. Then the same checkpoint with
  QUANTIZATION=fp8: weight bytes (planned and measured) and agreement with the bf16 tokens (random weights: the
  agreement shows the path works, not fp8's quality, which bench/fp8_quality.py measures on SmolLM2).
- `versions`: torch, Triton, CUDA, Python, the GPU and its driver, beside the torch / Triton pins of the image
  (one INFO line: the check machine's own image may carry another pair, which a pass there does not cover).

Each writes its section of docs/gpu.md and appends PASS/FAIL lines to .gpu-results/summary.txt, which the check
prints last. `--tiny`: the same code on CPU with a 2-layer toy model (CI runs it; writes nothing)."""

from __future__ import annotations

import argparse
import contextlib
import gc
import json
import logging
import random
import tempfile
import time
from pathlib import Path

import torch

from bench._common import gpu_summary as summarize
from bench._common import hf_greedy, logprobs_mismatch, producer, write_section
from bench.synthetic_model import LLAMA3_8B, SMOLLM2, TINY, write_model

REPO = Path(__file__).resolve().parents[1]
DOC = REPO / "docs" / "gpu.md"


def report(key: str, md: list[str], tiny: bool) -> None:
    """Print a part's section; outside --tiny runs also write it into docs/gpu.md."""
    if not tiny:
        md = [md[0], "", producer(f"python -m bench.gpu_engine {key.removeprefix('gpu-')}", "cuda"), *md[1:]]
        write_section(DOC, key, "\n".join(md), title="# GPU check")
    print("\n".join(md))


def prompts(n: int, vocab: int, seed: int = 0) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(3, vocab) for _ in range(rng.randrange(8, 40))] for _ in range(n)]


def parity(tiny: bool, workdir: Path) -> list[str]:
    from engine import LLM, SamplingParams

    device, n, new = ("cpu", 4, 8) if tiny else ("cuda", 32, 32)
    path, what = None, ""
    if not tiny:
        try:
            from bench._common import default_model_path

            path, what = default_model_path(), "SmolLM2-135M-Instruct (the embedded default)"
        except Exception as e:  # noqa: BLE001 - the device machine has no GGUF: use the same shape
            print(f"embedded SmolLM2 unavailable here ({type(e).__name__}); a random checkpoint of its shape")
    if path is None:
        path = workdir / "parity-model"
        shape = TINY | {"num_hidden_layers": 2} if tiny else SMOLLM2
        write_model(path, shape, device, std=0.08, dtype="float32")
        what = "random weights (std 0.08), " + ("2-layer toy" if tiny else "SmolLM2's shape")
    ps = prompts(n, json.loads((path / "config.json").read_text())["vocab_size"])
    t = time.perf_counter()
    ref = hf_greedy(path, ps, new, top_n=5, device=device)
    hf_s = time.perf_counter() - t
    sp = SamplingParams(temperature=0, max_tokens=new, ignore_eos=True, logprobs=5)
    rows, out = [], []
    for dtype, atol in (("float32", None), ("bfloat16", None)):
        llm = LLM(str(path), dtype=dtype, device=device, log_stats_interval=0)
        t = time.perf_counter()
        got = [o.outputs[0] for o in llm.generate([{"prompt_token_ids": p} for p in ps], sp)]
        s = time.perf_counter() - t
        equal = sum(g.token_ids == r[0] for g, r in zip(got, ref))
        bad = [m for g, r in zip(got, ref) if (m := logprobs_mismatch(g.token_ids, g.logprobs, r[0], r[1], atol))]
        ok = equal == n if dtype == "float32" else not bad
        rule = "greedy equal to HF on every prompt" if dtype == "float32" else "check_logprobs_close on every prompt"
        out.append(summarize(ok, f"parity {dtype}: {equal}/{n} prompts token-equal to HF; {rule}", tiny))
        rows.append(f"| {dtype} | {equal}/{n} | {len(bad)} | {bad[0] if bad else ''} | {s:.1f} |")
        del llm
        gc.collect()
    md = [
        "## SmolLM2 through `LLM` on CUDA vs HF transformers on the same GPU",
        "",
        f"Model: {what}. {n} prompts of 8-40 random tokens, {new} greedy tokens each; the HF fp32 reference took "
        f"{hf_s:.1f} s. fp32 must be token-equal; bf16 must pass vLLM's check_logprobs_close (top-5).",
        "",
        "| our dtype | token-equal prompts | logprob-rule failures | first failure | our seconds |",
        "|---|---:|---:|---|---:|",
        *rows,
    ]
    report("gpu-parity", md, tiny)
    return out


class _PlanLog(logging.Handler):
    def __init__(self):
        super().__init__()
        self.lines = []

    def emit(self, record):
        if record.getMessage().startswith("memory plan"):
            self.lines.append(record.getMessage())


def start(tiny: bool, workdir: Path, layers: int) -> list[str]:
    from engine import LLM, SamplingParams, memory

    device = "cpu" if tiny else "cuda"
    path = workdir / "llama8b"
    shape = TINY if tiny else LLAMA3_8B | {"num_hidden_layers": layers}
    t = time.perf_counter()
    write_model(path, shape, device)
    write_s = time.perf_counter() - t
    n, new = (8, 8) if tiny else (64, 32)
    ps = prompts(n, shape["vocab_size"], seed=1)
    sp = SamplingParams(temperature=0, max_tokens=new, ignore_eos=True)
    results, out, tokens = {}, [], {}
    for quant in (None, "fp8"):
        log = _PlanLog()
        logging.getLogger("engine").addHandler(log)
        logging.getLogger("engine").setLevel(logging.INFO)
        if not tiny:
            torch.cuda.empty_cache()
            torch.cuda.reset_peak_memory_stats()
            before = torch.cuda.memory_allocated()
        t = time.perf_counter()
        try:
            llm = LLM(
                str(path),
                device=device,
                gpu_memory_utilization=0.9,
                quantization=quant,
                log_stats_interval=0,
                cache_root=str(workdir / "cache"),  # the fp8 snapshot goes to the temporary folder
            )
            start_s = time.perf_counter() - t
            eng = llm.engine
            weights = (torch.cuda.memory_allocated() - before - eng.memory.kv_bytes) if not tiny else None
            t = time.perf_counter()
            got = llm.generate([{"prompt_token_ids": p} for p in ps], sp)
            gen_s = time.perf_counter() - t
        except Exception as e:  # noqa: BLE001 - an OOM or a refusal is this part's result
            out.append(summarize(False, f"start {quant or 'bf16'}: {type(e).__name__}: {str(e)[:300]}", tiny))
            continue
        finally:
            logging.getLogger("engine").removeHandler(log)
        plan = eng.memory
        kv_tensor = eng.runner.kv_caches.numel() * eng.runner.kv_caches.element_size()
        peak = torch.cuda.max_memory_reserved() if not tiny else 0
        complete = all(len(o.outputs[0].token_ids) == new for o in got)
        tokens[quant] = [o.outputs[0].token_ids for o in got]
        ok = complete and kv_tensor == plan.kv_bytes and (tiny or peak <= plan.budget_bytes)
        results[quant or "bf16"] = dict(
            start_s=start_s,
            gen_s=gen_s,
            plan=plan,
            planned_weights=memory.weight_bytes(eng.spec, eng.dtype.itemsize, quant),
            weights=weights,
            peak=peak,
            logged=log.lines[-1] if log.lines else "(no plan line: CPU plans from KV_CACHE_MEMORY)",
        )
        out.append(
            summarize(
                ok,
                f"start {quant or 'bf16'} at 0.9: KV {plan.kv_tokens} tokens (tensor = plan: "
                f"{kv_tensor == plan.kv_bytes}), {n} requests complete: {complete}, "
                f"peak reserved {peak / 2**30:.1f} GiB <= budget "
                f"{plan.budget_bytes / 2**30:.1f} GiB",
                tiny,
            )
        )
        del llm, eng, got
        gc.collect()
    if None in tokens and "fp8" in tokens:
        same = sum(a == b for a, b in zip(tokens[None], tokens["fp8"]))
        first = sum(a[0] == b[0] for a, b in zip(tokens[None], tokens["fp8"]))
        out.append(
            summarize(True, f"fp8 vs bf16 (random weights): {same}/{n} sequences equal, {first}/{n} first tokens", tiny)
        )
    gib = 2**30
    rows = [
        f"| {k} | {r['planned_weights'] / gib:.2f} | {'—' if r['weights'] is None else round(r['weights'] / gib, 2)} | "
        f"{r['plan'].activation_reserve_bytes / gib:.2f} | {r['plan'].kv_tokens:,} | {r['plan'].max_model_len} | "
        f"{r['peak'] / gib:.1f} / {r['plan'].budget_bytes / gib:.1f} | {r['start_s']:.1f} | {r['gen_s']:.1f} |"
        for k, r in results.items()
    ]
    md = [
        "## Engine start at GPU_MEMORY_UTILIZATION=0.9, Llama-3-8B shape",
        "",
        f"{layers if not tiny else 2} layers, random bf16 weights written to local disk in {write_s:.0f} s; then "
        f"{n} concurrent requests of {new} greedy tokens through `LLM.generate`, bf16 weights and then fp8.",
        "",
        "| weights | planned GiB | measured GiB | reserve GiB | KV tokens | max_model_len | peak reserved / budget "
        "GiB | start s | 64 requests s |",
        "|---|---:|---:|---:|---:|---:|---|---:|---:|",
        *rows,
        "",
        *[f"- {k}: `{r['logged']}`" for k, r in results.items()],
    ]
    report("gpu-start", md, tiny)
    return out


class _Specializations:
    """Under the interpreter (--tiny), Triton's own compile-cache key of every kernel launch: the binder a CUDA
    JITFunction runs (argument dtypes, 16-byte alignment and divisibility, constexprs) for an sm90 target, plus the
    launch options. A key first seen at some point is a kernel a GPU would compile there."""

    def __init__(self):
        from triton.backends.compiler import GPUTarget
        from triton.compiler import make_backend

        self.backend = make_backend(GPUTarget("cuda", 90, 32))
        self.binders: dict = {}
        self.keys: set[tuple[str, str]] = set()
        self.launches = 0

    def key(self, kernel, args, kwargs) -> tuple[str, str]:
        import inspect

        from triton.runtime.jit import KernelParam, compute_cache_key, create_function_from_signature

        if kernel not in self.binders:
            sig, opts = inspect.signature(kernel.fn), kernel.kwargs
            dns, dna = opts.get("do_not_specialize") or (), opts.get("do_not_specialize_on_alignment") or ()
            params = [
                KernelParam(i, p, i in dns or p.name in dns, i in dna or p.name in dna)
                for i, p in enumerate(sig.parameters.values())
            ]
            self.binders[kernel] = create_function_from_signature(sig, params, self.backend)
        _, spec, options = self.binders[kernel](*args, **kwargs)
        return kernel.fn.__qualname__, compute_cache_key({}, spec, self.backend.parse_options(options))

    def __enter__(self):
        from triton.runtime.interpreter import InterpretedFunction

        self.orig = orig = InterpretedFunction.run

        def run(kernel, *args, grid, warmup, **kwargs):
            self.keys.add(self.key(kernel, args, kwargs))
            self.launches += 1
            return orig(kernel, *args, grid=grid, warmup=warmup, **kwargs)

        InterpretedFunction.run = run
        return self

    def __exit__(self, *exc):
        from triton.runtime.interpreter import InterpretedFunction

        InterpretedFunction.run = self.orig


def compiles(tiny: bool, workdir: Path, tokens: int = 4096) -> list[str]:
    """How many Triton compiles one long generation triggers once the idle-gap warm steps have run. On a GPU: cache
    entries (one folder per compiled kernel in TRITON_CACHE_DIR) before and after a 4k-token greedy generation.
    --tiny (CPU, interpreter, nothing compiles): the kernel variants (_Specializations' keys) the generation
    launches that the warm steps did not."""
    import os

    from engine import LLM, SamplingParams

    if tiny and os.environ.get("TRITON_INTERPRET") != "1":
        return [summarize(False, "compiles --tiny needs TRITON_INTERPRET=1 (its kernels run in the interpreter)", tiny)]
    device, tokens = ("cpu", 24) if tiny else ("cuda", tokens)
    path = workdir / "compiles-model"
    write_model(path, TINY if tiny else SMOLLM2, device, std=0.08)
    llm = LLM(str(path), device=device, kernel_backend="triton", log_stats_interval=0, max_model_len=tokens + 64)
    runner = llm.engine.runner
    variants = _Specializations() if tiny else contextlib.nullcontext()
    with variants:
        t = time.perf_counter()
        for shape in runner.warm_shapes():  # what the worker's step loop does after ready (IdleWork)
            runner.warm(*shape)
        warm_s = time.perf_counter() - t
        cache = Path(os.environ.get("TRITON_CACHE_DIR", Path.home() / ".triton" / "cache"))
        if tiny:
            count = lambda: len(variants.keys)  # noqa: E731
        else:
            count = lambda: len(list(cache.iterdir())) if cache.is_dir() else 0  # noqa: E731
        before, launches = count(), variants.launches if tiny else 0
        t = time.perf_counter()
        out = llm.generate(
            {"prompt_token_ids": prompts(1, 1000, seed=2)[0]}, SamplingParams(max_tokens=tokens, ignore_eos=True)
        )
        gen_s = time.perf_counter() - t
    new = count() - before
    n = len(out[0].outputs[0].token_ids)
    if tiny:  # a check that saw no launches would pass by default
        what = (
            f"new kernel variants (Triton's sm90 cache keys of the interpreted launches) during a {n}-token "
            f"generation after the warm steps: {new} ({before} variants in {launches} warm launches)"
        )
        line = summarize(new == 0 and launches > 0, what, tiny)
    else:
        what = f"compiles during a {n}-token generation after the warm steps: {new}"
        line = summarize(new == 0, f"{what} (warm steps {warm_s:.1f} s; {1e3 * gen_s / n:.2f} ms per token, eager)")
    where = "" if tiny else f". Kernel cache: `{cache}`."
    report("gpu-compiles", ["## Compiles while serving", "", line.split(" ", 1)[1] + where], tiny)
    return [line]


def versions(tiny: bool) -> list[str]:
    """What this check runs on, beside what the image pins (pyproject.toml): a pass with another torch / Triton
    pair does not cover the image's. One INFO line (not a check: the device's own image may differ)."""
    import platform
    import subprocess

    import tomllib
    import triton

    deps = tomllib.loads((REPO / "pyproject.toml").read_text())["project"]["dependencies"]
    pins = {d.split("==")[0].strip(): d.split("==")[1].split(";")[0].strip() for d in deps if "==" in d}
    have = {"torch": torch.__version__, "triton": triton.__version__}
    same = all(have[n].split("+")[0] == pins.get(n) for n in have)
    try:
        smi = ["nvidia-smi", "--query-gpu=name,driver_version", "--format=csv,noheader"]
        gpu = subprocess.run(smi, capture_output=True, text=True, timeout=20).stdout.strip().splitlines()[0]
    except (OSError, IndexError, subprocess.SubprocessError):
        gpu = "no nvidia-smi"
    ran = ", ".join(f"{n} {v}" for n, v in have.items())
    line = (
        f"INFO versions: {ran}, CUDA {torch.version.cuda or 'none'} (torch's build), Python "
        f"{platform.python_version()}, GPU and driver: {gpu}; the image pins torch {pins.get('torch')} / triton "
        f"{pins.get('triton')}" + ("" if same else ", so this run does not cover the image's pair")
    )
    report("gpu-versions", ["## Versions this check ran with", "", line.removeprefix("INFO versions: ") + "."], tiny)
    print(line, flush=True)  # bench/gpu_check.sh puts it at the top of the summary
    return [line]


def main() -> None:
    ap = argparse.ArgumentParser(description="the GPU check's engine parts -> docs/gpu.md")
    ap.add_argument("part", choices=["parity", "start", "compiles", "versions"])
    ap.add_argument("--layers", type=int, default=32, help="layers of the 8B-shaped model (start)")
    ap.add_argument("--tiny", action="store_true", help="a toy model on CPU: the same code, for CI")
    args = ap.parse_args()
    with tempfile.TemporaryDirectory(prefix="gpu-check-") as d:
        d = Path(d)
        if args.part == "versions":
            lines = versions(args.tiny)
        elif args.part == "parity":
            lines = parity(args.tiny, d)
        else:
            lines = start(args.tiny, d, args.layers) if args.part == "start" else compiles(args.tiny, d)
    if any(line.startswith("FAIL") for line in lines):
        raise SystemExit(1)


if __name__ == "__main__":
    main()
