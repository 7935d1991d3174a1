"""bench/serve.py's records and report: per-request results, per-rate summaries (vllm bench serve's metrics),
the markdown tables (latency, and the streaming targets) and the plot."""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np


@dataclass
class Result:
    prompt_tokens: int
    max_tokens: int
    ok: bool = False
    error: str = ""
    ttft: float = 0.0
    latency: float = 0.0
    output_tokens: int = 0
    itl: list[float] = field(default_factory=list)
    job_id: str = ""  # the emulator's job (X-Job-Id), for its worker-side numbers
    posts: int = 0  # the worker's job-stream POSTs for this job (emulator only)
    exec_s: float = 0.0  # the job's execution time on the worker (emulator only)


@dataclass
class Target:
    """One server under test: its OpenAI base URL; for an emulator we launched, its flush setting and API root."""

    label: str
    base_url: str
    flush_ms: float | None = None  # STREAM_FLUSH_MS (math.inf: the count bound alone, as worker-vllm)
    api: str | None = None  # http://h:p/v2/local: /status/{id} gives the job's POSTs and execution time


def stats(xs: list[float]) -> dict:
    if not xs:
        return {"mean": float("nan"), "median": float("nan"), "p99": float("nan")}
    a = np.asarray(xs) * 1000  # ms
    return {"mean": float(a.mean()), "median": float(np.median(a)), "p99": float(np.percentile(a, 99))}


def summarize(rate: float, results: list[Result], duration: float, flush_ms: float | None = None) -> dict:
    ok = [r for r in results if r.ok]
    out = sum(r.output_tokens for r in ok)
    posts = {}
    if flush_ms is not None and any(r.posts for r in ok):  # the target: posts <= duration / flush + 5, per job
        excess = [r.posts - r.exec_s * 1000 / flush_ms for r in ok]
        posts = {"posts_per_job": float(np.mean([r.posts for r in ok])), "posts_max_excess": float(max(excess))}
    return {
        "rate": rate,
        "completed": len(ok),
        "failed": len(results) - len(ok),
        "duration_s": duration,
        **posts,
        "short": sum(r.output_tokens < r.max_tokens for r in ok),  # server ignored ignore_eos?
        "request_per_s": len(ok) / duration,
        "output_tok_per_s": out / duration,
        "total_tok_per_s": (out + sum(r.prompt_tokens for r in ok)) / duration,
        "ttft_ms": stats([r.ttft for r in ok]),
        "tpot_ms": stats([(r.latency - r.ttft) / (r.output_tokens - 1) for r in ok if r.output_tokens > 1]),
        "itl_ms": stats([x for r in ok for x in r.itl]),
        "errors": sorted({r.error for r in results if r.error})[:3],
    }


def table(rows: dict[str, list[dict]]) -> str:
    f = lambda s: f"{s['mean']:.0f} / {s['median']:.0f} / {s['p99']:.0f}"  # noqa: E731
    lines = [
        "| config | request rate | done / failed | req/s | output tok/s | TTFT ms mean / med / p99 | "
        "TPOT ms mean / med / p99 | ITL ms mean / med / p99 |",
        "|---|---:|---:|---:|---:|---:|---:|---:|",
    ]
    lines += [
        f"| {label} | {r['rate']:g}{streams(r)} | {r['completed']} / {r['failed']} | {r['request_per_s']:.2f} | "
        f"{r['output_tok_per_s']:.1f} | {f(r['ttft_ms'])} | {f(r['tpot_ms'])} | {f(r['itl_ms'])} |"
        for label, rs in rows.items()
        for r in rs
    ]
    return "\n".join(lines)


def streams(r: dict) -> str:
    return f", {r['streams']} streams" if r.get("streams") else ""


def plot(rows: dict[str, list[dict]], png: Path, title: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 2, figsize=(10, 3.6))
    for k, (label, rs) in enumerate(rows.items()):
        x, labels = range(len(rs)), [f"{r['rate']:g}{streams(r)}" for r in rs]  # categorical x: inf has a place too
        color = f"C{k}"
        axes[0].plot(x, [r["ttft_ms"]["median"] for r in rs], "-o", color=color, label=f"{label}: TTFT median")
        axes[1].plot(x, [r["itl_ms"]["p99"] for r in rs], "-o", color=color, label=f"{label}: ITL p99")
        axes[1].plot(x, [r["tpot_ms"]["median"] for r in rs], ":^", color=color, label=f"{label}: TPOT median")
    for ax, name in ((axes[0], "TTFT"), (axes[1], "gap between streamed events / TPOT")):
        ax.set_xticks(list(x), labels)
        ax.set_xlabel("request rate (req/s; inf = all at once)")
        ax.set_ylabel(f"{name} ms (lower is better)")
        ax.set_yscale("log")
        ax.grid(alpha=0.3)
        ax.legend(fontsize=7)
    fig.suptitle(title, fontsize=10)
    fig.tight_layout()
    png.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(png, dpi=120)


def compare(targets: list[Target], rows: dict[str, list[dict]]) -> str:
    """The streaming targets per rate: p99 gap <= flush + 2 x TPOT (median), POSTs per job <= its duration /
    flush + 5, and output tok/s against the first target (the count-only baseline)."""
    base = rows[targets[0].label]
    lines = [
        "| config | request rate | ITL p99 ms | TPOT median ms | bound: flush + 2 x TPOT ms | p99 within | "
        "POSTs per job (mean) | most POSTs over duration / flush | output tok/s vs count only |",
        "|---|---:|---:|---:|---:|---|---:|---:|---:|",
    ]
    for t in targets:
        for r, b in zip(rows[t.label], base):
            finite = t.flush_ms is not None and math.isfinite(t.flush_ms)
            bound = t.flush_ms + 2 * r["tpot_ms"]["median"] if finite else float("nan")
            within = ("yes" if r["itl_ms"]["p99"] <= bound else "**no**") if finite else "–"
            excess = f"{r['posts_max_excess']:+.1f}" if finite and "posts_max_excess" in r else "–"
            lines.append(
                f"| {t.label} | {r['rate']:g} | {r['itl_ms']['p99']:.0f} | {r['tpot_ms']['median']:.0f} | "
                f"{bound:.0f} | {within} | {r.get('posts_per_job', float('nan')):.1f} | {excess} | "
                f"{r['output_tok_per_s'] / b['output_tok_per_s']:.3f} |"
            )
    for t in targets[1:]:  # throughput over the whole run: total tokens / total time, against the baseline's
        tok = sum(r["output_tok_per_s"] * r["duration_s"] for r in rows[t.label])
        secs = sum(r["duration_s"] for r in rows[t.label])
        b_tok = sum(r["output_tok_per_s"] * r["duration_s"] for r in base)
        b_secs = sum(r["duration_s"] for r in base)
        lines.append(f"| {t.label}, all rates | | | | | | | | **{tok / secs / (b_tok / b_secs):.3f}** |")
    return "\n".join(lines)
