"""A CPU pool's open region (engine/block_manager.py with `chunk`): blocks are handed out from [0, num_open), which
grows a chunk at a time so that a chunk stays free; the unopened blocks count as free; cached blocks are evicted
inside the region before it grows. Then a CPU engine with the automatic pool: the region follows the load."""

from __future__ import annotations

import pytest

from engine.block_manager import BlockManager
from engine.types import Request, SamplingParams


def req(rid: str, tokens: list[int]) -> Request:
    return Request(rid, list(tokens), SamplingParams(max_tokens=100), eos_token_ids=frozenset({0}), cache_key=("base",))


def admit(bm: BlockManager, r: Request) -> bool:
    hits = bm.find_cached(r)
    ok = bm.allocate_slots(r, r.num_tokens - len(hits) * bm.block_size, hits)
    if ok:
        r.num_computed_tokens = len(hits) * bm.block_size
    return ok


def distinct(n: int, start: int) -> list[int]:
    return list(range(start, start + n))


def test_the_region_opens_by_chunks_keeping_a_chunk_free():
    opened = []
    bm = BlockManager(20, 4, chunk=4, on_open=opened.append)
    assert bm.num_open == 4 and list(bm.free_queue) == [0, 1, 2, 3]
    assert bm.num_free_blocks == 20 and bm.usage() == 0.0  # the unopened blocks count as free
    a = req("a", distinct(4, 100))
    assert admit(bm, a)  # 4 - 1 < a chunk: the next chunk opens first; the lowest free block goes out
    assert bm.num_open == 8 and opened == [8] and a.block_ids == [0]
    assert list(bm.free_queue) == [4, 5, 6, 7, 1, 2, 3]
    assert bm.num_free_blocks == 19 and bm.usage() == pytest.approx(1 / 20)
    b = req("b", distinct(8, 200))
    assert admit(bm, b)  # 7 - 2 >= 4: no growth
    assert bm.num_open == 8 and opened == [8] and b.block_ids == [1, 2]
    c = req("c", distinct(12, 300))
    assert admit(bm, c)  # 5 - 3 < 4: one chunk more (once: 9 - 3 >= 4); a run of consecutive blocks
    assert bm.num_open == 12 and opened == [8, 12] and c.block_ids == [3, 4, 5]
    bm.free(a), bm.free(b), bm.free(c)
    assert bm.num_free_blocks == 20 and bm.num_open == 12  # the region stays: its pages are resident already


def test_only_the_whole_pool_running_out_fails():
    opened = []
    bm = BlockManager(10, 4, chunk=3, on_open=opened.append)
    big = req("big", distinct(40, 100))  # 10 blocks: every chunk opens, in one call
    assert admit(bm, big) and bm.num_open == 10 and opened == [10] and sorted(big.block_ids) == list(range(10))
    assert bm.num_free_blocks == 0 and bm.usage() == 1.0
    one = req("one", [7])
    assert not admit(bm, one) and one.block_ids == [] and opened == [10]
    bm2 = BlockManager(10, 4, chunk=3, on_open=opened.append)
    assert not admit(bm2, req("too-big", distinct(44, 100)))  # 11 blocks: refused, nothing opened
    assert bm2.num_open == 3 and opened == [10] and len(bm2.free_queue) == 3


def test_cached_blocks_are_evicted_inside_the_region_before_it_grows():
    opened = []
    bm = BlockManager(100, 4, chunk=4, on_open=opened.append)
    prompt = distinct(33, 1000)  # 8 full blocks (cached) and a partial one
    a = req("a", prompt)
    assert admit(bm, a) and bm.num_open == 16 and opened == [16]  # 16 - 9 >= 4
    bm.free(a)  # 16 free: 8 of them cached, the others never used or the partial one
    for rid in ("b", "c"):  # 4 blocks each: the 8 blocks holding nothing go first, no growth
        assert admit(bm, req(rid, distinct(16, 2000 if rid == "b" else 3000)))
    assert bm.num_open == 16 and bm.evictions == 0 and len(bm.cached) == 8 + 8
    d = req("d", distinct(8, 4000))  # 8 free (a's cached blocks) - 2 >= 4: the two least recent are evicted
    assert admit(bm, d) and bm.num_open == 16 and bm.evictions == 2
    assert len(bm.find_cached(req("a again", prompt))) == 6  # a's tail went first; its first 6 blocks still hit
    e = req("e", distinct(16, 5000))  # 6 - 4 < 4: now the region grows, and the new blocks go first
    assert admit(bm, e) and bm.num_open == 20 and opened == [16, 20] and e.block_ids == [16, 17, 18, 19]
    assert bm.evictions == 2


def test_a_quarter_of_a_large_region_stays_free_for_cached_prefixes():
    bm = BlockManager(1000, 4, chunk=4)
    held = [req(f"r{i}", distinct(40, 1000 * i)) for i in range(30)]  # 10 blocks each: 300 in use
    for r in held:
        assert admit(bm, r)
    free_in_region = len(bm.free_queue)
    assert free_in_region >= bm.num_open // 4 - 4 and bm.num_open <= 300 * 4 // 3 + 8, (bm.num_open, free_in_region)
    for r in held:
        bm.free(r)
    again = [req(f"again{i}", distinct(40, 1000 * i)) for i in range(30)]  # the same prompts: the region kept them
    hits = sum(len(bm.find_cached(r)) for r in again)
    assert hits == 30 * 9  # every full block but each prompt's last (one token is left to compute)


