"""Embedding throughput on CPU: our engine's /v1/embeddings path (LLM.embed: one prefill-only request per text,
batched by the scheduler) against HF transformers' AutoModel on padded batches (what sentence-transformers runs),
the same texts, bf16 SmolLM2-135M, last-token pooling, normalized. Runs alternate between the two, so both see the
same machine state; the ratio per round is what to read (these machines are noisy).

Workload: 64 texts of random token ids, 16-512 tokens (uniform, seeded), all sent at once. HF batches of 16, sorted
by length (its best case: little padding), attention-masked, the last real token pooled. Also reported: the cosine
between the two sides' vectors (bf16 both; fp32 parity is tests/test_embeddings.py).

Usage: python -m bench.embeddings [--rounds 3] [--quick] [--no-write]"""

from __future__ import annotations

import argparse
import statistics
import time
from pathlib import Path

import torch

from bench._common import default_model_path, make_workload, producer, write_section

REPO = Path(__file__).resolve().parents[1]


def hf_embed(model, prompts: list[list[int]], batch: int) -> list[torch.Tensor]:
    order = sorted(range(len(prompts)), key=lambda i: len(prompts[i]))
    out: list[torch.Tensor | None] = [None] * len(prompts)
    with torch.inference_mode():
        for a in range(0, len(order), batch):
            idx = order[a : a + batch]
            width = max(len(prompts[i]) for i in idx)
            ids = torch.zeros(len(idx), width, dtype=torch.long)
            mask = torch.zeros(len(idx), width, dtype=torch.long)
            for r, i in enumerate(idx):  # right padding: the last real token is at len - 1
                ids[r, : len(prompts[i])] = torch.tensor(prompts[i])
                mask[r, : len(prompts[i])] = 1
            h = model(input_ids=ids, attention_mask=mask).last_hidden_state
            last = h[torch.arange(len(idx)), mask.sum(1) - 1].float()
            for r, i in enumerate(idx):
                out[i] = torch.nn.functional.normalize(last[r], dim=0)
    return out


def main(argv=None) -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--quick", action="store_true", help="16 texts, 1 round, nothing written")
    ap.add_argument("--no-write", action="store_true")
    args = ap.parse_args(argv)
    import transformers

    from engine import LLM, PoolingParams

    path = default_model_path()
    n, rounds = (16, 1) if args.quick else (64, args.rounds)
    wl = make_workload(n, 16, 512, 1, 1, 49152, seed=7)
    tokens = sum(len(p) for p in wl.prompts)
    llm = LLM(str(path), dtype="bfloat16", log_stats_interval=0)
    hf = transformers.AutoModel.from_pretrained(str(path), dtype=torch.bfloat16).eval()
    prompts = [{"prompt_token_ids": p} for p in wl.prompts]
    llm.embed(prompts[:2], PoolingParams())  # warm both once
    hf_embed(hf, wl.prompts[:2], 16)
    rows, ours_v, hf_v = [], None, None
    for r in range(rounds):
        times = {}
        for side in ("ours", "hf") if r % 2 == 0 else ("hf", "ours"):
            t = time.perf_counter()
            if side == "ours":
                ours_v = llm.embed(prompts, PoolingParams())
            else:
                hf_v = hf_embed(hf, wl.prompts, 16)
            times[side] = time.perf_counter() - t
        rows.append(times)
        print(f"round {r}: ours {n / times['ours']:.1f} texts/s, HF {n / times['hf']:.1f} texts/s, "
              f"ratio {times['hf'] / times['ours']:.2f}x")  # fmt: skip
    cos = [torch.nn.functional.cosine_similarity(torch.tensor(a), b, dim=0).item() for a, b in zip(ours_v, hf_v)]
    print(f"cosine ours vs HF (bf16): min {min(cos):.5f}, median {statistics.median(cos):.5f}")
    llm.engine.shutdown()
    if args.quick or args.no_write:
        return 0
    md = [producer("python -m bench.embeddings", "cpu"), "",
          f"{n} texts of 16-512 random tokens ({tokens} in all), bf16 SmolLM2-135M, last-token pooling, normalized; "
          "HF: AutoModel on padded batches of 16 sorted by length. Rounds alternate the order.", "",
          "| round | ours texts/s | HF texts/s | ours / HF |", "|---:|---:|---:|---:|"]  # fmt: skip
    for r, t in enumerate(rows):
        md.append(f"| {r} | {n / t['ours']:.1f} | {n / t['hf']:.1f} | {t['hf'] / t['ours']:.2f}x |")
    md += ["", f"Cosine between the two sides' bf16 vectors: min {min(cos):.5f}, median {statistics.median(cos):.5f}.",
           "", "![Embedding throughput](embeddings.png)"]  # fmt: skip
    write_section(REPO / "docs" / "benchmarks.md", "embeddings", "## Embeddings\n\n" + "\n".join(md))
    plot(rows, n, REPO / "docs" / "embeddings.png")
    return 0


def plot(rows: list[dict], n: int, png: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(5, 3))
    xs = range(len(rows))
    ax.bar([x - 0.2 for x in xs], [n / t["ours"] for t in rows], 0.4, label="ours (LLM.embed)")
    ax.bar([x + 0.2 for x in xs], [n / t["hf"] for t in rows], 0.4, label="HF AutoModel, batches of 16")
    ax.set_xlabel("round")
    ax.set_ylabel("texts / s")
    ax.set_xticks(list(xs))
    ax.legend()
    fig.tight_layout()
    fig.savefig(png, dpi=120)


if __name__ == "__main__":
    raise SystemExit(main())
