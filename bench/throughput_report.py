"""bench/throughput.py's report: its docs section and plot, and the floors beside the GEMM roofline.

A CPU's decode steps read every weight once a step, and each request's context once a step, from memory: where
memory is slow against the GEMM (AMX), that floor binds long before the GEMM's. memory_floor measures the
machine's read rate and the model's matmul rate at its own shapes, in the same run, and bounds the wall time from
below by bytes: every step reads the weights (at least max(out_len) steps: a step gives a request one token at
most) and every decode reads its request's K and V so far."""

from __future__ import annotations

import time
from pathlib import Path

import torch

CB_PAGE = 256  # HF's default page_size (bench/throughput.py's hf-cb)


def read_rate(gib: float = 1.0, reps: int = 3) -> float:
    """GB/s at which this process's threads sum an fp32 tensor of `gib` GiB (past every cache): best of reps."""
    x = torch.ones(int(gib * 2**28))
    best = float("inf")
    for _ in range(reps):
        t = time.perf_counter()
        x.sum()
        best = min(best, time.perf_counter() - t)
    return x.numel() * 4 / best / 1e9


def shape_rates(spec, dtype: torch.dtype, rows=(32, 2048), reps: int = 5) -> dict[int, float]:
    """GFLOP/s of F.linear over the model's four linears of a layer (qkv, o, gate_up, down) at each row count: a
    decode step's rows and a prefill chunk's."""
    hd, h = spec.head_dim, spec.hidden_size
    shapes = [((spec.num_heads + 2 * spec.num_kv_heads) * hd, h), (h, spec.num_heads * hd),
              (2 * spec.intermediate_size, h), (h, spec.intermediate_size)]  # fmt: skip
    ws = [torch.randn(n, k).to(dtype) for n, k in shapes]
    out = {}
    for m in rows:
        xs = [torch.randn(m, w.shape[1]).to(dtype) for w in ws]
        for x, w in zip(xs, ws):
            torch.nn.functional.linear(x, w)  # warm up
        best = float("inf")
        for _ in range(reps):
            t = time.perf_counter()
            for x, w in zip(xs, ws):
                torch.nn.functional.linear(x, w)
            best = min(best, time.perf_counter() - t)
        out[m] = sum(2 * m * w.shape[0] * w.shape[1] for w in ws) / best / 1e9
    return out


def memory_floor(spec, wl, p_ne: int, dtype_bytes: int, rate: float) -> dict:
    """The bytes a step-by-step engine must read for `wl`, and the seconds they take at `rate` GB/s: the weights
    (non-embedding and the lm_head, once a step) over max(out_len) steps, and each decode's K and V so far."""
    from engine.memory import kv_bytes_per_token

    steps = max(wl.out_lens)
    weights = (p_ne + spec.vocab_size * spec.hidden_size) * dtype_bytes
    tokens = sum(len(p) + t for p, o in zip(wl.prompts, wl.out_lens) for t in range(1, o))
    kv = tokens * kv_bytes_per_token(spec, dtype_bytes)
    return dict(steps=steps, weights=weights, kv=kv, rate=rate, seconds=(steps * weights + kv) / rate / 1e9)


def floors_paragraph(f: dict, gemm_floor: float, ours: float | None) -> str:
    rates = ", ".join(f"{r:,.0f} GFLOP/s at {m} rows" for m, r in f["shapes"].items())
    floor = max(gemm_floor, f["seconds"])
    text = (
        f"At the model's own shapes (its four linears of a layer through F.linear): {rates}. Memory floor: this "
        f"machine reads {f['rate']:.1f} GB/s (an fp32 sum of 1 GiB); the workload takes at least {f['steps']} "
        f"steps, each reading the weights ({f['weights'] / 1e6:,.0f} MB with the lm_head), and its decodes read "
        f"{f['kv'] / 1e9:.1f} GB of K and V: {f['seconds']:.2f} s at least. The larger floor is {floor:.2f} s"
    )
    return text + (f"; ours is at **{100 * floor / ours:.1f} %** of it." if ours else ".")  # fmt: skip


