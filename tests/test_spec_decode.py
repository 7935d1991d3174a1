"""Speculative decoding (engine/spec_decode/): n-gram prompt lookup and a draft model, verified by rejection
sampling. Greedy output must equal the plain engine's token for token; sampled output must keep the target's
distribution; rejected slots must be rolled back."""

from __future__ import annotations

import math
from pathlib import Path

import numpy as np
import pytest
import torch

from engine import LLM, EngineConfig, SamplingParams
from engine.block_manager import blocks_needed
from engine.errors import ConfigError
from engine.sampler import Sampler
from engine.spec_decode.config import SpeculativeConfig
from engine.spec_decode.ngram import propose_ngram
from engine.spec_decode.rejection import verify
from engine.types import Request, StructuredOutputsParams
from tests.utils import build_tiny_model

pytestmark = pytest.mark.slow  # draft models and the real SmolLM2

NGRAM = {"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_min": 1, "prompt_lookup_max": 3}
# prompts whose greedy continuations repeat (a random tiny model loops), plus one that does not
PROMPTS = [[5, 9, 13, 5, 9, 13, 5, 9], [100, 101, 102, 103], list(range(20, 60)), [7] * 10, [42, 17, 99]]
GREEDY = SamplingParams(temperature=0, max_tokens=40, ignore_eos=True)
CHI2_999 = {4: 18.467, 15: 37.697}  # chi-square critical values at p = 0.001 by degrees of freedom


@pytest.fixture(scope="module")
def models(tmp_path_factory, tiny_llama) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("spec")
    return {
        "target": tiny_llama,
        "random_draft": build_tiny_model(root / "draft", "llama", seed=7, num_hidden_layers=1),
        "other_vocab": build_tiny_model(root / "vocab", "llama", vocab_size=500),
    }


def llm(models, spec=None, **kw) -> LLM:
    kw = {"model": str(models["target"]), "dtype": "float32", "log_stats_interval": 0, "num_kv_blocks": 64, **kw}
    return LLM(speculative_config=spec, **kw)


def tokens(outs) -> list[list[int]]:
    return [c.token_ids for o in outs for c in o.outputs]


def run(engine_llm, prompts=PROMPTS, params=GREEDY, **kw):
    return engine_llm.generate([{"prompt_token_ids": p} for p in prompts], params, **kw)


def assert_pool_clean(e) -> None:
    assert e.block_manager.num_free_blocks == e.block_manager.num_blocks


# ---- configuration ----------------------------------------------------------------------------------------
def test_config_values_and_errors_name_the_field():
    c = SpeculativeConfig.of('{"method": "ngram", "num_speculative_tokens": 4}')
    assert (c.prompt_lookup_min, c.prompt_lookup_max) == (5, 5)  # vLLM's defaults
    c = SpeculativeConfig.of({"method": "ngram", "num_speculative_tokens": 2, "prompt_lookup_max": 3})
    assert (c.prompt_lookup_min, c.prompt_lookup_max) == (3, 3)
    assert SpeculativeConfig.of({"model": "x", "num_speculative_tokens": 2}).method == "draft_model"
    assert SpeculativeConfig.of("") is None and SpeculativeConfig.of({}) is None
    assert EngineConfig(speculative_config=NGRAM).speculative_config.num_speculative_tokens == 3
    bad = {
        '{"method": "ngram"}': "num_speculative_tokens",
        '{"method": "ngram", "num_speculative_tokens": 0}': "num_speculative_tokens",
        '{"method": "medusa", "num_speculative_tokens": 2}': "method",
        '{"method": "ngram", "num_speculative_tokens": 2, "prompt_lookup_min": 4, "prompt_lookup_max": 2}': (
            "prompt_lookup_min"
        ),
        '{"method": "ngram", "num_speculative_tokens": 2, "prompt_lookup_max": -1}': "prompt_lookup_max",
        '{"method": "draft_model", "num_speculative_tokens": 2}': "model",
        '{"method": "ngram", "num_speculative_tokens": 2, "bogus": 1}': "bogus",
        "{not json": "not valid JSON",
    }
    for text, field in bad.items():
        with pytest.raises(ConfigError, match=field):
            SpeculativeConfig.of(text)


