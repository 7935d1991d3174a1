"""Child processes that benchmarks and tests run against: the local emulator (`python -m handler.local`, which
spawns the real worker) and a moto S3 server. Each takes a free port, keeps its log, and is stopped by close()
or by leaving its `with` block."""

from __future__ import annotations

import json
import os
import re
import socket
import subprocess
import sys
import threading
import time
import urllib.error
import urllib.request
import uuid
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def emulator_env(**overrides: str) -> dict:
    """This process's environment without Runpod's variables or MODEL_NAME (the embedded default model), offline,
    plus `overrides`."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("RUNPOD_") and k != "MODEL_NAME"}
    return env | {"HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1", **overrides}


class Emulator:
    """`python -m handler.local --port P`. Its stderr is kept in `lines`, each line's arrival in seconds since
    launch in `stamps`. wait=True (default): return once /health reports a worker that has taken jobs.

    argv: what follows the interpreter (default `-m handler.local`; --port is appended). popen: extra Popen
    arguments (cwd, preexec_fn)."""

    def __init__(
        self,
        env: dict | None = None,
        *,
        argv: list[str] | None = None,
        wait: bool = True,
        timeout: float = 300,
        **popen,
    ):
        self.port = free_port()
        self.api = f"http://127.0.0.1:{self.port}/v2/local"  # /run, /stream/{id}, /status/{id}, /health, ...
        self.base_url = f"{self.api}/openai/v1"
        self.lines: list[str] = []
        self.stamps: list[float] = []
        self.t0 = time.perf_counter()
        self.proc = subprocess.Popen(
            [sys.executable, *(argv or self.ARGV), *self._port_args()],
            env=emulator_env() if env is None else env,
            stdout=subprocess.DEVNULL,
            stderr=subprocess.PIPE,
            text=True,
            **{"cwd": str(REPO), **popen},
        )
        threading.Thread(target=self._pump, daemon=True).start()
        if wait:
            self.wait_ready(timeout)

    ARGV = ["-m", "handler.local"]

    def _port_args(self) -> list[str]:
        return ["--port", str(self.port)]

    @property
    def base(self) -> str:
        return self.api

    def _pump(self) -> None:
        for line in self.proc.stderr:
            self.stamps.append(time.perf_counter() - self.t0)
            self.lines.append(line.rstrip())

    def tail(self, n: int = 40) -> str:
        return "\n".join(self.lines[-n:])

    def wait_ready(self, timeout: float = 300) -> None:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline and self.proc.poll() is None:
            try:
                with urllib.request.urlopen(f"{self.api}/health", timeout=5) as r:
                    if json.loads(r.read())["workers"]["ready"]:
                        return
            except (OSError, ValueError, KeyError):
                pass
            time.sleep(0.2)
        self.close()
        raise RuntimeError(f"the emulator did not become ready (exited, or {timeout:g} s passed):\n{self.tail(20)}")

    def wait_for(self, pattern: str, timeout: float) -> re.Match:
        """The first log line matching `pattern`, waiting up to `timeout` seconds for it."""
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            for line in list(self.lines):
                if m := re.search(pattern, line):
                    return m
            if self.proc.poll() is not None:
                raise AssertionError("emulator exited:\n" + self.tail())
            time.sleep(0.1)
        raise AssertionError(f"no log line matching {pattern!r}:\n" + self.tail())

    def mark(self, text: str) -> float | None:
        """Seconds from launch to the first log line containing `text` (None if none yet)."""
        return next((t for t, line in zip(list(self.stamps), list(self.lines)) if text in line), None)

    def close(self) -> None:
        self.proc.terminate()
        try:
            self.proc.wait(timeout=30)
        except subprocess.TimeoutExpired:
            self.proc.kill()

    def __enter__(self) -> Emulator:
        return self

    def __exit__(self, *exc) -> None:
        self.close()


class LBWorker(Emulator):
    """`python -m handler` as a load-balancing endpoint worker (RUNPOD_ENDPOINT_TYPE=lb, PORT free): its HTTP
    server at `api`, the OpenAI routes at `base_url`. wait=True: return once its /ping answers 200."""

    ARGV = ["-m", "handler"]

    def __init__(self, env: dict | None = None, *, wait: bool = True, timeout: float = 300, **kw):
        self._port = free_port()
        env = {**(emulator_env() if env is None else env), "RUNPOD_ENDPOINT_TYPE": "lb", "PORT": str(self._port)}
        super().__init__(env, wait=False, **kw)
        self.port, self.api = self._port, f"http://127.0.0.1:{self._port}"
        self.base_url = f"{self.api}/v1"
        if wait:
            self.wait_ready(timeout)

    def _port_args(self) -> list[str]:
        return []  # PORT, in its environment

    def ping(self, timeout: float = 5) -> int:
        """The health check's HTTP status (0: no answer)."""
        try:
            with urllib.request.urlopen(f"{self.api}/ping", timeout=timeout) as r:
                return r.status
        except urllib.error.HTTPError as e:
            return e.code
        except OSError:
            return 0

    def wait_ready(self, timeout: float = 300) -> None:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline and self.proc.poll() is None:
            if (status := self.ping()) == 200:
                return
            if status == 503:
                break
            time.sleep(0.1)
        self.close()
        raise RuntimeError(f"the worker did not become ready (exited, 503, or {timeout:g} s passed):\n{self.tail(30)}")


