"""The load-balancing endpoint mode against the queue path, one run, the same workload; and what pinning buys.

Everything runs the embedded default model (SmolLM2-135M-Instruct) with DTYPE=bfloat16 and HF_HUB_OFFLINE=1 on CPU.

1. Streams: two servers on the same settings (MAX_CONCURRENCY=16): the queue path, `python -m handler.local`
   (the emulator: Runpod's API in front, the worker taking jobs through runpod's real worker loop, each yield one
   POST), and one load-balancing worker, `RUNPOD_ENDPOINT_TYPE=lb python -m handler` (its own HTTP server). The
   `openai` client streams chat completions (a short user message, max_tokens --tokens, ignore_eos, greedy) at 1,
   4 and 16 at once. Per request: TTFT = send -> first content event; ITL = the mean gap between its content
   events. Per level: throughput = output tokens / (last token - first send). Rounds alternate between the two
   servers (queue, lb, queue, lb, ...), --rounds per level, so both see the same machine; medians over all
   requests of a level; ratios are lb / queue.
2. Pinning: on the load-balancing worker, a conversation with a ~2k-token system prompt, --turns turns (each turn
   appends the previous reply and a new question). Each turn is sent twice: "pinned", the conversation itself,
   whose earlier turns this worker served, so its prefix cache holds them (what `X-Runpod-Worker-Id: strict <id>`
   buys: the router sends it back here); and "cold", the same conversation with one different character at the
   start of the system prompt, never seen before, as on a worker that never served it. TTFT of each, non-streamed
   usage's cached_tokens of the pinned one.

Usage: python -m bench.lb [--rounds 2] [--tokens 48] [--turns 4] [--write-docs]
"""

from __future__ import annotations

import argparse
import asyncio
import os
import statistics
import sys
import time

from bench.procs import REPO, Emulator, LBWorker, emulator_env

LEVELS = (1, 4, 16)
now = time.perf_counter
med = statistics.median


async def one_stream(client, model: str, tokens: int, i: int) -> dict:
    t0 = now()
    stamps = []
    stream = await client.chat.completions.create(
        model=model,
        messages=[{"role": "user", "content": f"Tell me a long story about the number {i}."}],
        max_tokens=tokens,
        temperature=0,
        stream=True,
        extra_body={"ignore_eos": True},
        stream_options={"include_usage": True},
    )
    n = 0
    async for chunk in stream:
        if chunk.choices and chunk.choices[0].delta.content:
            stamps.append(now())
        if chunk.usage:
            n = chunk.usage.completion_tokens
    gaps = [b - a for a, b in zip(stamps, stamps[1:])]
    return {"t0": t0, "ttft": stamps[0] - t0, "itl": sum(gaps) / len(gaps) if gaps else float("nan"),
            "end": stamps[-1], "tokens": n}  # fmt: skip


async def level(base_url: str, model: str, c: int, tokens: int) -> list[dict]:
    from openai import AsyncOpenAI

    async with AsyncOpenAI(base_url=base_url, api_key="local", max_retries=0, timeout=300) as client:
        return await asyncio.gather(*(one_stream(client, model, tokens, i) for i in range(c)))


