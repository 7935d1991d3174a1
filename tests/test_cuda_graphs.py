"""CUDA graphs for decode steps (engine/cuda_graphs.py), on CPU: the buckets, which steps may replay a graph, the
padding, the persistent block table, and when capture happens. The real torch.cuda.CUDAGraph runs in
bench/gpu_check.sh; here the stand-in (tests/graph_standin.py) runs the captured function again at each replay,
reading the static input buffers, so a step whose inputs were not copied in (or were padded wrongly) gives wrong
tokens. It raises on the host syncs a real capture refuses (.item(), .tolist(), nonzero, boolean masks, ...) and
when a replay runs other ops, shapes, scalars or outside buffers than its capture."""

from __future__ import annotations

import asyncio
import time

import pytest
import torch

from engine import AsyncEngine, EngineConfig, SamplingParams
from engine.block_table import DeviceBlockTable
from engine.cuda_graphs import DecodeGraphs
from engine.llm import LLM
from engine.memory import graph_buckets
from engine.model_runner import FlatBatch
from tests.graph_standin import GraphReplayMismatch, HostSyncError, SyncCheckedGraph


class ReplayGraph(SyncCheckedGraph):
    """The sync-checking CPU stand-in for CudaGraph, counting what it captures."""

    captured: list = []

    def capture(self, fn):
        out = super().capture(fn)
        ReplayGraph.captured.append(out.shape[0])
        return out


def test_buckets():
    assert graph_buckets(128) == (1, 2, 4, 8) + tuple(range(16, 129, 8))
    assert graph_buckets(5) == (1, 2, 4, 5)
    assert graph_buckets(1) == (1,)
    assert graph_buckets(8) == (1, 2, 4, 8)
    assert graph_buckets(100)[-3:] == (88, 96, 100)


def test_which_steps_may_replay():
    table = DeviceBlockTable(16, 4, torch.device("cpu"))
    g = DecodeGraphs(lambda *a: a[0].float()[:, None], table, 16, torch.device("cpu"), ReplayGraph)
    assert g.bucket([1], False) is None  # nothing captured yet: eager
    assert [g.capture_next() for _ in range(3)] == [(1, 1), (2, 1), (4, 1)]  # smallest first
    assert g.bucket([1], False) == (1, 1)
    assert g.bucket([1, 1, 1], False) == (4, 1)  # padded up to the next captured bucket
    assert g.bucket([1] * 5, False) is None  # larger than every captured bucket
    assert g.bucket([1, 3], False) is None  # a prefill chunk in the step
    assert g.bucket([1, 1], True) is None  # a LoRA adapter in the step
    while g.capture_next() is not None:
        pass
    assert g.captured == list(graph_buckets(16)) and g.capture_next() is None


def test_padding_rows_write_and_read_nothing():
    """Replaying bucket 4 for 3 decodes: the static buffers hold the 3 rows, then token 0 at position 0, slot -1
    (cache_write skips it) and context 0 (attention reads nothing) in the pad row."""
    seen = {}

    def forward(ids, pos, slots, bt, seq_lens, qsl, max_query_len):  # clones: reading them here would be a sync
        seen.update(ids=ids.clone(), pos=pos.clone(), slots=slots.clone(), lens=seq_lens.clone(), qsl=qsl.clone())
        return ids.float()[:, None]

    table = DeviceBlockTable(8, 4, torch.device("cpu"))
    g = DecodeGraphs(forward, table, 8, torch.device("cpu"), ReplayGraph)
    while g.capture_next() != (4, 1):
        pass
    table.update([[3], [5, 6], [7]])
    out = g.run((4, 1), FlatBatch([11, 12, 13], [4, 20, 2], [52, 98, 114], [0, 1, 2, 3], [5, 21, 3], []))
    assert out.tolist() == [[11.0], [12.0], [13.0]]  # only the real rows come back
    assert {k: v.tolist() for k, v in seen.items()} == dict(
        ids=[11, 12, 13, 0],
        pos=[4, 20, 2, 0],
        slots=[52, 98, 114, -1],
        lens=[5, 21, 3, 0],
        qsl=[0, 1, 2, 3, 4],
    )