def test_env_reaches_the_engine():
    from handler.settings import load_settings

    s = load_settings({"SPECULATIVE_CONFIG": '{"method": "ngram", "num_speculative_tokens": 2}'})
    assert s.engine_config().speculative_config.num_speculative_tokens == 2
    assert s.ignored() == []


def test_draft_with_another_vocabulary_is_refused(models):
    with pytest.raises(ConfigError, match=r"speculative_config.model.*vocabulary has 500 tokens"):
        llm(models, {"model": str(models["other_vocab"]), "num_speculative_tokens": 2})


def test_propose_ngram():
    t = np.array([1, 2, 3, 4, 9, 1, 2, 3], dtype=np.int64)
    assert propose_ngram(t, 1, 3, 3) == [4, 9, 1]  # "1 2 3" occurred at 0: what followed it
    assert propose_ngram(t, 1, 3, 10) == [4, 9, 1, 2, 3]  # as far as the sequence goes
    assert propose_ngram(np.array([5, 6, 7, 5]), 1, 2, 2) == [6, 7]  # down to a 1-gram
    assert propose_ngram(np.array([5, 6, 7, 5]), 2, 2, 2) == []  # no 2-gram recurs
    assert propose_ngram(np.array([1, 2, 1, 3, 1]), 1, 1, 1) == [3]  # the most recent occurrence


# ---- greedy equality --------------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def base_out(models):
    return tokens(run(llm(models)))


@pytest.mark.parametrize("kind", ["ngram", "random_draft", "self_draft"])
def test_greedy_equals_plain_decoding(models, base_out, kind):
    spec = {
        "ngram": NGRAM,
        "random_draft": {"model": str(models["random_draft"]), "num_speculative_tokens": 3},
        "self_draft": {"model": str(models["target"]), "num_speculative_tokens": 4},
    }[kind]
    e = llm(models, spec)
    outs = run(e)
    assert tokens(outs) == base_out
    st = e.engine.stats()
    assert st["spec_decode_num_draft_tokens"] > 50
    rate = st["spec_decode_acceptance_rate"]
    if kind == "self_draft":
        assert rate > 0.95 and st["spec_decode_mean_acceptance_length"] > 4
    elif kind == "random_draft":
        assert rate < 0.2  # a random draft is rejected almost always, and changes nothing
    else:  # a random model rarely repeats itself: few n-gram drafts are right, but some are
        assert st["spec_decode_num_accepted_tokens"] > 0
    m = outs[0].metrics.spec_decode
    assert m["draft_tokens"] > 0 and len(m["accepted_per_pos"]) == spec["num_speculative_tokens"]
    assert 1 <= m["mean_acceptance_length"] <= 1 + spec["num_speculative_tokens"]
    assert m["acceptance_rate"] == round(m["accepted_tokens"] / m["draft_tokens"], 4)
    assert_pool_clean(e.engine)


def test_greedy_equality_with_chunked_prefill_preemption_and_stops(models):
    long = [list(range(3, 3 + 70)) + list(range(3, 20)), [11, 12, 13] * 20, [8] * 50]
    params = [
        SamplingParams(temperature=0, max_tokens=30, ignore_eos=True),
        SamplingParams(temperature=0, max_tokens=25, min_tokens=10, ignore_eos=False),
        SamplingParams(temperature=0, max_tokens=30, ignore_eos=True, logprobs=2),
    ]
    # small budget (chunked prefill) and a pool too small for all three at once (preemption)
    kw = dict(max_num_batched_tokens=24, num_kv_blocks=14, block_size=8)
    base = llm(models, **kw)
    ref = base.generate([{"prompt_token_ids": p} for p in long], params)
    e = llm(models, NGRAM, **kw)
    got = e.generate([{"prompt_token_ids": p} for p in long], params)
    assert tokens(got) == tokens(ref)
    assert e.engine.scheduler.num_preemptions > 0 and base.engine.scheduler.num_preemptions > 0
    lp_ref, lp_got = ref[2].outputs[0].logprobs, got[2].outputs[0].logprobs
    assert len(lp_got) == len(lp_ref) == 30
    for a, b in zip(lp_ref, lp_got):
        assert a.keys() == b.keys() and all(abs(a[t] - b[t]) < 1e-4 for t in a)
    assert_pool_clean(e.engine)

    # stop token ids, stop strings and max_tokens inside an accepted run (the model drafting for itself accepts
    # every draft): nothing past the stop
    self_draft = {"model": str(models["target"]), "num_speculative_tokens": 4}
    plain = tokens(run(llm(models), [[11, 12, 13] * 8]))[0]
    stop_tok = plain[5]
    text = base.engine.tok.decode(plain[:8])
    stop_str = text[len(base.engine.tok.decode(plain[:6])) :][:2] or None
    for sp in (
        SamplingParams(temperature=0, max_tokens=40, stop_token_ids=[stop_tok]),
        SamplingParams(temperature=0, max_tokens=7),
        SamplingParams(temperature=0, max_tokens=40, stop=[stop_str] if stop_str else None),
    ):
        ref_o = run(llm(models), [[11, 12, 13] * 8], sp)[0].outputs[0]
        got_o = run(llm(models, self_draft), [[11, 12, 13] * 8], sp)[0].outputs[0]
        assert (got_o.token_ids, got_o.text, got_o.finish_reason) == (ref_o.token_ids, ref_o.text, ref_o.finish_reason)


