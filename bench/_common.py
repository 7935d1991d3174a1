"""Shared helpers for the scripts in bench/: the default model, a seeded token-id workload, timing, the GEMM
roofline, the machine line, and writing one marked section of docs/benchmarks.md."""

from __future__ import annotations

import os
import platform
import re
import subprocess
import time
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch

REPO = Path(__file__).resolve().parents[1]
LOW_ID = 20  # SmolLM2's special tokens sit below this id


def default_model_path() -> Path:
    """The embedded SmolLM2-135M-Instruct, converted to an HF-loadable bf16 folder (once, cached)."""
    from engine.config import default_cache_root
    from engine.weights.default_model import ensure_default_model

    return ensure_default_model(Path(default_cache_root()))


def hf_greedy(path: Path, prompts: list[list[int]], max_new_tokens: int, top_n: int = 5, device: str = "cpu"):
    """HF transformers fp32 greedy, one prompt at a time (no padding): the parity reference. Returns
    [(new token ids, [per-step {token: logprob} of the top N])]."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(str(path), dtype=torch.float32).to(device)
    model.eval()
    results = []
    for ids in prompts:
        with torch.no_grad():
            out = model.generate(
                torch.tensor([ids], device=device),
                max_new_tokens=max_new_tokens,
                do_sample=False,
                output_logits=True,
                return_dict_in_generate=True,
                pad_token_id=2,
            )
        new = out.sequences[0, len(ids) :].tolist()
        tops = []
        for step_logits in out.logits[: len(new)]:
            lp = torch.log_softmax(step_logits[0].float(), -1)
            v, i = lp.topk(top_n)
            tops.append(dict(zip(i.tolist(), v.tolist())))
        results.append((new, tops))
    return results


def logprobs_mismatch(ours: list[int], ours_lp: list[dict], ref: list[int], ref_lp: list[dict], atol: float | None):
    """vLLM's check_logprobs_close: at the first differing position each side's token must be in the other's
    top-N (then stop); where the tokens agree, the chosen token's logprob must be within atol (None: not checked).
    Returns why they are not close, or None."""
    for pos, (a, b) in enumerate(zip(ours, ref)):
        if a != b:
            if a in ref_lp[pos] and b in ours_lp[pos]:
                return None
            return f"position {pos}: ours {a} vs ref {b}; not in each other's top-N"
        if atol is not None and b in ref_lp[pos] and abs(ours_lp[pos][a] - ref_lp[pos][b]) >= atol:
            return f"position {pos}: logprob {ours_lp[pos][a]:.5f} vs ref {ref_lp[pos][b]:.5f}"
    return None


def gpu_summary(ok: bool, line: str, tiny: bool = False) -> str:
    """One PASS/FAIL line of the GPU check: printed, and (not in --tiny runs) appended to .gpu-results/summary.txt,
    which bench/gpu_check.sh prints last."""
    text = f"{'PASS' if ok else 'FAIL'} {line}"
    if not tiny:
        path = Path(__file__).resolve().parents[1] / ".gpu-results" / "summary.txt"
        path.parent.mkdir(exist_ok=True)
        with path.open("a") as f:
            f.write(text + "\n")
    print(text, flush=True)
    return text


PACKAGES = ("engine", "handler", "kernels", "warmup")  # what a worker start imports of ours


def byte_compile() -> None:
    """Compile our packages' bytecode into __pycache__, as a user's worker has it (the image's `pip install .`
    compiles it; a laptop writes it on the first run). Without it a machine with PYTHONDONTWRITEBYTECODE=1, as
    this one, compiles every module from source in every start the benches time: about 0.3 s of the imports."""
    import compileall

    for pkg in PACKAGES:
        compileall.compile_dir(str(REPO / pkg), quiet=2)


def cat_seconds(files: list[Path]) -> float:
    """Seconds for `cat` to read `files` (the disk's speed for them, cold or warm as the page cache is)."""
    t = time.perf_counter()
    subprocess.run(["cat", *map(str, files)], stdout=subprocess.DEVNULL, check=True)
    return time.perf_counter() - t


def map_seconds(files: list[Path]) -> float:
    """Seconds for this process to map `files` and fault every page in (MADV_POPULATE_READ; else one read a page):
    what any loader that keeps the bytes addressable pays for them, with no process start (unlike `cat`)."""
    import mmap

    import numpy as np

    from engine.host_memory import madvise

    t = time.perf_counter()
    for f in files:
        with open(f, "rb") as fh:
            mm = mmap.mmap(fh.fileno(), 0, access=mmap.ACCESS_COPY)
        a = np.frombuffer(mm, dtype=np.uint8)
        if madvise([(a.ctypes.data, a.size)], 22) != 0:  # MADV_POPULATE_READ: Linux 5.14+
            int(a[::4096].sum())
        del a
        mm.close()
    return time.perf_counter() - t


def drop_cache(files) -> None:
    """Evict the files from the page cache (clean pages only, hence the fsync first): the next read is cold."""
    for f in files:
        fd = os.open(f, os.O_RDONLY)
        try:
            os.fsync(fd)
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        finally:
            os.close(fd)


def cpu_pressure() -> str:
    """/proc/pressure/cpu 'some avg60': the share of time something waited for a CPU (other processes too)."""
    try:
        line = Path("/proc/pressure/cpu").read_text().splitlines()[0]
        return next(f.split("=")[1] for f in line.split() if f.startswith("avg60=")) + " %"
    except (OSError, IndexError, StopIteration):
        return "n/a"


def sync(device: str) -> None:
    if device.startswith("cuda"):
        torch.cuda.synchronize()


def gemm_gflops(dtype: torch.dtype, device: str = "cpu", n: int = 2048, reps: int = 5) -> tuple[float, str]:
    """Best-of-`reps` dense n x n x n GEMM rate, as our linears run it (x @ w.T): the ceiling the GEMM-bound part of a
    forward can reach; and the dtype it ran in. On a CPU where oneDNN has no bf16 GEMM our bf16 linears run our AVX2
    GEMM with fp32 sums (engine/layers/dense.py), so the roofline there is MKL's fp32 GEMM: torch's bf16 GEMM ran at
    1-20 GFLOP/s on an AVX2 EPYC, against 120-170 for fp32."""
    from engine.layers.dense import onednn_bf16

    label = str(dtype).removeprefix("torch.")
    if device == "cpu" and dtype == torch.bfloat16 and not onednn_bf16():
        dtype, label = (
            torch.float32,
            "float32 (oneDNN has no bf16 GEMM for this CPU: our bf16 linears run our AVX2 GEMM, fp32 sums)",
        )
    a = torch.randn(n, n, device=device).to(dtype)
    b = torch.randn(n, n, device=device).to(dtype)
    torch.nn.functional.linear(a, b)  # warm up (oneDNN / cuBLAS picks its kernel here)
    best = float("inf")
    for _ in range(reps):
        sync(device)
        t = time.perf_counter()
        torch.nn.functional.linear(a, b)
        sync(device)
        best = min(best, time.perf_counter() - t)
    return 2 * n**3 / best / 1e9, label


@dataclass
class Workload:
    prompts: list[list[int]]
    out_lens: list[int]

    @property
    def n_prompt(self) -> int:
        return sum(map(len, self.prompts))

    @property
    def n_out(self) -> int:
        return sum(self.out_lens)


def make_workload(n, pmin, pmax, omin, omax, vocab, seed, low_id=LOW_ID) -> Workload:
    """n requests of random token ids in [low_id, vocab); lengths uniform in the closed ranges; seeded."""
    rng = np.random.default_rng(seed)
    plens, olens = rng.integers(pmin, pmax + 1, n), rng.integers(omin, omax + 1, n)
    return Workload([rng.integers(low_id, vocab, int(p)).tolist() for p in plens], [int(o) for o in olens])


def timed(fn, device):
    sync(device)
    t = time.perf_counter()
    fn()
    sync(device)
    return time.perf_counter() - t


def machine_line(device: str) -> str:
    cpu = platform.processor() or ""
    try:
        cpu = next(line.split(":", 1)[1].strip() for line in open("/proc/cpuinfo") if line.startswith("model name"))
    except (OSError, StopIteration):
        pass
    gpu = f", {torch.cuda.get_device_name()}" if device.startswith("cuda") else ""
    import transformers

    return (
        f"{cpu or 'unknown CPU'}, torch threads: {torch.get_num_threads()}{gpu}; torch {torch.__version__}, "
        f"transformers {transformers.__version__}"
    )


def kernel_at(cls, rev: str, *key):
    """`cls` (a kernels.cpu_build.NativeKernel) built from git revision `rev`'s copy of its C source, as a subclass of
    its own (its own build, beside ours): for the benches' `--against REV`. Returns it loaded, or with its error."""
    import tempfile

    from kernels.cpu_build import local_headers

    repo = Path(__file__).resolve().parents[1]
    src = Path(tempfile.mkdtemp()) / cls.SOURCE.name
    rel = cls.SOURCE.resolve().relative_to(repo)

    def show(path: Path) -> str:
        return subprocess.run(["git", "show", f"{rev}:{path}"], cwd=repo, check=True, capture_output=True,
                              text=True).stdout  # fmt: skip

    src.write_text(show(rel))
    for h in local_headers(src):  # the headers it includes, at the same revision
        (src.parent / h).write_text(show(rel.parent / h))
    return type(f"{cls.__name__}At", (cls,), {"SOURCE": src}).get(*key, src.parent / "build", wait=True)


def producer(command: str, device: str) -> str:
    """The line a bench writes at the top of its docs section: the command that printed it, the date and the
    machine (tests/test_docs_figures.py requires both beside every figure)."""
    import time

    return f"`{command}` on {time.strftime('%Y-%m-%d')}: {machine_line(device)}."


def write_section(md: Path, key: str, body: str, title: str = "# Benchmarks") -> None:
    """Replace the text between `<!-- key:start -->` and `<!-- key:end -->` in `md`, appending the marked
    section if absent and creating the file (with `title`) if missing. Other sections are left alone."""
    start, end = f"<!-- {key}:start -->", f"<!-- {key}:end -->"
    block = f"{start}\n{body.strip()}\n{end}"
    text = (
        md.read_text()
        if md.is_file()
        else f"{title}\n\nGenerated by the scripts in `bench/`; numbers from one "
        f"machine are comparable only within a section.\n"
    )
    pattern = re.compile(re.escape(start) + r".*?" + re.escape(end), re.S)
    text = pattern.sub(lambda _: block, text) if pattern.search(text) else text.rstrip() + "\n\n" + block + "\n"
    md.parent.mkdir(parents=True, exist_ok=True)
    md.write_text(text)


def snapshot_check_seconds(weights: Path) -> tuple[float, float]:
    """Seconds to check an fp8 snapshot's weights file: one SHA-256 of the whole file (how snapshots were checked
    before the pieces), then the engine's check (a SHA-256 per piece, on every core)."""
    from engine.weights import fp8_snapshot
    from engine.weights.default_model import sha256_file

    t = time.perf_counter()
    sha256_file(weights)
    whole = time.perf_counter() - t
    t = time.perf_counter()
    assert fp8_snapshot.valid(weights.parent)
    return whole, time.perf_counter() - t
