"""Where the worker writes its caches, run as users run it: `make demo` on a laptop (not root, no /runpod-volume)
must serve, and a Runpod volume that cannot be written is a warning, never a worker that fails every job.
Each test writes an fp8 snapshot (QUANTIZATION=fp8), so the cache root is really used."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import pytest
import requests

from bench.procs import Emulator

pytestmark = pytest.mark.slow  # the real SmolLM2 from a volume

REPO = Path(__file__).resolve().parents[1]
VOLUME = Path("/runpod-volume")
JOB = {"input": {"prompt": "hello there", "sampling_params": {"temperature": 0, "max_tokens": 4, "ignore_eos": True}}}


def _env(model: Path, home: Path, **extra) -> dict:
    env = {k: v for k, v in os.environ.items() if not k.startswith("RUNPOD_") and k not in ("BASE_PATH", "HOME")}
    return {
        **env,
        "HOME": str(home),
        "MODEL_NAME": str(model),
        "DTYPE": "float32",
        "QUANTIZATION": "fp8",
        "MAX_MODEL_LEN": "256",
        "HF_HUB_OFFLINE": "1",
        "PYTHONDONTWRITEBYTECODE": "1",
        **extra,
    }


def _snapshots(root: Path) -> set[str]:
    d = root / "fp8-snapshots"
    return {p.name for p in d.iterdir()} if d.is_dir() else set()


def _run_job(emu: Emulator) -> dict:
    r = requests.post(f"{emu.base}/runsync", json=JOB, timeout=120).json()
    deadline = time.time() + 120
    while r["status"] not in ("COMPLETED", "FAILED") and time.time() < deadline:
        time.sleep(0.2)
        r = requests.get(f"{emu.base}/status/{r['id']}", timeout=30).json()
    return r


def test_an_unwritable_base_path_is_a_warning_and_the_worker_serves(tiny_llama, tmp_path):
    blocker = tmp_path / "not-a-dir"
    blocker.write_text("")  # nothing can be created under a file, whoever runs this (CI runs as root)
    env = _env(tiny_llama, tmp_path / "home", BASE_PATH=str(blocker / "volume"), RUNPOD_ENDPOINT_ID="ep")
    r = subprocess.run(
        [sys.executable, "-m", "handler", "--test_input", json.dumps(JOB)],
        env=env,
        cwd=tmp_path,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert r.returncode == 0, r.stderr[-3000:]
    assert "cannot be written" in r.stderr and json.loads(r.stdout.splitlines()[-1])["status"] == "COMPLETED"
    assert _snapshots(tmp_path / "home" / ".cache" / "rp-llm-worker")  # the fallback cache was used


def test_the_emulator_writes_only_under_the_user_cache(tiny_llama, tmp_path):
    before = _snapshots(VOLUME)
    emu = Emulator(_env(tiny_llama, tmp_path / "home"))
    try:
        assert _run_job(emu)["status"] == "COMPLETED"
    finally:
        emu.close()
    assert _snapshots(tmp_path / "home" / ".cache" / "rp-llm-worker")
    assert _snapshots(VOLUME) == before  # the emulator is not Runpod: /runpod-volume is never written
    assert not any("cannot be written" in line for line in emu.lines)


def test_a_non_root_user_runs_the_demo(tiny_llama):
    """`make demo` as an ordinary user. As root (CI), the emulator and worker run as `nobody`, whose writes to
    /runpod-volume fail whether or not it exists; as a non-root user, as that user."""
    as_root = os.geteuid() == 0
    if not as_root and VOLUME.exists() and os.access(VOLUME, os.W_OK):
        pytest.skip("this user can write /runpod-volume: nothing to show")
    base = Path(tempfile.mkdtemp(prefix="nonroot-"))
    try:
        model, home = base / "model", base / "home"
        shutil.copytree(tiny_llama, model)
        home.mkdir()
        preexec = None
        if as_root:
            import pwd

            nobody = pwd.getpwnam("nobody")
            for p in [base, home, *model.rglob("*"), model]:
                os.chmod(p, 0o755 if p.is_dir() else 0o644)
            os.chown(home, nobody.pw_uid, nobody.pw_gid)

            def preexec():
                os.setgid(nobody.pw_gid)
                os.setuid(nobody.pw_uid)

            try:  # root's Python often lives under /root (mode 700), where nobody cannot start it
                subprocess.run(
                    [sys.executable, "-c", "import handler.local"],
                    preexec_fn=preexec,
                    cwd=base,
                    env={"HOME": str(home)},
                    check=True,
                    capture_output=True,
                    timeout=120,
                )
            except (OSError, subprocess.CalledProcessError) as e:
                pytest.skip(f"this machine's interpreter or repository cannot be run by 'nobody': {e}")
        emu = Emulator(_env(model, home), preexec_fn=preexec, cwd=str(base))
        try:
            r = _run_job(emu)
        finally:
            emu.close()
        assert r["status"] == "COMPLETED", (r, emu.lines[-30:])
        assert _snapshots(home / ".cache" / "rp-llm-worker")
    finally:
        shutil.rmtree(base, ignore_errors=True)