def test_the_stand_in_refuses_host_syncs_and_replays_that_differ():
    """What the stand-in checks (tests/graph_standin.py): a host sync raises at capture, as a real capture fails;
    a replay that would run other ops or scalars than the capture (a Python value read at call time) raises."""
    x = torch.arange(4.0)
    for sync in (lambda: x * x.sum().item(), lambda: torch.tensor(x.tolist()), lambda: x[x > 1], lambda: x.nonzero()):
        with pytest.raises(HostSyncError):
            SyncCheckedGraph().capture(sync)
    SyncCheckedGraph.errors.clear()  # the list other tests print when a capture in the engine fails
    scale = [2.0]
    g = SyncCheckedGraph()
    out = g.capture(lambda: x * scale[0])
    assert g.replay() is out and out.tolist() == [0.0, 2.0, 4.0, 6.0]  # the captured output, refilled
    scale[0] = 3.0  # a real graph keeps multiplying by 2.0
    with pytest.raises(GraphReplayMismatch, match="aten.mul"):
        g.replay()


def test_block_table_writes_only_what_changed():
    t = DeviceBlockTable(4, 8, torch.device("cpu"))
    a, b = [1, 2], [3]
    assert t.update([a, b]).tolist() == [[1, 2, 0, 0, 0, 0, 0, 0], [3, 0, 0, 0, 0, 0, 0, 0]]
    written = t.entries_written
    a.append(9)  # a decode step crossed into a new block
    assert t.update([a, b])[0, :3].tolist() == [1, 2, 9]
    assert t.entries_written == written + 1  # one new entry, not the whole table
    out = t.update([b, a])  # the batch order changed: both rows are rewritten (entries past a table are stale)
    assert out[0, :1].tolist() == [3] and out[1, :3].tolist() == [1, 2, 9]
    b2 = [7, 8]  # preemption gives the request a new list: its row is rewritten from the start
    assert t.update([b2, a])[0, :2].tolist() == [7, 8]


ENGINE = dict(
    dtype="float32",
    kernel_backend="triton",
    block_size=8,
    max_num_seqs=8,
    max_num_batched_tokens=64,
    num_kv_blocks=64,
    max_model_len=64,
    log_stats_interval=0,
)
PROMPTS = [[5, 9, 33, 7, 21, 62, 11], [40, 41], [8, 3, 14, 15, 92, 65, 35, 89, 79]]


def test_graph_steps_give_the_eager_tokens(tiny_llama):
    """Greedy and seeded sampling through graph replays (3 decodes in bucket 4, then 2 in bucket 2 as one finishes,
    contexts crossing block boundaries of 8) equal the eager engine's, token for token."""
    params = [
        SamplingParams(temperature=0, max_tokens=9, ignore_eos=True),
        SamplingParams(temperature=0, max_tokens=4, ignore_eos=True),
        SamplingParams(temperature=0.8, seed=3, max_tokens=9, ignore_eos=True),
    ]
    prompts = [{"prompt_token_ids": p} for p in PROMPTS]
    eager = LLM(str(tiny_llama), **ENGINE)
    ref = eager.generate(prompts, params)
    assert eager.engine.runner.graphs is None
    graphed = LLM(str(tiny_llama), **ENGINE)
    graphs = graphed.engine.runner.enable_graphs(ReplayGraph)
    out = graphed.generate(prompts, params)
    assert graphs.captured == [1, 2, 4], ReplayGraph.errors  # LLM.generate captured what 3 sequences need, first
    assert graphs.replays >= 8  # every decode step replayed (only the prefill step ran eagerly)
    assert [o.outputs[0].token_ids for o in out] == [o.outputs[0].token_ids for o in ref]


def test_enforce_eager_and_cpu_never_capture(tiny_llama):
    llm = LLM(str(tiny_llama), enforce_eager=False, **{**ENGINE, "kernel_backend": "torch"})
    assert not llm.engine.graphs_enabled and llm.engine.runner.graphs is None  # graphs are CUDA-only
    assert EngineConfig().enforce_eager  # the default until a GPU check shows graphs equal and faster


