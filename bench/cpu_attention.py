"""Our CPU attention (kernels/cpu_attention.c) against the torch path it replaces, through TorchAttention's own
build + forward (the cache write included), at SmolLM2-135M's geometry (9 query heads, 3 kv heads, head_dim 64,
block 16), bf16, on this machine's threads. Three steps:

  prefill   whole prompts of U(32, 384) tokens, 2048 or more in all (a prefill step of bench/throughput.py's
            workload): the kernel's one call against one SDPA call per prompt
  decode    32 sequences of U(32, 500) tokens of context, one new token each: the kernel against the gather and
            two batched matmuls
  cold      the decode of 18 such sequences, each of 30 layers' caches in turn (their KV comes from memory, as in a
            serving step); the kernel only, its KV read rate against the machine's copy rate
  cold-runs the same, each sequence's blocks consecutive (engine/block_manager.py hands out runs where it can)

Reported: ms per call (median of `--reps`), GFLOP/s (4 x heads x head_dim x the positions each token sees), and the
kernel's speed-up. `--against REV` also builds git revision REV's kernels/cpu_attention.c and times it and ours in
alternating rounds (these machines drift between minutes): ours ÷ it per step. Usage: python -m bench.cpu_attention
[--reps 20] [--against REV] [--no-write]"""

from __future__ import annotations

import argparse
import random
import tempfile
from pathlib import Path

import torch

from bench._common import kernel_at, producer, write_section
from bench.cpu_gemm import REPO, alternated, copy_rate, timed

H, KVH, D, BS = 9, 3, 64, 16  # SmolLM2-135M