def test_greedy_equality_with_n_and_a_lora_request(models, tmp_path):
    from engine import LoRARequest
    from tests.lora_fixtures import make_peft_adapter

    adapter = make_peft_adapter(models["target"], tmp_path / "a1", b_std=0.3, seed=1)[0]
    kw = dict(enable_lora=True, lora_modules=(("a1", str(adapter)),), cache_root=str(tmp_path), max_lora_rank=8)
    prompts = [{"prompt_token_ids": p} for p in PROMPTS[:3] + PROMPTS[:1]]  # the last: prompt 0 without the adapter
    loras = [LoRARequest("a1"), None, LoRARequest("a1"), None]
    sp = SamplingParams(temperature=0, max_tokens=30, ignore_eos=True, n=2)
    ref = llm(models, **kw).generate(prompts, sp, lora=loras)
    draft = {"model": str(models["target"]), "num_speculative_tokens": 3}  # the draft runs without the adapter
    e = llm(models, draft, **kw)
    got = e.generate(prompts, sp, lora=loras)
    assert tokens(got) == tokens(ref)
    # n=2: outputs 0-1 are prompt 0 with the adapter, 6-7 the same prompt without it; the adapter must change them
    assert tokens(ref)[0] != tokens(ref)[6]
    assert got[1].metrics.spec_decode["acceptance_rate"] > 0.95  # base model: its own draft
    assert got[0].metrics.spec_decode["acceptance_rate"] < got[1].metrics.spec_decode["acceptance_rate"]


def test_smollm2_self_draft_and_ngram(smollm2_path):
    prompt = "Rewrite this function with a docstring:\ndef add(a, b):\n    total = a + b\n    return total\n"
    sp = SamplingParams(temperature=0, max_tokens=48)
    kw = dict(model=str(smollm2_path), dtype="float32", log_stats_interval=0, kv_cache_memory=64 << 20)
    ref = LLM(**kw).generate(prompt, sp)[0].outputs[0].token_ids
    for spec, min_rate in (({"model": str(smollm2_path), "num_speculative_tokens": 3}, 0.9), (NGRAM, 0.1)):
        e = LLM(speculative_config=spec, **kw)
        out = e.generate(prompt, sp)[0]
        assert out.outputs[0].token_ids == ref
        assert out.metrics.spec_decode["acceptance_rate"] > min_rate, out.metrics.spec_decode


# ---- sampling -----------------------------------------------------------------------------------------------
def _chi2(counts: np.ndarray, probs: np.ndarray) -> float:
    expected = probs * counts.sum()
    return float(((counts - expected) ** 2 / expected).sum())


