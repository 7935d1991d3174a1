"""`python -m warmup` as a user runs it (a subprocess, settings from the environment) on a tiny random model in
a fake HF cache on a fake volume, and the Timeline it prints."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from engine.timeline import Timeline
from tests.utils import build_tiny_model

pytestmark = pytest.mark.slow  # python -m warmup on the real SmolLM2, in subprocesses

REPO = Path(__file__).resolve().parents[1]


@pytest.fixture(scope="module")
def volume(tmp_path_factory) -> Path:
    """BASE_PATH with the model in Runpod's layout: huggingface-cache/hub/models--org--name/snapshots/<rev>/."""
    base = tmp_path_factory.mktemp("volume")
    repo = base / "huggingface-cache" / "hub" / "models--org--name"
    build_tiny_model(repo / "snapshots" / "abc123", "llama")
    (repo / "refs").mkdir()
    (repo / "refs" / "main").write_text("abc123")
    return base


def warmup(base: Path, *args: str, **env: str) -> subprocess.CompletedProcess:
    # A clean environment: none of this machine's HF or model settings leak in; HOME keeps ~/.cache out of it.
    keep = {
        k: v
        for k, v in os.environ.items()
        if not k.startswith(("HF_", "MODEL_", "QUANTIZATION", "BASE_PATH", "RUNPOD_", "KV_", "MAX_"))
    }
    full = {
        **keep,
        "HOME": str(base / "home"),
        "BASE_PATH": str(base),
        "MODEL_NAME": "org/name",
        "HF_HUB_OFFLINE": "1",
        "TRANSFORMERS_OFFLINE": "1",
        "TRITON_CACHE_DIR": str(base / "triton"),
        **env,
    }
    return subprocess.run(
        [sys.executable, "-m", "warmup", *args], cwd=REPO, env=full, capture_output=True, text=True, timeout=300
    )


def test_fp8_volume_check_fails_then_warmup_builds_the_snapshot_then_check_passes(volume):
    before = warmup(volume, "--check", QUANTIZATION="fp8")
    assert before.returncode == 1, before.stderr
    assert "missing: QUANTIZATION=fp8: no valid fp8 snapshot" in before.stdout and "not ready" in before.stdout
    assert not (volume / "fp8-snapshots").exists()  # --check writes nothing

    run = warmup(volume, QUANTIZATION="fp8")
    assert run.returncode == 0, run.stderr
    for phase in ("imports", "settings", "model resolution", "model check", "engine build", "kernel warmup", "total"):
        assert phase in run.stdout, (phase, run.stdout)
    assert "checkpoint, quantized online" in run.stdout  # the engine built the snapshot
    snaps = list((volume / "fp8-snapshots").iterdir())
    assert len(snaps) == 1 and f"fp8 snapshot: {snaps[0]}" in run.stdout
    assert "huggingface-cache/hub/models--org--name/snapshots/abc123" in run.stdout

    after = warmup(volume, "--check", QUANTIZATION="fp8")
    assert after.returncode == 0, after.stdout + after.stderr
    assert "missing" not in after.stdout and after.stdout.strip().endswith("ready")


def test_missing_model_is_one_clear_line_and_no_download_offline(volume):
    r = warmup(volume, "--model", "org/absent")
    assert r.returncode == 1
    last = r.stderr.strip().splitlines()[-1]
    assert last.startswith("warmup: failed: model 'org/absent'") and "HF_HUB_OFFLINE=1" in last
    assert "Traceback" not in r.stderr and "downloading" not in r.stderr
    assert not (volume / "huggingface-cache" / "hub" / "models--org--absent").exists()


def test_download_goes_to_the_first_writable_hf_cache_safetensors_only(volume, tmp_path, monkeypatch, capsys):
    import shutil
    from fnmatch import fnmatch

    import huggingface_hub
    from huggingface_hub import constants

    from warmup.__main__ import main

    calls = []

    def fake_download(repo_id, *, revision, cache_dir, allow_patterns, **kw):  # what the hub would leave behind
        calls.append((repo_id, revision, cache_dir, allow_patterns))
        repo = Path(cache_dir) / "models--org--dl"
        shutil.copytree(volume / "huggingface-cache/hub/models--org--name/snapshots/abc123", repo / "snapshots/c0")
        (repo / "refs").mkdir()
        (repo / "refs" / "v1").write_text("c0")

    monkeypatch.setattr(huggingface_hub, "snapshot_download", fake_download)
    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", False)
    for k in [k for k in os.environ if k.startswith(("HF_", "MODEL_", "QUANTIZATION"))]:
        monkeypatch.delenv(k)
    monkeypatch.setenv("HF_HUB_CACHE", "/proc/not-writable")  # skipped: the volume's hub is next
    monkeypatch.setenv("BASE_PATH", str(tmp_path))
    assert main(["--model", "org/dl", "--revision", "v1"]) == 0
    [(repo_id, rev, cache_dir, patterns)] = calls
    assert (repo_id, rev, cache_dir) == ("org/dl", "v1", str(tmp_path / "huggingface-cache" / "hub"))
    assert any(fnmatch("model-00001-of-00002.safetensors", p) for p in patterns)
    assert not any(fnmatch(f, p) for p in patterns for f in ("pytorch_model.bin", "consolidated.pt"))
    out = capsys.readouterr().out
    assert "download" in out and "models--org--dl/snapshots/c0" in out and out.strip().endswith("ready")