def pinning(w: LBWorker, model: str, turns: int) -> list[dict]:
    from openai import OpenAI

    client = OpenAI(base_url=w.base_url, api_key="local", max_retries=0, timeout=300)
    system = " ".join(f"Rule {i}: answer politely and mention the colour of item {i}." for i in range(160))
    convo = [{"role": "system", "content": system}]
    rows = []
    for turn in range(1, turns + 1):
        convo.append({"role": "user", "content": f"Question {turn}: what is {turn} plus {turn}?"})
        out = {}
        for name, messages in (("pinned", convo), ("cold", [{"role": "system", "content": f"#{turn} " + system}]
                                                            + convo[1:])):  # fmt: skip
            t = now()
            r = client.chat.completions.create(model=model, messages=messages, max_tokens=1, temperature=0)
            out[name] = now() - t
            out[f"{name} cached"] = r.usage.prompt_tokens_details.cached_tokens
            out["prompt"] = r.usage.prompt_tokens
        reply = client.chat.completions.create(model=model, messages=convo, max_tokens=24, temperature=0)
        convo.append({"role": "assistant", "content": reply.choices[0].message.content})
        rows.append(out | {"turn": turn})
        print(f"  turn {turn}: " + ", ".join(f"{k} {v:.3f}" if isinstance(v, float) else f"{k} {v}"
                                            for k, v in out.items()), flush=True)  # fmt: skip
    return rows


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--tokens", type=int, default=48)
    ap.add_argument("--turns", type=int, default=4)
    ap.add_argument("--write-docs", action="store_true")
    args = ap.parse_args()
    t_all, load = now(), os.getloadavg()[0]
    env = emulator_env(DTYPE="bfloat16", MAX_CONCURRENCY="16", LB_MAX_WAITING="16", MAX_MODEL_LEN="4096")
    res = {(kind, c): [] for kind in ("queue", "lb") for c in LEVELS}
    with Emulator(env) as emu, LBWorker(env) as lb:
        urls = {"queue": emu.base_url, "lb": lb.base_url}
        from openai import OpenAI

        model = OpenAI(base_url=lb.base_url, api_key="local").models.list().data[0].id
        for url in urls.values():  # warm-up: each server's first request
            asyncio.run(level(url, model, 1, 4))
        for c in LEVELS:
            for r in range(args.rounds):
                for kind, url in urls.items():
                    got = asyncio.run(level(url, model, c, args.tokens))
                    assert all(x["tokens"] == args.tokens for x in got), [x["tokens"] for x in got]
                    res[(kind, c)].append(got)
                    tput = sum(x["tokens"] for x in got) / (max(x["end"] for x in got) - min(x["t0"] for x in got))
                    print(f"  {kind} x{c} round {r}: TTFT {med(x['ttft'] for x in got) * 1e3:.0f} ms, "
                          f"{tput:.1f} tok/s", flush=True)  # fmt: skip
        pins = pinning(lb, model, args.turns)

    def stats(kind, c):
        runs = res[(kind, c)]
        reqs = [x for run in runs for x in run]
        tput = med(sum(x["tokens"] for x in run) / (max(x["end"] for x in run) - min(x["t0"] for x in run))
                   for run in runs)  # fmt: skip
        return med(x["ttft"] for x in reqs), med(x["itl"] for x in reqs), tput

    from bench._common import machine_line, write_section

    cmd = ("python -m bench.lb " + " ".join(sys.argv[1:])).replace(" --write-docs", "").strip()
    lines = [
        "## Load-balancing endpoint vs the queue path",
        "",
        f"`{cmd}` on {time.strftime('%Y-%m-%d')}: {machine_line('cpu')}; load average {load:.2f} at start. "
        f"SmolLM2-135M-Instruct, bfloat16, CPU; streamed chat completions of {args.tokens} tokens (ignore_eos, "
        f"greedy) through the `openai` client; {args.rounds} rounds per level, alternating servers. Method: the "
        "docstring of `bench/lb.py`.",
        "",
        "| streams at once | TTFT queue ms | TTFT lb ms | lb ÷ queue | ITL queue ms | ITL lb ms | lb ÷ queue | "
        "tok/s queue | tok/s lb | lb ÷ queue |",
        "|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|",
    ]
    rows = {}
    for c in LEVELS:
        (tq, iq, pq), (tl, il, pl) = stats("queue", c), stats("lb", c)
        rows[c] = (tq, tl, iq, il, pq, pl)
        lines.append(f"| {c} | {tq * 1e3:.0f} | {tl * 1e3:.0f} | {tl / tq:.2f}x | {iq * 1e3:.1f} | {il * 1e3:.1f} | "
                     f"{il / iq:.2f}x | {pq:.1f} | {pl:.1f} | {pl / pq:.2f}x |")  # fmt: skip
    lines += [
        "",
        f"Pinning, on the load-balancing worker: a conversation whose system prompt is {pins[0]['prompt']} tokens, "
        "one request of 1 token per turn, TTFT (the whole request) with this worker's prefix cache holding the "
        "earlier turns (pinned) and without (cold: the same conversation, one character different at its start).",
        "",
        "| turn | prompt tokens | pinned ms | cached tokens | cold ms | cold ÷ pinned |",
        "|---:|---:|---:|---:|---:|---:|",
    ]
    for p in pins:
        lines.append(f"| {p['turn']} | {p['prompt']} | {p['pinned'] * 1e3:.0f} | {p['pinned cached']} | "
                     f"{p['cold'] * 1e3:.0f} | {p['cold'] / p['pinned']:.2f}x |")  # fmt: skip
    lines += ["", "![Load-balancing endpoint vs the queue path](lb.png)"]
    md = "\n".join(lines)
    print("\n" + md + f"\n\n(total {now() - t_all:.0f} s)")
    if args.write_docs:
        write_section(REPO / "docs" / "benchmarks.md", "lb", md)
        plot(rows, pins, REPO / "docs" / "lb.png")


def plot(rows: dict, pins: list[dict], png) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (a, b, p) = plt.subplots(1, 3, figsize=(11, 3))
    xs = list(rows)
    for ax, (iq, il), label in ((a, (0, 1), "TTFT ms"), (b, (4, 5), "output tok/s")):
        scale = 1e3 if label.startswith("TTFT") else 1
        ax.plot(xs, [rows[c][iq] * scale for c in xs], "o-", label="queue (emulator)")
        ax.plot(xs, [rows[c][il] * scale for c in xs], "s-", label="load-balancing")
        ax.set_xscale("log", base=2)
        ax.set_xticks(xs, [str(c) for c in xs])
        ax.set_xlabel("streams at once")
        ax.set_ylabel(label)
        ax.legend()
    turns = [x["turn"] for x in pins]
    p.bar([t - 0.2 for t in turns], [x["pinned"] * 1e3 for x in pins], 0.4, label="pinned")
    p.bar([t + 0.2 for t in turns], [x["cold"] * 1e3 for x in pins], 0.4, label="cold")
    p.set_xlabel("turn")
    p.set_ylabel("TTFT ms")
    p.legend()
    fig.suptitle("SmolLM2-135M bf16 on CPU")
    fig.tight_layout()
    fig.savefig(png, dpi=120)


if __name__ == "__main__":
    main()
