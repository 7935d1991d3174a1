"""Serving decode on CPU while another process keeps a core busy, or under a CPU quota: the engine's thread policy
on and off.

engine/cpu_threads.py starts an engine on torch's thread count capped by the cgroup's CPU quota (QUOTA_CAP), and
runs a served step on fewer threads while a team thread waits for a CPU (the governor, ADAPT). This measures what
that buys and what it costs, in one run: the embedded default model (bfloat16, CPU) in an engine.AsyncEngine per
child process (as the worker runs it), `--streams` requests at once, each --tokens tokens (ignore_eos, greedy),
output tok/s = tokens / (last token - first submit), after a warm-up and the idle work. "on": both; "off":
neither (torch's own count, fixed). Machine states (--states): "cores free" (nothing else running), "one core
busy" (a `python -c "while True: pass"` process, unpinned, started before the child and killed after it), and
"CPU quota" (the child in a cgroup of its own with a quota of --quota CPUs, as a container's --cpus; skipped,
saying so, where this machine does not let us make one). In each, --rounds rounds of on and off, alternating which
goes first; medians, and on ÷ off. "thread changes" counts the governor's changes of the thread count in the on
runs (drops and tries).

Usage: python -m bench.contention [--rounds 2] [--streams 1 8] [--tokens 128] [--states free busy quota]
    [--quota CPUS] [--write-docs]
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
PROMPT = "The history of the Roman Empire spans many centuries, from the founding of the city to the fall of"
STATES = {"free": "cores free", "busy": "one core busy", "quota": "CPU quota"}  # --states: the machine around it


def child(adapt: bool, streams: list[int], tokens: int, cgroup: str | None) -> None:
    """Child mode: one AsyncEngine, each stream count in turn; prints one JSON line. `cgroup`: the cgroup.procs
    it joins first."""
    import asyncio
    import logging
    import os

    if cgroup:
        Path(cgroup).write_text(str(os.getpid()))
    import engine.cpu_threads as ct
    from engine import AsyncEngine, SamplingParams

    ct.ADAPT = ct.QUOTA_CAP = adapt
    changes, waits = [], {}
    log = logging.getLogger("engine")
    log.setLevel(logging.INFO)  # the governor's changes are info lines: counted here, printed by nobody
    log.addFilter(lambda r: changes.append(1) if "CPU threads" in r.getMessage() and "->" in r.getMessage() else True)
    eng = AsyncEngine(dtype="bfloat16", log_stats_interval=0)

    async def one(n: int, mt: int) -> float:
        params = SamplingParams(temperature=0, max_tokens=mt, ignore_eos=True)

        async def stream(i: int) -> int:
            return sum([len(o.outputs[0].delta_token_ids) async for o in eng.generate(f"{i}. {PROMPT}", params)])

        t0, d0 = time.perf_counter(), eng.governor.read()
        done = await asyncio.gather(*[stream(i) for i in range(n)])
        wall, d1 = time.perf_counter() - t0, eng.governor.read()
        assert sum(done) == n * mt, done
        waits[str(n)] = max((d1[t] - d0.get(t, 0) for t in d1), default=0) / 1e9 / wall
        return n * mt / wall

    async def main() -> dict:
        await one(1, 4)
        while eng.engine.idle.pending:
            await asyncio.sleep(0.05)
        return {str(n): await one(n, tokens) for n in streams}

    rates = asyncio.run(main())
    threads = eng.governor.max_threads  # the count the engine started on
    eng.shutdown()
    print(json.dumps({"rates": rates, "waits": waits, "changes": len(changes), "threads": threads}), flush=True)


def run_child(adapt: bool, busy: bool, streams: list[int], tokens: int, cgroup: Path | None = None) -> dict:
    hog = subprocess.Popen([sys.executable, "-c", "while True: pass"]) if busy else None
    try:
        argv = [sys.executable, "-m", "bench.contention", "--child", "on" if adapt else "off", "--tokens", str(tokens)]
        argv += ["--cgroup", str(cgroup)] if cgroup else []
        out = subprocess.run([*argv, "--streams", *map(str, streams)], cwd=REPO, capture_output=True, text=True)
        if out.returncode:
            raise RuntimeError(out.stderr[-3000:])
        return json.loads(out.stdout.strip().splitlines()[-1])
    finally:
        if hog is not None:
            hog.kill()
            hog.wait()


def render(res: dict, streams: list[int], rounds: int, tokens: int, cmd: str, machine: str, skipped: list[str]) -> str:
    rows = []
    for state in res:
        for n in streams:
            on = [r["rates"][str(n)] for r in res[state]["on"]]
            off = [r["rates"][str(n)] for r in res[state]["off"]]
            m_on, m_off = statistics.median(on), statistics.median(off)
            changes = sum(r["changes"] for r in res[state]["on"])
            wait = {m: statistics.median(r["waits"][str(n)] for r in res[state][m]) for m in ("on", "off")}
            start = "/".join(str(res[state][m][0]["threads"]) for m in ("on", "off"))
            rows.append(
                f"| {state} | {n} | {m_on:.1f} | {m_off:.1f} | {m_on / m_off:.2f}x | "
                f"{', '.join(f'{a / b:.2f}x' for a, b in zip(on, off))} | {start} | {changes} | {wait['on']:.0%} | "
                f"{wait['off']:.0%} |"
            )
    return "\n".join(
        [
            "## CPU decode beside a busy core, or under a CPU quota",
            "",
            f"`{cmd}` on {time.strftime('%Y-%m-%d')}: {machine}. SmolLM2-135M-Instruct (the embedded default), "
            f"bfloat16, `engine.AsyncEngine` in a child process per run; {tokens} output tokens per request "
            f"(ignore_eos, greedy); {rounds} rounds per state, on and off alternating. Method: the docstring of "
            "`bench/contention.py`.",
            "",
            "| machine | streams | on tok/s | off tok/s | on ÷ off | per round | threads at start (on/off) "
            "| thread changes (on) | team wait on | team wait off |",
            "|---|---:|---:|---:|---:|---|---:|---:|---:|---:|",
            *rows,
            "",
            "Notes:",
            "- on: the engine's thread policy (engine/cpu_threads.py): torch's count capped by the cgroup's CPU "
            "quota at start, and while serving, fewer threads (as many as the CPUs the team had, at least one "
            "fewer) when a step thread waits for a CPU more than 30 % of a window, one more tried again after 2 s, "
            "kept under 15 %, else backing off to 64 s. off: torch's own count (a thread per CPU), fixed.",
            "- one core busy: one unpinned `while True: pass` process beside the engine. CPU quota: the engine's "
            "process in a cgroup of its own with that quota (a container's --cpus). team wait: the share of the "
            "run the step thread or one of its OpenMP workers (the one that waited most) spent waiting for a CPU "
            "while it could run (a quota's throttling counts), median of the rounds.",
            *[f"- {why}" for why in skipped],
            "",
            "![CPU decode with a busy core or a quota: the thread policy on and off](contention.png)",
        ]
    )


def plot(res: dict, streams: list[int], png: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    labels = [f"{state}, {n} stream{'s' * (n > 1)}" for state in res for n in streams]
    med = {m: [statistics.median(r["rates"][str(n)] for r in res[s][m]) for s in res for n in streams]
           for m in ("on", "off")}  # fmt: skip
    fig, ax = plt.subplots(figsize=(7.5, 3.2))
    y = range(len(labels))
    for k, (m, color) in enumerate((("on", "tab:green"), ("off", "tab:gray"))):
        bars = ax.barh([i + 0.4 * k for i in y], med[m], height=0.4, color=color, label=f"thread policy {m}")
        ax.bar_label(bars, fmt="{:.1f}", padding=3)
    ax.set_yticks([i + 0.2 for i in y], labels)
    ax.set_xlim(0, max(med["on"] + med["off"]) * 1.2)
    ax.invert_yaxis()
    ax.set_xlabel("output tokens / s (higher is better)")
    ax.set_title("CPU decode beside a busy core or under a quota, SmolLM2-135M bf16")
    ax.legend(loc="lower right")
    fig.tight_layout()
    png.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(png, dpi=120)


def main() -> None:
    import os

    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--child", choices=("on", "off"), help=argparse.SUPPRESS)
    ap.add_argument("--cgroup", help=argparse.SUPPRESS)
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--streams", type=int, nargs="+", default=[1, 8])
    ap.add_argument("--tokens", type=int, default=128)
    ap.add_argument("--states", nargs="+", choices=tuple(STATES), default=list(STATES), help="machine states")
    cpus = len(os.sched_getaffinity(0))
    ap.add_argument("--quota", type=float, default=max(0.5, cpus - 1.0), help="CPUs (default: one fewer than here)")
    ap.add_argument("--write-docs", action="store_true", help="write docs/benchmarks.md's section")
    args = ap.parse_args()
    if args.child:
        return child(args.child == "on", args.streams, args.tokens, args.cgroup)
    from bench.procs import cpu_cgroup

    res, skipped, cgroup = {}, [], None
    for key in args.states:
        state = STATES[key] if key != "quota" else f"CPU quota {args.quota:g} of {cpus}"
        if key == "quota":
            if (cgroup := cpu_cgroup(f"bench-contention-{os.getpid()}", args.quota)) is None:
                skipped.append("CPU quota: skipped, no writable CPU cgroup here (not root, or a read-only cgroup tree)")
                print(skipped[-1], flush=True)
                continue
        res[state] = {"on": [], "off": []}
        try:
            for r in range(args.rounds):
                for adapt in (True, False) if r % 2 == 0 else (False, True):
                    procs = cgroup[0] if key == "quota" else None
                    got = run_child(adapt, key == "busy", args.streams, args.tokens, procs)
                    res[state]["on" if adapt else "off"].append(got)
                    rates = ", ".join(f"{n} streams {v:.1f} tok/s" for n, v in got["rates"].items())
                    print(f"  {state}, {'on' if adapt else 'off'}: {rates}; threads {got['threads']}, "
                          f"changes {got['changes']}", flush=True)  # fmt: skip
        finally:
            if key == "quota":
                cgroup[1].rmdir()

    from bench._common import machine_line, write_section

    cmd = ("python -m bench.contention " + " ".join(a for a in sys.argv[1:] if a != "--write-docs")).strip()
    md = render(res, args.streams, args.rounds, args.tokens, cmd, machine_line("cpu"), skipped)
    print("\n" + md)
    if args.write_docs:
        write_section(REPO / "docs" / "benchmarks.md", "contention", md)
        plot(res, args.streams, REPO / "docs" / "contention.png")
        print(f"\nwrote {REPO / 'docs' / 'benchmarks.md'} and {REPO / 'docs' / 'contention.png'}")


if __name__ == "__main__":
    main()