def test_check_reports_an_unconverted_default_model(tmp_path):
    r = warmup(tmp_path, "--check", MODEL_NAME="")  # empty: unset, the embedded default model
    assert r.returncode == 1, r.stdout + r.stderr
    assert f"missing: the default model is not converted yet (expected {tmp_path / 'default-model'}" in r.stdout
    assert not (tmp_path / "default-model").exists()


def test_bad_settings_exit_2_naming_the_variable(volume):
    r = warmup(volume, "--check", MAX_MODEL_LEN="lots")
    assert r.returncode == 2 and "Traceback" not in r.stderr
    assert "MAX_MODEL_LEN='lots'" in r.stderr.strip().splitlines()[-1]


def test_timeline_phases_marks_skips_and_table():
    now = [0.0]
    tl = Timeline(clock=lambda: now[0])
    now[0] = 1.0
    tl.mark("imports")  # 0 -> 1
    with tl.phase("weight read") as p:
        now[0] = 4.0
        p.note = "3 GB"
    now[0] = 4.5  # untimed work before the skip: the next mark must still cover it
    tl.skip("kernel warmup", "no CUDA")
    now[0] = 5.0
    tl.mark("ready")  # begins where the previous entry ended (4.0)
    assert [(p.name, p.start, p.seconds) for p in tl.phases] == [
        ("imports", 0.0, 1.0),
        ("weight read", 1.0, 3.0),
        ("kernel warmup", 4.0, 0.0),
        ("ready", 4.0, 1.0),
    ]
    assert tl.total() == 5.0
    d = tl.as_dict()
    assert d["total_s"] == 5.0 and d["phases"][1] == {
        "name": "weight read",
        "start_s": 1.0,
        "seconds": 3.0,
        "note": "3 GB",
    }
    lines = tl.table().splitlines()
    assert lines[0].split() == ["phase", "seconds", "%", "at"]
    assert lines[2].split() == ["weight", "read", "3.00", "60%", "4.00", "3", "GB"]
    assert "skipped: no CUDA" in lines[3] and lines[-1].split() == ["total", "5.00", "100%"]


def test_timeline_records_a_phase_that_raised_and_starts_where_told():
    now = [10.0]
    tl = Timeline(start=8.0, clock=lambda: now[0])  # e.g. the process start, taken before the imports
    with pytest.raises(RuntimeError):
        with tl.phase("weight read"):
            now[0] = 12.0
            raise RuntimeError("disk")
    assert [(p.name, p.start, p.seconds) for p in tl.phases] == [("weight read", 2.0, 2.0)]
    assert Timeline().table().splitlines()[-1].split() == ["total", "0.00", "-"]


def test_warmup_drains_the_work_a_worker_does_after_ready(tiny_llama, monkeypatch):
    """python -m warmup's kernel phase (on CUDA) runs one request and then all of the engine's IdleWork at once:
    every warm step, the grammar mask pieces though no grammar exists, every graph capture; so the volume's
    Triton cache holds what the worker would otherwise compile after ready. Here on CPU with the warm steps forced
    on, the graph stand-in and a counting hook on xgrammar's mask (its CUDA path is the Triton kernel)."""
    import xgrammar

    from engine import LLM
    from engine.cuda_graphs import IdleWork
    from engine.memory import graph_buckets
    from tests.graph_standin import SyncCheckedGraph
    from warmup.__main__ import _warm_kernels

    engine = LLM(
        str(tiny_llama), dtype="float32", kernel_backend="triton", block_size=8, max_num_seqs=4, num_kv_blocks=64,
        max_model_len=64, log_stats_interval=0,
    ).engine  # fmt: skip
    graphs = engine.runner.enable_graphs(SyncCheckedGraph)
    engine.idle = IdleWork(engine.runner, warm_kernels=True, grammar=engine.structured)
    warmed, masks = [], []
    warm, apply = engine.runner.warm, xgrammar.apply_token_bitmask_inplace
    monkeypatch.setattr(engine.runner, "warm", lambda *shape: warmed.append(shape) or warm(*shape))
    monkeypatch.setattr(
        xgrammar, "apply_token_bitmask_inplace", lambda lg, m, **kw: masks.append(lg.shape[0]) or apply(lg, m, **kw)
    )
    note = _warm_kernels(engine)
    assert not engine.idle.pending and not engine.has_unfinished()
    assert warmed == engine.runner.warm_shapes() and masks == [1, 2, 16]
    assert graphs.captured == list(graph_buckets(4)), SyncCheckedGraph.errors
    assert note == f"one request, then {len(warmed) + 3 + len(graph_buckets(4))} warm-up pieces"
