"""Every Triton kernel compiled for the GPUs Runpod rents (sm80, sm86, sm89, sm90, sm120), on a CPU-only machine:
shared memory, registers and spills per kernel and arch.

    python -m bench.compile_arch [--arch 80 86 89 90 120] [-j N] [--json FILE] [--no-docs]

Spawned worker processes (-j of them) take one arch at a time, make themselves a stand-in for that GPU
(bench/_standin.py) and run bench/_compile_cases.py's cases: tiny engines end to end, real models' sizes through
the launchers. Triton and the ptxas it bundles compile each kernel to a cubin; nothing runs on a GPU. It fails (a
FAIL line each, exit 1) on:

- a compile error, except fp8 where the engine refuses it (check_fp8_support, below sm89): there every fp8 case
  must fail with Triton's "not supported", and compile everywhere else, so the refusal is checked both ways;
- shared memory over the arch's per-block limit, or more registers than a block of the kernel's threads can have;
- a spill in the attention kernels' loops (decode, its split reduction, prefill): local-memory traffic inside a
  loop of the SASS. Spills outside every loop (a value saved before the KV loop, reloaded after it: ptxas's trade
  for one block more per SM) and other kernels' spills are reported.

Caches, under --cache (default: the user cache's compile-arch/): Triton's own (each kernel by the hash of its
source, target, options and specialization), the ptxas numbers by that hash, the tiny checkpoints, and each arch's
results by the hash of every source they follow from (source_key; --fresh ignores them). Writes the
"compile-arch" section of docs/gpu.md."""

from __future__ import annotations

import argparse
import concurrent.futures as cf
import hashlib
import json
import multiprocessing as mp
import os
import resource
import time
from collections import defaultdict
from pathlib import Path

from bench._standin import ARCHS, GPU_NAMES, REGISTERS_PER_BLOCK

REPO = Path(__file__).resolve().parents[1]
ATTENTION = ("_paged_attn_kernel", "_reduce_splits_kernel", "_prefill_attn_kernel")  # a spill in a loop here fails
REFUSAL = "not supported"  # Triton's words for an fp8 type the target lacks


def compile_arch(arch: int, models: dict[str, str], cache: str) -> dict:
    """In a worker process: every case for `arch` through the stand-in; plain data back (kernels, errors, cases)."""
    import torch

    import kernels
    from bench import _standin
    from bench._compile_cases import cases
    from kernels._common import target

    rec = _standin.install(arch)
    facts = ARCHS[arch]
    # nothing launches, so every kernel's output is whatever torch.empty held: denormals among it made the torch ops
    # between the kernels (the engines' linears) 20x slower
    torch.set_flush_denormal(True)
    # ... and NaN among it would fail requests at the sampler's NaN screen (engine/faults.py), ending the decode
    # steps whose kernel variants this run must compile: the screen is not what it checks
    from engine.sampler import Sampler

    Sampler.bad_rows = staticmethod(
        lambda logits, *_: torch.zeros(logits.shape[0], dtype=torch.bool, device=logits.device)
    )
    torch.set_num_threads(1)  # those ops are small; the workers share the cores
    seen: dict[str, dict] = {}
    with target(facts), kernels.backend("triton"):
        for case in cases({k: Path(v) for k, v in models.items()}, facts.sms):
            rec.case, t0 = case.name, time.perf_counter()
            try:
                case.run()
            except Exception as e:  # noqa: BLE001 - recorded and judged by problems(); the next case still runs
                if not any(c == case.name for c, _, _ in rec.errors):  # not a compile error (recorded as raised)
                    rec.errors.append((case.name, "", _standin.one_line(e)))
            seen[case.name] = dict(fp8=case.fp8, seconds=round(time.perf_counter() - t0, 2))
    rows = []
    for h, c in rec.kernels.items():
        md = c.kernel.metadata
        st = _standin.kernel_stats(c, arch, Path(cache) / "ptxas")
        row = dict(kernel=c.name, case=c.case, spec=c.spec, smem=md.shared, warps=md.num_warps, hash=h, **st)
        rows.append(row | dict(fresh=bool(c.ptxas_log)))  # compiled by this run, not read from Triton's cache
    errors = [dict(case=c, kernel=k, message=m) for c, k, m in rec.errors]
    return dict(arch=arch, kernels=rows, errors=errors, cases=seen)


def fp8_admitted(arch: int) -> bool:
    """Whether the engine lets fp8 weights and KV start on this arch (engine/device.py's check)."""
    from engine.config import EngineConfig
    from engine.device import check_fp8_support
    from engine.errors import ConfigError

    try:
        cfg = EngineConfig(quantization="fp8", kv_cache_dtype="fp8")
        check_fp8_support(cfg, True, f"sm{arch}", ARCHS[arch].capability)
    except ConfigError:
        return False
    return True


