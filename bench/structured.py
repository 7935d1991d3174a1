"""Structured output on CPU (SmolLM2-135M-Instruct, bf16), through LLM.generate.

1. Overhead: 64 chat requests asking for JSON, at most 64 output tokens. Run B: every second one constrained by one
   of the test schemas (it stops when its JSON is complete). Run A: the same requests unconstrained, each made to
   generate exactly B's token count (ignore_eos), so both do the same model work and differ only by the masks
   (fill on the host, apply to the logits, matcher advance). The order alternates (A B, B A, ...), `--reps`
   times each, on one engine; median output tok/s. Target: B >= 0.90 x A. Since that ratio is within the noise,
   the mask work is also timed directly inside B's runs (wrappers around fill, apply and accept, and around the
   engine step): ms per step, per constrained row, and its share of step time.
2. Compile time per schema (the 11 of tests/test_structured.py): first compile on a fresh compiler, then the
   cached lookup; and the one-time start (xgrammar's import, the tokenizer's vocabulary, the compiler).

Usage: python -m bench.structured [--reps 3]   (~2 min; writes docs/benchmarks.md and docs/structured.png)
"""

from __future__ import annotations

import argparse
import statistics
import time
from pathlib import Path

from bench._common import default_model_path, machine_line, write_section
from engine import LLM, SamplingParams, StructuredOutputsParams

REPO = Path(__file__).resolve().parents[1]
N, OUT = 64, 64


def requests(llm: LLM, lengths: list[int] | None = None) -> tuple[list[str], list[SamplingParams]]:
    """Every second request constrained by one of the test schemas (lengths None); or, given each request's output
    length from such a run, the same requests unconstrained, each made to generate exactly that many tokens."""
    from tests.test_structured import SCHEMAS

    schemas = list(SCHEMAS.items())
    prompts, params = [], []
    for i in range(N):
        name, schema = schemas[i % len(schemas)]
        msgs = [{"role": "user", "content": f"Reply with JSON only: a {name.replace('_', ' ')} example, number {i}."}]
        prompts.append(llm.engine.tok.apply_chat_template(msgs, add_generation_prompt=True))
        if lengths is not None:
            params.append(SamplingParams(temperature=0, max_tokens=lengths[i], ignore_eos=True))
        else:
            so = StructuredOutputsParams(json=schema) if i % 2 else None
            params.append(SamplingParams(temperature=0, max_tokens=OUT, ignore_eos=not so, structured_outputs=so))
    return prompts, params


class MaskTimer:
    """Wall time inside the structured-output calls of a step (fill, apply, accept) and inside whole steps, by
    instance-level wrappers on this engine's objects (the engine code is not changed)."""

    def __init__(self, llm: LLM):
        self.mask_s = self.step_s = 0.0
        self.steps = self.rows = 0
        self.on = False
        so, eng = llm.engine.structured, llm.engine
        for name in ("fill", "apply", "accept"):
            setattr(so, name, self._wrap(getattr(so, name), mask=True))
        eng.step = self._wrap(eng.step, mask=False)

    def _wrap(self, fn, mask: bool):
        def timed(*a, **kw):
            t = time.perf_counter()
            out = fn(*a, **kw)
            if self.on:
                dt = time.perf_counter() - t
                if mask:
                    self.mask_s += dt
                    if fn.__name__ == "fill" and out is not None:
                        self.rows += len(out[1])  # the constrained rows this step
                else:
                    self.step_s, self.steps = self.step_s + dt, self.steps + 1
            return out

        return timed


def overhead(llm: LLM, reps: int) -> dict:
    lengths = [len(o.outputs[0].token_ids) for o in llm.generate(*requests(llm))]  # untimed: B's token counts
    work = {"half constrained": requests(llm), "none constrained": requests(llm, lengths)}
    runs = {k: [] for k in work}
    timer = MaskTimer(llm)
    for rep in range(reps):
        for name in sorted(work, reverse=rep % 2 == 1):  # the order alternates
            timer.on = name == "half constrained"
            t = time.perf_counter()
            outs = llm.generate(*work[name])
            wall = time.perf_counter() - t
            assert [len(o.outputs[0].token_ids) for o in outs] == lengths  # the same work in both runs
            runs[name].append(sum(lengths) / wall)
    timer.on = False
    mask = dict(
        ms_per_step=timer.mask_s / timer.steps * 1e3,
        ms_per_row=timer.mask_s / max(timer.rows, 1) * 1e3,
        share=timer.mask_s / timer.step_s,
        steps=timer.steps,
    )
    return {k: statistics.median(v) for k, v in runs.items()} | {"all": runs, "tokens": sum(lengths), "mask": mask}


