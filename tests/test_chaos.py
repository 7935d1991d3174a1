"""bench/chaos.py's run, short and with fixed plans, as a test: under mixed traffic through the emulator, an
out-of-memory step, NaN logits, a hung step and a killed worker each fire, and no request is lost (each is served or
fails with an error that says why)."""

from __future__ import annotations

import re
import subprocess
import sys

import pytest

from bench.procs import REPO

pytestmark = pytest.mark.slow  # the emulator and its workers as processes, on the real SmolLM2


def test_no_request_is_lost_when_every_fault_fires(smollm2_path):
    plans = "oom@4,nan@12,oom@20,hang@60;nan@5,kill@40"
    r = subprocess.run(
        [sys.executable, "-m", "bench.chaos", "--minutes", "0.5", "--rate", "2", "--plans", plans],
        cwd=REPO, capture_output=True, text=True, timeout=600,
    )  # fmt: skip
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    fired = dict(re.findall(r"'(\w+)': (\d+)", r.stdout.split("faults fired")[1].splitlines()[0]))
    assert all(int(fired.get(k, 0)) >= 1 for k in ("oom", "nan", "hang", "kill")), r.stdout[-2000:]
    assert "nothing lost" in r.stdout