def problems(results: list[dict]) -> list[str]:
    """Every failure of the rules in the module doc, one line each; [] when all arches pass."""
    out = []
    for r in results:
        arch, limit = r["arch"], ARCHS[r["arch"]].max_shared
        fp8_ok = fp8_admitted(arch)
        failed = set()
        for e in r["errors"]:
            failed.add(e["case"])
            if not (r["cases"][e["case"]]["fp8"] and not fp8_ok and REFUSAL in e["message"]):
                out.append(f"sm{arch} {e['case']}: {e['kernel'] or 'error'}: {e['message']}")
        if not fp8_ok:
            stale = [name for name, c in r["cases"].items() if c["fp8"] and name not in failed]
            out += [f"sm{arch} {name}: compiled, yet the engine refuses fp8 here (check_fp8_support)" for name in stale]
        for k in r["kernels"]:
            where = f"sm{arch} {k['kernel']} [{k['case']}; {k['spec']}]"
            if k["smem"] > limit:
                out.append(f"{where}: {k['smem']} B of shared memory, over the {limit} B a block may have")
            if k["regs"] * k["warps"] * 32 > REGISTERS_PER_BLOCK:
                out.append(f"{where}: {k['regs']} registers x {k['warps'] * 32} threads > {REGISTERS_PER_BLOCK}")
            if k["kernel"] in ATTENTION and k["loop_spills"]:
                out.append(f"{where}: {k['loop_spills']} spill loads / stores inside a loop ({k['spill_stores']} B)")
    return out


def source_key() -> str:
    """The hash of everything an arch's results follow from: the sources the workers run (kernels, engine, these
    benches, the tiny-model builder) and the packages' versions. Equal keys, equal results: they are reused."""
    import importlib.metadata as md

    h = hashlib.sha256()
    files = [*sorted((REPO / "kernels").rglob("*.py")), *sorted((REPO / "engine").rglob("*.py"))]
    files += [REPO / "bench" / n for n in ("_standin.py", "_compile_cases.py", "compile_arch.py")]
    for f in [*files, REPO / "tests" / "utils.py"]:
        h.update(f"{f.relative_to(REPO)}\0".encode() + f.read_bytes())
    for pkg in ("torch", "triton", "transformers", "xgrammar"):
        h.update(f"{pkg}={md.version(pkg)}\0".encode())
    return h.hexdigest()[:24]


def run(arches: list[int], jobs: int, cache: Path, reuse: bool = True) -> list[dict]:
    """Build the tiny checkpoints once, then compile each arch in `jobs` spawned workers; results by arch. An arch
    whose results for this source_key are cached (reuse) is not compiled again."""
    from bench._compile_cases import build_models

    os.environ["TRITON_INTERPRET"] = "0"  # the workers import kernels afresh: @triton.jit then compiles for real
    os.environ["TRITON_CACHE_DIR"] = str(cache / "triton")
    key = source_key()
    saved = {a: cache / "results" / f"sm{a}-{key}.json" for a in arches}
    results = [json.loads(saved[a].read_text()) | dict(reused=True) for a in arches if reuse and saved[a].is_file()]
    todo = [a for a in arches if a not in {r["arch"] for r in results}]
    todo.sort(key=fp8_admitted, reverse=True)  # the arches with fp8 compile the most: start them first
    if todo:
        models = {k: str(v) for k, v in build_models(cache / "models").items()}
        ctx = mp.get_context("spawn")
        with cf.ProcessPoolExecutor(min(jobs, len(todo)), mp_context=ctx) as ex:
            futures = [ex.submit(compile_arch, a, models, str(cache)) for a in todo]
            for f in cf.as_completed(futures):
                r = f.result()
                path = saved[r["arch"]]
                path.parent.mkdir(parents=True, exist_ok=True)
                tmp = path.with_suffix(f".{os.getpid()}.tmp")
                tmp.write_text(json.dumps(r))
                tmp.replace(path)  # atomic: a concurrent run reads a whole file or none
                results.append(r)
    return sorted(results, key=lambda r: r["arch"])


def table(results: list[dict]) -> str:
    """Markdown: per kernel and arch, its variants, the most registers and shared memory any takes, its spills."""
    arches = [r["arch"] for r in results]
    cells: dict[str, dict[int, list]] = defaultdict(dict)
    for r in results:
        for k in r["kernels"]:
            cells[k["kernel"]].setdefault(r["arch"], []).append(k)
    lines = ["| kernel | " + " | ".join(f"sm{a}" for a in arches) + " |", "|---|" + "---|" * len(arches)]
    for name in sorted(cells):
        row = []
        for a in arches:
            ks = cells[name].get(a, [])
            spilled = [k for k in ks if k["spill_stores"] or k["spill_loads"]]
            if not ks:
                row.append("not compiled (fp8)")
                continue
            cell = f"{len(ks)} var., {max(k['regs'] for k in ks)} regs, {max(k['smem'] for k in ks) / 1024:.0f} KiB"
            if spilled:
                in_loop = sum(k["loop_spills"] > 0 for k in spilled)
                where = f"**{in_loop} in a loop**" if in_loop else "outside loops"
                cell += f"; spills in {len(spilled)} ({max(k['spill_stores'] for k in spilled)} B at most, {where})"
            row.append(cell)
        lines.append(f"| `{name}` | " + " | ".join(row) + " |")
    return "\n".join(lines)


