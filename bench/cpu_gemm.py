"""Our CPU GEMM (kernels/cpu_gemm.py) against what dense() runs without it and plain F.linear, at SmolLM2's linear
shapes, bf16, on this machine's threads: on a CPU with AMX its AMX build against oneDNN's packed GEMM from a
decode's rows to a 2048-token prefill chunk's (docs section `cpu-gemm`); with AVX512-BF16 but no AMX, the thin
kernel's vdpbf16ps build against the same, at 1-128 rows (section `cpu-gemm-dot`); where oneDNN has no bf16 GEMM,
the AVX2 GEMM on the weights' packed panels (what dense() runs once IdleWork has packed them) and on the bf16
weights themselves (before: each panel packed as the kernel reaches it), against MKL's fp32 GEMM, on fp32 copies
(what holding them would give) and widened per call (what dense() runs without the kernel), from a decode's rows to
a prefill's (section `cpu-gemm-avx2`). Up to 64 rows each linear is timed over as many weights as the model has of
it (30 layers: more than the L3 holds, as a decode step reads them), past that over 2 (the GEMM is compute-bound);
median of `--reps`. Reported: microseconds per call, GFLOP/s, and the machine's copy rate in the same run (read +
write of 512 MiB) for scale.

`--against REV` (the thin kernel's builds) also builds git revision REV's kernels/cpu_gemm.c and times its packed
copies and ours in alternating rounds (these machines drift between minutes): it ÷ ours per row count.

Usage: python -m bench.cpu_gemm [--reps 15] [--against REV] [--no-write]"""

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
ROWS = {
    "amx": (1, 4, 8, 16, 32, 64, 128, 256, 512, 1024, 2048),
    "dot": (1, 4, 8, 16, 24, 32, 64, 128),
    "avx2": (1, 4, 16, 64, 256, 1024),
}


def timed(fn, reps: int) -> float:
    fn()
    ts = []
    for _ in range(reps):
        t = time.perf_counter()
        fn()
        ts.append(time.perf_counter() - t)
    return statistics.median(ts)


def alternated(a, b, reps: int) -> tuple[float, float]:
    """Medians of a() and b() timed in alternating rounds (which goes first alternates too)."""
    ta, tb = [], []
    for i in range(reps):
        for fn, out in ((a, ta), (b, tb)) if i % 2 == 0 else ((b, tb), (a, ta)):
            t = time.perf_counter()
            fn()
            out.append(time.perf_counter() - t)
    return statistics.median(ta), statistics.median(tb)


def measure(x, ws, kind: str, thin, base: str, copies, reps: int, packed=()) -> dict[str, float]:
    """Seconds per call of each way, over the weights in turn (packed: the AVX2 GEMM's panels of each)."""

    def packed_thin():  # either thin build, on its packed copies
        return [a(x) for a in thin]

    calls = {
        "amx": packed_thin,
        "dot": packed_thin,
        "avx2": lambda: [thin.linear(x, w, None, p) for w, p in zip(ws, packed)],
        "unpacked": lambda: [thin.linear(x, w) for w in ws],
        "onednn": lambda: [torch.ops.mkldnn._linear_pointwise(x, p, None, "none", [], "") for p in copies],
        "fp32": lambda: [F.linear(x.float(), p).bfloat16() for p in copies],
        "widened": lambda: [F.linear(x.float(), w.float()).bfloat16() for w in ws],
        "plain": lambda: [F.linear(x, w) for w in ws],
    }
    ways = (kind, base) + (("unpacked", "widened") if kind == "avx2" else ()) + (("plain",) if x.shape[0] <= 64 else ())
    return {name: timed(calls[name], reps) / len(ws) for name in ways}


def copy_rate() -> float:
    a = torch.ones(512 << 20, dtype=torch.uint8)
    b = torch.empty_like(a)
    return 2 * a.numel() / timed(lambda: b.copy_(a), 5) / 1e9


