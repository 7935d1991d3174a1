"""Tensor parallelism's cost on CPU (gloo): decode steps at TP=1 and TP=2, same model, same run.

On 2 CPU cores TP cannot be faster (the ranks split the cores TP=1 already uses); what this measures is what the
collectives and the step descriptors cost per step, so the overhead is known before a multi-GPU worker pays it:

- step ms: one decode step of `b` sequences (rank 0's wall time, after a warm-up);
- collectives ms: rank 0's time inside all-reduce (two per layer, one for the embedding) and the logits gather,
  waiting for the other rank included;
- descriptor ms: pickling the step's host lists and queueing them for the other ranks' pipes;
- descriptor bytes: the step's pickled messages (forward and LM head), once for all ranks. The block tables go as
  deltas, so at a long context (`--context 2000`) this stays what it is at a short one.

The model is a random Llama from bench/synthetic_model.py (8 heads so that 2 ranks divide it), `--layers` layers of
`--hidden` width. Usage: python -m bench.tp [--steps 20] [--context 64]   (~2 min; writes docs/benchmarks.md)
"""

from __future__ import annotations

import argparse
import os
import statistics
import tempfile
import time
from pathlib import Path

from bench._common import machine_line, write_section
from bench.synthetic_model import write_model
from engine import LLM, SamplingParams

REPO = Path(__file__).resolve().parents[1]


def measure(path: Path, tp: int, batch: int, steps: int, context: int = 64) -> dict:
    # every run uses all cores: TP=1 its torch threads, TP=N one share per rank (the engine splits them)
    threads = {"num_threads": os.cpu_count()} if tp == 1 else {}
    llm = LLM(str(path), tensor_parallel_size=tp, log_stats_interval=0, **threads)
    e = llm.engine
    try:
        for i in range(batch):
            e.add_request(f"r{i}", {"prompt_token_ids": [100 + (i + j) % 20000 for j in range(context)]},
                          SamplingParams(temperature=0, max_tokens=steps + 10, ignore_eos=True))  # fmt: skip
        while e.scheduler.waiting or any(r.num_computed_tokens < context for r in e.scheduler.running):
            e.step()  # prefill
        for _ in range(5):  # warm decodes
            e.step()
        comm = e.model.tp
        c0, n0 = (comm.seconds, comm.calls) if comm else (0.0, 0)
        s0 = e.tp_group.send_seconds if e.tp_group else 0.0
        b0 = sum(e.tp_group.sent_bytes.values()) if e.tp_group else 0
        times = []
        for _ in range(steps):
            t = time.perf_counter()
            e.step()
            times.append(time.perf_counter() - t)
        coll = (comm.seconds - c0) / steps if comm else 0.0
        calls = (comm.calls - n0) / steps if comm else 0
        send = (e.tp_group.send_seconds - s0) / steps if e.tp_group else 0.0
        sent = (sum(e.tp_group.sent_bytes.values()) - b0) / steps if e.tp_group else 0
        return dict(tp=tp, batch=batch, step=statistics.median(times), coll=coll, calls=calls, send=send, sent=sent)
    finally:
        e.abort_all()
        e.shutdown()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--steps", type=int, default=20)
    ap.add_argument("--context", type=int, default=64, help="prompt tokens per sequence")
    ap.add_argument("--hidden", type=int, default=512)
    ap.add_argument("--layers", type=int, default=8)
    ap.add_argument("--docs-dir", type=Path, default=REPO / "docs")
    args = ap.parse_args()
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp) / "m"
        shape = dict(
            hidden_size=args.hidden,
            intermediate_size=3 * args.hidden,
            num_attention_heads=8,
            num_key_value_heads=4,
            vocab_size=49152,
            num_hidden_layers=args.layers,
            tie_word_embeddings=True,
        )
        write_model(path, shape, "cpu")  # fmt: skip
        for batch in (1, 8):
            for tp in (1, 2):
                rows.append(measure(path, tp, batch, args.steps, args.context))
                print(rows[-1])
    base = {r["batch"]: r["step"] for r in rows if r["tp"] == 1}
    lines = [
        "## Tensor parallelism on CPU (gloo)",
        "",
        f"`python -m bench.tp --steps {args.steps} --context {args.context}` on {time.strftime('%Y-%m-%d')}: "
        f"{machine_line('cpu')} "
        f"(at the end: TP=1 runs with {os.cpu_count()} threads, each of the TP=2 "
        f"ranks with {max(1, (os.cpu_count() or 1) // 2)}). A random Llama ({args.layers} layers, hidden "
        f"{args.hidden}, 8 heads, bf16) with a 49152-token vocabulary; gloo; median of {args.steps} decode steps after "
        f"a warm-up, {args.context}-token prompts.",
        "",
        "| batch | TP | step ms | vs TP=1 | collectives per step | in collectives ms | descriptor ms "
        "| descriptor bytes |",
        "|---:|---:|---:|---:|---:|---:|---:|---:|",
        *[
            f"| {r['batch']} | {r['tp']} | {r['step'] * 1e3:.2f} | {r['step'] / base[r['batch']]:.2f}x | "
            f"{r['calls']:.0f} | {r['coll'] * 1e3:.2f} | {r['send'] * 1e3:.3f} | {r['sent']:.0f} |"
            for r in rows
        ],
        "",
        "On 2 cores each rank gets one core, so TP=2 is not faster here; on GPUs the ranks add devices instead. "
        "The collectives column is rank 0's wall time inside all-reduce and gather, which includes waiting for the "
        "slower rank.",
    ]
    lines += ["", "![step time by part](tp.png)"]
    body = "\n".join(lines)
    print(body)
    plot(rows, args.docs_dir / "tp.png")
    write_section(args.docs_dir / "benchmarks.md", "tp", body)


def plot(rows: list[dict], png: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6, 3))
    names = [f"b={r['batch']}, TP={r['tp']}" for r in rows]
    comp = [1e3 * (r["step"] - r["coll"] - r["send"]) for r in rows]
    coll = [1e3 * r["coll"] for r in rows]
    send = [1e3 * r["send"] for r in rows]
    ax.bar(names, comp, label="everything else")
    ax.bar(names, coll, bottom=comp, label="collectives")
    ax.bar(names, send, bottom=[a + b for a, b in zip(comp, coll)], label="descriptor")
    ax.set_ylabel("ms per decode step")
    ax.set_title("Tensor parallelism on CPU (gloo): where a step goes")
    ax.legend()
    fig.tight_layout()
    fig.savefig(png, dpi=110)


if __name__ == "__main__":
    main()