def test_without_a_chunk_the_whole_pool_is_open():
    bm = BlockManager(8, 4)
    assert bm.num_open == 8 and list(bm.free_queue) == list(range(8)) and bm.stats()["kv_open_blocks"] == 8
    assert BlockManager(8, 4, chunk=100).num_open == 8  # a chunk past the pool: all of it
    with pytest.raises(ValueError):
        BlockManager(8, 4, chunk=0)


def test_cpu_engine_with_the_automatic_pool_opens_what_the_load_uses(tiny_llama, monkeypatch):
    """The tiny model's automatic pool holds 128 sequences of its 512-token context (4096 blocks); with 64 KiB
    chunks (8 blocks; 64 MiB would be the whole pool) a few requests open a few chunks, and the tokens are those of
    a fixed pool open from the start."""
    from engine import LLM, kv_cache

    monkeypatch.setattr(kv_cache, "CHUNK_BYTES", 64 << 10)
    prompts = [{"prompt_token_ids": distinct(20 + 9 * i, 3 + i)} for i in range(6)]
    params = SamplingParams(temperature=0, max_tokens=16, ignore_eos=True)
    fixed = LLM(str(tiny_llama), dtype="float32", num_kv_blocks=64, log_stats_interval=0)
    want = [o.outputs[0].token_ids for o in fixed.generate(prompts, params)]
    llm = LLM(str(tiny_llama), dtype="float32", log_stats_interval=0)
    got = [o.outputs[0].token_ids for o in llm.generate(prompts, params)]
    eng = llm.engine
    bm, pf = eng.block_manager, eng.kv_prefault
    assert got == want
    assert bm.num_blocks == eng.memory.num_blocks == 128 * 512 // 16 and bm.chunk == pf.chunk == 8
    assert eng.memory.sized_by.startswith("automatic: room for MAX_NUM_SEQS=128")
    # six requests of at most 81 tokens: 6 blocks each at most, all in one step
    assert bm.num_open <= 6 * 6 + 2 * 8 and bm.num_open * 20 < bm.num_blocks
    pf.wait()
    assert pf.target == min(bm.num_open + 8, bm.num_blocks)  # populated a chunk ahead of the region
    assert eng.stats()["kv_open_blocks"] == bm.num_open and eng.stats()["kv_usage"] == 0.0


def test_a_draft_models_pool_grows_with_the_targets(tiny_llama, monkeypatch):
    """A draft model writes under the target's block ids: its pool is faulted in by the same Prefaulter, as far as
    the target's, and speculation over a growing region gives the plain engine's greedy tokens."""
    from engine import LLM, kv_cache

    monkeypatch.setattr(kv_cache, "CHUNK_BYTES", 64 << 10)  # 4 blocks of the target's and the draft's KV
    prompts = [{"prompt_token_ids": [5, 9, 13] * (3 + i)} for i in range(4)]
    params = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True)
    plain = LLM(str(tiny_llama), dtype="float32", num_kv_blocks=64, log_stats_interval=0)
    want = [o.outputs[0].token_ids for o in plain.generate(prompts, params)]
    spec = {"model": str(tiny_llama), "num_speculative_tokens": 3}
    llm = LLM(str(tiny_llama), dtype="float32", max_num_seqs=8, log_stats_interval=0, speculative_config=spec)
    assert [o.outputs[0].token_ids for o in llm.generate(prompts, params)] == want
    eng = llm.engine
    pf, bm = eng.kv_prefault, eng.block_manager
    assert pf.chunk == bm.chunk == 4 and 8 < bm.num_open < bm.num_blocks
    pf.wait()
    assert [p.num_blocks for p in pf._pools] == [bm.num_blocks] * 2  # the target's pool and the draft's
    assert all(p.done == pf.target == min(bm.num_open + 4, bm.num_blocks) for p in pf._pools)


def test_a_sequence_grows_into_the_block_after_its_last_and_else_takes_the_lowest_free():
    """Runs of consecutive blocks per sequence: the CPU attention reads them faster (BlockManager's docstring)."""
    bm = BlockManager(32, 4)
    a, b, c = req("a", distinct(3, 100)), req("b", distinct(8, 200)), req("c", distinct(3, 300))
    assert admit(bm, a) and admit(bm, b) and admit(bm, c)
    assert (a.block_ids, b.block_ids, c.block_ids) == ([0], [1, 2], [3])
    b.num_computed_tokens = 8
    assert bm.allocate_slots(b, 1) and b.block_ids == [1, 2, 4]  # 3 is c's: the lowest free
    bm.free(a), bm.free(c)  # partial blocks: nothing cached; c's (3) was freed last
    b.num_computed_tokens = 12
    assert bm.allocate_slots(b, 1) and b.block_ids == [1, 2, 4, 5]  # after its last
    d = req("d", distinct(3, 400))
    assert admit(bm, d) and d.block_ids == [0]  # the lowest, not the most recently freed
    bm.free(b)  # its prompt's two full blocks are cached: kept, handed out after every plain block
    e = req("e", distinct(40, 500))
    assert admit(bm, e) and e.block_ids[0] == 3 and not {1, 2} & set(e.block_ids), e.block_ids
