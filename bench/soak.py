"""Soak: a long run through the emulator at ~70 % of the saturating request rate, with random cancels and client
hang-ups, watching the worker's memory and the engine's KV pool. Not part of the test suite.

1. Capacity: 24 native jobs submitted at once (the soak's length mix); saturating rate = completed / elapsed.
2. Soak for --minutes at --load x that rate, Poisson arrivals, each request one of:
   - a native job (POST /run, then GET /stream/{id} until done), prompt 16-256 words, max_tokens 16-128,
     ignore_eos, streamed; 10 % are cancelled (POST /cancel/{id}) at a random moment while running;
   - an OpenAI completions stream (the `openai` client); 10 % hang up (close the stream) after a few events.
3. Every 10 s: the worker's RSS (/proc/<pid>/status VmRSS). At the end, once idle: the worker's last
   "KV blocks free F/T" log line.
Checks: RSS after minute 2, less what the KV pool's open region grew since minute 2, never above 1.05 x its value
at minute 2; all KV blocks free at the end; every job that completed produced exactly its max_tokens; no request
failed. The region is left out because it grows by design with the running peak of concurrent requests (engine/
block_manager.py), up to the pool the planner sized, so it can grow whenever a new peak comes; the table shows the
raw RSS growth beside it. What the rule catches is the rest: a leak, a cache without a bound, the heap's creep.

Usage: python -m bench.soak [--minutes 10] [--load 0.7] [--hang-ups 0.1] [--kv-cache-memory BYTES] [--write-docs]
"""

from __future__ import annotations

import argparse
import asyncio
import os
import random
import re
import sys
import time
from pathlib import Path

import httpx

from bench.procs import REPO, Emulator, emulator_env
from bench.serve import WORDS

now = time.monotonic


def words(rng: random.Random, n: int) -> str:
    return " ".join(rng.choice(WORDS) for _ in range(n))


class Soak:
    def __init__(self, emu: Emulator, seed: int, hang_ups: float = 0.1):
        self.emu, self.rng, self.hang_ups = emu, random.Random(seed), hang_ups
        self.http = httpx.AsyncClient(base_url=emu.api, timeout=120)
        self.counts = {"completed": 0, "cancelled": 0, "hung up": 0, "failed": 0, "wrong length": 0}
        self.errors: list[str] = []

    async def native(self, cancel: bool) -> None:
        mt = self.rng.randint(16, 128)
        job = {
            "input": {
                "prompt": words(self.rng, self.rng.randint(16, 256)),
                "stream": True,
                "sampling_params": {"temperature": 0, "max_tokens": mt, "ignore_eos": True},
            }
        }
        jid = (await self.http.post("/run", json=job)).json()["id"]
        cancel_after = now() + self.rng.uniform(0.5, 5) if cancel else None
        out = 0
        while True:
            st = (await self.http.get(f"/stream/{jid}")).json()
            for c in st.get("stream", []):
                out = c["output"]["usage"]["output"]
            if st["status"] in ("COMPLETED", "FAILED", "CANCELLED"):
                break
            if cancel_after is not None and now() > cancel_after:
                await self.http.post(f"/cancel/{jid}")
                self.counts["cancelled"] += 1
                return
        self._done(st["status"], out, mt, st.get("error"))

    async def openai(self, client, hang_up: bool) -> None:
        mt = self.rng.randint(16, 128)
        stream = await client.completions.create(
            model="SmolLM2-135M-Instruct",
            prompt=words(self.rng, self.rng.randint(16, 256)),
            max_tokens=mt,
            temperature=0,
            stream=True,
            stream_options={"include_usage": True},
            extra_body={"ignore_eos": True},
        )
        events, out = 0, 0
        async for ch in stream:
            events += 1
            if ch.usage:
                out = ch.usage.completion_tokens
            if hang_up and events >= 3:
                await stream.close()
                self.counts["hung up"] += 1
                return
        self._done("COMPLETED", out, mt, None)

    def _done(self, status: str, out: int, want: int, error) -> None:
        if status != "COMPLETED":
            self.counts["failed"] += 1
            self.errors.append(f"{status}: {error}")
        elif out != want:
            self.counts["wrong length"] += 1
            self.errors.append(f"{out} tokens, max_tokens {want}")
        else:
            self.counts["completed"] += 1

    async def one(self, client) -> None:
        try:
            if self.rng.random() < 0.5:
                await self.native(cancel=self.rng.random() < self.hang_ups)
            else:
                await self.openai(client, hang_up=self.rng.random() < self.hang_ups)
        except Exception as e:  # noqa: BLE001 - counted and reported
            self.counts["failed"] += 1
            self.errors.append(f"{type(e).__name__}: {e}"[:200])