def test_capture_happens_in_idle_gaps_after_ready(tiny_llama):
    """AsyncEngine captures nothing during construction, then one bucket per idle gap, smallest first; a request
    sent meanwhile is served, and once the buckets are in, its decode steps replay graphs."""
    llm = LLM(str(tiny_llama), **ENGINE)
    graphs = llm.engine.runner.enable_graphs(ReplayGraph)
    assert graphs.captured == []  # nothing on the cold-start path
    ReplayGraph.captured = []

    async def main():
        eng = AsyncEngine(engine=llm.engine)
        deadline = time.monotonic() + 120
        while graphs.pending and time.monotonic() < deadline:
            await asyncio.sleep(0.05)
        assert graphs.captured == list(graph_buckets(8)) == ReplayGraph.captured
        before = graphs.replays
        final = None
        params = SamplingParams(temperature=0, max_tokens=5, ignore_eos=True)
        async for o in eng.generate({"prompt_token_ids": PROMPTS[0]}, params):
            final = o
        eng.shutdown()
        assert len(final.outputs[0].token_ids) == 5
        assert graphs.replays - before == 4  # the prefill step eager, the 4 decodes from the bucket-1 graph

    asyncio.run(main())


def test_failed_capture_leaves_eager_steps(tiny_llama):
    class Broken(ReplayGraph):
        def capture(self, fn):
            raise RuntimeError("operation not permitted when stream is capturing")

    llm = LLM(str(tiny_llama), **ENGINE)
    graphs = llm.engine.runner.enable_graphs(Broken)
    assert llm.engine.idle.capture_next_graph() is None and not graphs.pending and not graphs.captured
    out = llm.generate({"prompt_token_ids": PROMPTS[1]}, SamplingParams(temperature=0, max_tokens=3))
    assert len(out[0].outputs[0].token_ids) == 3


@pytest.mark.parametrize("graphs_on", [False, True])
def test_planner_counts_the_graph_pool(graphs_on):
    from engine import memory
    from engine.models.spec import ModelSpec
    from tests.test_memory import LLAMA31_8B

    LLAMA_8B = ModelSpec.from_hf(LLAMA31_8B)

    reserve = memory.activation_reserve(
        LLAMA_8B,
        2048,
        128,
        2,
        graph_pool_bytes=memory.graph_pool_bytes(LLAMA_8B, 128, 2) if graphs_on else 0,
    )
    base = memory.activation_reserve(LLAMA_8B, 2048, 128, 2)
    pool = memory.graph_pool_bytes(LLAMA_8B, 128, 2)
    assert 0 < pool < base  # a decode step at 128 rows is smaller than a 2048-token prefill step
    assert reserve == base + (pool if graphs_on else 0)


@pytest.mark.slow  # whole engines warming under the Triton interpreter
def test_idle_work_warms_kernels_then_captures(tiny_llama):
    """One piece per idle gap: every kernel-warm shape first (a CUDA engine does these; forced here), then the graph
    buckets smallest first; then nothing is pending."""
    from engine.cuda_graphs import IdleWork

    llm = LLM(str(tiny_llama), **ENGINE)
    graphs = llm.engine.runner.enable_graphs(ReplayGraph)
    idle = IdleWork(llm.engine.runner, warm_kernels=True)
    shapes = len(idle.warm_shapes)
    assert shapes > 0 and idle.pending
    for _ in range(shapes):
        idle.step()
    assert not idle.warm_shapes and graphs.captured == []
    idle.step()
    assert graphs.captured == [1]
    while idle.pending:
        idle.step()
    assert graphs.captured == list(graph_buckets(8))
    assert not IdleWork(LLM(str(tiny_llama), **{**ENGINE, "kernel_backend": "torch"}).engine.runner, True).pending


def test_host_pieces_run_first_one_a_gap_and_a_failure_ends_only_itself(tiny_llama, caplog):
    """The worker's host pieces (AsyncEngine.warm_later: the OpenAI routes' import, the chat templates' compiles)
    run before the kernel warm-up, one per step; one that raises is logged and the next still runs."""
    from engine.cuda_graphs import IdleWork

    llm = LLM(str(tiny_llama), **ENGINE)
    ran = []

    def broken():
        raise RuntimeError("no such module")

    idle = IdleWork(llm.engine.runner, warm_kernels=True, host=[lambda: ran.append("a")])
    idle.add(broken, lambda: ran.append("c"))
    shapes = len(idle.warm_shapes)
    for expected in (["a"], ["a"], ["a", "c"]):
        idle.step()
        assert ran == expected and len(idle.warm_shapes) == shapes
    assert "no such module" in caplog.text
    idle.step()
    assert len(idle.warm_shapes) == shapes - 1