@pytest.mark.parametrize("sampled_draft", [False, True])
def test_rejection_sampling_keeps_the_target_distribution(sampled_draft):
    """Chi-square: the first emitted token follows p_0, and after an accepted first draft the second follows p_1,
    whatever the draft proposes (one-hot n-gram drafts, or drafts drawn from a q far from p)."""
    torch.manual_seed(0)
    vocab, n, k = 6, 20000, 2
    target = torch.tensor([[2.0, 1.0, 0.5, 0.0, -1.0, 0.3], [0.0, 1.5, -0.5, 1.0, 0.2, 0.0], [0.0] * 6])
    q_rows = torch.tensor([[0.05, 0.05, 0.5, 0.2, 0.1, 0.1], [0.3, 0.1, 0.1, 0.1, 0.3, 0.1]])
    sp = SamplingParams(temperature=1.0, top_k=5)  # top_k applies: the least likely token (4) must never appear
    reqs = [Request(f"r{i}", [1, 2], sp) for i in range(n)]
    if sampled_draft:
        drafts = torch.multinomial(q_rows, n, replacement=True).T.tolist()  # [n, k], d_j ~ q_j
        probs = {r: q_rows for r in reqs}
    else:
        drafts = [[2, 1]] * (n // 2) + [[0, 3]] * (n - n // 2)  # fixed proposals, q = 1
        probs = None
    logits = target.repeat(n, 1)
    out, _ = verify(Sampler(vocab, torch.device("cpu")), logits, reqs, drafts, probs)
    cut = torch.tensor([[4], [2]])  # top_k=5 drops each row's least likely token
    p = torch.softmax(target[:2].scatter(1, cut, float("-inf")), -1).numpy()
    first = np.bincount([o[0] for o in out], minlength=vocab)
    assert first[4] == 0
    keep0 = [i for i in range(vocab) if i != 4]
    assert _chi2(first[keep0], p[0][keep0]) < CHI2_999[4]
    # a first draft that was accepted is followed by row 1's token (a rejected one never equals its draft)
    second = np.bincount([o[1] for o, d in zip(out, drafts) if o[0] == d[0]], minlength=vocab)
    assert second.sum() > 2000 and second[2] == 0
    keep1 = [i for i in range(vocab) if i != 2]
    assert _chi2(second[keep1], p[1][keep1]) < CHI2_999[4]
    assert all(len(o) <= k + 1 for o in out) and any(len(o) == k + 1 for o in out)
    # the check can fail: accepting every draft would follow the drafts, not p
    naive = np.bincount([d[0] for d in drafts], minlength=vocab)
    assert _chi2(naive[keep0] + 1, p[0][keep0]) > CHI2_999[4]


def test_engine_samples_from_the_target_distribution(models):
    """End to end, with the model as its own (sampled) draft: the joint law of the first two tokens under
    top_k=4 matches the one computed from the plain engine's logprobs."""
    prompt, top = [5, 9, 13, 21], 4
    plain = llm(models)

    def top_probs(ids) -> dict[int, float]:
        lp = run(plain, [ids], SamplingParams(temperature=0, max_tokens=1, logprobs=top))[0].outputs[0].logprobs[0]
        best = sorted(lp, key=lp.get, reverse=True)[:top]
        z = sum(math.exp(lp[t]) for t in best)
        return {t: math.exp(lp[t]) / z for t in best}

    p1 = top_probs(prompt)
    joint = {(a, b): pa * pb for a, pa in p1.items() for b, pb in top_probs(prompt + [a]).items()}
    e = llm(models, {"model": str(models["target"]), "num_speculative_tokens": 2}, max_num_seqs=256, num_kv_blocks=1200)
    sp = SamplingParams(temperature=1.0, top_k=top, max_tokens=3, ignore_eos=True, n=200, seed=None)
    outs = run(e, [prompt] * 20, sp)
    pairs = [tuple(c.token_ids[:2]) for o in outs for c in o.outputs]
    assert e.engine.stats()["spec_decode_num_accepted_tokens"] > 500  # drafts were verified and accepted
    cells = sorted(joint)
    counts = np.array([sum(1 for x in pairs if x == c) for c in cells])
    assert counts.sum() == len(pairs) == 4000  # no pair outside the top-4 x top-4 support
    assert _chi2(counts, np.array([joint[c] for c in cells])) < CHI2_999[15]


def test_seeded_request_alone_and_in_a_batch(models):
    spec = {"model": str(models["random_draft"]), "num_speculative_tokens": 3}
    sp = SamplingParams(temperature=0.8, max_tokens=24, seed=1234, ignore_eos=True)
    other = SamplingParams(temperature=1.0, max_tokens=24, ignore_eos=True)
    alone = run(llm(models, spec), [PROMPTS[0]], sp)[0].outputs[0].token_ids
    e = llm(models, spec)
    batch = [PROMPTS[1], PROMPTS[2], PROMPTS[0], PROMPTS[3], PROMPTS[4]]
    outs = e.generate([{"prompt_token_ids": p} for p in batch], [other, other, sp, other, other])
    assert outs[2].outputs[0].token_ids == alone
    both = e.generate([{"prompt_token_ids": PROMPTS[1]}, {"prompt_token_ids": PROMPTS[0]}], [other, sp])
    assert both[1].outputs[0].token_ids == alone
    ng = llm(models, NGRAM)
    a = run(ng, [PROMPTS[0]], sp)[0].outputs[0].token_ids
    b = ng.generate([{"prompt_token_ids": p} for p in PROMPTS[1::-1] + PROMPTS[2:3]], [other, sp, other])
    b = b[1].outputs[0].token_ids
    assert a == b


# ---- KV rollback ------------------------------------------------------------------------------------------
def test_rollback_frees_rejected_slots_and_aborts_free_everything(models):
    e = llm(models, {"model": str(models["random_draft"]), "num_speculative_tokens": 4}, block_size=8).engine
    for i, p in enumerate(PROMPTS):
        e.add_request(f"r{i}", {"prompt_token_ids": p}, SamplingParams(temperature=0, max_tokens=60, ignore_eos=True))
    rejected = 0
    for _ in range(8):
        e.step()
        for r in e.scheduler.running:  # after verification a sequence holds the blocks of its verified tokens only
            assert len(r.block_ids) == blocks_needed(r.num_computed_tokens, 8)
        rejected = e.output.spec.num_draft_tokens - e.output.spec.num_accepted_tokens
    assert rejected > 0
    # abort in the middle of a speculation: the granted lookahead slots are freed with the rest
    out = e.scheduler.schedule()
    assert out.spec
    e.abort_all()
    assert_pool_clean(e)


def test_short_pool_speculates_less_before_preempting(models):
    """A pool that only fits the real tokens: speculation shrinks, and preempts no one the plain engine does not."""
    kw = dict(num_kv_blocks=9, block_size=8, max_num_seqs=3)
    prompts = [[11, 12, 13] * 7, [5, 9, 13] * 7, [7] * 21]
    sp = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True)
    base = llm(models, **kw)
    ref = run(base, prompts, sp)
    e = llm(models, NGRAM, **kw)
    assert tokens(run(e, prompts, sp)) == tokens(ref)
    assert e.engine.scheduler.num_preemptions <= base.engine.scheduler.num_preemptions
    assert e.engine.stats()["spec_decode_num_draft_tokens"] > 0


