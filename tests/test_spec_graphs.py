"""CUDA graphs with speculative decoding (engine/cuda_graphs.py, engine/spec_decode/), on CPU with the sync-checking
stand-in (tests/graph_standin.py): verify steps replay (bucket, k + 1) graphs with each sequence's tokens in the
last rows of its k + 1, a draft model's one-token steps replay its own graphs fed the previous picks on the device,
its catch-up of one or two tokens replays too, and the tokens equal the eager engine's. A step no captured graph
fits runs eagerly. The plan counts the draft's pool."""

from __future__ import annotations

import dataclasses
from collections import Counter
from types import SimpleNamespace

import pytest
import torch

from engine import LLM, EngineConfig, SamplingParams, memory
from engine.block_table import DeviceBlockTable
from engine.cuda_graphs import DecodeGraphs, IdleWork
from engine.layers.attention import PREFILL_TILE_MIN_QUERY
from engine.model_runner import FlatBatch
from tests.graph_standin import SyncCheckedGraph
from tests.utils import build_tiny_model

ENGINE = dict(
    dtype="float32",
    kernel_backend="triton",
    block_size=8,
    max_num_seqs=4,
    max_num_batched_tokens=64,
    num_kv_blocks=64,
    max_model_len=64,
    log_stats_interval=0,
)
# prompts whose greedy continuations repeat (n-gram proposals find matches), of 2 to 9 tokens
PROMPTS = [[5, 9, 13, 5, 9, 13, 5, 9], [40, 41], [7, 3, 7, 3, 7, 3, 7, 3, 7]]
K = 3


def _recording_forward(seen: dict):
    def forward(ids, pos, slots, bt, seq_lens, qsl, max_query_len):  # clones: reading them here would be a sync
        seen.update(ids=ids.clone(), pos=pos.clone(), slots=slots.clone(), lens=seq_lens.clone(), qsl=qsl.clone())
        seen["max_query_len"] = max_query_len
        return ids.float()[:, None] * 2  # [T, 1]: each row's token id, doubled

    return forward


def test_verify_rows_sit_at_the_end_of_each_sequence():
    """Bucket 4 at query length 3 for sequences of 1, 3 and 2 tokens: each sequence's tokens fill the last of its 3
    rows, the rows before them and the padding sequence write no KV (slot -1), the query offsets and max query
    length are the graph's own, and only the real rows come back, in the batch's order. Token ids already on the
    device land in the same rows."""
    seen = {}
    table = DeviceBlockTable(8, 4, torch.device("cpu"))
    g = DecodeGraphs(_recording_forward(seen), table, 8, torch.device("cpu"), SyncCheckedGraph, query_lens=(1, 3))
    assert [g.capture_next() for _ in range(6)] == [(1, 1), (1, 3), (2, 1), (2, 3), (4, 1), (4, 3)]
    assert g.bucket([1, 3, 2], False) == (4, 3) and g.bucket([1, 1], False) == (2, 1)
    assert g.bucket([4], False) is None and g.bucket([1] * 5, False) is None and g.bucket([2], True) is None
    tables = [[3], [5, 6], [7]]
    table.update(tables)
    batch = FlatBatch(
        input_ids=[11, 21, 22, 23, 31, 32],
        positions=[4, 7, 8, 9, 2, 3],
        slots=[28, 47, 48, 49, 58, 59],
        query_start_loc=[0, 1, 4, 6],
        seq_lens=[5, 10, 4],
        block_tables=tables,
    )
    want = [[22.0], [42.0], [44.0], [46.0], [62.0], [64.0]]
    assert g.run((4, 3), batch).tolist() == want
    assert {k: v.tolist() if isinstance(v, torch.Tensor) else v for k, v in seen.items()} == dict(
        ids=[0, 0, 11, 21, 22, 23, 0, 31, 32, 0, 0, 0],
        pos=[0, 0, 4, 7, 8, 9, 0, 2, 3, 0, 0, 0],
        slots=[-1, -1, 28, 47, 48, 49, -1, 58, 59, -1, -1, -1],
        lens=[5, 10, 4, 0],
        qsl=[0, 3, 6, 9, 12],
        max_query_len=3,
    )
    placeholders = dataclasses.replace(batch, input_ids=[0] * 6)
    assert g.run((4, 3), placeholders, ids=torch.tensor([11, 21, 22, 23, 31, 32])).tolist() == want
    one = FlatBatch([0, 0], [4, 9], [28, 49], [0, 1, 2], [5, 10], tables[:2])  # a draft model's one-token step
    assert g.run((2, 1), one, ids=torch.tensor([12, 24])).tolist() == [[24.0], [48.0]]
    assert seen["ids"].tolist() == [12, 24] and g.replays == 3