_MOTO_LINE = re.compile(r'"(GET|HEAD|PUT|POST|DELETE) (\S+) HTTP/[\d.]+" (\d+)')


class MotoServer:
    """moto's S3 server in its own process (real HTTP, as boto3 sees it), logging every request to `log_path`."""

    def __init__(self, log_path: Path):
        self.port = free_port()  # moto binds it right after
        self.url = f"http://127.0.0.1:{self.port}"
        self.log_path = log_path
        self._log = open(log_path, "wb")
        env = {k: v for k, v in os.environ.items() if not k.startswith("AWS_")}
        self.proc = subprocess.Popen(
            [sys.executable, "-u", "-m", "moto.server", "-H", "127.0.0.1", "-p", str(self.port)],
            stdout=self._log,
            stderr=subprocess.STDOUT,
            env=env,
        )
        deadline = time.monotonic() + 30
        while True:
            try:
                urllib.request.urlopen(self.url + "/moto-api/", timeout=1).read()
                break
            except OSError:
                if self.proc.poll() is not None or time.monotonic() > deadline:
                    raise RuntimeError(f"moto server did not start: {log_path.read_text()[-2000:]}") from None
                time.sleep(0.1)

    def requests(self) -> list[tuple[str, str, int]]:
        """Every request the server has answered so far: (method, path, status). A marker request is sent first
        and waited for, so every line of requests completed before this call is in the log."""
        marker = f"/moto-api/?marker={uuid.uuid4().hex}"
        urllib.request.urlopen(self.url + marker, timeout=5).read()
        for _ in range(100):
            text = self.log_path.read_text()
            if marker in text:
                break
            time.sleep(0.02)
        return [(m[1], m[2], int(m[3])) for m in _MOTO_LINE.finditer(text) if not m[2].startswith("/moto-api/")]

    def count(self, method: str, path_prefix: str) -> int:
        return sum(1 for m, p, _ in self.requests() if m == method and p.startswith(path_prefix))

    def close(self) -> None:
        self.proc.terminate()
        self.proc.wait(10)
        self._log.close()

    stop = close

    def __enter__(self) -> MotoServer:
        return self

    def __exit__(self, *exc) -> None:
        self.close()


def cpu_cgroup(name: str, quota_cpus: float) -> tuple[Path, Path] | None:
    """A new cgroup with a CPU quota (v1's cpu controller, or v2 where the root lets us make one), or None where
    this machine does not let us (not root, a read-only /sys/fs/cgroup): (its cgroup.procs, its directory). A
    process joins it by writing its pid to cgroup.procs; the caller removes the directory (rmdir) once it is empty.
    For tests/test_cpu_threads.py and bench/contention.py's quota state."""
    root = Path("/sys/fs/cgroup")
    for base, write in ((root / "cpu", "v1"), (root, "v2")):
        d = base / name
        try:
            if write == "v2" and "cpu" not in (root / "cgroup.subtree_control").read_text().split():
                continue
            d.mkdir(exist_ok=True)
            if write == "v1":
                (d / "cpu.cfs_period_us").write_text("100000")
                (d / "cpu.cfs_quota_us").write_text(str(int(quota_cpus * 100000)))
            else:
                (d / "cpu.max").write_text(f"{int(quota_cpus * 100000)} 100000")
            return d / "cgroup.procs", d
        except OSError:
            try:
                d.rmdir()  # made, but its quota could not be set
            except OSError:
                pass
    return None