def test_grammar_constrained_speculation(models):
    """A regex constraint with n-gram drafts: the drafts are checked against the grammar row by row."""
    so = StructuredOutputsParams(regex=r"(ab|cd){3,12}")
    sp = SamplingParams(temperature=0, max_tokens=40, structured_outputs=so)
    prompt = [{"prompt_token_ids": [5, 9, 13, 5, 9, 13]}]
    ref = llm(models).generate(prompt, sp)[0].outputs[0]
    e = llm(models, NGRAM)
    got = e.generate(prompt, sp)[0].outputs[0]
    assert (got.token_ids, got.text) == (ref.token_ids, ref.text)
    import re

    assert re.fullmatch(r"(ab|cd){3,12}", got.text)
    assert e.engine.stats()["spec_decode_num_draft_tokens"] > 0


# ---- what a user sees -------------------------------------------------------------------------------------------
def test_native_job_metrics_status_line_and_draft_prefix_reuse(models, caplog):
    """Through the handler: a native job's final metrics carry the acceptance numbers, the status line shows the
    rate, and a second request on a cached prefix spares the draft that prefix too."""
    import asyncio
    import logging

    from engine import AsyncEngine
    from handler.settings import load_settings
    from handler.worker import Worker

    spec = {"model": str(models["target"]), "num_speculative_tokens": 3}
    cfg = EngineConfig(
        model=str(models["target"]), dtype="float32", num_kv_blocks=64, log_stats_interval=0.001,
        speculative_config=spec,
    )  # fmt: skip
    eng = AsyncEngine(cfg)
    try:
        worker = Worker(load_settings({}), eng)
        prompt = {"prompt": "The quick brown fox jumps over the lazy dog. " * 4, "stream": True}
        inp = {**prompt, "sampling_params": {"temperature": 0, "max_tokens": 24, "ignore_eos": True}}

        async def job():
            return [c async for c in worker.handle({"id": "t", "input": inp})]

        with caplog.at_level(logging.INFO, logger="engine"):
            chunks = asyncio.run(job())
        m = chunks[-1]["metrics"]["spec_decode"]
        assert m["draft_tokens"] > 0 and m["acceptance_rate"] > 0.9 and m["mean_acceptance_length"] > 3
        assert chunks[-1]["usage"]["output"] == 24
        assert any("spec acceptance" in r.getMessage() for r in caplog.records)
        draft = eng.engine.speculator.draft
        before = draft.num_catchup_tokens
        asyncio.run(job())  # the same prompt: its full blocks are cached for the target and the draft
        n_prompt = chunks[-1]["usage"]["input"]
        assert draft.num_catchup_tokens - before < n_prompt - 16
    finally:
        eng.shutdown()


