"""Speculative decoding on CPU (SmolLM2-135M-Instruct, bf16), through LLM.generate: the same requests with and
without speculation, alternating in one run, at batch 1, 4 and 16.

1. n-gram prompt lookup on code editing: "rename / add docstrings / add type hints" to a class given in the
   prompt, so the answer repeats most of the prompt.
2. A draft model on plain chat prompts. The only real checkpoint here is SmolLM2-135M itself, and no smaller
   model of its vocabulary can be had offline, so two stand-ins bound what a draft does:
   - SmolLM2 cut to its first `--draft-layers` layers (an early-exit self-draft, as LayerSkip does without the
     training): cheap, shares the vocabulary by construction, and (untrained) rarely right;
   - SmolLM2 drafting for itself: always right, and as costly as the target, so it shows the machinery's
     overhead at full acceptance.

Each run is a batch of `b` requests submitted together (greedy, at most `--max-tokens` tokens, natural stops).
Output tok/s counts every output token over the wall time of the whole batch, the draft model's time included.
The prompts' prefixes are cached by one warm-up pass first, for both engines alike.

Exactness is measured, not assumed: the same 16 requests (8 code edits, 8 chats) run greedy with and without
each method, in fp32 and in bf16, and the table counts the identical outputs. Where two outputs differ, it
reports how close a tie the plain run had at the first differing token (the gap between its top-2 logprobs) and
whether the speculative run's token was among the plain run's top two (vLLM's check_logprobs_close rule).

Usage: python -m bench.spec [--reps 2] [--max-tokens 128]   (~20 min; writes docs/benchmarks.md and docs/spec.png)
"""

from __future__ import annotations

import argparse
import json
import shutil
import statistics
import tempfile
import time
from pathlib import Path

from bench._common import default_model_path, machine_line, write_section
from engine import LLM, SamplingParams

REPO = Path(__file__).resolve().parents[1]
BATCHES = (1, 4, 16)
NGRAM = {"method": "ngram", "num_speculative_tokens": 5, "prompt_lookup_min": 2, "prompt_lookup_max": 4}
CLASSES = [
    """class Inventory:
    def __init__(self):
        self.items = {}

    def add(self, name, count):
        if name in self.items:
            self.items[name] += count
        else:
            self.items[name] = count

    def remove(self, name, count):
        if name not in self.items:
            raise KeyError(name)
        self.items[name] -= count
        if self.items[name] <= 0:
            del self.items[name]

    def total(self):
        return sum(self.items.values())
""",
    """class RateLimiter:
    def __init__(self, limit, window):
        self.limit = limit
        self.window = window
        self.calls = []

    def allow(self, now):
        self.calls = [t for t in self.calls if now - t < self.window]
        if len(self.calls) < self.limit:
            self.calls.append(now)
            return True
        return False

    def reset(self):
        self.calls = []
""",
]
EDITS = [
    "Rename the class to `{new}` and return the whole class.",
    "Add a docstring to every method of this class. Return the full code.",
    "Rewrite this class with type hints on every method.",
    "Rename the attribute `self.{attr}` to `self._{attr}` everywhere. Return the full class.",
]
CHAT = [
    "Explain how a hash map works in a few sentences.",
    "Give me three tips for writing clear emails.",
    "What is the difference between a list and a tuple in Python?",
    "Describe the water cycle for a ten-year-old.",
    "Why is the sky blue?",
    "Write a short poem about autumn leaves.",
    "How do I make a good cup of tea?",
    "What are the benefits of regular exercise?",
]


