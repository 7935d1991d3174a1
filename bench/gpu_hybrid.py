"""The GPU check's hybrid part (bench/gpu_check.sh): a small random Qwen3-Next (6 Gated DeltaNet layers over the
state pool, 2 gated-attention layers, top-2 of 8 experts with a shared expert) through `LLM` on CUDA against HF
transformers on the same GPU, fp32 greedy token for token, in three settings:

- eager, prompts in one chunk each (the Triton conv, recurrent rule and gated norm over the state pool);
- prefill in 48-token chunks (every prompt over 48 tokens split: the state carried from chunk to chunk);
- ENFORCE_EAGER=false: decode steps replayed from CUDA graphs (static slot indices, padding into the spare slot).

Writes its section of docs/gpu.md and a PASS/FAIL line to .gpu-results/summary.txt. `--tiny`: the same code on CPU
with a toy model and the torch kernels (CI runs it; tests/test_hybrid.py runs the Triton path under the interpreter),
fewer and shorter prompts, and no graphs (CUDA-only)."""

from __future__ import annotations

import argparse
import gc
import tempfile
import time
from pathlib import Path

from bench._common import gpu_summary as summarize
from bench._common import hf_greedy, producer, write_section
from bench.gpu_engine import DOC, prompts
from bench.synthetic_model import write_tiny_hybrid


def run(tiny: bool, workdir: Path) -> list[str]:
    from engine import LLM, SamplingParams

    device, n, new = ("cpu", 2, 3) if tiny else ("cuda", 16, 16)
    path = write_tiny_hybrid(workdir / "qwen3-next", dtype="float32", toy=tiny)
    ps = [p * (1 if tiny else 4) for p in prompts(n, 8192)]  # 8-40 tokens, or 32-160 on the GPU
    t = time.perf_counter()
    ref = [r[0] for r in hf_greedy(path, ps, new, top_n=1, device=device)]
    hf_s = time.perf_counter() - t
    settings = {"eager": {}, "chunked prefill": {"max_num_batched_tokens": 48}}
    if not tiny:
        settings["CUDA graphs"] = {"enforce_eager": False}
    rows, ok = [], True
    sp = SamplingParams(temperature=0, max_tokens=new, ignore_eos=True)
    for name, kw in settings.items():
        llm = LLM(str(path), dtype="float32", device=device, log_stats_interval=0, **kw)
        t = time.perf_counter()
        got = [o.outputs[0].token_ids for o in llm.generate([{"prompt_token_ids": p} for p in ps], sp)]
        s = time.perf_counter() - t
        equal = sum(g == r for g, r in zip(got, ref))
        graphs = llm.engine.runner.graphs
        replays = graphs.replays if graphs is not None else 0
        ok &= equal == n and (replays > 0) == (name == "CUDA graphs")
        slots = llm.engine.scheduler.state_slots
        ok &= slots.num_free == slots.num_slots  # every slot back
        rows.append(f"| {name} | {equal}/{n} | {replays} | {s:.1f} |")
        llm.engine.shutdown()
        del llm, graphs, slots  # the next setting's engine plans from the memory this one held
        gc.collect()
    md = [
        "## A hybrid (Qwen3-Next) through `LLM` on CUDA vs HF transformers on the same GPU",
        "",
        f"Model: a random Qwen3-Next ({'a toy' if tiny else '6 Gated DeltaNet and 2 attention layers, hidden 256'}, "
        f"top-2 of 8 experts with a shared one). {n} prompts of {min(map(len, ps))}-{max(map(len, ps))} random "
        f"tokens, {new} greedy tokens each; the HF fp32 reference took {hf_s:.1f} s. Every setting must be "
        "token-equal.",
        "",
        "| setting | token-equal prompts | graph replays | our seconds |",
        "|---|---:|---:|---:|",
        *rows,
    ]
    if not tiny:
        md = [md[0], "", producer("python -m bench.gpu_hybrid", "cuda"), *md[1:]]
        write_section(DOC, "gpu-hybrid", "\n".join(md), title="# GPU check")
    print("\n".join(md))
    what = f"hybrid (Qwen3-Next): {', '.join(settings)} token-equal to HF on {n} prompts, every state slot back"
    return [summarize(ok, what if ok else f"{what}: not so, see docs/gpu.md's table", tiny)]


def main() -> None:
    ap = argparse.ArgumentParser(description="the GPU check's hybrid part -> docs/gpu.md")
    ap.add_argument("--tiny", action="store_true", help="on CPU, the Triton kernels under the interpreter (CI)")
    args = ap.parse_args()
    with tempfile.TemporaryDirectory(prefix="gpu-hybrid-") as d:
        lines = run(args.tiny, Path(d))
    if any(line.startswith("FAIL") for line in lines):
        raise SystemExit(1)


if __name__ == "__main__":
    main()