async def capacity(emu: Emulator, n: int = 24) -> float:
    soak = Soak(emu, seed=1)
    t = now()
    await asyncio.gather(*(soak.native(cancel=False) for _ in range(n)))
    return soak.counts["completed"] / (now() - t)


def rss_mb(pid: int) -> float:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) / 1024
    return float("nan")


async def soak(emu: Emulator, rate: float, minutes: float, seed: int, hang_ups: float) -> tuple[Soak, list[tuple]]:
    from openai import AsyncOpenAI

    client = AsyncOpenAI(base_url=emu.base_url, api_key="local", max_retries=0, timeout=300)
    pid = (await httpx.AsyncClient().get(f"{emu.api}/health")).json()["localWorker"]["pid"]
    s, rng, tasks, samples = Soak(emu, seed, hang_ups), random.Random(seed + 1), [], []
    t0 = now()
    next_sample = t0
    while (t := now()) - t0 < minutes * 60:
        if t >= next_sample:
            samples.append(((t - t0) / 60, rss_mb(pid), kv_open_mb(emu), breakdown(emu)))
            next_sample += 10
        tasks.append(asyncio.create_task(s.one(client)))
        await asyncio.sleep(rng.expovariate(rate))
    await asyncio.gather(*tasks)
    samples.append(((now() - t0) / 60, rss_mb(pid), kv_open_mb(emu), breakdown(emu)))
    await client.close()
    return s, samples


def kv_open_mb(emu: Emulator) -> float:
    """The KV pool's open region (engine/block_manager.py) as of the worker's last status line, in MB: its blocks
    times the bytes per block its start-up line gives."""
    text = "\n".join(emu.lines)
    per_token, opened = re.findall(r"(\d+) B/token", text), re.findall(r"\((\d+) blocks open\)", text)
    return int(opened[-1]) * 16 * int(per_token[0]) / 2**20 if per_token and opened else float("nan")


MEMORY = re.compile(
    r"memory: anon (\d+) MiB, file (\d+) MiB(?:, heap (\d+) MiB used (\d+) free (\d+) mmapped)?, python blocks (\d+)"
)
PARTS = ("anon MiB", "file MiB", "heap used MiB", "heap free MiB", "heap mmapped MiB", "python blocks")


def breakdown(emu: Emulator) -> dict[str, float]:
    """The worker's own account of its memory in its last status line (engine/host_memory.py memory_breakdown)."""
    found = MEMORY.findall("\n".join(emu.lines[-200:]))
    return {k: float(v or "nan") for k, v in zip(PARTS, found[-1])} if found else {}


def breakdown_table(samples) -> str:
    """One row a minute: RSS, the KV region, and the worker's breakdown (what grew shows in its column)."""
    rows, seen = [], set()
    for m, mb, kv, parts in samples:
        if int(m) in seen or not parts:
            continue
        seen.add(int(m))
        rows.append(f"| {m:.1f} | {mb:.0f} | {kv:.0f} | " + " | ".join(f"{parts[k]:.0f}" for k in PARTS) + " |")
    head = "| minute | RSS MB | KV region MB | " + " | ".join(PARTS) + " |"
    return "\n".join([head, "|" + "---:|" * (3 + len(PARTS)), *rows])


def heap_trims(emu: Emulator) -> str:
    """The worker's last word on giving its heap back (engine/async_engine.py's status line)."""
    found = re.findall(r"heap given back (\d+) times \(([\d.]+) MB in ([\d.]+) ms on average\)", "\n".join(emu.lines))
    if not found:
        return "The worker's status lines report no heap trim."
    n, mb, ms = found[-1]
    return f"The engine loop gave the heap back (malloc_trim) {n} times: {mb} MB in {ms} ms on average."


