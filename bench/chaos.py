"""Chaos: the local emulator with fault injection on, mixed traffic for --minutes, every runtime fault of
docs/decisions.md "Faults" at random. Reports requests served, failed with a clear error, and lost (must be 0).

The emulator runs the worker through `python -m bench.chaos --worker` (`--restart-worker`): each worker it spawns
draws its own FAULT_INJECTION plan (seeded by --seed and the spawn's number), two `oom`, two `nan` and one `hang`
or `kill` that ends it, at random steps; the emulator fails what a dead worker held and starts the next, as the
platform would. `STEP_TIMEOUT_S` is 3 s, so a hang is noticed quickly. With --plans "P1;P2;...", spawn i takes
P(i mod n) instead (the test's fixed run).

Traffic, Poisson at --rate requests/s, each one of: a native streamed job (POST /run, GET /stream/{id}); a native job
asking for prompt logprobs; an OpenAI chat stream (the `openai` client); an OpenAI completion with n = 2. Greedy,
ignore_eos, 8-48 tokens. Each ends as:
- served: completed with exactly its max_tokens (every choice);
- failed with a clear error: an error whose message says why (a hung step, a killed worker, NaN logits, out of
  memory, the worker restarting);
- lost: anything else: no answer 120 s after the traffic stopped, a completion of the wrong length, an error that
  does not say why.

Usage: python -m bench.chaos [--minutes 3] [--rate 1.5] [--seed 0] [--plans P1;P2] [--log FILE] [--write-docs]"""

from __future__ import annotations

import argparse
import asyncio
import os
import random
import re
import sys
import time
from collections import Counter
from pathlib import Path

import httpx

from bench.procs import REPO, Emulator, emulator_env
from bench.serve import WORDS

CLEAR = (
    "STEP_TIMEOUT_S",  # a hung step
    "exited with code",  # a killed worker (the emulator's word for what the platform does)
    "NaN or infinite logits",
    "did not fit in device memory",
    "the worker could not serve",  # a job that reached a faulted worker before it left
    "engine step failed",
    "not running",
)
SPAWNS = "CHAOS_SPAWNS"  # a file whose size counts the workers spawned so far


def plan_for(spawn: int, seed: int, plans: list[str]) -> str:
    """The FAULT_INJECTION of the spawn-th worker."""
    if plans:
        return plans[spawn % len(plans)]
    rng = random.Random(seed * 1000 + spawn)
    end = rng.randint(150, 900)
    steps = sorted(rng.sample(range(5, end), 4))
    kinds = ["oom", "nan", "oom", "nan"]
    return ",".join([f"{k}@{s}" for k, s in zip(kinds, steps)] + [f"{rng.choice(['hang', 'kill'])}@{end}"])


def worker(seed: int, plans: list[str]) -> None:
    """The emulator's worker command: this spawn's plan, then `python -m handler` in this process's place."""
    counter = Path(os.environ[SPAWNS])
    with counter.open("ab") as f:
        f.write(b".")
    spawn = counter.stat().st_size - 1
    plan = plan_for(spawn, seed, plans)
    print(f"chaos: worker {spawn} FAULT_INJECTION={plan}", file=sys.stderr, flush=True)
    os.environ.update(FAULT_INJECTION=plan, STEP_TIMEOUT_S="3")
    os.execv(sys.executable, [sys.executable, "-m", "handler"])


