"""Decode steps at batch 1, 8 and 64 for an 8B-shaped random model, eager against CUDA graphs, bf16 and fp8 weights
(the GPU check's parts 4 and 5).

Each step is ModelRunner.execute as the engine runs it (host batch building, the block table, the model, lm_head,
greedy sampling), every sequence holding CTX tokens of context. Per (weights, batch): the eager step and the graph
replay of the same bucket must give the same tokens; the table reports ms per step and the weight-bytes /
copy-bandwidth floor's share of it (floor / step; KV reads are not in the floor). Graphs are captured here only for
the buckets measured. Writes the gpu-decode section of docs/gpu.md (and, with `--json PATH`, the rows as JSON).
`--tiny`: a 2-layer toy model on CPU, the Triton kernels under the interpreter and the ReplayGraph stand-in: the
same code path, for CI (no docs written)."""

from __future__ import annotations

import argparse
import json
import statistics
from pathlib import Path

import torch

from bench._common import gpu_summary, producer, timed, write_section
from bench.synthetic_model import LLAMA3_8B, TINY, hf_config

CTX, BS = 1024, 16  # context per sequence; KV block size
BATCHES = (1, 8, 64)
REPO = Path(__file__).resolve().parents[1]
DOC = REPO / "docs" / "gpu.md"


def step_weight_bytes(model) -> int:
    """Weight bytes one decode step reads: every linear (+ fp8 scales) and norm, lm_head, one embedding row."""
    nb = lambda t: t.numel() * t.element_size()  # noqa: E731
    total = sum(nb(p) for name, p in model.named_parameters() if name != "embed")  # lm_head is not tied here
    total += sum(nb(s) for layer in model.layers for s in layer.fp8_scales.values())
    return total + nb(model.embed[0])


