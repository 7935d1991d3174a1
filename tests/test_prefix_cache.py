"""Automatic prefix caching: the block manager with exact block ids (no model), then the engine, whose
outputs must not change when caching is switched on."""

from __future__ import annotations

import pytest

from engine.block_manager import BlockManager
from engine.scheduler import Scheduler
from engine.types import Request, SamplingParams


def req(rid: str, tokens: list[int], key: tuple = ("base",), max_tokens: int = 100) -> Request:
    return Request(
        rid, list(tokens), SamplingParams(max_tokens=max_tokens), eos_token_ids=frozenset({0}), cache_key=key
    )


def admit(bm: BlockManager, r: Request) -> list[int]:
    """What the scheduler does at admission: take the cached prefix, allocate the rest."""
    hits = bm.find_cached(r)
    assert bm.allocate_slots(r, r.num_tokens - len(hits) * bm.block_size, hits)
    r.num_computed_tokens = len(hits) * bm.block_size
    return hits


P = list(range(1, 11))  # 10 tokens: two full blocks of 4, and a partial one


def test_hit_shares_full_blocks_and_never_the_partial_one():
    bm = BlockManager(num_blocks=8, block_size=4)
    a, b = req("a", P), req("b", P)
    assert admit(bm, a) == [] and a.block_ids == [0, 1, 2]
    assert admit(bm, b) == [0, 1] and b.block_ids == [0, 1, 3]  # the partial 3rd block is b's own
    assert b.num_computed_tokens == 8
    assert bm.ref_counts[:4] == [2, 2, 1, 1]
    assert len(bm.cached) == 2  # only full blocks are findable


def test_partial_hit_and_at_least_one_token_computed():
    bm = BlockManager(num_blocks=8, block_size=4)
    a = req("a", P)
    admit(bm, a)
    c = req("c", P[:4] + [99] + P[5:])  # differs inside the second block
    assert admit(bm, c) == [0] and c.block_ids == [0, 3, 4]
    # a prompt that is exactly the two cached blocks: the last one is recomputed to get logits
    d = req("d", P[:8])
    assert admit(bm, d) == [0] and d.num_computed_tokens == 4 and d.block_ids == [0, 5]


def test_freed_blocks_stay_findable_then_lru_eviction():
    bm = BlockManager(num_blocks=4, block_size=4)
    a = req("a", P)
    admit(bm, a)  # [0, 1, 2]; 0 and 1 cached, 2 partial
    bm.free(a)
    assert bm.ref_counts == [0] * 4 and bm.num_free_blocks == 4
    # the unhashed partial block is reused first; the cached ones wait, tail first (1 before 0)
    assert list(bm.free_queue) == [2, 3, 1, 0]
    assert bm.find_cached(req("again", P)) == [0, 1]
    x = req("x", [50, 51, 52, 53, 54, 55, 56, 57, 58])  # 3 blocks: 2, 3, then evicts 1 (LRU)
    admit(bm, x)
    assert x.block_ids == [2, 3, 1] and bm.evictions == 1
    assert bm.find_cached(req("again", P)) == [0]  # block 1's identity is gone; block 0 still hits
    bm.free(x)  # x's partial block 1 goes to the front; its cached blocks 3, 2 to the back
    assert list(bm.free_queue) == [1, 0, 3, 2]
    y = req("y", P)  # hits block 0 (revived from the free queue), then takes 1 and evicts 3
    assert admit(bm, y) == [0] and y.block_ids == [0, 1, 3] and bm.evictions == 2
    assert bm.ref_counts == [1, 1, 0, 1] and list(bm.free_queue) == [2]


def test_hit_on_a_freed_block_counts_it_out_of_the_free_pool():
    bm = BlockManager(num_blocks=3, block_size=4)
    a = req("a", P)
    admit(bm, a)
    bm.free(a)
    b = req("b", P + [11, 12, 13, 14, 15, 16, 17])  # 17 tokens: hits [0, 1], needs 3 more blocks
    hits = bm.find_cached(b)
    assert hits == [0, 1]
    # only block 2 is free once 0 and 1 are revived: the allocation must fail and change nothing
    assert not bm.allocate_slots(b, b.num_tokens - 8, hits)
    assert b.block_ids == [] and bm.ref_counts == [0, 0, 0] and bm.num_free_blocks == 3


def test_adapters_never_share_blocks():
    bm = BlockManager(num_blocks=8, block_size=4)
    admit(bm, req("a", P, key=("lora", "alice")))
    assert bm.find_cached(req("b", P, key=("lora", "bob"))) == []
    assert bm.find_cached(req("c", P, key=("base",))) == []
    assert bm.find_cached(req("d", P, key=("lora", "alice"))) == [0, 1]
    assert bm.find_cached(req("e", P, key=())) == []  # () = caching off for this request


def test_no_block_freed_while_referenced_and_refcounts_return_to_zero_on_abort():
    bm = BlockManager(num_blocks=8, block_size=4)
    s = Scheduler(bm, max_num_seqs=8, max_num_batched_tokens=100, max_model_len=100)
    a, b = req("a", P), req("b", P)
    s.add(a)
    s.add(b)
    out = s.schedule()  # both admitted in one step; b shares the blocks a is filling right now
    assert out.num_scheduled_tokens == [10, 2] and b.block_ids[:2] == a.block_ids[:2]
    s.finish(a, "abort")
    assert bm.ref_counts[0] == 1 and bm.ref_counts[1] == 1 and 0 not in bm.free_queue
    s.finish(b, "abort")
    assert bm.ref_counts == [0] * 8 and bm.num_free_blocks == 8
    st = bm.stats()
    assert st["prefix_cache_queried_tokens"] == 20 and st["prefix_cache_hit_tokens"] == 8


