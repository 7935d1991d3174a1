"""Block manager and scheduler, with no model: exact block ids, budgets and preemption order."""

from __future__ import annotations

from engine.block_manager import BlockManager
from engine.scheduler import Scheduler
from engine.types import Request, RequestStatus, SamplingParams


def req(rid: str, n_prompt: int, max_tokens: int = 100) -> Request:
    return Request(
        rid, list(range(1, n_prompt + 1)), SamplingParams(max_tokens=max_tokens), eos_token_ids=frozenset({0})
    )


def run_step(sched: Scheduler, token: int = 7):
    """Schedule, then pretend the model ran: every request whose chunk reached its end samples `token`."""
    out = sched.schedule()
    sampled = {
        r: [token] for r, n in zip(out.requests, out.num_scheduled_tokens) if r.num_computed_tokens + n == r.num_tokens
    }
    sched.update(out, sampled)
    return out


def test_allocate_exact_ids_and_free_order():
    bm = BlockManager(num_blocks=8, block_size=4)
    a, b = req("a", 5), req("b", 4)
    assert bm.allocate_slots(a, 5) and a.block_ids == [0, 1]
    assert bm.allocate_slots(b, 4) and b.block_ids == [2]
    a.num_computed_tokens = 5
    assert bm.allocate_slots(a, 3) and a.block_ids == [0, 1]  # 8 tokens still fit in 2 blocks
    assert bm.allocate_slots(a, 4) and a.block_ids == [0, 1, 3]
    bm.free(a)
    assert a.block_ids == [] and bm.num_free_blocks == 7
    # freed blocks without a cached identity are reused first, in table order
    assert list(bm.free_queue) == [0, 1, 3, 4, 5, 6, 7]
    assert bm.ref_counts == [0, 0, 1, 0, 0, 0, 0, 0]


def test_allocate_fails_without_side_effects():
    bm = BlockManager(num_blocks=2, block_size=4)
    a = req("a", 9)
    assert not bm.allocate_slots(a, 9)
    assert a.block_ids == [] and bm.num_free_blocks == 2


def test_chunked_prefill_budget_and_mixing_with_decodes():
    bm = BlockManager(num_blocks=100, block_size=4)
    s = Scheduler(bm, max_num_seqs=8, max_num_batched_tokens=10, max_model_len=1000)
    a, b = req("a", 6), req("b", 25)
    s.add(a)
    s.add(b)
    out = run_step(s)
    assert [(r.request_id, n) for r, n in zip(out.requests, out.num_scheduled_tokens)] == [("a", 6), ("b", 4)]
    assert len(a.output_token_ids) == 1 and len(b.output_token_ids) == 0
    out = run_step(s)  # a decodes one token, b takes the rest of the budget
    assert [(r.request_id, n) for r, n in zip(out.requests, out.num_scheduled_tokens)] == [("a", 1), ("b", 9)]
    out = run_step(s)
    assert [(r.request_id, n) for r, n in zip(out.requests, out.num_scheduled_tokens)] == [("a", 1), ("b", 9)]
    out = run_step(s)
    assert [(r.request_id, n) for r, n in zip(out.requests, out.num_scheduled_tokens)] == [("a", 1), ("b", 3)]
    assert len(b.output_token_ids) == 1 and b.num_computed_tokens == 25
    # a reached 9 tokens (3rd block) in step 4, before b took its 7th block in the same step.
    assert a.block_ids == [0, 1, 8] and b.block_ids == [2, 3, 4, 5, 6, 7, 9]


def test_max_num_seqs_caps_admission():
    s = Scheduler(BlockManager(100, 4), max_num_seqs=2, max_num_batched_tokens=100, max_model_len=1000)
    for i in range(3):
        s.add(req(f"r{i}", 3))
    out = run_step(s)
    assert [r.request_id for r in out.requests] == ["r0", "r1"]
    assert [r.request_id for r in s.waiting] == ["r2"]