def test_warm_later_reaches_the_step_loop(tiny_llama):
    """AsyncEngine.warm_later hands pieces to the loop's thread, which runs them while idle."""
    import threading

    engine = AsyncEngine(engine=LLM(str(tiny_llama), **{**ENGINE, "kernel_backend": "torch"}).engine)
    try:
        done, where = threading.Event(), []
        engine.warm_later(lambda: (where.append(threading.current_thread().name), done.set()))
        assert done.wait(10) and where == ["engine-step-loop"]
    finally:
        engine.shutdown()


class Hooks:
    """Counting hooks on one engine: each kernel warm step, graph capture and engine step is recorded in order
    (with whether requests were running) and advances a fake clock by a power of two (exact sums)."""

    STEP = PIECE = 1 / 64

    def __init__(self, engine):
        self.now, self.events, runner = 0.0, [], engine.runner
        warm, step, capture = runner.warm, engine.step, runner.graphs.capture_next

        def hooked(kind, fn, cost):
            def call(*a, **kw):
                self.events.append((kind, a, engine.has_unfinished()))
                self.now += cost
                return fn(*a, **kw)

            return call

        runner.warm = hooked("warm", warm, self.PIECE)
        runner.graphs.capture_next = hooked("capture", capture, self.PIECE)
        engine.step = hooked("step", step, self.STEP)

    def kinds(self) -> list[str]:
        return [e[0] for e in self.events]


@pytest.mark.slow  # whole engines warming under the Triton interpreter
def test_a_busy_worker_warms_and_captures_within_its_share(tiny_llama):
    """Under continuous load (a request always running, so the loop never has an idle gap) every warm shape runs
    and every bucket is captured, one piece after a step whenever the share allows it: with share 1/4 a piece
    that took d waits for 3d of steps, so piece k runs right after step 1 + 3k and the last one within
    1 + 3 (pieces - 1) steps. Then decode steps replay the graphs."""
    from engine.cuda_graphs import IdleWork

    llm = LLM(str(tiny_llama), **ENGINE)
    graphs = llm.engine.runner.enable_graphs(ReplayGraph)
    hooks = Hooks(llm.engine)
    idle = llm.engine.idle = IdleWork(llm.engine.runner, warm_kernels=True, share=0.25, clock=lambda: hooks.now)
    shapes = list(idle.warm_shapes)
    pieces = len(shapes) + len(graph_buckets(8))
    # the load: running before the loop starts; its outputs go to no stream. 57 tokens outlast the 40 steps
    load = SamplingParams(temperature=0, max_tokens=64 - len(PROMPTS[0]), ignore_eos=True)
    llm.engine.add_request("load", {"prompt_token_ids": PROMPTS[0]}, load)

    async def main():
        eng = AsyncEngine(engine=llm.engine)
        deadline = time.monotonic() + 300
        while idle.pending and time.monotonic() < deadline:
            await asyncio.sleep(0.05)
        done = list(hooks.events)
        before = graphs.replays
        params = SamplingParams(temperature=0, max_tokens=4, ignore_eos=True)
        out = [o async for o in eng.generate({"prompt_token_ids": PROMPTS[1]}, params)]
        eng.shutdown()
        return done, graphs.replays - before, out[-1]

    done, replays, final = asyncio.run(main())
    work = [(i, e) for i, e in enumerate(done) if e[0] != "step"]
    assert [e[1] for _, e in work] == shapes + [()] * len(graph_buckets(8)), work
    assert all(busy for _, (_, _, busy) in work)  # every piece ran while a request was running
    steps_before = [sum(k == "step" for k, *_ in done[:i]) for i, _ in work]
    assert steps_before == [1 + 3 * k for k in range(pieces)]  # the share, exactly; the last within the bound
    assert graphs.captured == list(graph_buckets(8)) and not idle.warm_shapes
    assert idle.pieces == pieces and idle.seconds == pieces * Hooks.PIECE
    assert len(final.outputs[0].token_ids) == 4 and replays >= 3  # its decodes (with the load's) from graphs