class Traffic:
    def __init__(self, emu: Emulator, seed: int):
        self.emu, self.rng = emu, random.Random(seed)
        self.http = httpx.AsyncClient(base_url=emu.api, timeout=300)
        self.outcomes: Counter = Counter()
        self.kinds: Counter = Counter()
        self.lost: list[str] = []

    def _end(self, kind: str, ok: bool | None, why: str = "") -> None:
        """ok: True served, False failed (clear if `why` says why), None lost."""
        self.kinds[kind] += 1
        if ok:
            self.outcomes["served"] += 1
        elif ok is False and any(c in why for c in CLEAR):
            self.outcomes["failed, clear error"] += 1
            self.outcomes[f"  {next(c for c in CLEAR if c in why)}"] += 1
        else:
            self.outcomes["lost"] += 1
            self.lost.append(f"{kind}: {why}"[:300])

    async def native(self, prompt_logprobs: bool) -> None:
        kind = "native, prompt logprobs" if prompt_logprobs else "native stream"
        mt = self.rng.randint(8, 48)
        sp = {"temperature": 0, "max_tokens": mt, "ignore_eos": True} | (
            {"prompt_logprobs": 1} if prompt_logprobs else {}
        )
        job = {"input": {"prompt": words(self.rng), "stream": True, "sampling_params": sp}}
        jid = (await self.http.post("/run", json=job)).json()["id"]
        out, deadline = 0, time.monotonic() + 600
        while time.monotonic() < deadline:
            st = (await self.http.get(f"/stream/{jid}")).json()
            for c in st.get("stream", []):
                out = c["output"].get("usage", {}).get("output", out) if isinstance(c.get("output"), dict) else out
            if st["status"] == "COMPLETED":
                return self._end(kind, True if out == mt else None, f"{out} tokens of {mt}")
            if st["status"] in ("FAILED", "CANCELLED"):
                return self._end(kind, False, str(st.get("error")))
        self._end(kind, None, f"job {jid} never ended")

    async def chat(self, client) -> None:
        mt = self.rng.randint(8, 48)
        try:
            stream = await client.chat.completions.create(
                model="SmolLM2-135M-Instruct", messages=[{"role": "user", "content": words(self.rng)}],
                max_tokens=mt, temperature=0, stream=True, stream_options={"include_usage": True},
                extra_body={"ignore_eos": True},
            )  # fmt: skip
            out = 0
            async for ch in stream:
                if ch.usage:
                    out = ch.usage.completion_tokens
            self._end("OpenAI chat stream", True if out == mt else None, f"{out} tokens of {mt}")
        except Exception as e:  # noqa: BLE001 - the client's error is the outcome
            self._end("OpenAI chat stream", False, f"{type(e).__name__}: {e}")

    async def completion_n2(self, client) -> None:
        mt = self.rng.randint(8, 48)
        try:
            r = await client.completions.create(
                model="SmolLM2-135M-Instruct", prompt=words(self.rng), max_tokens=mt, temperature=0, n=2,
                extra_body={"ignore_eos": True},
            )  # fmt: skip
            ok = r.usage.completion_tokens == 2 * mt
            self._end("OpenAI completion, n=2", True if ok else None, f"{r.usage.completion_tokens} of {2 * mt}")
        except Exception as e:  # noqa: BLE001
            self._end("OpenAI completion, n=2", False, f"{type(e).__name__}: {e}")

    async def one(self, client) -> None:
        pick = self.rng.random()
        try:
            if pick < 0.3:
                await self.native(prompt_logprobs=False)
            elif pick < 0.45:
                await self.native(prompt_logprobs=True)
            elif pick < 0.8:
                await self.chat(client)
            else:
                await self.completion_n2(client)
        except Exception as e:  # noqa: BLE001 - a transport error of the bench's own requests
            self._end("transport", None, f"{type(e).__name__}: {e}")


def words(rng: random.Random) -> str:
    return " ".join(rng.choice(WORDS) for _ in range(rng.randint(8, 120)))


async def run(emu: Emulator, minutes: float, rate: float, seed: int) -> Traffic:
    from openai import AsyncOpenAI

    client = AsyncOpenAI(base_url=emu.base_url, api_key="local", max_retries=0, timeout=600)
    t, rng, tasks = Traffic(emu, seed), random.Random(seed + 1), []
    t0 = time.monotonic()
    while time.monotonic() - t0 < minutes * 60:
        tasks.append(asyncio.create_task(t.one(client)))
        await asyncio.sleep(rng.expovariate(rate))
    done, pending = await asyncio.wait(tasks, timeout=120)
    for task in pending:
        task.cancel()
        t._end("unanswered", None, "no answer 120 s after the traffic stopped")
    await client.close()
    return t


