"""The automatic CPU KV pool (engine/host_memory.py): room for MAX_NUM_SEQS full-context sequences, capped at half
the memory available at start, on simulated numbers; the reading of /proc/meminfo and the cgroup's limit on fake
files; the engine's plan and its start-up line."""

from __future__ import annotations

import logging
import os
import sys
import time

import pytest
import torch

from engine import ConfigError, EngineConfig, LLMEngine, ModelSpec, startup
from engine.host_memory import GIB, HostMemory, cpu_pool_bytes, read_host_memory

SMOLLM2_135M = {  # the default model's shapes: 23040 B of bf16 KV a token
    "architectures": ["LlamaForCausalLM"],
    "vocab_size": 49152,
    "hidden_size": 576,
    "intermediate_size": 1536,
    "num_hidden_layers": 30,
    "num_attention_heads": 9,
    "num_key_value_heads": 3,
    "max_position_embeddings": 8192,
    "rms_norm_eps": 1e-5,
    "rope_theta": 100000.0,
    "tie_word_embeddings": True,
}
BLOCK = 23040 * 16  # bytes of a 16-token block


def test_room_for_the_concurrency_within_half_the_memory():
    host = HostMemory(64 * GIB, "MemAvailable 64.0 GiB")
    size, why = cpu_pool_bytes(bytes_per_block=BLOCK, blocks_per_seq=512, max_num_seqs=8, host=host)
    assert size == 8 * 512 * BLOCK and why.startswith("automatic: room for MAX_NUM_SEQS=8")  # 1.4 GiB
    size, why = cpu_pool_bytes(bytes_per_block=BLOCK, blocks_per_seq=512, max_num_seqs=128, host=host)
    assert size == 128 * 512 * BLOCK and "22.5 GiB" not in why  # 22.5 GiB: within half of 64 GiB
    host = HostMemory(32 * GIB, "MemAvailable 32.0 GiB")
    size, why = cpu_pool_bytes(bytes_per_block=BLOCK, blocks_per_seq=512, max_num_seqs=128, host=host)
    assert size == 16 * GIB and "capped at half of MemAvailable 32.0 GiB" in why and "22.5 GiB" in why
    # a cgroup limit read lower than MemAvailable is what host.available says; tensor-parallel ranks share the cap
    small = HostMemory(2 * GIB, "the cgroup limit 2.0 GiB (memory.max)")
    size, why = cpu_pool_bytes(bytes_per_block=BLOCK, blocks_per_seq=512, max_num_seqs=128, host=small, ranks=2)
    assert size == GIB // 2 and "shared by 2 ranks" in why and "memory.max" in why
    # nothing readable: capped at 1 GiB
    size, why = cpu_pool_bytes(bytes_per_block=BLOCK, blocks_per_seq=512, max_num_seqs=128, host=HostMemory(None, "?"))
    assert size == GIB and "capped at 1.0 GiB" in why
    # one full-length sequence whenever the cap holds one: the capacity is whole sequences
    for avail in (2 * 512 * BLOCK, 4 * GIB, 100 * GIB):
        size, _ = cpu_pool_bytes(bytes_per_block=BLOCK, blocks_per_seq=512, max_num_seqs=3, host=HostMemory(avail, "x"))
        assert size >= 512 * BLOCK


def _files(tmp_path, meminfo: str | None, cgroup_line: str, limits: dict[str, str]):
    proc, cg = tmp_path / "proc", tmp_path / "cgroup"
    (proc / "self").mkdir(parents=True)
    if meminfo is not None:
        (proc / "meminfo").write_text(f"MemTotal:       65536000 kB\nMemAvailable:   {meminfo} kB\n")
    (proc / "self" / "cgroup").write_text(cgroup_line + "\n")
    for rel, text in limits.items():
        (cg / rel).parent.mkdir(parents=True, exist_ok=True)
        (cg / rel).write_text(text + "\n")
    return proc, cg


