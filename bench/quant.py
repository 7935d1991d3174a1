"""Quantized checkpoints on CPU with SmolLM2: each format written from the bf16 model by bench/quant_writers.py
(round to nearest, no calibration), loaded by the engine, and compared with bf16 in one run.

- Perplexity over windows of Python's `pydoc_data.topics` (offline), and KL(bf16 || format) at the same positions
  (bench/fp8_quality.py's method: the final hidden states of each window's one prefill step, scored).
- Greedy agreement: prompts x tokens, the share of positions whose token equals bf16's.
- Bytes: the checkpoint's file, and the weights as a GPU holds them (packed: memory.weight_bytes, which the tests
  check against the allocated tensors); on CPU every format is dequantized at load to bf16.
- CPU linears, the decision behind that: one SmolLM2 MLP linear (gate_up, [1536, 576]) as W4A16 dequantized per
  call (kernels/int_gemm.py's reference) against the bf16 GEMM on weights dequantized once, at 1 and 256 tokens.

Usage: python -m bench.quant [--quick]   (writes docs/benchmarks.md section quant; --quick prints only)"""

from __future__ import annotations

import argparse
import tempfile
import time
from pathlib import Path

import torch

from bench import quant_writers as qw
from bench._common import default_model_path, producer, write_section
from bench.fp8_quality import corpus_ids, mean_kl, perplexity, score_windows
from engine import LLM, SamplingParams, memory

REPO = Path(__file__).resolve().parents[1]
FORMATS = {  # name -> writer(src, dst, ref): SmolLM2's K (576, 1536) are multiples of 64, not of 128
    "AWQ int4 g64": lambda s, q, r: qw.write_awq(s, q, r, group=64),
    "GPTQ int4 g64 sym": lambda s, q, r: qw.write_gptq(s, q, r, bits=4, group=64, sym=True),
    "GPTQ int4 g64 asym act-order": lambda s, q, r: qw.write_gptq(s, q, r, bits=4, group=64, sym=False, desc_act=True),
    "GPTQ int8 per channel": lambda s, q, r: qw.write_gptq(s, q, r, bits=8, group=None, sym=True),
    "compressed-tensors W4A16 g64": lambda s, q, r: qw.write_compressed_tensors(s, q, r, bits=4, group=64),
    "compressed-tensors W8A16 g64": lambda s, q, r: qw.write_compressed_tensors(s, q, r, bits=8, group=64),
    "fp8 block 128": lambda s, q, r: qw.write_fp8_block(s, q, r, block=(128, 128)),
}