def test_graph_query_lens_follow_the_config():
    """Verification's k + 1 is captured while it takes the paged decode kernel (the limit is attention's)."""
    assert memory.GRAPH_MAX_QUERY == PREFILL_TILE_MIN_QUERY
    spec = {"method": "ngram", "num_speculative_tokens": 4}
    assert memory.graph_query_lens(EngineConfig()) == (1,)
    assert memory.graph_query_lens(EngineConfig(speculative_config=spec)) == (1, 5)
    spec["num_speculative_tokens"] = PREFILL_TILE_MIN_QUERY  # a 17-token query: the prefill kernel, eagerly
    assert memory.graph_query_lens(EngineConfig(speculative_config=spec)) == (1,)


def _fake_runner(query_lens, graph=SyncCheckedGraph):
    table = DeviceBlockTable(8, 2, torch.device("cpu"))
    forward = lambda ids, *a: ids.float()[:, None]  # noqa: E731
    return SimpleNamespace(graphs=DecodeGraphs(forward, table, 8, torch.device("cpu"), graph, query_lens))


def test_idle_work_captures_the_drafts_graphs_with_the_targets():
    """Smallest bucket first, the target's graphs then the draft's of the same bucket; a batch API captures what
    its batch can use from both; a draft capture that fails leaves the target's going."""
    target, draft = _fake_runner((1, 4)), _fake_runner((1, 2))
    idle = IdleWork(target, warm_kernels=False, draft=draft)
    order = [idle.capture_next_graph() for _ in range(8)]
    assert order == [(1, 1), (1, 4), (1, 1), (1, 2), (2, 1), (2, 4), (2, 1), (2, 2)]
    assert target.graphs.buckets == {1: [1, 2], 4: [1, 2]} and draft.graphs.buckets == {1: [1, 2], 2: [1, 2]}
    idle.capture_graphs(3)  # bucket 4 holds 3 sequences: both runners' bucket-4 graphs, nothing larger
    assert target.graphs.buckets[4] == draft.graphs.buckets[2] == [1, 2, 4] and target.graphs.pending[0] == (8, 1)

    class Broken(SyncCheckedGraph):
        def capture(self, fn):
            raise RuntimeError("operation not permitted when stream is capturing")

    target, draft = _fake_runner((1, 4)), _fake_runner((1, 2), Broken)
    idle = IdleWork(target, warm_kernels=False, draft=draft)
    while idle.pending:
        idle.step()
    assert target.graphs.captured == [1, 2, 4, 8] and not draft.graphs.captured and not draft.graphs.pending


