"""What a user feels on the first requests to a worker, on the embedded SmolLM2 (bf16, CPU).

1. Repeated prefix: a fresh `LLM` (own process), then 10 calls with the same ~1.5k-token prefix and a new
   question each (greedy, 8 tokens): wall time per call. Target: calls 2-5 each <= 1.2 x call 10 (one-time work,
   such as a background tokenizer load, would land on calls 2-5).
2. First job: a fresh emulator per run (`python -m handler.local`), and its first job, streamed through the
   OpenAI routes with the `openai` client: a chat job, or a completions job whose prompt is that chat's rendered
   text (the same tokens). Time from send to the first content event; runs alternate, 3 of each. Target: the
   chat job within 0.1 s of the prompt job.
3. Where the time to first token goes: the emulator and the worker run under bench/_trace.py, which stamps the
   job at each hand-over (same clock). 12 streamed chat jobs at low load (one at a time, 16 tokens), after a
   warm-up job, on two emulators side by side, interleaved: our worker loop, and the runpod SDK's own
   JobScaler.run (which looks at its job queue every 100 ms). Medians per stage.

Usage: python -m bench.latency [--write-docs]     (~3 min on 2 cores)
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from bench.procs import REPO, Emulator, emulator_env

PREFIX = "You are a careful assistant for a lighthouse keepers' guild. " + " ".join(
    f"Rule {i}: log the lamp, the weather and every ship seen at hour {i % 24}." for i in range(100)
)
CHAT = [{"role": "user", "content": "Write a haiku about GPUs."}]
STAGES = [  # (label, from event, to event, what happens there, whose code)
    ("client -> emulator route", "send", "submit", "HTTP request, job record", "emulator"),
    ("emulator -> job-take answer", "submit", "taken", "the worker's held job-take returns the job", "emulator"),
    ("job-take answer -> SDK", "taken", "sdk_got", "HTTP response, JSON", "runpod SDK"),
    ("SDK -> handler", "sdk_got", "handler_start", "job queue, task start", "runpod SDK loop (ours: Scaler)"),
    ("handler: validate, chat template, tokenize", "handler_start", "engine_submit", "", "ours"),
    ("engine: queue, prefill, first token", "engine_submit", "engine_first", "", "ours"),
    ("first token -> yield", "engine_first", "handler_yield", "pacing, SSE text", "ours"),
    ("yield -> emulator has the chunk", "handler_yield", "post_in", "the SDK's job-stream POST", "runpod SDK"),
    ("emulator -> client sees it", "post_in", "first", "SSE write, client parse", "emulator, client"),
]
now = time.perf_counter


def repeat_prefix_child() -> None:
    from engine import LLM, SamplingParams

    llm = LLM(log_stats_interval=0, dtype="bfloat16")
    sp = SamplingParams(temperature=0, max_tokens=8)
    times = []
    for i in range(10):
        t = now()
        llm.generate([f"{PREFIX}\nQuestion {i}: what is {i} plus {i + 7}?"], sp)
        times.append(now() - t)
    print(
        json.dumps(
            {
                "times": times,
                "prefix_tokens": len(llm.engine.tokenize(PREFIX)),
                "transformers_imported": "transformers" in sys.modules,
            }
        )
    )


def repeat_prefix() -> dict:
    r = subprocess.run(
        [sys.executable, "-m", "bench.latency", "--child"],
        cwd=REPO,
        capture_output=True,
        text=True,
        check=True,
        env={**os.environ, "HF_HUB_OFFLINE": "1"},
    )
    return json.loads(r.stdout.strip().splitlines()[-1])


def first_job(kind: str) -> float:
    from openai import OpenAI

    prompt = _rendered_chat() if kind == "prompt" else None  # before the clock (it loads a tokenizer here)
    with Emulator(emulator_env(DTYPE="bfloat16")) as emu:
        client = OpenAI(base_url=emu.base_url, api_key="local", max_retries=0)
        kw = dict(model="SmolLM2-135M-Instruct", max_tokens=16, temperature=0, stream=True)
        t = now()
        if kind == "chat":
            stream = client.chat.completions.create(messages=CHAT, **kw)
            texts = (c.choices[0].delta.content for c in stream if c.choices)
        else:
            stream = client.completions.create(prompt=prompt, **kw)
            texts = (c.choices[0].text for c in stream if c.choices)
        ttft = next(now() - t for text in texts if text)
        stream.close()
    return ttft


def _rendered_chat() -> str:
    from bench._common import default_model_path
    from engine.tokenizer import Tokenizer

    return Tokenizer(default_model_path()).apply_chat_template(CHAT)


def breakdown(jobs: int) -> dict[str, dict[str, float]]:
    """Median ms per stage, for our worker loop and for the SDK's."""
    import httpx
    from openai import OpenAI

    trace = Path(tempfile.mkdtemp()) / "trace.jsonl"
    argv = ["-m", "bench._trace", "emulator", "--worker-cmd", f"{sys.executable} -m bench._trace worker"]
    client_events: list[tuple[str, str, float]] = []
    with (
        Emulator(emulator_env(DTYPE="bfloat16", TRACE_FILE=str(trace)), argv=argv) as ours,
        Emulator(emulator_env(DTYPE="bfloat16", TRACE_FILE=str(trace), TRACE_SDK_LOOP="original"), argv=argv) as sdk,
    ):
        configs = {"ours": ours, "runpod SDK loop": sdk}
        job_config: dict[str, str] = {}
        for i in range(jobs + 1):
            for name, emu in configs.items():
                client = OpenAI(base_url=emu.base_url, api_key="local", max_retries=0)
                t = time.time()
                stream = client.chat.completions.create(
                    model="SmolLM2-135M-Instruct",
                    max_tokens=16,
                    temperature=0,
                    stream=True,
                    messages=[{"role": "user", "content": f"Write haiku number {i} about GPUs."}],
                )
                jid = stream.response.headers["x-job-id"]
                first = next(time.time() for c in stream if c.choices and c.choices[0].delta.content)
                for _ in stream:
                    pass
                if i:  # the first job of each emulator is the warm-up
                    client_events += [("send", jid, t), ("first", jid, first)]
                    job_config[jid] = name
                time.sleep(0.3)
        httpx.get(f"{ours.api}/health")  # both still up: every event is written
    events: dict[str, dict[str, float]] = {}
    for ev, jid, ts in [tuple(json.loads(line)) for line in trace.read_text().splitlines()] + client_events:
        events.setdefault(jid, {}).setdefault(ev, ts)  # the first of each (post_in: the first chunk)
    out: dict[str, dict[str, list[float]]] = {name: {} for name in configs}
    for jid, name in job_config.items():
        e = events[jid]
        for label, a, b, _, _ in STAGES:
            out[name].setdefault(label, []).append(1000 * (e[b] - e[a]))
        out[name].setdefault("total", []).append(1000 * (e["first"] - e["send"]))
    return {name: {k: statistics.median(v) for k, v in stages.items()} for name, stages in out.items()}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    ap.add_argument("--runs", type=int, default=3, help="first-job launches of each kind (3)")
    ap.add_argument("--jobs", type=int, default=12, help="traced jobs per config (12)")
    ap.add_argument("--write-docs", action="store_true")
    args = ap.parse_args()
    if args.child:
        return repeat_prefix_child()
    os.environ["HF_HUB_OFFLINE"] = "1"
    t_all, load = now(), os.getloadavg()[0]

    rp = repeat_prefix()
    tenth = rp["times"][9]
    print("repeated prefix (s):", " ".join(f"{t:.3f}" for t in rp["times"]), flush=True)

    firsts = {"chat": [], "prompt": []}
    for _ in range(args.runs):
        for kind in firsts:
            firsts[kind].append(first_job(kind))
            print(f"first {kind} job TTFT {firsts[kind][-1]:.3f} s", flush=True)
    med = {k: statistics.median(v) for k, v in firsts.items()}

    bd = breakdown(args.jobs)
    print(json.dumps(bd, indent=1), flush=True)

    from bench._common import machine_line, write_section

    rows = ["| call | s | ÷ call 10 |", "|---:|---:|---:|"]
    rows += [f"| {i + 1} | {t:.3f} | {t / tenth:.2f} |" for i, t in enumerate(rp["times"])]
    worst = max(t / tenth for t in rp["times"][1:5])
    fj = ["| first job | TTFT s, median | each run s |", "|---|---:|---:|"]
    fj += [f"| {k} | {med[k]:.3f} | {', '.join(f'{x:.3f}' for x in v)} |" for k, v in firsts.items()]
    names = list(bd)
    br = [
        "| stage | what | whose code | " + " | ".join(f"{n} ms" for n in names) + " |",
        "|---|---|---|" + "---:|" * len(names),
    ]
    br += [
        f"| {label} | {what} | {whose} | " + " | ".join(f"{bd[n][label]:.1f}" for n in names) + " |"
        for label, _, _, what, whose in STAGES
    ]
    br.append(
        "| **total: send -> first content event** | | | "
        + " | ".join(f"**{bd[n]['total']:.1f}**" for n in names)
        + " |"
    )
    md = "\n".join(
        [
            "## Latency: the first requests and the path to the first token",
            "",
            f"`python -m bench.latency` on {time.strftime('%Y-%m-%d')}: {machine_line('cpu')}; load average {load:.2f} "
            "at start. SmolLM2-135M-Instruct, bfloat16, CPU. Method: the docstring of `bench/latency.py`.",
            "",
            f"Repeated {rp['prefix_tokens']}-token prefix in a fresh `LLM` (the first call computes the prefix; the "
            f"rest hit the prefix cache). Calls 2-5 at most {worst:.2f} x call 10 (target 1.2); transformers imported: "
            f"{rp['transformers_imported']}.",
            "",
            *rows,
            "",
            f"First job of a fresh worker, streamed through the OpenAI routes: chat {med['chat']:.3f} s vs prompt "
            f"{med['prompt']:.3f} s to the first token, a difference of {med['chat'] - med['prompt']:+.3f} s "
            "(target: within 0.1 s).",
            "",
            *fj,
            "",
            f"Where the time to first token goes, medians of {args.jobs} streamed chat jobs at low load (16 tokens, "
            'one at a time). "ours": the worker as shipped; "runpod SDK loop": the same worker with the SDK\'s '
            "own JobScaler.run, whose run_jobs looks at its queue every 100 ms.",
            "",
            *br,
            "",
        ]
    )
    print("\n" + md + f"\n(total {now() - t_all:.0f} s)")
    if args.write_docs:
        write_section(REPO / "docs" / "benchmarks.md", "latency", md)
        print("wrote docs/benchmarks.md")


if __name__ == "__main__":
    main()