def build(tiny: bool, ctx: int, batches: tuple[int, ...]):
    """A random model on the device (bf16, made in place), a KV pool for max(batches) sequences of ctx + 1 tokens,
    and a runner with a block table for them. Returns (model, runner, steps {batch: SchedulerOutput})."""
    from engine.block_manager import BlockManager
    from engine.kv_cache import allocate
    from engine.layers.attention import TritonAttention
    from engine.memory import kv_bytes_per_token, plan
    from engine.model_runner import ModelRunner
    from engine.models.llama import LlamaForCausalLM
    from engine.models.spec import ModelSpec
    from engine.types import Request, SamplingParams, SchedulerOutput

    dev = torch.device("cpu" if tiny else "cuda")
    spec = ModelSpec.from_hf(hf_config(TINY if tiny else LLAMA3_8B))
    dtype = torch.float32 if tiny else torch.bfloat16  # the interpreter's bf16 dots are slow and inexact
    model = LlamaForCausalLM(spec, dtype, dev, max_positions=ctx + BS)
    g = torch.Generator(dev).manual_seed(0)
    for name, p in model.named_parameters():  # in place, in the model dtype: no fp32 copy of the model
        p.fill_(1.0) if name.endswith("norm") else p.normal_(0, 0.02, generator=g)
    most = max(batches)
    per_seq = -(-(ctx + 1) // BS)
    cap = plan(
        kv_budget=0,
        kv_bytes_per_token=kv_bytes_per_token(spec, dtype.itemsize),
        block_size=BS,
        model_max_len=ctx + BS,
        num_blocks=most * per_seq,
    )
    kv = allocate(spec, cap, dtype, dev)
    runner = ModelRunner(
        model,
        kv,
        TritonAttention(BS, spec.head_dim**-0.5),
        BS,
        dev,
        "triton",
        max_num_seqs=most,
        max_model_len=ctx + BS,
    )
    blocks = BlockManager(most * per_seq, BS)
    reqs = []
    for i in range(most):  # ctx tokens computed, one new: each step writes position ctx and attends over ctx + 1
        prompt = [(7 * i + j) % spec.vocab_size for j in range(ctx)]
        r = Request(f"s{i}", prompt, SamplingParams(temperature=0.0), output_token_ids=[i], num_computed_tokens=ctx)
        assert blocks.allocate_slots(r, 1)
        reqs.append(r)
    return model, runner, {b: SchedulerOutput(reqs[:b], [1] * b, sampling=reqs[:b]) for b in batches}


def measure(tiny: bool, ctx: int = CTX, batches: tuple[int, ...] = BATCHES, reps: int = 3) -> list[dict]:
    import kernels
    from engine.cuda_graphs import ReplayGraph, cuda_graph_factory
    from engine.sampler import Sampler
    from engine.spec_decode.speculator import NO_DRAFTS
    from engine.step_runner import StepInput, StepRunner
    from engine.structured import NO_MASKS

    model, runner, plans = build(tiny, ctx, batches)
    dev = "cpu" if tiny else "cuda"
    step_runner = StepRunner(runner, Sampler(model.spec.vocab_size, torch.device(dev)))
    steps = {b: StepInput(out, NO_DRAFTS, NO_MASKS) for b, out in plans.items()}

    def execute(step: StepInput) -> dict:
        return step_runner.execute(step).tokens

    def seconds(fn) -> float:
        if tiny:  # the first call of each shape was the token check above
            return statistics.median(timed(fn, dev) for _ in range(reps))
        from triton.testing import do_bench

        return do_bench(fn, warmup=25, rep=200, return_mode="median") * 1e-3

    rows = []
    for weights in ("bf16", "fp8"):
        if weights == "fp8":
            runner.graphs = None
            with kernels.backend("triton"):
                for layer in model.layers:
                    layer.quantize_fp8()  # new weight tensors: the graphs are captured again below
        eager = {}
        for b, step in steps.items():
            reqs = step.scheduled.requests
            eager[b] = ([execute(step)[r] for r in reqs], seconds(lambda s=step: execute(s)))
        graphs = runner.enable_graphs(ReplayGraph if tiny else cuda_graph_factory())
        graphs.pending = [(b, 1) for b in sorted(steps)]  # only the decode buckets measured
        while graphs.capture_next() is not None:
            pass
        for b, step in steps.items():
            tokens = [execute(step)[r] for r in step.scheduled.requests]
            t = seconds(lambda s=step: execute(s))
            rows.append(
                dict(
                    weights=weights,
                    batch=b,
                    weight_bytes=step_weight_bytes(model),
                    eager_s=eager[b][1],
                    graph_s=t,
                    tokens_equal=tokens == eager[b][0],
                    replays=graphs.replays,
                )
            )
        runner.graphs = None
    return rows


def lines(rows: list[dict], copy: float | None, name: str, ctx: int = CTX) -> list[str]:
    out = [
        f"Decode steps, {name}, random weights, context {ctx} per sequence in a paged KV cache of the model "
        f"dtype (block {BS}): "
        "`ModelRunner.execute` eager, then replaying a CUDA graph of the same bucket. Floor = weight bytes read per "
        "step / the device-to-device copy bandwidth (read + write bytes per second); KV reads are not in it.",
        "",
        "| weights | batch | weight MB | eager ms | graph ms | graph speed-up | floor ms | floor / graph step | "
        "same tokens |",
        "|---|---:|---:|---:|---:|---:|---:|---:|---|",
    ]
    for r in rows:
        floor = r["weight_bytes"] / copy if copy else None
        fl = f"{floor * 1e3:.2f} | {floor / r['graph_s']:.0%}" if floor else "— | —"
        out.append(
            f"| {r['weights']} | {r['batch']} | {r['weight_bytes'] / 1e6:,.0f} | {r['eager_s'] * 1e3:.2f} | "
            f"{r['graph_s'] * 1e3:.2f} | {r['eager_s'] / r['graph_s']:.2f}x | {fl} | "
            f"{'yes' if r['tokens_equal'] else '**NO**'} |"
        )
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description="decode steps, eager vs CUDA graphs -> docs/gpu.md (gpu-decode)")
    ap.add_argument("--tiny", action="store_true", help="toy model on CPU under the interpreter (CI smoke test)")
    ap.add_argument("--json", type=Path, default=None, help="also write the rows here")
    args = ap.parse_args()
    if args.tiny:
        rows = measure(tiny=True, ctx=40, batches=(1, 2, 4))
        print("\n".join(lines(rows, None, "tiny model (2 layers, hidden 256, fp32) on CPU, stand-in graphs", 40)))
    else:
        from bench.kernel_bench import copy_bandwidth

        copy = copy_bandwidth()
        rows = measure(tiny=False)
        head = ["## Decode steps: eager vs CUDA graphs", "", producer("python -m bench.decode_step", "cuda"), ""]
        md = "\n".join([*head, *lines(rows, copy, "Llama-3-8B shape")])
        write_section(DOC, "gpu-decode", md, title="# GPU check")
        print(md)
    if args.json:
        args.json.write_text(json.dumps(rows))
    for r in rows:
        gpu_summary(r["tokens_equal"], f"decode {r['weights']} batch {r['batch']}: graph tokens equal eager", args.tiny)
    if not args.tiny:  # the GPU target at batch 1 (bf16; docs/gpu.md)
        one = next(r for r in rows if r["weights"] == "bf16" and r["batch"] == 1)
        floor = one["weight_bytes"] / copy / one["graph_s"]
        # the speed-up over eager is reported, not a target: an 8B step reads ~16 GB of weights, so even the eager
        # step is close to the bandwidth floor and graphs cannot gain much; the floor share is the meaningful rule
        speedup = one["eager_s"] / one["graph_s"]
        gpu_summary(
            floor >= 0.7,
            f"decode bf16 batch 1 with graphs: {floor:.0%} of the floor (target >= 70%); graphs {speedup:.2f}x eager",
        )
    if any(not r["tokens_equal"] for r in rows):
        raise SystemExit(1)


if __name__ == "__main__":
    main()