def test_draft_weights_and_kv_are_planned_with_the_target(models):
    """The draft's KV shares the target's block ids, so each block costs both: the same budget gives fewer blocks."""
    kw = dict(model=str(models["target"]), dtype="float32", log_stats_interval=0, kv_cache_memory=4 << 20)
    plain = LLM(**kw).engine
    e = LLM(speculative_config={"model": str(models["random_draft"]), "num_speculative_tokens": 2}, **kw).engine
    from engine import memory

    t = memory.kv_bytes_per_token(plain.spec, 4)
    d = memory.kv_bytes_per_token(e.draft_spec, 4)
    assert plain.block_manager.num_blocks == (4 << 20) // (t * 16)
    assert e.block_manager.num_blocks == (4 << 20) // ((t + d) * 16)
    both = memory.weight_bytes(plain.spec, 4, None) + memory.weight_bytes(e.draft_spec, 4, None)
    assert e.memory.weight_bytes == both


def test_device_block_table_sees_a_trimmed_and_regrown_table():
    """The Triton path reads block tables from a persistent device tensor: a table cut back after rejected drafts
    and grown again must be rewritten there, not left holding the freed block."""
    from engine.block_manager import BlockManager
    from engine.block_table import DeviceBlockTable

    bm = BlockManager(10, 4)
    req = Request("r", list(range(7)), SamplingParams())
    assert bm.allocate_slots(req, 7, num_lookahead=4)  # 11 slots: 3 blocks, the last for drafts only
    table = DeviceBlockTable(2, 8, torch.device("cpu"))
    table.update([req.block_ids])
    freed = req.block_ids[2]
    bm.trim(req, 7)
    req.num_computed_tokens = 7
    other = Request("o", list(range(3)), SamplingParams())
    assert bm.allocate_slots(other, 3) and other.block_ids == [freed]  # someone else takes the freed block
    assert bm.allocate_slots(req, 1, num_lookahead=4)
    assert table.update([req.block_ids])[0, :3].tolist() == req.block_ids and freed not in req.block_ids


def test_stop_string_inside_a_run_that_a_later_rule_ended(models):
    """The run of accepted drafts reaches max_tokens after a stop string: the stop string wins, as without
    speculation (where the sequence never got that far)."""
    prompt = [[11, 12, 13] * 8]
    plain = tokens(run(llm(models), prompt, SamplingParams(temperature=0, max_tokens=16, ignore_eos=True)))[0]
    tok = llm(models).engine.tok
    # self-drafting accepts every draft: token 0 comes from the prefill, then runs of up to 5 (1..5, 6..10), each cut
    # to max_tokens; a stop at 6 <= j <= 9 with max_tokens = j + 2 sits inside the run that max_tokens ends
    j = next(j for j in range(6, 10) if (p := tok.decode(plain[: j + 1])[len(tok.decode(plain[:j])) :]).strip()
             and p not in tok.decode(plain[:j]))  # fmt: skip
    stop = tok.decode(plain[: j + 1])[len(tok.decode(plain[:j])) :]
    self_draft = {"model": str(models["target"]), "num_speculative_tokens": 4}
    for max_tokens in range(j + 2, j + 6):
        sp = SamplingParams(temperature=0, max_tokens=max_tokens, stop=[stop], ignore_eos=True)
        ref = run(llm(models), prompt, sp)[0].outputs[0]
        got = run(llm(models, self_draft), prompt, sp)[0].outputs[0]
        assert ref.finish_reason == "stop" and ref.stop_reason == stop
        assert (got.token_ids, got.text, got.finish_reason, got.stop_reason) == (
            ref.token_ids, ref.text, ref.finish_reason, ref.stop_reason
        )  # fmt: skip