@pytest.mark.slow  # whole engines warming under the Triton interpreter
def test_lora_and_grammar_pieces(tiny_llama, tmp_path, monkeypatch):
    """With LoRA on, the warm steps include slot-0 steps of 1, 17 and 64 tokens, which launch the LoRA kernel's
    three token tiles for both its shrink and its expand; once the first grammar is compiled, the mask is warmed
    over 1, 2 and 16 rows (xgrammar's CPU path here: its CUDA kernel is the Triton one), before any capture."""
    import xgrammar

    import kernels.lora
    from engine import StructuredOutputsParams
    from engine.cuda_graphs import IdleWork

    llm = LLM(str(tiny_llama), enable_lora=True, max_lora_rank=8, cache_root=str(tmp_path), **ENGINE)
    graphs = llm.engine.runner.enable_graphs(ReplayGraph)
    hooks = Hooks(llm.engine)
    masks, tiles, sgmv = [], set(), kernels.lora._sgmv_kernel

    class Tiles:
        def __getitem__(self, grid):
            def launch(*a, **constexprs):
                tiles.add((constexprs["BLOCK_M"], constexprs["ADD"]))
                return sgmv[grid](*a, **constexprs)

            return launch

    monkeypatch.setattr(kernels.lora, "_sgmv_kernel", Tiles())
    apply = xgrammar.apply_token_bitmask_inplace

    def counted(logits, mask, **kw):
        masks.append((tuple(logits.shape), logits.dtype, len(kw["indices"])))
        return apply(logits, mask, **kw)

    monkeypatch.setattr(xgrammar, "apply_token_bitmask_inplace", counted)
    structured = llm.engine.structured
    idle = IdleWork(llm.engine.runner, warm_kernels=True, grammar=structured)
    lora_shapes = [s for s in idle.warm_shapes if len(s) == 4]
    assert lora_shapes == [(1, 1, 1, True), (17, 17, 1, True), (64, 64, 1, True)]
    while idle.warm_shapes:
        idle.step()
    assert tiles == {(m, add) for m in (16, 32, 64) for add in (False, True)}  # 3 tiles x (shrink, expand)
    idle.step()  # no grammar yet: the next piece is a capture
    assert graphs.captured == [1] and not masks and not idle.mask_rows
    structured.compile(StructuredOutputsParams(choice=("yes", "no"))).result()
    assert idle.pending and idle.mask_rows == [1, 2, 16]
    for _ in range(3):
        idle.step()
    assert masks == [((r, 384), torch.float32, r) for r in (1, 2, 16)] and graphs.captured == [1]
    while idle.pending:
        idle.step()
    assert graphs.captured == list(graph_buckets(8)) and len(masks) == 3  # once only
    warm_calls = [e[1] for e in hooks.events if e[0] == "warm"]
    assert warm_calls == llm.engine.runner.warm_shapes() and hooks.kinds().count("capture") == len(graph_buckets(8))


@pytest.mark.slow  # whole engines warming under the Triton interpreter
def test_llm_generate_warms_kernels_before_its_first_step(tiny_llama):
    """A batch API: every kernel warm step, then the captures its batch can use, before the first step; nothing
    else while it runs."""
    from engine.cuda_graphs import IdleWork

    llm = LLM(str(tiny_llama), **ENGINE)
    graphs = llm.engine.runner.enable_graphs(ReplayGraph)
    hooks = Hooks(llm.engine)
    llm.engine.idle = IdleWork(llm.engine.runner, warm_kernels=True)
    shapes = llm.engine.runner.warm_shapes()
    prompts = [{"prompt_token_ids": p} for p in PROMPTS]
    llm.generate(prompts, SamplingParams(temperature=0, max_tokens=3, ignore_eos=True))
    first = hooks.kinds().index("step")
    assert hooks.kinds()[:first] == ["warm"] * len(shapes) + ["capture"] * 3
    assert "warm" not in hooks.kinds()[first:] and "capture" not in hooks.kinds()[first:]
    assert graphs.captured == [1, 2, 4] and graphs.replays >= 2