def test_the_plan_counts_the_draft_models_graph_pool():
    """With graphs on, the reserve holds the target's pool (decode and verify graphs) and the draft's own (its one-
    and two-token graphs); Needs.graph_pool_bytes is both."""
    from engine.models.spec import ModelSpec
    from tests.test_memory import LLAMA31_8B
    from tests.test_plan import LLAMA32_1B

    target, draft = ModelSpec.from_hf(LLAMA31_8B), ModelSpec.from_hf(LLAMA32_1B)
    cfg = EngineConfig(speculative_config={"model": "draft", "num_speculative_tokens": 4})
    eager = memory.engine_needs(cfg, target, 2, graphs=False, draft_spec=draft)
    graphs = memory.engine_needs(cfg, target, 2, graphs=True, draft_spec=draft)
    own = memory.graph_pool_bytes(target, 128, 2, (1, 5))
    drafts = memory.graph_pool_bytes(draft, 128, 2, memory.DRAFT_GRAPH_QUERY_LENS)
    assert eager.graph_pool_bytes == 0 and graphs.graph_pool_bytes == own + drafts
    assert graphs.reserve_bytes - eager.reserve_bytes == own + drafts
    assert memory.graph_pool_bytes(target, 128, 2) < own  # 5 tokens a sequence: more activations, more outputs
    assert 0 < drafts < own


# ---- whole engines ------------------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def draft_path(tmp_path_factory):
    return build_tiny_model(tmp_path_factory.mktemp("draft") / "draft", "llama", seed=7, num_hidden_layers=1)


def _spec(kind: str, tiny_llama, draft_path) -> dict:
    return {
        "ngram": {"method": "ngram", "num_speculative_tokens": K, "prompt_lookup_min": 1, "prompt_lookup_max": 3},
        "self_draft": {"model": str(tiny_llama), "num_speculative_tokens": K},
        "random_draft": {"model": str(draft_path), "num_speculative_tokens": K},
    }[kind]


class Replays:
    """A runner's forwards, counted by (the query length of the graph replayed, None: eagerly; whether the token ids
    were already on the device)."""

    def __init__(self, runner):
        self.calls: Counter = Counter()
        graphs, forward = runner.graphs, runner.forward

        def counted(batch, ids=None):
            key = graphs.bucket(batch.tokens_per_seq, bool(batch.token_slot))
            self.calls[(key[1] if key else None, ids is not None)] += 1
            return forward(batch, ids)

        runner.forward = counted

    def __getitem__(self, how) -> int:
        return self.calls[how]


def _engine(tiny_llama, spec, graphs: bool) -> LLM:
    llm = LLM(str(tiny_llama), speculative_config=spec, **ENGINE)
    if graphs:
        llm.engine.runner.enable_graphs(SyncCheckedGraph)
        if llm.engine.speculator.draft is not None:
            llm.engine.speculator.draft.runner.enable_graphs(SyncCheckedGraph)
    return llm


PARAMS = [
    SamplingParams(temperature=0, max_tokens=17, ignore_eos=True),
    SamplingParams(temperature=0, max_tokens=9, ignore_eos=True),
    SamplingParams(temperature=0.8, seed=3, max_tokens=17, ignore_eos=True),
]


@pytest.mark.slow  # whole engines under the Triton interpreter
@pytest.mark.parametrize("kind", ["self_draft", "random_draft", "ngram"])
def test_speculation_with_graphs_gives_the_eager_tokens(tiny_llama, draft_path, kind):
    """Greedy and seeded requests, three then two running (bucket 4, then 2): the target's verify steps replay its
    (bucket, k + 1) graphs, a draft model's one-token steps replay its own graphs fed on the device and its catch-up
    (after a speculating step: 1 token, or 2 when every draft was accepted) too, and every token equals the eager
    engine's with the same speculation."""
    spec = _spec(kind, tiny_llama, draft_path)
    prompts = [{"prompt_token_ids": p} for p in PROMPTS]
    ref = _engine(tiny_llama, spec, graphs=False).generate(prompts, PARAMS)
    llm = _engine(tiny_llama, spec, graphs=True)
    e = llm.engine
    target = Replays(e.runner)
    draft = Replays(e.speculator.draft.runner) if e.speculator.draft is not None else None
    out = llm.generate(prompts, PARAMS)
    assert [o.outputs[0].token_ids for o in out] == [o.outputs[0].token_ids for o in ref]
    assert e.runner.graphs.buckets == {1: [1, 2, 4], K + 1: [1, 2, 4]}  # LLM.generate: what 3 sequences use
    assert target[(K + 1, False)] >= 2, SyncCheckedGraph.errors  # verify steps replayed
    assert e.stats()["spec_decode_num_draft_tokens"] > 0
    if draft is None:
        return
    assert e.speculator.draft.runner.graphs.buckets == {1: [1, 2, 4], 2: [1, 2, 4]}
    assert draft[(None, True)] == 0 and draft[(1, True)] >= 3 * (K - 1)  # every one-token step replayed
    catch_up = 2 if kind == "self_draft" else 1  # every draft accepted: 2 tokens; rejections: 1
    assert draft[(catch_up, False)] >= 2


