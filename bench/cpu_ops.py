"""The C ops of a CPU layer (kernels/cpu_ops.c: add + RMSNorm, rotary, SiLU-and-mul) against their torch references
at SmolLM2-135M's shapes (hidden 576, 9 + 3 heads of 64, intermediate 1536), bf16, on this machine's threads, from a
decode step's rows to a prefill chunk's: microseconds per call (median of `--reps`) and the speed-up. `--against REV`
also builds the C ops from git revision REV's kernels/cpu_ops.c and times them beside ours (an op that REV lacks is
left out). Writes the `cpu-ops` section of docs/benchmarks.md and docs/cpu-ops.png.

Usage: python -m bench.cpu_ops [--reps 30] [--against REV] [--no-write]"""

from __future__ import annotations

import argparse
import tempfile
from pathlib import Path

import torch

from bench._common import kernel_at, producer, write_section
from bench.cpu_gemm import REPO, timed

ROWS = (1, 16, 32, 256, 2048)
HIDDEN, H, KVH, D, INTER = 576, 9, 3, 64, 1536


def cases(rows: int, lib) -> dict[str, tuple]:
    """op -> (the C call on `lib`, the torch reference), on fresh inputs of `rows` tokens."""
    from engine.layers.rotary import RotaryCache
    from kernels import cpu_ops
    from kernels.activation import silu_and_mul_ref
    from kernels.rmsnorm import add_rms_norm_ref
    from kernels.rotary import rotary_rows, rotate_ref

    g = torch.Generator().manual_seed(rows)
    x, res = (torch.randn(rows, HIDDEN, generator=g).bfloat16() for _ in range(2))
    w = torch.rand(HIDDEN, generator=g).bfloat16()
    qkv = torch.randn(rows, (H + 2 * KVH) * D, generator=g).bfloat16()  # q and k as views of the fused row
    q, k = qkv[:, : H * D].view(rows, H, D), qkv[:, H * D : (H + KVH) * D].view(rows, KVH, D)
    rc = RotaryCache(D, 4096, 10000.0, None, "cpu")
    c, s = rotary_rows(rc.cos, rc.sin, torch.randint(0, 4096, (rows,), generator=g), torch.bfloat16)
    gate_up = torch.randn(rows, 2 * INTER, generator=g).bfloat16()
    ops = {
        "add + RMSNorm": (
            lambda: cpu_ops.add_rms_norm(lib, x, res, w, 1e-5),
            lambda: add_rms_norm_ref(x, res, w, 1e-5),
        ),
        "rotary (q and k)": (
            lambda: (cpu_ops.rope(lib, q, c, s), cpu_ops.rope(lib, k, c, s)),
            lambda: (rotate_ref(q, c, s), rotate_ref(k, c, s)),
        ),
        "SiLU-and-mul": (lambda: cpu_ops.silu_and_mul(lib, gate_up), lambda: silu_and_mul_ref(gate_up)),
    }
    silu = hasattr(lib, "silu_and_mul_lut") or hasattr(lib, "silu_and_mul")  # a revision before it has neither
    return {op: calls for op, calls in ops.items() if op != "SiLU-and-mul" or silu}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--reps", type=int, default=30)
    ap.add_argument("--against", default=None, help="a git revision whose kernels/cpu_ops.c to time beside ours")
    ap.add_argument("--no-write", action="store_true")
    args = ap.parse_args(argv)
    from kernels.cpu_ops import CpuOps

    ours = CpuOps.get(Path(tempfile.mkdtemp()), wait=True)
    if ours.lib is None:
        print("the C ops did not build:", ours.error)
        return 1
    past = kernel_at(CpuOps, args.against) if args.against else None
    if past is not None and past.lib is None:
        print(f"{args.against}'s C ops did not build: {past.error}")
    old = past.lib if past is not None else None
    rows_out = []
    for rows in ROWS:
        reps = args.reps if rows <= 256 else max(5, args.reps // 4)
        then = cases(rows, old) if old is not None else {}
        for op, (c_call, ref) in cases(rows, ours.lib).items():
            t_c, t_ref = timed(c_call, reps), timed(ref, reps)
            t_old = timed(then[op][0], reps) if op in then else None
            rows_out.append((op, rows, t_c, t_ref, t_old))
            was = f" | {args.against} {t_old * 1e6:8.1f} us" if t_old else ""
            print(f"  {op:18s} {rows:5d} rows: C {t_c * 1e6:8.1f} us | torch {t_ref * 1e6:8.1f} us{was}", flush=True)
    if args.no_write:
        return 0
    cmd = "python -m bench.cpu_ops" + (f" --against {args.against}" if args.against else "")
    then_cols = (f" | C at {args.against} us | ours ÷ it", "|---:|---:") if old is not None else ("", "")
    md = [
        "## CPU ops (norm, rotary, SiLU-and-mul)",
        "",
        producer(cmd, "cpu"),
        "",
        "The C ops of a CPU layer (`kernels/cpu_ops.c`) against their torch references at SmolLM2-135M's shapes, "
        "bf16: add + RMSNorm of [rows, 576], the rotary of q [rows, 9, 64] and k [rows, 3, 64] (views of the fused "
        "qkv row), SiLU-and-mul of [rows, 3072]. Median microseconds per call.",
        "",
        f"| op | rows | C us | torch us | torch ÷ C{then_cols[0]} |",
        f"|---|---:|---:|---:|---:{then_cols[1]}|",
    ]
    for op, rows, t_c, t_ref, t_old in rows_out:
        then = (f" | {t_old * 1e6:.1f} | {t_old / t_c:.2f}×" if t_old else " | – | –") if old is not None else ""
        md.append(f"| {op} | {rows} | {t_c * 1e6:.1f} | {t_ref * 1e6:.1f} | {t_ref / t_c:.2f}×{then} |")
    md += ["", "![CPU ops](cpu-ops.png)"]
    write_section(REPO / "docs" / "benchmarks.md", "cpu-ops", "\n".join(md))
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(5, 3))
    for op in dict.fromkeys(r[0] for r in rows_out):
        pts = [(r[1], r[3] / r[2]) for r in rows_out if r[0] == op]
        ax.plot([p[0] for p in pts], [p[1] for p in pts], marker="o", label=op)
    ax.set_xscale("log")
    ax.set_xlabel("rows")
    ax.set_ylabel("torch ÷ C")
    ax.axhline(1, color="gray", lw=0.5)
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(REPO / "docs" / "cpu-ops.png", dpi=110)
    print(f"wrote {REPO / 'docs' / 'benchmarks.md'} and {REPO / 'docs' / 'cpu-ops.png'}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