def linear_timings(reps: int) -> list[tuple[int, float, float]]:
    """(tokens, ms per call dequantizing per call, ms per call on bf16 dequantized once)."""
    from kernels.int_gemm import dequantize, int_linear_ref, pack

    n, k, group = 1536, 576, 64
    g = torch.Generator().manual_seed(0)
    q = pack(torch.randint(0, 16, (n, k), generator=g), 4)
    s = (torch.rand(n, k // group, generator=g) * 0.01).to(torch.bfloat16)
    z = torch.randint(0, 16, (n, k // group), generator=g).to(torch.uint8)
    dense = dequantize(q, s, z, 4, group, k, torch.bfloat16)
    out = []
    for m in (1, 256):
        x = torch.randn(m, k, generator=g).to(torch.bfloat16)
        times = []
        per_call = lambda x=x: int_linear_ref(x, q, s, z, None, 4, group)  # noqa: E731
        once = lambda x=x: torch.nn.functional.linear(x, dense)  # noqa: E731
        for fn in (per_call, once):
            fn()
            t = time.perf_counter()
            for _ in range(reps):
                fn()
            times.append((time.perf_counter() - t) / reps * 1e3)
        out.append((m, *times))
    return out


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--windows", type=int, default=8)
    ap.add_argument("--window", type=int, default=512)
    ap.add_argument("--prompts", type=int, default=16)
    ap.add_argument("--tokens", type=int, default=32)
    ap.add_argument("--quick", action="store_true", help="2 windows of 128, 4 prompts x 8 tokens, 2 formats")
    args = ap.parse_args(argv)
    formats = dict(list(FORMATS.items())[:2]) if args.quick else FORMATS
    if args.quick:
        args.windows, args.window, args.prompts, args.tokens = 2, 128, 4, 8
    src = default_model_path()
    rows, ref_lp, ref_greedy, ids = [], None, None, None
    with tempfile.TemporaryDirectory() as tmp:
        for name, write in {"bf16": None, **formats}.items():
            path = src
            if write is not None:
                path = Path(tmp) / name.replace(" ", "_")
                write(src, path, Path(tmp) / (path.name + "-ref"))
            llm = LLM(str(path), dtype="bfloat16", log_stats_interval=0, kv_cache_memory=256 << 20)
            ids = ids or corpus_ids(llm.tokenizer, args.windows * args.window + args.prompts * 17)
            windows = [ids[i * args.window : (i + 1) * args.window] for i in range(args.windows)]
            lps = score_windows(llm, windows)
            ppl, kl = perplexity(lps, windows), None if ref_lp is None else mean_kl(ref_lp, lps)
            ref_lp = ref_lp or lps
            base = args.windows * args.window
            prompts = [{"prompt_token_ids": ids[base + 17 * i : base + 17 * i + 16]} for i in range(args.prompts)]
            params = SamplingParams(temperature=0, max_tokens=args.tokens, ignore_eos=True)
            t = time.perf_counter()
            greedy = [o.outputs[0].token_ids for o in llm.generate(prompts, params)]
            tok_s = args.prompts * args.tokens / (time.perf_counter() - t)
            ref_greedy = ref_greedy or greedy
            same = sum(a == b for g, r in zip(greedy, ref_greedy) for a, b in zip(g, r)) / (args.prompts * args.tokens)
            spec = llm.engine.spec
            gpu_bytes = memory.weight_bytes(spec, 2, None, packed=True)
            file_bytes = sum(f.stat().st_size for f in Path(path).glob("*.safetensors"))
            rows.append((name, ppl, kl, same, file_bytes, gpu_bytes, tok_s))
            print(f"{name:30s} ppl {ppl:.3f} kl {kl or 0:.4f} greedy {same:.1%} file {file_bytes / 2**20:.1f} MiB "
                  f"GPU weights {gpu_bytes / 2**20:.1f} MiB {tok_s:.0f} tok/s", flush=True)  # fmt: skip
            llm.engine.shutdown()
            del llm
    timings = linear_timings(5 if args.quick else 50)
    for m, per_call, once in timings:
        print(f"gate_up W4A16 at {m} tokens: dequantized per call {per_call:.2f} ms, bf16 once {once:.3f} ms")
    if args.quick:
        return 0
    base_ppl = rows[0][1]
    md = ["## Quantized checkpoints (SmolLM2, CPU)", "", producer("python -m bench.quant", "cpu"), "",
          f"Each format written from the bf16 model by `bench/quant_writers.py` (round to nearest, no calibration: "
          f"the layouts are what is measured, not a quantizer). Perplexity over {args.windows} windows x "
          f"{args.window} tokens of `pydoc_data.topics`; greedy agreement over {args.prompts} prompts x "
          f"{args.tokens} tokens. On CPU each format is dequantized at load into the same dense bf16 model, so its "
          "speed is bf16's by construction (not timed here: sequential runs on this VM differ by more than that "
          "would show); *GPU weights* is what the packed layout holds on a GPU (memory.weight_bytes, tested "
          "against the allocated tensors). Nothing here ran on a GPU.", "",
          "| format | perplexity | vs bf16 | mean KL | greedy tokens = bf16 | checkpoint MiB | GPU weights MiB |",
          "|---|---:|---:|---:|---:|---:|---:|"]  # fmt: skip
    for name, ppl, kl, same, fb, gb, _ in rows:
        md.append(f"| {name} | {ppl:.3f} | {100 * (ppl / base_ppl - 1):+.2f} % | {'–' if kl is None else f'{kl:.4f}'} "
                  f"| {same:.1%} | {fb / 2**20:.1f} | {gb / 2**20:.1f} |")  # fmt: skip
    md += ["", "Why CPU dequantizes at load: one SmolLM2 gate_up linear ([1536, 576], int4 in groups of 64),",
           "dequantized per call against bf16 weights dequantized once:", "",
           "| tokens | dequantized per call, ms | bf16 (once, at load), ms | ratio |",
           "|---:|---:|---:|---:|"]  # fmt: skip
    md += [f"| {m} | {a:.2f} | {b:.3f} | {a / b:.1f}x |" for m, a, b in timings]
    md += ["", "The cost of dequantizing at load is memory: a 16-bit model's bytes on CPU (4x an int4 model's).",
           "", "![Quantized formats](quant.png)"]  # fmt: skip
    write_section(REPO / "docs" / "benchmarks.md", "quant", "\n".join(md))
    plot(rows, REPO / "docs" / "quant.png")
    return 0


def plot(rows, png: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 3.5))
    ax.scatter([r[5] / 2**20 for r in rows], [r[1] for r in rows])
    for r in rows:
        ax.annotate(r[0], (r[5] / 2**20, r[1]), fontsize=7, xytext=(3, 3), textcoords="offset points")
    ax.set_xlabel("weights as a GPU holds them (MiB)")
    ax.set_ylabel("perplexity (CPU)")
    fig.tight_layout()
    fig.savefig(png, dpi=120)


if __name__ == "__main__":
    raise SystemExit(main())