def kv_at_end(emu: Emulator) -> tuple[int, int]:
    found = re.findall(r"KV blocks free (\d+)/(\d+)", "\n".join(emu.lines))
    return tuple(map(int, found[-1])) if found else (-1, -1)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--minutes", type=float, default=10)
    ap.add_argument("--load", type=float, default=0.7, help="fraction of the saturating rate (0.7)")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--hang-ups", type=float, default=0.1, help="fraction of jobs cancelled and streams hung up (0.1)")
    ap.add_argument("--kv-cache-memory", default=None, help="the worker's KV_CACHE_MEMORY (default: automatic)")
    ap.add_argument("--write-docs", action="store_true")
    args = ap.parse_args()
    t_all, load = time.perf_counter(), os.getloadavg()[0]
    kv = {"KV_CACHE_MEMORY": args.kv_cache_memory} if args.kv_cache_memory else {}
    with Emulator(emulator_env(DTYPE="bfloat16", **kv)) as emu:
        sat = asyncio.run(capacity(emu))
        rate = args.load * sat
        print(f"saturating rate {sat:.2f} req/s: soaking at {rate:.2f} req/s for {args.minutes:g} min", flush=True)
        s, samples = asyncio.run(soak(emu, rate, args.minutes, args.seed, args.hang_ups))
        time.sleep(2)  # the last job-end log lines
        free, total = kv_at_end(emu)
        trims = heap_trims(emu)
    at2, kv2 = next(((mb, kv) for m, mb, kv, _ in samples if m >= 2), samples[-1][1:3])
    after = [mb for m, mb, _, _ in samples if m >= 2]
    kv_after = max(kv for m, _, kv, _ in samples if m >= 2) if after else float("nan")
    growth = max(after) / at2 - 1 if after else float("nan")
    rest = [mb - (kv - kv2) for m, mb, kv, _ in samples if m >= 2]  # RSS less the region's growth since minute 2
    growth_rest = max(rest) / at2 - 1 if rest else float("nan")
    ok = growth_rest <= 0.05 and free == total and not s.counts["failed"] and not s.counts["wrong length"]
    print(
        f"counts {s.counts}; RSS at 2 min {at2:.0f} MB, max after {max(after):.0f} MB ({growth:+.1%}; "
        f"{growth_rest:+.1%} without the KV region's growth); "
        f"KV free {free}/{total}; errors {s.errors[:5]}"
    )
    from bench._common import machine_line, write_section

    md = "\n".join(
        [
            "## Soak: 70 % load with cancels and hang-ups",
            "",
            f"`python -m bench.soak --minutes {args.minutes:g} --load {args.load:g} --hang-ups {args.hang_ups:g}"
            + (f" --kv-cache-memory {args.kv_cache_memory}" if args.kv_cache_memory else "")
            + f"` on {time.strftime('%Y-%m-%d')}: "
            f"{machine_line('cpu')}; load average {load:.2f} at start. The local emulator, SmolLM2-135M-Instruct, "
            "bfloat16, CPU. Method: the docstring of `bench/soak.py`.",
            "",
            "| saturating rate req/s | soak rate req/s | completed | cancelled | hung up | failed | wrong length | "
            "worker RSS at 2 min MB | max after MB | growth | growth less the KV region's | "
            "KV blocks free at the end | verdict |",
            "|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---|",
            f"| {sat:.2f} | {rate:.2f} | {s.counts['completed']} | {s.counts['cancelled']} | {s.counts['hung up']} | "
            f"{s.counts['failed']} | {s.counts['wrong length']} | {at2:.0f} | {max(after):.0f} | {growth:+.1%} | "
            f"{growth_rest:+.1%} | "
            f"{free} / {total} | {'pass' if ok else '**fail**'} |",
            "",
            "Worker RSS (MB) by minute: " + ", ".join(f"{m:.1f}: {mb:.0f}" for m, mb, _, _ in samples[::3]),
            "",
            "Of which the KV pool's open region (MB, from the worker's status lines, 16-token blocks): "
            + ", ".join(f"{m:.1f}: {kv:.0f}" for m, _, kv, _ in samples[::3])
            + f"; after minute 2 it grew by {kv_after - kv2:+.0f} MB of the RSS's {max(after) - at2:+.0f} MB.",
            "",
            "Where the memory is, a row a minute (the worker's status line: engine/host_memory.py memory_breakdown; "
            "RSS = anon + file; the heap's used and free bytes are glibc malloc's, inside anon):",
            "",
            breakdown_table(samples),
            "",
            trims,
            "",
        ]
    )
    print(md + f"\n(total {time.perf_counter() - t_all:.0f} s)")
    if args.write_docs:
        write_section(REPO / "docs" / "benchmarks.md", "soak", md)
    sys.exit(0 if ok else 1)


if __name__ == "__main__":
    main()
