"""One OpenMP pool, the step loop's (engine/openmp.py): a second one makes libgomp's workers sleep between the
hundreds of parallel regions of a step. Each check runs in a fresh process, whose threads it can count: a thread's
pool is there when ending it ends a thread."""

from __future__ import annotations

import json
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from tests.lora_fixtures import make_peft_adapter

REPO = Path(__file__).resolve().parents[1]

PROBE = """
import json, os, torch
from engine.openmp import release_openmp_threads

torch.set_num_threads(2)


def pool_ended() -> int:
    '''How many threads ending this thread's OpenMP pool ended: 0 when it had none. (Joined, a worker may still be
    listed for a moment: looked for up to 1 s.)'''
    import time
    before = set(os.listdir("/proc/self/task"))
    release_openmp_threads()
    deadline = time.monotonic() + 1
    while not (gone := before - set(os.listdir("/proc/self/task"))) and time.monotonic() < deadline:
        time.sleep(0.02)
    return len(gone)


def parallel_region() -> None:
    '''A region on both threads, as a model load or an adapter's padding makes: 2^20 elements, past torch's grain.'''
    torch.ones(1 << 20).add_(1)
"""


def run(script: str) -> dict:
    out = subprocess.run(
        [sys.executable, "-c", PROBE + textwrap.dedent(script)], cwd=REPO, capture_output=True, text=True, timeout=300
    )
    assert out.returncode == 0, out.stderr[-3000:]
    return json.loads(out.stdout.strip().splitlines()[-1])


def test_release_ends_the_calling_threads_pool_and_no_other():
    got = run("""
        import threading
        parallel_region()
        other = []  # a second thread's pool, made and measured while this one's is gone
        parallel_region()
        first = pool_ended()
        second = pool_ended()
        t = threading.Thread(target=lambda: (parallel_region(), other.append(pool_ended())))
        t.start(); t.join()
        import time  # joined, its OS thread may still be listed: gone before the next count, which it would join
        deadline = time.monotonic() + 1
        while str(t.native_id) in os.listdir("/proc/self/task") and time.monotonic() < deadline:
            time.sleep(0.02)
        parallel_region()  # a new pool after a release
        print(json.dumps({"first": first, "second": second, "other": other[0], "again": pool_ended()}))
    """)
    assert got == {"first": 1, "second": 0, "other": 1, "again": 1}


@pytest.mark.slow
def test_only_the_step_loop_keeps_a_pool_after_a_build_and_an_adapter_load(lora_bases, tmp_path):
    """The building thread (here the main one) and the LoRA loader threads hand their pools back; the probe can tell
    (the first test), and both made one: the main thread by a parallel region before the build, the loader by
    padding a rank-256 adapter (2 layers x 3 x 256 x 64 zeros)."""
    adapter, _ = make_peft_adapter(lora_bases["llama"], tmp_path / "a1", r=4, seed=1)
    got = run(f"""
        import asyncio, threading
        from engine import AsyncEngine, LoRARequest, SamplingParams

        parallel_region()
        eng = AsyncEngine(
            model={str(lora_bases["llama"])!r}, dtype="float32", num_threads=2, enable_lora=True, max_lora_rank=256,
            lora_modules=(("a1", {str(adapter)!r}),), cache_root={str(tmp_path / "cache")!r},
        )
        main = pool_ended()

        async def one():
            params = SamplingParams(temperature=0, max_tokens=4, ignore_eos=True)
            return [o async for o in eng.generate({{"prompt_token_ids": [5, 17, 42]}}, params, lora=LoRARequest("a1"))]

        outs = asyncio.run(one())
        loaders, lock, meet = [], threading.Lock(), threading.Barrier(4)

        def probe():  # on 4 loader threads at once (the one that loaded among them), measured one at a time
            meet.wait()
            with lock:
                loaders.append(pool_ended())

        pool = eng.engine.lora._pool
        for f in [pool.submit(probe) for _ in range(4)]:
            f.result()
        eng.shutdown()
        print(json.dumps({{"main": main, "loaders": loaders, "loads": eng.engine.lora.num_loads, "out": len(outs)}}))
    """)
    assert got["out"] > 0 and got["loads"] == 1
    assert got["main"] == 0, "the thread that built the engine kept its OpenMP pool"
    assert got["loaders"] == [0, 0, 0, 0], "a LoRA loader thread kept its OpenMP pool"