def main(argv=None) -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--reps", type=int, default=15)
    ap.add_argument("--against", default=None, help="a git revision whose thin kernel to time beside ours")
    ap.add_argument("--no-write", action="store_true")
    args = ap.parse_args(argv)
    from bench._common import kernel_at
    from engine.host_memory import keep_freed_memory
    from engine.layers.dense import onednn_bf16
    from kernels.cpu_gemm import Avx2Gemm, ThinGemm, has_amx

    keep_freed_memory()  # as the engine: a call's temporaries reuse the heap, not fresh pages each time
    cache = Path(tempfile.mkdtemp())
    if (thin := ThinGemm.get(cache, wait=True)) is not None:
        kind, base, key = ("amx", "onednn", "cpu-gemm") if has_amx() else ("dot", "onednn", "cpu-gemm-dot")
    elif not onednn_bf16() and (thin := Avx2Gemm.get(cache, wait=True)) is not None:
        kind, base, key = "avx2", "fp32", "cpu-gemm-avx2"
    else:
        print("no GEMM of ours for this machine: it has oneDNN's bf16 GEMM but no AVX512-BF16, or no AVX2")
        return 1
    if thin.lib is None:
        print("our GEMM did not build:", thin.error)
        return 1
    then = kernel_at(ThinGemm, args.against) if args.against and kind != "avx2" else None
    if then is not None and then.lib is None:
        print(f"{args.against}'s thin GEMM did not build: {then.error}")
        return 1
    copy = copy_rate()
    print(f"copy {copy:.1f} GB/s (read + write), {torch.get_num_threads()} threads", flush=True)
    rows_out, series = [], {}
    unit = "GFLOP/s"
    for name, (n, k, count) in SHAPES.items():
        ws_all = [torch.randn(n, k).bfloat16() for _ in range(count)]
        thin_all = [thin.pack(w) for w in ws_all] if kind != "avx2" else thin
        packed_all = [thin.pack(w) for w in ws_all] if kind == "avx2" else []
        base_all = [torch.ops.mkldnn._reorder_linear_weight(w, None) if base == "onednn" else w.float() for w in ws_all]
        then_all = [then.pack(w) for w in ws_all] if then is not None else []
        for m in ROWS[kind]:
            few = slice(None) if m <= 64 else slice(2)  # compute-bound past a decode's rows: 2 weights are enough
            ws, copies = ws_all[few], base_all[few]
            x = torch.randn(m, k).bfloat16()
            t = measure(x, ws, kind, thin_all if kind == "avx2" else thin_all[few], base, copies, args.reps,
                        packed_all[few])  # fmt: skip
            if then is not None:  # ours and REV's on their own packed copies, alternated
                mine, theirs = thin_all[few], then_all[few]
                ours, was = alternated(lambda: [a(x) for a in mine], lambda: [a(x) for a in theirs], args.reps)  # noqa: B023
                t[kind], t["then"] = ours / len(ws), was / len(ws)
            rate = {s: 2 * m * n * k / v / 1e9 for s, v in t.items()}
            rows_out.append((name, n, k, m, t, rate))
            for s in t:
                series.setdefault((name, s), []).append((m, rate[s]))
            others = " | ".join(f"{s} {v * 1e6:8.1f} us" for s, v in t.items() if s != kind)
            others += f" | {args.against} / ours {t['then'] / t[kind]:.2f}x" if "then" in t else ""
            print(f"  {name:8s} {m:4d} rows: {kind} {t[kind] * 1e6:8.1f} us {rate[kind]:6.1f} {unit} | {others} | "
                  f"{base} / {kind} {t[base] / t[kind]:.2f}x", flush=True)  # fmt: skip
    if args.no_write:
        return 0
    k_name, b_name = {"amx": ("AMX", "oneDNN packed"), "dot": ("AVX512-BF16", "oneDNN packed")}.get(
        kind, ("AVX2", "MKL fp32 copy")
    )
    what = (
        "our thin kernel's AMX build (`kernels/cpu_gemm.c`), oneDNN's GEMM on its packed copy (what dense() ran "
        "before: past 32 rows until a2be456) at the same rows, and `F.linear` on the plain bf16 weight. dense() runs "
        "the kernel at every row count"
        if kind == "amx"
        else "our thin kernel's AVX512-BF16 build (`kernels/cpu_gemm.c`: vdpbf16ps on AMX's packed layout), oneDNN's "
        "GEMM on its packed copy at the same rows (dense() pads rows to its buckets for oneDNN: 17-32 rows run as "
        "32), and `F.linear` on the plain bf16 weight. dense() runs the kernel at every row count there"
        if kind == "dot"
        else "our AVX2 GEMM (`kernels/cpu_gemm_avx2.c`) on the weights' packed panels (what dense() runs once IdleWork "
        "has packed them) and on the bf16 weights (before: each panel packed as it is reached; the same sums), MKL's "
        "fp32 GEMM on fp32 copies of them "
        "(twice their memory: what holding copies would give), MKL's fp32 GEMM on the weights widened per call (what "
        "dense() runs without the kernel), and `F.linear` on the bf16 weight (torch's own bf16 GEMM, up to 64 rows). "
        "dense() runs the kernel at every row count"
    )
    extra = " | AVX2 unpacked µs | MKL widened µs" if kind == "avx2" else ""
    md = [
        f"## CPU GEMM ({k_name})",
        "",
        producer("python -m bench.cpu_gemm" + (f" --against {args.against}" if then else ""), "cpu")
        + f" {torch.get_num_threads()} threads; copy rate "
        f"{copy:.1f} GB/s (read + write, 512 MiB).",
        "",
        f"SmolLM2-135M's linear shapes (bf16): {what}. Up to 64 rows each is timed over as many weights as the model "
        f"has of it (30 layers), past that over 2; median of the reps. {unit}: "
        + "2 x rows x N x K over the time."
        + (
            f" {k_name} at {args.against}: that revision's kernel on its own packed copies, timed in rounds "
            "alternating with ours."
            if then
            else ""
        ),  # fmt: skip
        "",
        f"| weight [N, K] | rows | {k_name} µs | {b_name} µs{extra} | F.linear µs | {k_name} {unit} | "
        f"{b_name} {unit} | {b_name} ÷ {k_name} |" + (f" {k_name} at {args.against} µs | it ÷ ours |" if then else ""),
        "|---|---:|---:|---:|"
        + ("---:|---:|" if extra else "")
        + "---:|---:|---:|---:|"
        + ("---:|---:|" if then else ""),
    ]
    for name, n, k, m, t, rate in rows_out:
        wide = f" {t['unpacked'] * 1e6:.0f} | {t['widened'] * 1e6:.0f} |" if extra else ""
        plain = f"{t['plain'] * 1e6:.0f}" if "plain" in t else "–"
        md.append(f"| {name} [{n}, {k}] | {m} | {t[kind] * 1e6:.0f} | {t[base] * 1e6:.0f} |{wide} {plain} | "
                  f"{rate[kind]:.1f} | {rate[base]:.1f} | {t[base] / t[kind]:.2f}× |"
                  + (f" {t['then'] * 1e6:.0f} | {t['then'] / t[kind]:.2f}× |" if "then" in t else ""))  # fmt: skip
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, len(SHAPES), figsize=(3 * len(SHAPES), 3), sharey=True)
    for ax, name in zip(axes, SHAPES):
        for s, style in ((kind, "-o"), ("unpacked", "-x"), (base, "--s"), ("widened", "-.d"), ("plain", ":^")):
            if (name, s) in series:
                ax.plot(*zip(*series[(name, s)]), style, label=s, markersize=3)
        ax.set_title(name, fontsize=9)
        ax.set_xlabel("rows")
        if kind != "dot":
            ax.set_xscale("log", base=2)
    axes[0].set_ylabel("GFLOP/s")
    axes[0].legend(fontsize=7)
    fig.tight_layout()
    png = REPO / "docs" / f"{key}.png"
    fig.savefig(png, dpi=110)
    md += ["", f"![CPU GEMM: {unit} per row count]({key}.png)"]
    write_section(REPO / "docs" / "benchmarks.md", key, "\n".join(md))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