def fired(lines: list[str]) -> Counter:
    """The faults the workers report having fired (engine/faults.py's warning), and the workers that exited."""
    c = Counter(k for line in lines for k in re.findall(r"FAULT_INJECTION: (\w+) at step", line))
    c["worker exits"] = sum("worker exited with code" in line for line in lines)
    return c


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--minutes", type=float, default=3)
    ap.add_argument("--rate", type=float, default=1.5, help="requests per second (Poisson)")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--plans", default="", help="FAULT_INJECTION per spawn, ';'-separated (default: random)")
    ap.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    ap.add_argument("--log", type=Path, help="write the emulator's and workers' log here")
    ap.add_argument("--write-docs", action="store_true")
    args = ap.parse_args()
    plans = [p for p in args.plans.split(";") if p]
    if args.worker:
        return worker(args.seed, plans)
    import tempfile

    spawns = Path(tempfile.mkstemp(prefix="chaos-spawns-")[1])
    cmd = f"{sys.executable} -m bench.chaos --worker --seed {args.seed}" + (f" --plans '{args.plans}'" if plans else "")
    env = emulator_env(DTYPE="bfloat16", MAX_CONCURRENCY="8", **{SPAWNS: str(spawns)})
    t_all = time.perf_counter()
    with Emulator(env, argv=["-m", "handler.local", "--restart-worker", "--worker-cmd", cmd]) as emu:
        t = asyncio.run(run(emu, args.minutes, args.rate, args.seed))
        lines = list(emu.lines)
    spawns.unlink(missing_ok=True)
    if args.log:
        args.log.write_text("\n".join(lines) + "\n")
    f = fired(lines)
    total = sum(t.kinds.values())
    lost = t.outcomes["lost"]
    print(f"requests {total}: {dict(t.outcomes)}; by kind {dict(t.kinds)}; faults fired {dict(f)}")
    for line in t.lost[:10]:
        print("  lost:", line)
    from bench._common import machine_line, write_section

    rows = [f"| {k.strip()} | {v} |" for k, v in sorted(t.outcomes.items(), key=lambda kv: kv[0].startswith(" "))]
    md = "\n".join(
        [
            "## Chaos: faults at random under mixed traffic",
            "",
            f"`python -m bench.chaos --minutes {args.minutes:g} --rate {args.rate:g} --seed {args.seed}` on "
            f"{time.strftime('%Y-%m-%d')}: {machine_line('cpu')}. The local emulator with `--restart-worker`, "
            "SmolLM2-135M-Instruct, bfloat16, CPU; each worker draws its own FAULT_INJECTION plan (two `oom`, two "
            "`nan`, then a `hang` or a `kill`), STEP_TIMEOUT_S=3. Method: the docstring of `bench/chaos.py`.",
            "",
            f"Faults fired: {', '.join(f'{k} {v}' for k, v in sorted(f.items()) if k != 'worker exits')}; workers "
            f"that exited (and were replaced): {f['worker exits']}. Requests by kind: "
            + ", ".join(f"{k} {v}" for k, v in sorted(t.kinds.items()))
            + ".",
            "",
            f"| outcome ({total} requests) | requests |",
            "|---|---:|",
            *rows,
            "",
            f"Verdict: {'pass, nothing lost' if lost == 0 else f'**fail: {lost} lost**'}.",
            "",
        ]
    )
    print(md + f"\n(total {time.perf_counter() - t_all:.0f} s)")
    if args.write_docs:
        write_section(REPO / "docs" / "benchmarks.md", "chaos", md)
    sys.exit(0 if lost == 0 else 1)


if __name__ == "__main__":
    main()