def test_preempts_most_recent_and_requeues_at_front():
    bm = BlockManager(num_blocks=6, block_size=4)
    s = Scheduler(bm, max_num_seqs=8, max_num_batched_tokens=100, max_model_len=1000)
    a, b, c = req("a", 8), req("b", 8), req("c", 8)
    for r in (a, b, c):
        s.add(r)
    run_step(s)  # each: 2 blocks, 8 tokens computed, 1 output -> 9 tokens, needs a 3rd block next
    assert (a.block_ids, b.block_ids, c.block_ids) == ([0, 1], [2, 3], [4, 5])
    out = run_step(s)
    # a needs a block: c (last admitted) is preempted; then b needs one: nothing left for b but
    # preempting b itself is not needed since c's two blocks cover a and b.
    assert [r.request_id for r in out.preempted] == ["c"]
    assert c.status is RequestStatus.PREEMPTED and c.num_computed_tokens == 0 and c.block_ids == []
    # c's blocks (4, 5) hold nothing cached, so they are reused first, in table order.
    assert a.block_ids == [0, 1, 4] and b.block_ids == [2, 3, 5]
    assert list(s.waiting) == [c] and s.running == [a, b]
    assert c.num_preemptions == 1 and s.num_preemptions == 1
    # c's recompute covers its prompt and the token it already produced.
    assert c.num_tokens == 9


def test_preempted_request_resumes_and_finishes():
    bm = BlockManager(num_blocks=6, block_size=4)
    s = Scheduler(bm, max_num_seqs=8, max_num_batched_tokens=100, max_model_len=1000)
    rs = [req(x, 8, max_tokens=6) for x in "abc"]
    for r in rs:
        s.add(r)
    for _ in range(40):
        if not s.has_work():
            break
        run_step(s)
    assert not s.has_work()
    assert all(r.finish_reason == "length" and len(r.output_token_ids) == 6 for r in rs)
    assert s.num_preemptions > 0
    assert bm.num_free_blocks == 6 and bm.ref_counts == [0] * 6


def test_last_request_preempts_itself():
    bm = BlockManager(num_blocks=3, block_size=4)
    s = Scheduler(bm, max_num_seqs=8, max_num_batched_tokens=100, max_model_len=12)
    a, b = req("a", 3), req("b", 8)
    s.add(a)
    s.add(b)
    run_step(s)  # a: [0], 4 tokens after its first output; b: [1, 2], 9 tokens
    out = run_step(s)  # a still fits block 0; b needs a 3rd block and is itself the most recent
    assert [r.request_id for r in out.preempted] == ["b"]
    assert out.requests == [a] and a.block_ids == [0]
    assert list(bm.free_queue) == [1, 2]


def test_stop_rules():
    s = Scheduler(BlockManager(10, 4), max_num_seqs=8, max_num_batched_tokens=100, max_model_len=1000)
    eos = req("eos", 2)
    stop_id = Request("stopid", [1, 2], SamplingParams(stop_token_ids=[9], max_tokens=10), frozenset({0}))
    min_tok = Request("min", [1, 2], SamplingParams(min_tokens=3, max_tokens=10), frozenset({0}))
    for r in (eos, stop_id, min_tok):
        s.add(r)
    out = s.schedule()
    s.update(out, {eos: [0], stop_id: [9], min_tok: [0]})
    assert eos.finish_reason == "stop" and stop_id.finish_reason == "stop" and stop_id.stop_reason == 9
    assert min_tok.finish_reason is None  # eos before min_tokens does not stop
    assert s.running == [min_tok]


def test_max_model_len_finishes_with_length():
    s = Scheduler(BlockManager(10, 4), max_num_seqs=8, max_num_batched_tokens=100, max_model_len=6)
    r = req("r", 4, max_tokens=100)
    s.add(r)
    for _ in range(5):
        if s.has_work():
            run_step(s)
    assert r.finish_reason == "length" and r.num_tokens == 6


def test_long_prefill_token_threshold_caps_each_request_per_step():
    s = Scheduler(
        BlockManager(100, 4),
        max_num_seqs=8,
        max_num_batched_tokens=100,
        max_model_len=1000,
        long_prefill_token_threshold=8,
    )
    a, b, c = req("a", 3), req("b", 30), req("c", 20)
    for r in (a, b, c):
        s.add(r)
    out = run_step(s)  # each request at most 8 tokens, however much budget is left
    assert [(r.request_id, n) for r, n in zip(out.requests, out.num_scheduled_tokens)] == [("a", 3), ("b", 8), ("c", 8)]
    out = run_step(s)
    assert [(r.request_id, n) for r, n in zip(out.requests, out.num_scheduled_tokens)] == [("a", 1), ("b", 8), ("c", 8)]
