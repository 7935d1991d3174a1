"""`python -m handler` as users run it: runpod's --test_input / test_input.json / --rp_serve_api modes, a
failed start, and an engine fault injected into a step."""

from __future__ import annotations

import asyncio
import json
import os
import socket
import subprocess
import sys
import time
import urllib.request

import pytest

from engine import AsyncEngine, EngineConfig
from handler.settings import load_settings
from handler.worker import Worker

pytestmark = pytest.mark.slow  # the worker's entry point as a process

JOB = {
    "input": {
        "prompt": "hello there",
        "stream": True,
        "sampling_params": {"temperature": 0, "max_tokens": 6, "ignore_eos": True},
    }
}


def _env(model) -> dict:
    env = {k: v for k, v in os.environ.items() if not k.startswith("RUNPOD_")}
    return {**env, "MODEL_NAME": str(model), "DTYPE": "float32", "HF_HUB_OFFLINE": "1"}


def _run(args, env, cwd, timeout=120):
    return subprocess.run(
        [sys.executable, "-m", "handler", *args], env=env, cwd=cwd, capture_output=True, text=True, timeout=timeout
    )


def test_test_input_flag_iterates_the_generator(tiny_llama, tmp_path):
    r = _run(["--test_input", json.dumps(JOB)], {**_env(tiny_llama), "STREAM_FLUSH_MS": "600000"}, tmp_path)
    assert r.returncode == 0, r.stderr[-2000:]
    lines = r.stdout.strip().splitlines()
    assert sum(ln.startswith("--- chunk") for ln in lines) == 3  # 1, 3, then the rest of 6 tokens
    final = json.loads(lines[-1])
    assert final["status"] == "COMPLETED" and final["output"][-1]["usage"]["output"] == 6
    # the first job reports the cold-start timeline; the log shows it as a table at ready
    cold = final["output"][-1]["metrics"]["cold_start"]
    names = [p["name"] for p in cold["phases"]]
    assert names == [
        "imports",
        "settings",
        "engine setup",
        "model resolution",
        "model build",
        "weight read",
        "KV allocation",
        "kernel warmup",
        "ready",
        "first token",
    ], names
    assert abs(cold["total_s"] - sum(p["seconds"] for p in cold["phases"])) < 0.05  # marks tile the time
    assert "cold start:" in r.stderr and "first token" in r.stderr


def test_heavy_imports_stay_off_the_cold_start_path(tiny_llama, tmp_path):
    """`import handler` loads no torch, and a CPU worker is ready, and serves a job, without transformers, boto3,
    runpod, triton or xgrammar: they load when something needs them (LoRA, the SDK loop, the Triton kernels, a
    grammar; transformers only when asked for). The OpenAI and Anthropic routes (their pydantic models) and a chat
    template's jinja2 are not imported before ready either: the engine's idle work imports the routes after ready
    (this tiny model has no chat template: jinja2 never loads)."""
    code = (
        "import sys, time, handler\n"
        "assert 'torch' not in sys.modules\n"
        "from handler.__main__ import build_worker\n"
        "w = build_worker()\n"
        "assert w.engine is not None\n"
        "assert 'handler.openai_jobs' not in sys.modules, 'the OpenAI routes were imported before ready'\n"
        "import asyncio, io\n"
        "from handler.worker import run_test_job\n"
        "w.ready()\n"
        f"assert asyncio.run(run_test_job(w, {JOB!r}, io.StringIO())) == 0\n"
        "deadline = time.monotonic() + 30\n"
        "while 'handler.openai_jobs' not in sys.modules and time.monotonic() < deadline:\n"
        "    time.sleep(0.05)\n"
        "assert 'handler.openai_jobs' in sys.modules, 'the idle work never imported the OpenAI routes'\n"
        "w.engine.shutdown()\n"
        "heavy = ('transformers', 'jinja2', 'boto3', 'botocore', 'runpod', 'triton', 'xgrammar')\n"
        "print(sorted(m for m in heavy if m in sys.modules))"
    )
    r = subprocess.run(
        [sys.executable, "-c", code], env=_env(tiny_llama), cwd=tmp_path, capture_output=True, text=True, timeout=120
    )
    assert r.returncode == 0, r.stderr[-2000:]
    assert r.stdout.strip().splitlines()[-1] == "[]"


def test_test_input_json_file_and_bad_job_exit_code(tiny_llama, tmp_path):
    (tmp_path / "test_input.json").write_text(json.dumps(JOB))
    r = _run([], _env(tiny_llama), tmp_path)
    assert r.returncode == 0 and json.loads(r.stdout.strip().splitlines()[-1])["status"] == "COMPLETED"
    r = _run(
        ["--test_input", json.dumps({"input": {"prompt": "x", "sampling_params": {"top_p": 7}}})],
        _env(tiny_llama),
        tmp_path,
    )
    assert r.returncode == 1
    final = json.loads(r.stdout.strip().splitlines()[-1])
    assert final["status"] == "FAILED" and "top_p" in final["error"]
    r = _run(["--test_input", "[1]"], _env(tiny_llama), tmp_path)  # not a job object: an error, not a traceback
    assert r.returncode == 1 and json.loads(r.stdout.strip().splitlines()[-1])["status"] == "FAILED", r.stderr[-500:]