def step(spec: list[tuple[int, int]], layers: int = 1, seed: int = 0, runs: bool = False):
    """q, k, v for the new tokens of `spec` ([(new tokens, context)]), `layers` KV caches holding every context (its
    blocks shuffled over the pool, the worst a server's free blocks can be; runs: each sequence's consecutive), and
    the StepLayout."""
    from engine.layers.attention import StepLayout

    g = torch.Generator().manual_seed(seed)
    nblk = [-(-ctx // BS) for _, ctx in spec]
    blocks = list(range(sum(nblk)))
    if not runs:
        random.Random(seed).shuffle(blocks)
    it = iter(blocks)
    tables = [[next(it) for _ in range(n)] for n in nblk]
    caches = [tuple(torch.randn(KVH, len(blocks), BS, D, generator=g).bfloat16() for _ in "kv") for _ in range(layers)]
    t = sum(n for n, _ in spec)
    q, k, v = (torch.randn(t, h, D, generator=g).bfloat16() for h in (H, KVH, KVH))
    slots = [tables[i][p // BS] * BS + p % BS for i, (n, ctx) in enumerate(spec) for p in range(ctx - n, ctx)]
    qsl = [0]
    for n, _ in spec:
        qsl.append(qsl[-1] + n)
    layout = StepLayout(torch.tensor(slots), qsl, [ctx for _, ctx in spec], tables)
    return q, k, v, caches, layout


def flops(spec) -> float:
    return 4 * H * D * sum(ctx - n + i + 1 for n, ctx in spec for i in range(n))  # QK^T and PV, causal


def run(attn, q, k, v, caches, layout) -> None:
    meta = attn.build(layout, torch.device("cpu"))
    for kc, vc in caches:
        attn.forward(q, k, v, kc, vc, meta)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--reps", type=int, default=20)
    ap.add_argument("--against", default=None, help="a git revision whose kernel to time beside ours")
    ap.add_argument("--no-write", action="store_true")
    args = ap.parse_args(argv)
    from engine.host_memory import keep_freed_memory
    from engine.layers.attention import TorchAttention
    from kernels.cpu_attention import NativeAttention

    keep_freed_memory()  # as the engine
    native = NativeAttention.get(D, Path(tempfile.mkdtemp()), wait=True)
    if native.lib is None:
        print("the C attention did not build:", native.error)
        return 1
    then = kernel_at(NativeAttention, args.against, D) if args.against else None
    if then is not None and then.lib is None:
        print(f"{args.against}'s C attention did not build: {then.error}")
        then = None
    rng = random.Random(0)
    prompts = []
    while sum(n for n, _ in prompts) < 2048:
        n = rng.randint(32, 384)
        prompts.append((n, n))
    cases = {
        "prefill": prompts,
        "decode": [(1, rng.randint(32, 500)) for _ in range(32)],
        "cold": [(1, rng.randint(32, 500)) for _ in range(18)],
    }
    cases["cold-runs"] = cases["cold"]
    copy = copy_rate()
    rows = []
    for name, spec in cases.items():
        layers = 30 if name.startswith("cold") else 1
        q, k, v, caches, layout = step(spec, layers, runs=name == "cold-runs")
        ways = {}
        for way, kernel in (("C", native), ("torch", None)):
            if name.startswith("cold") and kernel is None:
                continue
            attn = TorchAttention(BS, D**-0.5)
            attn.native = kernel
            call = (attn, q, k, v, caches, layout)
            ways[way] = timed(lambda call=call: run(*call), args.reps) / layers
            if kernel is not None and then is not None:  # ours and REV's, alternated
                old = TorchAttention(BS, D**-0.5)
                old.native = then
                then_call = (old, *call[1:])
                ours, was = alternated(lambda c=call: run(*c), lambda c=then_call: run(*c), args.reps)
                ways["C"], ways[f"C@{args.against}"] = ours / layers, was / layers
        kv = sum(ctx for _, ctx in spec) * KVH * D * 2 * 2  # bf16 K and V each token's sequence reads
        rows.append((name, spec, ways, flops(spec), kv))
        each = " | ".join(f"{w} {s * 1e3:7.3f} ms {flops(spec) / s / 1e9:6.1f} GFLOP/s" for w, s in ways.items())
        print(f"  {name:8s} {each} | C's KV read {kv / ways['C'] / 1e9:.1f} GB/s", flush=True)
    if args.no_write:
        return 0
    md = [
        "## CPU attention",
        "",
        producer("python -m bench.cpu_attention" + (f" --against {args.against}" if then else ""), "cpu")
        + f" {torch.get_num_threads()} threads; copy rate "
        f"{copy:.1f} GB/s (read + write, 512 MiB).",
        "",
        "SmolLM2-135M's attention (9 query heads, 3 kv heads, head_dim 64, block 16, bf16) through `TorchAttention` "
        "(the cache write included): our C kernel (`kernels/cpu_attention.c`, one call for the step) against the "
        "torch path (one SDPA call per prompt; the decodes' gather and batched matmuls). prefill: whole prompts of "
        "U(32, 384) tokens, 2048 or more in all; decode: 32 sequences of U(32, 500) tokens of context; cold: 18 such "
        "decodes over 30 layers' caches in turn (the KV from memory), each sequence's blocks shuffled over the pool; "
        "cold-runs: the same with each sequence's blocks consecutive. GFLOP/s: 4 x heads x head_dim x the positions "
        "each token sees; KV GB/s: the K and V bytes the kernel reads over its time. Median of the reps."
        + (f" C at {args.against}: that revision's kernel, timed in rounds alternating with ours." if then else ""),
        "",
        "| step | tokens | C ms | torch ms | C GFLOP/s | torch GFLOP/s | torch ÷ C | C's KV read GB/s |"
        + (f" C at {args.against} ms | it ÷ ours |" if then else ""),
        "|---|---:|---:|---:|---:|---:|---:|---:|" + ("---:|---:|" if then else ""),
    ]
    for name, spec, ways, fl, kv in rows:
        c, t = ways["C"], ways.get("torch")
        torch_cols = f"{t * 1e3:.2f} | {fl / c / 1e9:.1f} | {fl / t / 1e9:.1f} | {t / c:.2f}×" if t else (
            f"– | {fl / c / 1e9:.1f} | – | –")  # fmt: skip
        read = f"{kv / c / 1e9:.1f}" if name != "prefill" else "–"  # a prefill's K / V stay in cache: compute-bound
        was = ways.get(f"C@{args.against}")
        was_cols = f" {was * 1e3:.2f} | {was / c:.2f}× |" if was else ""
        md.append(f"| {name} | {sum(n for n, _ in spec)} | {c * 1e3:.2f} | {torch_cols} | {read} |{was_cols}")
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(5, 3))
    for i, (way, color) in enumerate((("C", "tab:blue"), ("torch", "tab:gray"))):
        xs = [j + 0.4 * i for j, r in enumerate(rows) if way in r[2]]
        ax.bar(xs, [r[3] / r[2][way] / 1e9 for r in rows if way in r[2]], 0.4, label=way, color=color)
    ax.set_xticks([j + 0.2 for j in range(len(rows))], [r[0] for r in rows])
    ax.set_ylabel("GFLOP/s")
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(REPO / "docs" / "cpu-attention.png", dpi=110)
    md += ["", "![CPU attention: GFLOP/s per step](cpu-attention.png)"]
    write_section(REPO / "docs" / "benchmarks.md", "cpu-attention", "\n".join(md))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
