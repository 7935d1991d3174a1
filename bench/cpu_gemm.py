"""The thin GEMM (kernels/cpu_gemm.py) against what dense() runs without it and plain F.linear, at SmolLM2's linear
shapes and a decode step's row counts, bf16, on this machine's threads: on a CPU with AMX its AMX kernel against
oneDNN's packed GEMM (docs section `cpu-gemm`); where oneDNN has no bf16 GEMM, its AVX2 kernel against MKL's fp32
GEMM on fp32 copies (section `cpu-gemm-avx2`); each linear timed over as many weights as
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


def measure(x, ws, kind: str, thin, base: str, copies, reps: int) -> dict[str, float]:
    """Seconds per call of each way, over the weights in turn."""
    calls = {
        kind: lambda: [a(x) for a in thin],
        "onednn": lambda: [torch.ops.mkldnn._linear_pointwise(x, p, None, "none", [], "") for p in copies],
        "fp32": lambda: [F.linear(x.float(), p).bfloat16() for p in copies],
        "plain": lambda: [F.linear(x, w) for w in ws],
    }
    return {name: timed(calls[name], reps) / len(ws) for name in (kind, base, "plain")}


def copy_rate() -> float:
    a = torch.ones(512 << 20, dtype=torch.uint8)
    b = torch.empty_like(a)
    return 2 * a.numel() / timed(lambda: b.copy_(a), 5) / 1e9


def main(argv=None) -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--reps", type=int, default=15)
    ap.add_argument("--no-write", action="store_true")
    args = ap.parse_args(argv)
    from engine.layers.dense import onednn_bf16
    from kernels.cpu_gemm import Avx2Gemm, ThinGemm

    cache = Path(tempfile.mkdtemp())
    if (thin := ThinGemm.get(cache, wait=True)) is not None:
        kind, base, key = "amx", "onednn", "cpu-gemm"
    elif not onednn_bf16() and (thin := Avx2Gemm.get(cache, wait=True)) is not None:
        kind, base, key = "avx2", "fp32", "cpu-gemm-avx2"
    else:
        print("no thin GEMM for this machine: it has oneDNN's bf16 GEMM but no AMX, or no AVX2")
        return 1
    if thin.lib is None:
        print("the thin GEMM did not build:", thin.error)
        return 1
    copy = copy_rate()
    print(f"copy {copy:.1f} GB/s (read + write), {torch.get_num_threads()} threads", flush=True)
    rows_out, series = [], {}
    for name, (n, k, count) in SHAPES.items():
        ws = [torch.randn(n, k).bfloat16() for _ in range(count)]
        packed = [thin.pack(w) for w in ws]
        copies = [torch.ops.mkldnn._reorder_linear_weight(w, None) if base == "onednn" else w.float() for w in ws]
        for m in ROWS:
            t = measure(torch.randn(m, k).bfloat16(), ws, kind, packed, base, copies, args.reps)
            gbs = {s: n * k * 2 / v / 1e9 for s, v in t.items()}
            rows_out.append((name, n, k, m, t, gbs))
            for s in t:
                series.setdefault((name, s), []).append(gbs[s])
            print(f"  {name:8s} {m:3d} rows: {kind} {t[kind] * 1e6:8.1f} us {gbs[kind]:5.1f} GB/s | {base} "
                  f"{t[base] * 1e6:8.1f} us | plain {t['plain'] * 1e6:8.1f} us | {base} / {kind} "
                  f"{t[base] / t[kind]:.2f}x", flush=True)  # fmt: skip
    if args.no_write:
        return 0
    k_name, b_name = ("AMX", "oneDNN packed") if kind == "amx" else ("AVX2", "MKL fp32")
    what = (
        "our AMX kernel (`kernels/cpu_gemm.c`), oneDNN's GEMM on its packed copy (what dense() used before)"
        if kind == "amx"
        else "our AVX2 kernel (`kernels/cpu_thin_avx2.c`) on the bf16 weights, MKL's fp32 GEMM on fp32 copies (what "
        "dense() runs without it where oneDNN has no bf16 GEMM)"
    )
    md = [
        f"## CPU thin GEMM ({k_name})",
        "",
        producer("python -m bench.cpu_gemm", "cpu") + f" {torch.get_num_threads()} threads; copy rate "
        f"{copy:.1f} GB/s (read + write, 512 MiB).",
        "",
        f"A decode step's linears at SmolLM2-135M's shapes (bf16): {what}, and `F.linear` on the plain bf16 weight. "
        "Each is timed over as many weights as the model has of it (30 layers), median of the reps; GB/s is the "
        "bf16 weights' bytes over the time. dense() takes the kernel up to `MAX_ROWS` rows (AMX) or `AVX2_ROWS` "
        "(kernels/cpu_gemm.py).",
        "",
        f"| weight [N, K] | rows | {k_name} µs | {b_name} µs | F.linear µs | {k_name} GB/s | {b_name} GB/s | "
        f"{b_name} ÷ {k_name} |",
        "|---|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for name, n, k, m, t, gbs in rows_out:
        md.append(f"| {name} [{n}, {k}] | {m} | {t[kind] * 1e6:.0f} | {t[base] * 1e6:.0f} | "
                  f"{t['plain'] * 1e6:.0f} | {gbs[kind]:.1f} | {gbs[base]:.1f} | "
                  f"{t[base] / t[kind]:.2f}× |")  # fmt: skip
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, len(SHAPES), figsize=(3 * len(SHAPES), 3), sharey=True)
    for ax, name in zip(axes, SHAPES):
        for s, style in ((kind, "-o"), (base, "--s"), ("plain", ":^")):
            ax.plot(ROWS, series[(name, s)], style, label=s, markersize=3)
        ax.set_title(name, fontsize=9)
        ax.set_xlabel("rows")
    axes[0].set_ylabel("weights read, GB/s")
    axes[0].legend(fontsize=7)
    fig.tight_layout()
    png = REPO / "docs" / f"{key}.png"
    fig.savefig(png, dpi=110)
    md += ["", f"![CPU thin GEMM: weight read rate per row count]({key}.png)"]
    write_section(REPO / "docs" / "benchmarks.md", key, "\n".join(md))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