def code_prompts(llm: LLM, n: int) -> list[str]:
    out = []
    for i in range(n):
        cls = CLASSES[i % len(CLASSES)]
        attr = "items" if "items" in cls else "calls"
        ask = EDITS[(i // len(CLASSES)) % len(EDITS)].format(new=f"Store{i}", attr=attr)
        msgs = [{"role": "user", "content": f"{ask}\n\n```python\n{cls}```"}]
        out.append(llm.engine.tok.apply_chat_template(msgs, add_generation_prompt=True))
    return out


def chat_prompts(llm: LLM, n: int) -> list[str]:
    tok = llm.engine.tok
    return [tok.apply_chat_template([{"role": "user", "content": CHAT[i % len(CHAT)]}], add_generation_prompt=True)
            for i in range(n)]  # fmt: skip


def layer_draft(src: Path, layers: int, out: Path) -> Path:
    """SmolLM2 cut to its first `layers` decoder layers (embeddings, final norm and tied head kept)."""
    from safetensors.torch import load_file, save_file

    out.mkdir(parents=True, exist_ok=True)
    cfg = json.loads((src / "config.json").read_text())
    cfg["num_hidden_layers"] = layers
    (out / "config.json").write_text(json.dumps(cfg))
    tensors = {}
    for f in sorted(src.glob("*.safetensors")):
        for k, v in load_file(f).items():
            if not k.startswith("model.layers.") or int(k.split(".")[2]) < layers:
                tensors[k] = v
    save_file(tensors, out / "model.safetensors")
    for f in src.iterdir():
        if f.suffix != ".safetensors" and f.name != "config.json" and f.is_file():
            shutil.copy(f, out / f.name)
    return out


def timed_run(llm: LLM, prompts: list[str], sp: SamplingParams) -> tuple[float, list[list[int]]]:
    t = time.perf_counter()
    outs = llm.generate(prompts, sp)
    dt = time.perf_counter() - t
    toks = [o.outputs[0].token_ids for o in outs]
    return sum(len(x) for x in toks) / dt, toks


def compare(plain: LLM, spec: LLM, prompts_of, reps: int, max_tokens: int) -> list[dict]:
    sp = SamplingParams(temperature=0, max_tokens=max_tokens)
    rows = []
    for b in BATCHES:
        prompts = prompts_of(plain, b)
        for e in (plain, spec):  # warm-up: the prompts' prefixes cached for both alike
            e.generate(prompts, SamplingParams(temperature=0, max_tokens=2))
        rates = {"plain": [], "spec": []}
        st0 = spec.engine.speculator.stats()
        for rep in range(reps):
            order = [("plain", plain), ("spec", spec)][:: 1 if rep % 2 == 0 else -1]
            for name, e in order:
                rate, toks = timed_run(e, prompts, sp)
                rates[name].append(rate)
                if name == "plain":
                    ref = toks
                else:
                    got = toks
        st1 = spec.engine.speculator.stats()
        drafts = st1["spec_decode_num_drafts"] - st0["spec_decode_num_drafts"]
        acc = st1["spec_decode_num_accepted_tokens"] - st0["spec_decode_num_accepted_tokens"]
        p, s = statistics.median(rates["plain"]), statistics.median(rates["spec"])
        rows.append(
            dict(
                batch=b,
                plain=p,
                spec=s,
                ratio=s / p,
                mean_len=1 + acc / drafts if drafts else 1.0,
                equal=sum(a == g for a, g in zip(ref, got)),
                n=len(prompts),
                runs=rates,
            )  # fmt: skip
        )
        print(rows[-1])
    return rows


def agreement(path: Path, methods: dict[str, dict], dtype: str, max_tokens: int) -> dict[str, dict]:
    """Greedy outputs of the same 16 requests with and without each method, in `dtype`. The plain run records
    its top-2 logprobs, so a difference can be judged: a near tie flipped, or a real error."""
    plain = LLM(str(path), dtype=dtype, log_stats_interval=0, max_num_seqs=16)
    prompts = code_prompts(plain, 8) + chat_prompts(plain, 8)
    ref = plain.generate(prompts, SamplingParams(temperature=0, max_tokens=max_tokens, logprobs=2))
    del plain
    out = {}
    for name, cfg in methods.items():
        llm = LLM(str(path), dtype=dtype, speculative_config=cfg, log_stats_interval=0, max_num_seqs=16)
        got = llm.generate(prompts, SamplingParams(temperature=0, max_tokens=max_tokens))
        del llm
        diffs = []
        for r, g in zip(ref, got):
            a, b = r.outputs[0].token_ids, g.outputs[0].token_ids
            if a == b:
                continue
            pos = next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), min(len(a), len(b)))
            top = sorted(r.outputs[0].logprobs[pos].items(), key=lambda kv: -kv[1]) if pos < len(a) else []
            gap = top[0][1] - top[1][1] if len(top) > 1 else float("nan")
            in_top2 = pos < len(b) and b[pos] in dict(top[:2])  # vLLM's check_logprobs_close criterion
            diffs.append(dict(pos=pos, gap=gap, in_top2=in_top2))
        out[name] = dict(equal=len(prompts) - len(diffs), n=len(prompts), diffs=diffs)
        print(dtype, name, out[name])
    return out


def agreement_table(results: dict[str, dict[str, dict]]) -> list[str]:
    out = [
        "| dtype | method | greedy outputs identical | at the first differing token: plain run's top-2 logprob gap "
        "(max) | speculative token in plain's top 2 |",
        "|---|---|---:|---:|---:|",
    ]
    for dtype, by_method in results.items():
        for name, r in by_method.items():
            d = r["diffs"]
            gap = f"{max(x['gap'] for x in d):.3f}" if d else "-"
            top2 = f"{sum(x['in_top2'] for x in d)}/{len(d)}" if d else "-"
            out.append(f"| {dtype} | {name} | {r['equal']}/{r['n']} | {gap} | {top2} |")
    return out


def table(rows: list[dict]) -> list[str]:
    out = [
        "| batch | plain tok/s | speculative tok/s | speed-up | mean acceptance length | greedy outputs equal |",
        "|---:|---:|---:|---:|---:|---:|",
    ]
    for r in rows:
        out.append(
            f"| {r['batch']} | {r['plain']:,.1f} | {r['spec']:,.1f} | **{r['ratio']:.2f}x** | {r['mean_len']:.2f} | "
            f"{r['equal']}/{r['n']} |"
        )
    stop = next((r["batch"] for r in rows if r["ratio"] < 1.0), None)
    out += ["", f"Stops paying at batch {stop}." if stop else f"Still pays at batch {rows[-1]['batch']}."]
    return out