def test_reading_meminfo_and_the_cgroup_limit(tmp_path):
    mem = 8 * 1024 * 1024  # kB: 8 GiB
    # v2: the process's own cgroup unlimited ("max"), its parent limited to 4 GiB: the lower one counts
    proc, cg = _files(
        tmp_path / "a", str(mem), "0::/pod/worker", {"pod/worker/memory.max": "max", "pod/memory.max": str(4 * GIB)}
    )
    h = read_host_memory(proc, cg)
    assert h.available == 4 * GIB and "cgroup limit 4.0 GiB" in h.source and "pod/memory.max" in h.source
    # v1 with no limit (a page-rounded 2^63): MemAvailable
    proc, cg = _files(
        tmp_path / "b", str(mem), "4:memory:/x\n0::/", {"memory/x/memory.limit_in_bytes": str(9223372036854771712)}
    )
    assert read_host_memory(proc, cg) == HostMemory(8 * GIB, "MemAvailable 8.0 GiB")
    # v1 limited above MemAvailable: MemAvailable
    proc, cg = _files(tmp_path / "c", str(mem), "4:cpu,memory:/x", {"memory/x/memory.limit_in_bytes": str(16 * GIB)})
    assert read_host_memory(proc, cg).available == 8 * GIB
    # a container's namespace: its own cgroup is /, the limit at the root; no meminfo
    proc, cg = _files(tmp_path / "d", None, "0::/", {"memory.max": str(3 * GIB)})
    assert read_host_memory(proc, cg).available == 3 * GIB
    proc, cg = _files(tmp_path / "e", None, "0::/", {})
    assert read_host_memory(proc, cg).available is None
    # strict overcommit (vm.overcommit_memory=2): the whole mapping is charged, so the commit limit left counts
    proc, cg = _files(tmp_path / "f", str(mem), "0::/", {})
    (proc / "sys" / "vm").mkdir(parents=True)
    (proc / "sys" / "vm" / "overcommit_memory").write_text("2\n")
    with (proc / "meminfo").open("a") as f:
        f.write(f"CommitLimit:    {6 * 1024 * 1024} kB\nCommitted_AS:   {4 * 1024 * 1024} kB\n")
    h = read_host_memory(proc, cg)
    assert h.available == 2 * GIB and "overcommit_memory=2" in h.source
    (proc / "sys" / "vm" / "overcommit_memory").write_text("0\n")  # heuristic (the default): MemAvailable
    assert read_host_memory(proc, cg).available == 8 * GIB
    assert read_host_memory().available > 0  # this machine


def test_memory_room_is_what_meminfo_and_the_cgroups_leave_now(tmp_path):
    from engine.host_memory import memory_room

    mem = 8 * 1024 * 1024  # kB: 8 GiB
    # v2: the parent's 4 GiB limit with 3 GiB used leaves 1 GiB; the child's own (6 GiB, 1 used) leaves more
    proc, cg = _files(tmp_path / "a", str(mem), "0::/pod/worker", {
        "pod/worker/memory.max": str(6 * GIB), "pod/worker/memory.current": str(GIB),
        "pod/memory.max": str(4 * GIB), "pod/memory.current": str(3 * GIB)})  # fmt: skip
    assert memory_room(proc, cg) == GIB
    # v1, over its limit: nothing left
    proc, cg = _files(tmp_path / "b", str(mem), "4:memory:/x", {
        "memory/x/memory.limit_in_bytes": str(2 * GIB), "memory/x/memory.usage_in_bytes": str(3 * GIB)})  # fmt: skip
    assert memory_room(proc, cg) == 0
    # no limit: MemAvailable; a limit whose usage cannot be read counts for nothing
    assert memory_room(*_files(tmp_path / "c", str(mem), "0::/", {"memory.max": str(GIB)})) == 8 * GIB
    assert memory_room(*_files(tmp_path / "d", None, "0::/", {})) is None
    assert memory_room() > 0  # this machine