def summary(results: list[dict]) -> str:
    """Markdown: per arch, the GPUs, variants, the most shared memory against the limit, spills, fp8."""
    lines = ["| arch | GPUs | variants | most shared memory / limit | variants that spill (in a loop) | fp8 |"]
    lines.append("|---|---|---|---|---|---|")
    for r in results:
        a, ks = r["arch"], r["kernels"]
        spilled = [k for k in ks if k["spill_stores"] or k["spill_loads"]]
        in_loop = sum(k["loop_spills"] > 0 for k in spilled)
        smem = f"{max(k['smem'] for k in ks) / 1024:.0f} / {ARCHS[a].max_shared // 1024} KiB"
        fp8 = "compiles" if fp8_admitted(a) else "refused (engine and Triton)"
        lines.append(f"| sm{a} | {GPU_NAMES[a]} | {len(ks)} | {smem} | {len(spilled)} ({in_loop}) | {fp8} |")
    return "\n".join(lines)


def section(results: list[dict], command: str, seconds: float, cpu: float, jobs: int) -> str:
    from bench._common import producer

    ran = [r for r in results if not r.get("reused")]
    fresh = sum(k["fresh"] for r in ran for k in r["kernels"])
    cached = sum(len(r["kernels"]) for r in ran) - fresh
    reused = len(results) - len(ran)
    reused = f"; {reused} arches' results read back (no source had changed)" if reused else ""
    load = os.getloadavg()[0]

    bad = problems(results)
    verdict = "All checks pass." if not bad else "FAILURES:\n\n" + "\n".join(f"- {b}" for b in bad)
    return f"""## Kernels compiled per GPU arch (on CPU)

{producer(command, "cpu")}

Compiled on a CPU-only machine, not run on a GPU: a stand-in Triton driver (bench/_standin.py) has Triton and its
bundled ptxas compile every kernel the engine reaches into a cubin for each arch, launching nothing. The variants
come from tiny engines run end to end with real models' attention geometry (warm-up shapes, then prefill,
chunked prefill and decode) and from real models' sizes through the launchers (bench/_compile_cases.py). This run
took {seconds:.0f} s with {jobs} worker processes and {cpu:.0f} s of CPU (the machine's load average: {load:.1f} at
its end, other work included): {fresh} variants compiled, {cached} read from Triton's cache{reused}.

A variant is one Triton specialization (constexprs, pointer dtypes, which ints and pointers are divisible by 16);
registers and spills are ptxas --verbose's. A spill "in a loop" has local-memory traffic inside a loop of the SASS;
one outside loops is saved once before a loop and reloaded after it. `tests/test_compile_arch.py` fails on a
compile error (other than fp8 where the engine refuses it), shared memory over the limit, and a spill inside a loop
of an attention kernel (`_paged_attn_kernel`, `_reduce_splits_kernel`, `_prefill_attn_kernel`). `_fp8_gemm_kernel`
is the fallback for shapes `torch._scaled_mm` cannot take (K or N not a multiple of 16); xgrammar's
`apply_token_bitmask_inplace_kernel` masks grammar-constrained rows on CUDA.

{summary(results)}

{table(results)}

{verdict}
"""


def main() -> int:
    from bench._common import write_section
    from engine.config import default_cache_root

    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--arch", type=int, nargs="+", default=list(ARCHS), choices=list(ARCHS))
    ap.add_argument("-j", "--jobs", type=int, default=min(len(ARCHS), os.cpu_count() or 1))
    ap.add_argument("--cache", type=Path, default=Path(default_cache_root()) / "compile-arch")
    ap.add_argument("--json", type=Path, help="write every kernel's numbers here")
    ap.add_argument("--docs-dir", type=Path, default=REPO / "docs")
    ap.add_argument("--no-docs", action="store_true", help="leave docs/gpu.md alone")
    ap.add_argument("--fresh", action="store_true", help="compile every arch again (Triton's cache still serves)")
    args = ap.parse_args()
    t0 = time.perf_counter()
    results = run(args.arch, args.jobs, args.cache, reuse=not args.fresh)
    seconds = time.perf_counter() - t0
    cpu = sum(t for who in (resource.RUSAGE_SELF, resource.RUSAGE_CHILDREN) for t in resource.getrusage(who)[:2])
    if args.json:
        args.json.write_text(json.dumps(dict(results=results, seconds=seconds), indent=1))
    for r in results:
        spent = sum(c["seconds"] for c in r["cases"].values())
        print(f"sm{r['arch']}: {len(r['kernels'])} kernel variants, {len(r['errors'])} compile errors, {spent:.1f} s")
    print(table(results))
    bad = problems(results)
    for b in bad:
        print("FAIL", b)
    print(f"{'FAIL' if bad else 'PASS'}: {len(args.arch)} arches in {seconds:.1f} s, {cpu:.0f} s of CPU")
    if not args.no_docs:
        command = "python -m bench.compile_arch" + (f" -j {args.jobs}" if args.jobs != len(ARCHS) else "")
        write_section(args.docs_dir / "gpu.md", "compile-arch", section(results, command, seconds, cpu, args.jobs))
    return 1 if bad else 0


if __name__ == "__main__":
    raise SystemExit(main())