def test_failed_start_reports_on_every_job(tmp_path):
    env = _env(tmp_path / "no-such-model")
    r = _run(["--test_input", json.dumps(JOB)], env, tmp_path)
    assert r.returncode == 1
    err = json.loads(json.loads(r.stdout.strip().splitlines()[-1])["error"])
    assert err["type"] == "server_error" and "no-such-model" in err["message"]
    assert "engine start failed" in r.stderr


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_rp_serve_api_runsync_returns_aggregate(tiny_llama, tmp_path):
    port = _free_port()
    proc = subprocess.Popen(
        [sys.executable, "-m", "handler", "--rp_serve_api", "--rp_api_port", str(port)],
        env={**_env(tiny_llama), "STREAM_FLUSH_MS": "600000"},  # the count bound alone
        cwd=tmp_path,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    try:
        deadline = time.time() + 90
        while True:
            try:
                req = urllib.request.Request(
                    f"http://127.0.0.1:{port}/runsync",
                    data=json.dumps(JOB).encode(),
                    headers={"Content-Type": "application/json"},
                )
                out = json.loads(urllib.request.urlopen(req, timeout=60).read())
                break
            except OSError:
                if time.time() > deadline or proc.poll() is not None:
                    raise
                time.sleep(0.5)
        assert out["status"] == "COMPLETED"
        chunks = out["output"]
        assert [c["usage"]["output"] for c in chunks] == [1, 4, 6]  # 1, 3, then the rest
    finally:
        proc.terminate()
        proc.wait(timeout=20)


def test_engine_fault_fails_everything_and_asks_for_replacement(tiny_llama):
    eng = AsyncEngine(EngineConfig(model=str(tiny_llama), dtype="float32", log_stats_interval=0))
    worker = Worker(load_settings({}), eng)
    worker.runpod_config()  # as python -m handler hands it to runpod
    real_step, calls = eng.engine.step, [0]

    def faulty_step():
        calls[0] += 1
        if calls[0] == 5:
            raise RuntimeError("CUDA error: an illegal memory access was encountered (injected)")
        return real_step()

    eng.engine.step = faulty_step
    job = {"prompt": "hi", "stream": True, "sampling_params": {"max_tokens": 200, "ignore_eos": True}}

    async def go():
        async def one():
            return [c async for c in worker.handle({"id": "j", "input": job})]

        return await asyncio.wait_for(asyncio.gather(*(one() for _ in range(4))), timeout=30)

    results = asyncio.run(go())
    for chunks in results:
        err = json.loads(chunks[-1]["error"])
        assert err["type"] == "server_error" and "illegal memory access" in err["message"]
    assert worker.rp_config["refresh_worker"] is True and worker.fault
    later = asyncio.run(asyncio.wait_for(_collect(worker, job), 5))
    assert "illegal memory access" in json.loads(later[-1]["error"])["message"]
    eng.shutdown()


async def _collect(worker, job):
    return [c async for c in worker.handle({"id": "k", "input": job})]


def test_a_clean_exit_stops_the_step_loop_first(tiny_llama, tmp_path):
    """A bf16 CPU worker packs its weights for oneDNN as idle pieces on the step loop's thread after the job. If
    the process exited with a piece inside torch, the interpreter's finalization unwound that thread out of C++ and
    the process aborted after a good job (exit 134, 'terminate called without an active exception'). Each piece is
    made long here (a matmul of ~0.3 s, in torch, GIL released), so the exit lands inside one."""
    code = (
        "import sys, torch, engine.cuda_graphs as cg\n"
        "real = cg.pack\n"
        "def slow(piece):\n"
        "    a = torch.ones(1500, 1500); [a @ a for _ in range(20)]\n"
        "    return real(piece)\n"
        "cg.pack = slow\n"
        "from handler.__main__ import main\n"
        f"sys.exit(main(['--test_input', {json.dumps(JOB)!r}]))"
    )
    env = {**_env(tiny_llama), "DTYPE": "bfloat16"}
    r = subprocess.run([sys.executable, "-c", code], env=env, cwd=tmp_path, capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stderr[-2000:]
    assert json.loads(r.stdout.strip().splitlines()[-1])["status"] == "COMPLETED"


def test_runpod_imports_lean_and_whole():
    """handler.runpod_sdk.lean_import: `import runpod` without cpuinfo's probe or the CLI's ssh group (paramiko,
    cryptography), and everything the worker loop and the SDK's clients use is there: its worker loop, its job
    scaler, the credentials its HTTP client reads from the CLI's config module, and the Endpoint client."""
    code = (
        "import sys\n"
        "import handler.runpod_sdk as m\n"
        "m.lean_import()\n"
        "import runpod\n"
        "from runpod.serverless.modules import rp_scale\n"
        "assert callable(runpod.serverless.start) and rp_scale.JobScaler\n"
        "config = sys.modules['runpod.cli.groups.config.functions']\n"
        "assert runpod.http_client.get_credentials is config.get_credentials\n"
        "assert runpod.Endpoint and runpod.check_credentials\n"
        "from runpod.serverless.utils import rp_debugger\n"
        "assert rp_debugger.PROCESSOR == sys.modules['cpuinfo'].get_cpu_info()['brand_raw']\n"
        "print(sorted(x for x in ('paramiko', 'cryptography', 'invoke', 'runpod.cli.groups.ssh') if x in sys.modules))"
    )
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stderr[-2000:]
    assert r.stdout.strip().splitlines()[-1] == "[]"