def test_plan_memory_sizes_the_cpu_pool_from_the_host():
    spec = ModelSpec.from_hf(SMOLLM2_135M)

    def plan(host, **kw):
        return startup.plan_memory(EngineConfig(**kw), spec, None, torch.bfloat16, host=host)

    big = HostMemory(100 * GIB, "MemAvailable 100.0 GiB")
    p = plan(big, max_num_seqs=4)
    assert (p.num_blocks, p.max_model_len, p.max_concurrent_seqs) == (4 * 512, 8192, 4.0)
    assert p.sized_by.startswith("automatic: room for MAX_NUM_SEQS=4") and p.sized_by in p.describe()
    p = plan(big, max_num_seqs=4, max_model_len=1000)  # MAX_MODEL_LEN is the context: 63 blocks a sequence
    assert (p.num_blocks, p.max_model_len) == (4 * 63, 1000)
    p = plan(HostMemory(8 * GIB, "MemAvailable 8.0 GiB"))  # 128 x 8192 tokens: 22.5 GiB, capped at 4 GiB
    assert p.num_blocks == 4 * GIB // BLOCK and p.max_model_len == 8192 and "capped at half" in p.sized_by
    p = plan(big, kv_cache_memory=GIB)  # given: as before, nothing said about it
    assert p.num_blocks == GIB // BLOCK and p.sized_by == ""
    assert plan(big, num_kv_blocks=64).num_blocks == 64
    with pytest.raises(ConfigError, match="Or set KV_CACHE_MEMORY"):  # the cap holds fewer tokens than asked
        plan(HostMemory(GIB // 4, "MemAvailable 0.2 GiB"), max_model_len=8192)


def test_the_start_logs_how_the_pool_was_sized(tiny_llama, caplog):
    cfg = EngineConfig(model=str(tiny_llama), dtype="float32", max_num_seqs=4, log_stats_interval=0)
    with caplog.at_level(logging.INFO, logger="engine"):
        eng = LLMEngine(cfg)
    assert eng.memory.num_blocks == 4 * 512 // 16 and eng.memory.max_model_len == 512
    line = next(r.getMessage() for r in caplog.records if "KV cache:" in r.getMessage())
    assert "automatic: room for MAX_NUM_SEQS=4 full-context sequences (within half of MemAvailable" in line


def test_the_engine_gives_the_heap_back_when_it_goes_idle(tiny_llama, monkeypatch):
    """After a busy spell the loop calls trim_heap once as it goes idle (not while requests run, not again while
    idle), at most every TRIM_INTERVAL_S."""
    import asyncio

    import engine.async_engine as ae
    from engine import EngineConfig, SamplingParams

    calls = []
    monkeypatch.setattr(ae, "trim_heap", lambda: (calls.append(time.monotonic()), (0.0, 0))[1])
    monkeypatch.setattr(ae, "TRIM_INTERVAL_S", 0.5)
    eng = ae.AsyncEngine(EngineConfig(model=str(tiny_llama), dtype="float32", num_kv_blocks=64, log_stats_interval=0))

    async def one():
        params = SamplingParams(max_tokens=4, temperature=0, ignore_eos=True)
        return [o async for o in eng.generate({"prompt_token_ids": [3, 4, 5]}, params)]

    try:
        assert asyncio.run(one())[-1].finished
        deadline = time.monotonic() + 5
        while not calls and time.monotonic() < deadline:
            time.sleep(0.01)
        time.sleep(0.2)  # idle: no second call
        assert len(calls) == 1
        asyncio.run(one())  # busy again, idle again within the interval: the trim waits for it, then comes
        deadline = time.monotonic() + 5
        while len(calls) < 2 and time.monotonic() < deadline:
            time.sleep(0.01)
        assert len(calls) == 2 and calls[1] - calls[0] >= 0.5
    finally:
        eng.shutdown()


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="glibc's malloc_trim and /proc")
def test_trim_heap_gives_back_free_pages_and_says_how_much():
    from engine.host_memory import trim_heap

    blocks = [bytearray(8192) for _ in range(8192)]  # 64 MiB of malloc's heap, touched (zero-filled)
    keep = blocks[-1]  # holds the heap's top: malloc cannot give the pages below it back by itself
    del blocks
    took, returned = trim_heap()
    assert returned > 32 << 20, returned
    assert 0 <= took < 1.0
    del keep


def test_the_engine_gives_the_heap_back_under_a_load_that_never_lets_it_go_idle(tiny_llama, monkeypatch):
    """A loop that is never idle still trims, between steps, every TRIM_BUSY_INTERVAL_S."""
    import asyncio

    import engine.async_engine as ae
    from engine import EngineConfig, SamplingParams

    calls = []
    monkeypatch.setattr(ae, "TRIM_INTERVAL_S", 100.0)  # no idle trim in this test
    monkeypatch.setattr(ae, "TRIM_BUSY_INTERVAL_S", 0.05)
    eng = ae.AsyncEngine(EngineConfig(model=str(tiny_llama), dtype="float32", num_kv_blocks=64, log_stats_interval=0))
    monkeypatch.setattr(
        ae, "trim_heap", lambda: (calls.append((time.monotonic(), eng.engine.has_unfinished())), (0.0, 0))[1]
    )

    async def long_one():
        params = SamplingParams(max_tokens=400, temperature=0, ignore_eos=True)
        t0 = time.monotonic()
        outs = [o async for o in eng.generate({"prompt_token_ids": [3, 4, 5]}, params)]
        return outs, time.monotonic() - t0

    try:
        outs, took = asyncio.run(long_one())
        assert outs[-1].finished and len(outs[-1].outputs[0].token_ids) == 400
    finally:
        eng.shutdown()
    during = [t for t, busy in calls if busy]
    assert took > 0.2 and len(during) >= 2, (took, calls)  # while the request ran
    assert all(b - a >= 0.05 for a, b in zip(during, during[1:]))  # not more often than the interval


def test_reading_the_cgroups_cpu_quota(tmp_path):
    from engine.host_memory import cpu_quota

    # v2: the own cgroup unlimited ("max"), its parent at 1.5 CPUs, the root's file absent: 1.5, from the parent
    proc, cg = _files(tmp_path / "a", None, "0::/pod/worker", {
        "pod/worker/cpu.max": "max 100000", "pod/cpu.max": "150000 100000"})  # fmt: skip
    assert cpu_quota(proc, cg) == (1.5, str(cg / "pod" / "cpu.max"))
    # v1 (cpu,cpuacct mounted as cpu): -1 is no quota; 50 ms of a 100 ms period is half a CPU; the lowest counts
    proc, cg = _files(tmp_path / "b", None, "3:cpu,cpuacct:/x/y\n4:memory:/x", {
        "cpu/x/y/cpu.cfs_quota_us": "-1", "cpu/x/y/cpu.cfs_period_us": "100000",
        "cpu/x/cpu.cfs_quota_us": "400000", "cpu/x/cpu.cfs_period_us": "100000",
        "cpu/cpu.cfs_quota_us": "50000", "cpu/cpu.cfs_period_us": "100000"})  # fmt: skip
    assert cpu_quota(proc, cg) == (0.5, str(cg / "cpu" / "cpu.cfs_quota_us"))
    # v1 mounted under the joint name only (no "cpu" link), a period of 50 ms: 150 ms of it is 3 CPUs
    proc, cg = _files(tmp_path / "b2", None, "3:cpu,cpuacct:/x", {
        "cpu,cpuacct/x/cpu.cfs_quota_us": "150000", "cpu,cpuacct/x/cpu.cfs_period_us": "50000"})  # fmt: skip
    assert cpu_quota(proc, cg) == (3.0, str(cg / "cpu,cpuacct" / "x" / "cpu.cfs_quota_us"))
    # a container's namespace (its cgroup is /), a quota of 2 CPUs at the root; none anywhere; nothing readable
    proc, cg = _files(tmp_path / "c", None, "0::/", {"cpu.max": "200000 100000"})
    assert cpu_quota(proc, cg)[0] == 2.0
    proc, cg = _files(tmp_path / "d", None, "0::/", {"cpu.max": "max 100000"})
    assert cpu_quota(proc, cg) is None
    assert cpu_quota(tmp_path / "nothing", tmp_path / "nothing") is None


def test_physical_cores_count_the_cores_the_cpus_sit_on(tmp_path):
    from engine.host_memory import physical_cores

    for cpu, pkg, core in ((0, 0, 0), (1, 0, 0), (2, 0, 1), (3, 0, 1), (4, 1, 0)):  # two threads a core; 2 packages
        topo = tmp_path / f"cpu{cpu}" / "topology"
        topo.mkdir(parents=True)
        (topo / "physical_package_id").write_text(f"{pkg}\n")
        (topo / "core_id").write_text(f"{core}\n")
    assert physical_cores({0, 1, 2, 3, 4}, tmp_path) == 3
    assert physical_cores({0, 2}, tmp_path) == 2 and physical_cores({0, 1}, tmp_path) == 1
    assert physical_cores({0, 9}, tmp_path) is None  # cpu9's topology unreadable
    for cpu in (0, 1):  # where the kernel lists a core's CPUs, that list is the core (core_id may repeat elsewhere)
        (tmp_path / f"cpu{cpu}" / "topology" / "core_cpus_list").write_text("0-1\n")
    (tmp_path / "cpu2" / "topology" / "core_cpus_list").write_text("2-3\n")
    assert physical_cores({0, 1, 2}, tmp_path) == 2
    here = physical_cores(os.sched_getaffinity(0))  # this machine: None where a sandbox hides the topology
    assert here is None or 1 <= here <= len(os.sched_getaffinity(0))