def test_preempting_a_request_that_shares_blocks():
    bm = BlockManager(num_blocks=5, block_size=4)
    s = Scheduler(bm, max_num_seqs=8, max_num_batched_tokens=100, max_model_len=100)
    a, b = req("a", P), req("b", P)
    s.add(a)
    s.add(b)
    s.schedule()  # a: [0, 1, 2]; b: [0, 1, 3]
    for r in (a, b):  # pretend three decode steps sampled the same tokens for both
        r.output_token_ids += [20, 21, 22]
        r.num_computed_tokens = 12
    out = s.schedule()  # a takes the last free block (4) for token 13; b needs one too: b is preempted
    assert [r.request_id for r in out.preempted] == ["b"] and a.block_ids == [0, 1, 2, 4]
    assert bm.ref_counts[:3] == [1, 1, 1]  # shared blocks survive b's preemption, held by a
    assert b.block_ids == [] and b.num_computed_tokens == 0 and s.waiting[0] is b
    s.finish(a, "stop")
    out = s.schedule()  # b comes back and finds all 3 full blocks in the cache: it recomputes one token
    assert out.requests == [b] and b.block_ids[:3] == [0, 1, 2] and b.num_computed_tokens == 12
    assert out.num_scheduled_tokens == [1]


# ---- the engine: caching must not change outputs -------------------------------------------------------
def _run(path, prompts, caching: bool, **kw):
    from engine import LLM

    llm = LLM(model=str(path), dtype="float32", enable_prefix_caching=caching, **kw)
    outs = llm.generate(
        [{"prompt_token_ids": p} for p in prompts], SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)
    )
    return [o.outputs[0].token_ids for o in outs], outs, llm.engine.stats()


@pytest.mark.parametrize(
    "budget", [pytest.param(2048, marks=pytest.mark.slow), 24]
)  # all in one step; chunked, so later requests hit
def test_engine_outputs_identical_with_caching_on_and_off(tiny_llama, budget):  # blocks still being filled
    import random

    rng = random.Random(0)
    system = [rng.randrange(3, 380) for _ in range(53)]  # shared prefix: 3 full blocks + a partial
    prompts = [system + [rng.randrange(3, 380) for _ in range(rng.randrange(1, 30))] for _ in range(6)]
    prompts += [system[:48], system[:48], system + prompts[0][53:]]  # block-aligned; an exact repeat
    prompts += [system[:16] * 2 + [5, 6, 7]]  # its 2nd block equals the 1st: only the parent hash tells them apart
    off, _, st_off = _run(tiny_llama, prompts, False, max_num_batched_tokens=budget)
    on, outs, st_on = _run(tiny_llama, prompts, True, max_num_batched_tokens=budget)
    assert on == off
    assert st_off["prefix_cache_hit_tokens"] == 0 and st_on["prefix_cache_hit_tokens"] >= 8 * 32
    cached = [o.metrics.cached_prompt_tokens for o in outs]
    assert cached[0] == 0 and all(c >= 32 for c in cached[1:-1]) and cached[-1] == 16, cached
    assert st_on["num_free_blocks"] == st_on["num_total_blocks"]


def test_engine_n_siblings_share_prompt_blocks_even_with_caching_off(tiny_llama):
    from engine import LLM

    llm = LLM(model=str(tiny_llama), dtype="float32", enable_prefix_caching=False)
    eng = llm.engine
    eng.add_request(
        "r", {"prompt_token_ids": list(range(3, 40))}, SamplingParams(n=3, temperature=1.0, seed=1, max_tokens=4)
    )
    eng.step()
    seqs = eng.output.groups["r"].seqs
    assert seqs[0].block_ids[:2] == seqs[1].block_ids[:2] == seqs[2].block_ids[:2]  # 37 tokens: 2 full blocks
    assert len({s.block_ids[2] for s in seqs}) == 3  # each has its own partial block
    while eng.has_unfinished():
        eng.step()
    assert eng.stats()["num_free_blocks"] == eng.stats()["num_total_blocks"]
    # a later request with the same prompt does not hit: caching is off across requests
    hits = eng.stats()["prefix_cache_hit_tokens"]
    eng.add_request("s", {"prompt_token_ids": list(range(3, 40))}, SamplingParams(max_tokens=1))
    eng.step()
    assert eng.stats()["prefix_cache_hit_tokens"] == hits


def test_request_metrics(tiny_llama):
    prompts = [list(range(3, 60)), list(range(3, 60))]
    _, outs, _ = _run(tiny_llama, prompts, True)
    for o in outs:
        m = o.metrics
        assert m.prompt_tokens == 57 and m.output_tokens == 12 and m.num_preemptions == 0
        assert 0 <= m.queue_time <= m.ttft <= m.e2e_time
        assert 0 < m.mean_itl <= m.max_itl
    assert outs[1].metrics.cached_prompt_tokens == 48