def import_seconds() -> float:
    """`import xgrammar` in a fresh interpreter (it pays torch's import too, as a worker has already: minus that)."""
    import subprocess
    import sys

    code = "import time, torch; t = time.perf_counter(); import xgrammar; print(time.perf_counter() - t)"
    return float(subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout)


def compile_times(path: str) -> tuple[float, list[tuple[str, float, float]]]:
    from tests.test_structured import SCHEMAS

    llm = LLM(path, log_stats_interval=0)  # a fresh engine: nothing compiled, xgrammar maybe already imported
    t = time.perf_counter()
    so = llm.engine.structured
    so.compile(StructuredOutputsParams(regex="a")).result()  # builds the tokenizer info and the compiler
    start = time.perf_counter() - t
    rows = []
    for name, schema in SCHEMAS.items():
        p = StructuredOutputsParams(json=schema)
        t = time.perf_counter()
        so.compile(p).result()
        first = time.perf_counter() - t
        t = time.perf_counter()
        so.compile(p).result()
        rows.append((name, first, time.perf_counter() - t))
    return start, rows


def render(ov: dict, start: float, rows, reps: int) -> str:
    a, b, m = ov["none constrained"], ov["half constrained"], ov["mask"]
    lines = [
        "## Structured output",
        "",
        f"`python -m bench.structured --reps {reps}` on {time.strftime('%Y-%m-%d')}: {machine_line('cpu')}. "
        "SmolLM2-135M-Instruct, bf16, "
        f"`LLM.generate` of {N} chat requests asking for JSON (greedy, at most {OUT} tokens). Half constrained: "
        "every second request by one of tests/test_structured.py's 11 schemas (it ends when its JSON is complete). "
        "None constrained: the same requests unconstrained, each made to generate exactly as many tokens as in the "
        f"constrained run (ignore_eos), so both runs do the same model work ({ov['tokens']:,} tokens) and differ "
        "only by the masks (fill on the host, apply, matcher advance). Runs alternate in order; medians.",
        "",
        "| run | output tok/s (median) | runs | vs none |",
        "|---|---:|---|---:|",
        f"| none constrained | {a:,.0f} | {', '.join(f'{x:,.0f}' for x in ov['all']['none constrained'])} | 1.00x |",
        f"| half constrained | {b:,.0f} | {', '.join(f'{x:,.0f}' for x in ov['all']['half constrained'])} | "
        f"{b / a:.2f}x |",
        "",
        f"**Overhead of constraining half the batch: {1 - b / a:.1%} of output tok/s** (target <= 10 %).",
        "",
        f"Mask work timed inside the half-constrained runs ({m['steps']:,} steps): {m['ms_per_step']:.2f} ms per "
        f"step, {m['ms_per_row']:.3f} ms per constrained row per step, **{m['share']:.1%} of step time**.",
        "",
        f"Grammar compile times (tests/test_structured.py's schemas). Paid once per worker, on the compile thread "
        f"when the first constrained request comes: `import xgrammar` {ov['import_s']:.2f} s (torch already "
        f"imported), then the vocabulary and the compiler {start * 1e3:,.0f} ms.",
        "",
        "| schema | first compile ms | cached ms |",
        "|---|---:|---:|",
        *[f"| {n} | {f * 1e3:.2f} | {c * 1e3:.3f} |" for n, f, c in rows],
        "",
        "![output tok/s per run](structured.png)",
    ]
    return "\n".join(lines)


def plot(ov: dict, png: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6, 3))
    names = list(ov["all"])
    for i, n in enumerate(names):
        ax.scatter([i] * len(ov["all"][n]), ov["all"][n], color="tab:blue")
        ax.bar(i, ov[n], alpha=0.4, color="tab:blue")
    ax.set_xticks(range(len(names)), names)
    ax.set_ylabel("output tok/s")
    ax.set_title("Structured output overhead (CPU, SmolLM2, 64 requests)")
    fig.tight_layout()
    fig.savefig(png, dpi=110)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--docs-dir", type=Path, default=REPO / "docs")
    args = ap.parse_args()
    path = str(default_model_path())
    llm = LLM(path, log_stats_interval=0)
    llm.generate(*[x[:4] for x in requests(llm)])  # warm-up, and xgrammar imported
    ov = overhead(llm, args.reps) | {"import_s": import_seconds()}
    start, rows = compile_times(path)
    body = render(ov, start, rows, args.reps)
    print(body)
    plot(ov, args.docs_dir / "structured.png")
    write_section(args.docs_dir / "benchmarks.md", "structured", body)


if __name__ == "__main__":
    main()