@pytest.mark.slow  # whole engines under the Triton interpreter
def test_a_step_no_graph_fits_runs_eagerly(tiny_llama, draft_path):
    """Only bucket 1's graphs are captured: while three sequences speculate, the draft's and the verify steps run
    eagerly; once one is left they replay; the tokens are the eager engine's."""
    spec = _spec("random_draft", tiny_llama, draft_path)
    prompts = [{"prompt_token_ids": p} for p in PROMPTS]
    params = [SamplingParams(temperature=0, max_tokens=n, ignore_eos=True) for n in (6, 6, 16)]
    ref = _engine(tiny_llama, spec, graphs=False).generate(prompts, params)
    e = _engine(tiny_llama, spec, graphs=True).engine
    e.idle.capture_graphs(1)
    target, draft = Replays(e.runner), Replays(e.speculator.draft.runner)
    for i, (p, sp) in enumerate(zip(prompts, params)):
        e.add_request(str(i), p, sp)
    tokens = {}
    while e.has_unfinished():
        for o in e.step():
            tokens[o.request_id] = o.outputs[0].token_ids
    assert [tokens[str(i)] for i in range(3)] == [o.outputs[0].token_ids for o in ref]
    assert e.runner.graphs.buckets == {1: [1], K + 1: [1]}
    assert target[(None, False)] >= 2 and target[(K + 1, False)] >= 2  # eager at 3 sequences, replayed at 1
    assert draft[(None, True)] >= K - 1 and draft[(1, True)] >= K - 1


@pytest.mark.slow  # whole engines under the Triton interpreter
def test_host_waits_per_speculating_step(tiny_llama, draft_path, monkeypatch):
    """A speculating step with graphs: the host reads from the device twice (the drafts in one copy, then the
    verified tokens), makes no blocking host-to-device copy, and the draft's block table is written (a copy that
    the next write waits for) at most once, by its catch-up (when a sequence's blocks changed), never by its
    one-token steps."""
    from tests.host_copies import count_host_copies

    e = _engine(tiny_llama, _spec("random_draft", tiny_llama, draft_path), graphs=True).engine
    e.idle.capture_graphs(4)
    reads = Counter()
    for name in ("item", "tolist", "cpu"):
        real = getattr(torch.Tensor, name)
        monkeypatch.setattr(torch.Tensor, name, lambda self, *a, _r=real, **k: reads.update(["reads"]) or _r(self))
    for i, p in enumerate(PROMPTS):
        e.add_request(str(i), {"prompt_token_ids": p}, PARAMS[0])
    e.step()  # the prefill
    table = e.speculator.draft.runner.block_table
    steps = []
    while e.has_unfinished():
        reads.clear()
        before, replays = table.copies, e.runner.graphs.replays + e.speculator.draft.runner.graphs.replays
        with count_host_copies() as c:
            e.step()
        after = e.runner.graphs.replays + e.speculator.draft.runner.graphs.replays
        steps.append((reads["reads"], c["list_index"] + c["tensor"], table.copies - before, after - replays))
    speculating = [s for s in steps if s[3] > 1]
    assert len(speculating) >= 3
    assert all(s[:2] == (2, 0) and s[2] <= 1 for s in speculating), steps
    assert any(s[3] == K + 1 for s in speculating)  # the catch-up, K - 1 one-token steps and the verify: replays
