"""The AMX thin GEMM (kernels/cpu_gemm.py) against oneDNN's packed GEMM and plain F.linear, at SmolLM2's linear
shapes and a decode step's row counts, bf16, on this machine's threads; each linear timed over as many weights as
the model has of it (30 layers: more than the L3 holds, as a decode step reads them), median of `--reps`.
Reported: microseconds per call, the weights' read rate (GB/s), and the machine's copy rate in the same run (read +
write of 512 MiB) for scale. Writes the `cpu-gemm` section of docs/benchmarks.md and its plot.

Usage: python -m bench.cpu_gemm [--reps 15] [--no-write]"""

from __future__ import annotations

import argparse
import statistics
import tempfile
import time
from pathlib import Path

import torch
import torch.nn.functional as F

from bench._common import producer, write_section

REPO = Path(__file__).resolve().parents[1]
SHAPES = {
    "qkv": (960, 576, 30),
    "o": (576, 576, 30),
    "gate_up": (3072, 576, 30),
    "down": (576, 1536, 30),
    "lm_head": (49152, 576, 1),
}  # fmt: skip  name: (N, K, weights of it in SmolLM2-135M)
ROWS = (1, 4, 8, 16, 32, 48, 64)


def timed(fn, reps: int) -> float:
    fn()
    ts = []
    for _ in range(reps):
        t = time.perf_counter()
        fn()
        ts.append(time.perf_counter() - t)
    return statistics.median(ts)


def measure(x, ws, amx, dnn, reps: int) -> dict[str, float]:
    """Seconds per call of each way, over the weights in turn."""
    calls = {
        "amx": lambda: [a(x) for a in amx],
        "onednn": lambda: [torch.ops.mkldnn._linear_pointwise(x, p, None, "none", [], "") for p in dnn],
        "plain": lambda: [F.linear(x, w) for w in ws],
    }
    return {name: timed(fn, reps) / len(ws) for name, fn in calls.items()}


def copy_rate() -> float:
    a = torch.ones(512 << 20, dtype=torch.uint8)
    b = torch.empty_like(a)
    return 2 * a.numel() / timed(lambda: b.copy_(a), 5) / 1e9


def main(argv=None) -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--reps", type=int, default=15)
    ap.add_argument("--no-write", action="store_true")
    args = ap.parse_args(argv)
    from kernels.cpu_gemm import ThinGemm

    thin = ThinGemm.get(Path(tempfile.mkdtemp()), wait=True)
    if thin is None or thin.lib is None:
        print("no AMX thin GEMM on this machine:", "no AMX-BF16" if thin is None else thin.error)
        return 1
    copy = copy_rate()
    print(f"copy {copy:.1f} GB/s (read + write), {torch.get_num_threads()} threads", flush=True)
    rows_out, series = [], {}
    for name, (n, k, count) in SHAPES.items():
        ws = [torch.randn(n, k).bfloat16() for _ in range(count)]
        amx = [thin.pack(w) for w in ws]
        dnn = [torch.ops.mkldnn._reorder_linear_weight(w, None) for w in ws]
        for m in ROWS:
            t = measure(torch.randn(m, k).bfloat16(), ws, amx, dnn, args.reps)
            gbs = {s: n * k * 2 / v / 1e9 for s, v in t.items()}
            rows_out.append((name, n, k, m, t, gbs))
            for s in t:
                series.setdefault((name, s), []).append(gbs[s])
            print(f"  {name:8s} {m:3d} rows: amx {t['amx'] * 1e6:8.1f} us {gbs['amx']:5.1f} GB/s | onednn "
                  f"{t['onednn'] * 1e6:8.1f} us | plain {t['plain'] * 1e6:8.1f} us | onednn / amx "
                  f"{t['onednn'] / t['amx']:.2f}x", flush=True)  # fmt: skip
    if args.no_write:
        return 0
    md = [
        "## CPU thin GEMM (AMX)",
        "",
        producer("python -m bench.cpu_gemm", "cpu") + f" {torch.get_num_threads()} threads; copy rate "
        f"{copy:.1f} GB/s (read + write, 512 MiB).",
        "",
        "A decode step's linears at SmolLM2-135M's shapes (bf16): our AMX kernel (`kernels/cpu_gemm.c`), oneDNN's "
        "GEMM on its packed copy (what dense() used before), and `F.linear` on the plain weight. Each is timed over "
        "as many weights as the model has of it (30 layers), median of the reps; GB/s is the weights' bytes over "
        "the time. dense() takes the kernel up to `MAX_ROWS` rows (kernels/cpu_gemm.py).",
        "",
        "| weight [N, K] | rows | AMX µs | oneDNN packed µs | F.linear µs | AMX GB/s | oneDNN GB/s | oneDNN ÷ AMX |",
        "|---|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for name, n, k, m, t, gbs in rows_out:
        md.append(f"| {name} [{n}, {k}] | {m} | {t['amx'] * 1e6:.0f} | {t['onednn'] * 1e6:.0f} | "
                  f"{t['plain'] * 1e6:.0f} | {gbs['amx']:.1f} | {gbs['onednn']:.1f} | "
                  f"{t['onednn'] / t['amx']:.2f}× |")  # fmt: skip
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, len(SHAPES), figsize=(3 * len(SHAPES), 3), sharey=True)
    for ax, name in zip(axes, SHAPES):
        for s, style in (("amx", "-o"), ("onednn", "--s"), ("plain", ":^")):
            ax.plot(ROWS, series[(name, s)], style, label=s, markersize=3)
        ax.set_title(name, fontsize=9)
        ax.set_xlabel("rows")
    axes[0].set_ylabel("weights read, GB/s")
    axes[0].legend(fontsize=7)
    fig.tight_layout()
    png = REPO / "docs" / "cpu-gemm.png"
    fig.savefig(png, dpi=110)
    md += ["", "![CPU thin GEMM: weight read rate per row count](cpu-gemm.png)"]
    write_section(REPO / "docs" / "benchmarks.md", "cpu-gemm", "\n".join(md))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