# ---- host-device copies -------------------------------------------------------------------------------------------
def _reads(monkeypatch) -> dict:
    """Counts device-to-host reads (.tolist(), .item(), .cpu()): each one waits for the device on a GPU."""
    n = {"reads": 0}

    def counted(real):
        def read(self, *a, **k):
            n["reads"] += 1
            return real(self, *a, **k)

        return read

    for name in ("item", "tolist", "cpu"):
        monkeypatch.setattr(torch.Tensor, name, counted(getattr(torch.Tensor, name)))
    return n


def test_verify_indexes_no_device_tensor_with_a_list(monkeypatch):
    """Verification reads and writes its random rows through one pinned index (none when every row is random) and
    comes to the host once, whatever the batch and its options."""
    from tests.host_copies import count_host_copies

    reads = _reads(monkeypatch)

    def copies(batch: int, greedy_every: int) -> tuple[int, int, int, int]:
        reqs, drafts = [], []
        for i in range(batch):
            t = 0 if greedy_every and i % greedy_every == 0 else 0.8
            sp = SamplingParams(temperature=t, min_tokens=3, repetition_penalty=1.1, logprobs=1 if i % 2 else None)
            reqs.append(Request(f"r{i}", [1, 2, 3], sp, eos_token_ids=frozenset({2})))
            drafts.append([5, 6, 7][: i % 4])
        probs = {r: torch.softmax(torch.randn(3, 16), -1) for r in reqs[::3]}
        logits = torch.randn(sum(len(d) + 1 for d in drafts), 16)
        reads["reads"] = 0
        with count_host_copies() as c:
            out, _ = verify(Sampler(16, torch.device("cpu")), logits, reqs, drafts, probs)
        assert [len(o) for o in out] and all(1 <= len(o) <= len(d) + 1 for o, d in zip(out, drafts))
        return c["list_index"], c["tensor"], c["h2d"], reads["reads"]

    for greedy_every in (0, 3):  # every row random (no index at all), and random rows among greedy ones
        small, large = copies(4, greedy_every), copies(16, greedy_every)
        assert small[:2] == (0, 0) and small == large
        assert small[3] == 3  # the tokens and acceptances (.tolist()), then the logprobs (.cpu().tolist())


def test_draft_tokens_stay_on_the_device_until_one_copy(models, monkeypatch):
    """The draft model's k steps feed each pick to the next forward on the device: one read to the host per
    proposal, whatever k, and no list indexing; greedy and sampled drafts stay what they were."""
    from tests.host_copies import count_host_copies

    e = llm(models, {"model": str(models["random_draft"]), "num_speculative_tokens": 4}).engine
    draft = e.speculator.draft
    seen = []
    real = draft.propose

    def propose(reqs, ks):
        reads["reads"] = 0
        with count_host_copies() as c:
            out = real(reqs, ks)
        seen.append((c["list_index"], c["tensor"], reads["reads"], tuple(ks)))
        return out

    reads = _reads(monkeypatch)
    monkeypatch.setattr(draft, "propose", propose)
    params = [SamplingParams(temperature=t, max_tokens=9 + i, ignore_eos=True) for i, t in enumerate((0, 1, 0.7, 0))]
    for i, p in enumerate(PROMPTS[:4]):
        e.add_request(f"r{i}", {"prompt_token_ids": p}, params[i])
    while e.has_unfinished():
        e.step()
    assert any(max(ks) == 4 for *_, ks in seen) and any(len(set(ks)) > 1 for *_, ks in seen)
    assert all(s[:3] == (0, 0, 1) for s in seen), seen