def plot(results: dict[str, list[dict]], png: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6, 3))
    for name, rows in results.items():
        ax.plot([r["batch"] for r in rows], [r["ratio"] for r in rows], marker="o", label=name)
    ax.axhline(1.0, color="grey", lw=0.8)
    ax.set_xscale("log", base=2)
    ax.set_xticks(BATCHES, [str(b) for b in BATCHES])
    ax.set_xlabel("batch size")
    ax.set_ylabel("speculative / plain output tok/s")
    ax.set_title("Speculative decoding speed-up (CPU, SmolLM2-135M)")
    ax.legend()
    fig.tight_layout()
    fig.savefig(png, dpi=110)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--reps", type=int, default=2)
    ap.add_argument("--max-tokens", type=int, default=128)
    ap.add_argument("--draft-layers", type=int, default=8)
    ap.add_argument("--draft-k", type=int, default=3)
    ap.add_argument("--docs-dir", type=Path, default=REPO / "docs")
    ap.add_argument("--skip-speed", action="store_true", help="only the exactness table (docs untouched)")
    args = ap.parse_args()
    path = default_model_path()
    with tempfile.TemporaryDirectory() as tmp:
        draft_path = layer_draft(path, args.draft_layers, Path(tmp) / "draft")
        methods = {
            "n-gram": NGRAM,
            "early-exit draft": {"model": str(draft_path), "num_speculative_tokens": args.draft_k},
            "self-draft": {"model": str(path), "num_speculative_tokens": args.draft_k},
        }
        exact = {dt: agreement(path, methods, dt, args.max_tokens) for dt in ("float32", "bfloat16")}
        print("\n".join(agreement_table(exact)))
        if args.skip_speed:
            return
        kw = dict(log_stats_interval=0, max_num_seqs=16)
        plain = LLM(str(path), **kw)
        results = {}
        for name, prompts_of, cfg in (
            ("n-gram, code editing", code_prompts, methods["n-gram"]),
            ("early-exit draft, chat", chat_prompts, methods["early-exit draft"]),
            ("self-draft, chat", chat_prompts, methods["self-draft"]),
        ):
            spec = LLM(str(path), speculative_config=cfg, **kw)
            results[name] = compare(plain, spec, prompts_of, args.reps, args.max_tokens)
            del spec
    n_layers = json.loads((path / "config.json").read_text())["num_hidden_layers"]
    lines = [
        "## Speculative decoding (SmolLM2, CPU)",
        "",
        f"`python -m bench.spec --reps {args.reps} --max-tokens {args.max_tokens}` on {time.strftime('%Y-%m-%d')}: "
        f"{machine_line('cpu')}. SmolLM2-135M-Instruct, bf16, greedy, at most {args.max_tokens} output "
        f"tokens, natural stops; median of {args.reps} alternating runs per engine; the draft model's time is "
        "included.",
        "",
        f"**n-gram prompt lookup** (`{json.dumps(NGRAM)}`) on code editing (rename, docstrings, type hints on a "
        "class given in the prompt):",
        "",
        *table(results["n-gram, code editing"]),
        "",
        f"**Draft model, early exit** (SmolLM2's first {args.draft_layers} of {n_layers} layers as the draft, "
        f"k={args.draft_k}) on plain chat prompts:",
        "",
        *table(results["early-exit draft, chat"]),
        "",
        f"**Draft model, SmolLM2 drafting for itself** (k={args.draft_k}): every draft is right and costs a full "
        "forward pass, so this is the draft path's overhead at full acceptance:",
        "",
        *table(results["self-draft, chat"]),
        "",
        "No draft of SmolLM2's vocabulary smaller than SmolLM2 exists offline here, so what a trained draft gives "
        "cannot be measured on this machine: the early-exit draft is too often wrong, and the self-draft too "
        "costly.",
        "",
        "**Exactness**: the same 16 requests (8 code edits, 8 chats), greedy, at most "
        f"{args.max_tokens} tokens, each method against the plain engine in the same dtype (one run each):",
        "",
        *agreement_table(exact),
        "",
        "A (k + 1)-token verification row is computed in other batch shapes than a 1-token decode, so its "
        "rounding differs; where the plain run's top two tokens are nearly tied, that can flip the greedy choice "
        "and the outputs part from there. The gap column says how near the tie was.",
        "",
        "![speed-up by batch size](spec.png)",
    ]
    body = "\n".join(lines)
    print(body)
    plot(results, args.docs_dir / "spec.png")
    write_section(args.docs_dir / "benchmarks.md", "spec", body)


if __name__ == "__main__":
    main()