def render(rows, wl, args, cmd, peak, flops, spec, p_ne, oh, machine, floors=None) -> str:
    """docs/benchmarks.md's section; floors: memory_floor's, where measured."""
    layers = f" ({sum(spec.linear_layers)} Gated DeltaNet, {spec.num_kv_layers} attention layers)"
    kind = f"Qwen3-Next{layers}" if spec.hybrid else "Mixtral"
    name = f"a random {kind}, top-{spec.num_experts_per_tok} of {spec.num_experts} experts" if spec.num_experts else ""
    model_line = f"Model: {name or 'SmolLM2-135M-Instruct'} ({p_ne / 1e6:.1f} M non-embedding params per token, "
    model_line += f"vocab {spec.vocab_size})."
    floor_s = flops / (peak * 1e9)
    ours = next((r for r in rows if r[0] == "ours"), None)
    hf = [r for r in rows if r[0] != "ours"]
    lines = [
        "## Offline throughput",
        "",
        f"`{cmd}` on {time.strftime('%Y-%m-%d')}: {machine}.",
        "",
        f"Workload: {len(wl.prompts)} requests, prompt tokens uniform in [{args.min_prompt}, {args.max_prompt}] "
        f"(sum {wl.n_prompt}), output tokens uniform in [{args.min_out}, {args.max_out}] (sum {wl.n_out}); "
        f"random token ids (seed {args.seed}), ignore_eos, greedy, all submitted at t=0, {args.dtype}. "
        f"{model_line} "
        "One timed call per peer, all in one process run; output tok/s counts only each request's own output "
        "tokens.",
        "",
        "| peer | wall s | output tok/s | total tok/s | GFLOP/s | % of roofline | ours ÷ peer |",
        "|---|---:|---:|---:|---:|---:|---:|",
    ]
    for name, s in rows:
        ratio = f"{s / ours[1]:.2f}×" if ours else "–"
        lines.append(
            f"| {name} | {s:.2f} | {wl.n_out / s:,.0f} | {(wl.n_prompt + wl.n_out) / s:,.0f} | "
            f"{flops / s / 1e9:,.0f} | {100 * floor_s / s:.1f} % | {ratio} |"
        )
    lines.append("")
    if ours and hf:
        best = min(hf, key=lambda r: r[1])
        lines += [f"**ours vs the best peer ({best[0]}): {best[1] / ours[1]:.2f}× the output tok/s.**", ""]
    lines += [
        f"Roofline: a {args.gemm} 2048³ matmul runs at {peak:,.0f} GFLOP/s here. The workload is "
        f"{flops / 1e12:.2f} TFLOP (2·params·tokens + 2·vocab·hidden·output tokens; attention left out), so "
        f"its floor is {floor_s:.2f} s, {wl.n_out / floor_s:,.0f} output tok/s.",
        "",
    ]
    if floors:
        lines += [floors_paragraph(floors, floor_s, ours[1] if ours else None), ""]
    if oh:
        lines += [
            f"Engine overhead ({oh['n_req']} requests, prompt 32, {oh['n_out']} output tokens each): at the "
            f"{oh['n_steps']} decode steps of batch {oh['batch']}, a step takes {oh['step_ms']:.1f} ms, of which "
            f"the model forward + lm_head take {oh['fwd_ms']:.1f} ms, so **{100 * oh['overhead']:.1f} %** of "
            f"step time is outside the model (scheduling, input building, sampling, detokenizing); "
            f"{100 * oh['all_overhead']:.1f} % over all steps, prefill included.",
            "",
        ]
    lines += [
        "Notes:",
        "- hf-pad*: `model.generate` on left-padded batches; each row generates its batch's max out_len "
        "(`min_new_tokens = max_new_tokens`, so EOS cannot end it); padding and surplus tokens are not counted.",
        "- hf-cb: the manager behind `generate_batch`, driven by `add_request`, which alone takes a per-request "
        f"`max_new_tokens`; EOS off (`eos_token_id=-1`); page_size {CB_PAGE}, num_blocks = the pages the "
        f"workload needs + 2, max_batch_tokens {args.cb_max_batch_tokens} unless named. Cache set-up is untimed.",
        "- hf-cb-gb (if run): `generate_batch` itself: one max_new_tokens for all, set-up timed.",
        "- Timings here are noisy: compare ratios within this run, not absolute numbers.",
        "",
        "![Offline throughput: output tok/s per peer](throughput.png)",
    ]
    return "\n".join(lines)


def plot(rows, wl, floor_s, png: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    names, tps = [r[0] for r in rows], [wl.n_out / r[1] for r in rows]
    fig, ax = plt.subplots(figsize=(8, 0.6 * len(rows) + 1.8))
    bars = ax.barh(names, tps, color=["tab:green" if n == "ours" else "tab:gray" for n in names])
    ax.bar_label(bars, fmt="{:,.0f}", padding=3)
    ax.axvline(wl.n_out / floor_s, ls="--", color="tab:red", label="GEMM roofline")
    ax.invert_yaxis()
    ax.set_xlabel("useful output tokens / s (higher is better)")
    ax.set_title(f"Offline throughput, {png.stem}, {len(wl.prompts)} requests")
    ax.legend(loc="lower right")
    fig.tight_layout()
    png.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(png, dpi=120)
