"""Sampler: seeds independent of the batch, penalties as vLLM defines them, top-k/top-p/min-p, n > 1."""

from __future__ import annotations

import pytest
import torch

from engine import LLM, SamplingParams
from engine.sampler import Sampler
from engine.types import Request


@pytest.fixture(scope="module")
def llm(tiny_llama):
    return LLM(model=str(tiny_llama), dtype="float32", log_stats_interval=0)


PROMPT = {"prompt_token_ids": [5, 17, 33, 90, 4, 61]}


def _ids(outs):
    return [o.outputs[0].token_ids for o in outs]


def test_seed_reproduces_alone_and_inside_a_batch(llm):
    p = SamplingParams(temperature=1.0, top_p=0.95, seed=1234, max_tokens=24, ignore_eos=True)
    alone = llm.generate(PROMPT, p)[0].outputs[0].token_ids
    others = [{"prompt_token_ids": [7 + i, 8 + 2 * i, 9]} for i in range(16)]
    other_params = [
        SamplingParams(temperature=0.9, max_tokens=30, ignore_eos=True, seed=None if i % 2 else i) for i in range(16)
    ]
    batch = llm.generate(others[:8] + [PROMPT] + others[8:], other_params[:8] + [p] + other_params[8:])
    assert batch[8].outputs[0].token_ids == alone
    # the check can fail: another seed gives another sequence
    other_seed = llm.generate(
        PROMPT, SamplingParams(temperature=1.0, top_p=0.95, seed=99, max_tokens=24, ignore_eos=True)
    )
    assert other_seed[0].outputs[0].token_ids != alone


def test_n_sequences(llm):
    out = llm.generate(PROMPT, SamplingParams(n=3, temperature=1.0, seed=5, max_tokens=12, ignore_eos=True))[0]
    assert [c.index for c in out.outputs] == [0, 1, 2]
    assert all(len(c.token_ids) == 12 for c in out.outputs)
    assert len({tuple(c.token_ids) for c in out.outputs}) > 1
    greedy = llm.generate(PROMPT, SamplingParams(n=2, temperature=0, max_tokens=8, ignore_eos=True))[0]
    assert greedy.outputs[0].token_ids == greedy.outputs[1].token_ids


def _req(output_ids, prompt_ids=(1,), **kw):
    return Request(
        "r", list(prompt_ids), SamplingParams(**kw), eos_token_ids=frozenset({2}), output_token_ids=list(output_ids)
    )


def test_penalties_match_vllm_definition():
    torch.manual_seed(0)
    logits = torch.randn(1, 10) * 3
    s = Sampler(10, torch.device("cpu"))
    r = _req(
        [3, 3, 5], prompt_ids=[7], temperature=0, repetition_penalty=1.5, frequency_penalty=0.4, presence_penalty=0.3
    )
    ref = logits.clone()[0]
    for t in (3, 5, 7):  # repetition: prompt and output tokens
        ref[t] = ref[t] / 1.5 if ref[t] > 0 else ref[t] * 1.5
    ref[3] -= 0.4 * 2 + 0.3  # frequency x count + presence, output tokens only
    ref[5] -= 0.4 * 1 + 0.3
    work = logits.clone()
    s._apply_penalties(work, [r])
    torch.testing.assert_close(work[0], ref)
    # and the sampler picks the argmax of the penalized logits
    tokens, _ = s(logits.clone(), [r])
    assert tokens == [int(ref.argmax())]


def test_min_tokens_masks_eos_and_stop_ids():
    logits = torch.full((1, 10), -5.0)
    logits[0, 2] = 10.0  # eos is the clear favourite
    logits[0, 4] = 9.0
    logits[0, 6] = 1.0
    s = Sampler(10, torch.device("cpu"))
    assert s(logits.clone(), [_req([], temperature=0)])[0] == [2]
    assert s(logits.clone(), [_req([], temperature=0, min_tokens=2, stop_token_ids=[4])])[0] == [6]
    assert s(logits.clone(), [_req([1, 1], temperature=0, min_tokens=2)])[0] == [2]


def test_top_k_top_p_min_p_restrict_support():
    torch.manual_seed(0)
    logits = torch.tensor([[4.0, 3.9, 3.0, 1.0, 0.0, -1.0]])
    s = Sampler(6, torch.device("cpu"))

    def support(**kw):
        seen = set()
        for seed in range(300):
            r = _req([], temperature=1.0, seed=seed, **kw)
            r.generator = torch.Generator().manual_seed(seed)
            seen.add(s(logits.clone(), [r])[0][0])
        return seen

    assert support() >= {0, 1, 2, 3}  # unrestricted: more than any restricted support below
    assert support(top_k=2) == {0, 1}
    assert support(top_p=0.5) == {0, 1}  # p(0) ~ 0.43 < 0.5, so token 1 is needed too
    assert support(min_p=0.3) == {0, 1, 2}  # p(2)/p(0) = e^-1 ~ 0.37


def test_logprobs_are_raw_and_include_sampled_token():
    logits = torch.tensor([[1.0, 2.0, 3.0, 0.5]])
    s = Sampler(4, torch.device("cpu"))
    r = _req([], temperature=0, logprobs=2, repetition_penalty=2.0, prompt_ids=[2])
    tokens, lps = s(logits.clone(), [r])
    raw = torch.log_softmax(logits[0], -1)
    assert tokens == [1]  # the penalty moved the argmax away from token 2 ...
    assert set(lps[0]) == {2, 1}  # ... but logprobs are from the raw logits: top-2 is {2, 1}
    assert lps[0][2] == pytest.approx(raw[2].item())
    assert lps[0][1] == pytest.approx(raw[1].item())


def test_stop_strings_and_stop_ids_in_engine(llm):
    base = llm.generate(PROMPT, SamplingParams(temperature=0, max_tokens=20, ignore_eos=True))[0].outputs[0]
    assert len(base.text) > 6
    stop = base.text[3:6]  # spans whatever tokens it spans
    out = llm.generate(PROMPT, SamplingParams(temperature=0, max_tokens=20, ignore_eos=True, stop=[stop]))
    c = out[0].outputs[0]
    assert c.finish_reason == "stop" and c.stop_reason == stop and c.text == base.text[: base.text.index(stop)]
    out = llm.generate(
        PROMPT,
        SamplingParams(temperature=0, max_tokens=20, ignore_eos=True, stop=[stop], include_stop_str_in_output=True),
    )
    assert out[0].outputs[0].text == base.text[: base.text.index(stop) + len(stop)]
    stop_id = base.token_ids[4]
    first = base.token_ids.index(stop_id)
    out = llm.generate(PROMPT, SamplingParams(temperature=0, max_tokens=20, stop_token_ids=[stop_id]))
    c = out[0].outputs[0]
    assert c.finish_reason == "stop" and c.stop_reason == stop_id and c.token_ids == base.token_ids[: first + 1]
    out = llm.generate(PROMPT, SamplingParams(temperature=0, max_tokens=5, ignore_eos=True))
    assert out[0].outputs[0].finish_reason == "length" and len(out[0].outputs[0].token_ids) == 5


def test_host_round_trips_do_not_grow_with_the_batch(monkeypatch):
    """Penalties, sampling options and logprobs cost a fixed number of device round trips per step, not a few
    per request (each .item(), .tolist(), .cpu() or blocking copy is a stream sync on a GPU)."""
    from engine.sampler import Sampler
    from engine.types import Request

    counted = {"n": 0}
    for name in ("item", "tolist", "cpu"):
        real = getattr(torch.Tensor, name)
        monkeypatch.setattr(
            torch.Tensor,
            name,
            lambda self, *a, _real=real, **k: counted.__setitem__("n", counted["n"] + 1) or _real(self, *a, **k),
        )

    def trips(batch: int) -> int:
        params = SamplingParams(
            temperature=0.8,
            top_p=0.9,
            top_k=20,
            min_p=0.05,
            repetition_penalty=1.2,
            frequency_penalty=0.5,
            presence_penalty=0.3,
            logprobs=3,
            max_tokens=8,
        )
        reqs = [Request(f"r{i}", list(range(5 + i)), params, eos_token_ids=frozenset({0})) for i in range(batch)]
        for r in reqs:
            r.output_token_ids = [7, 8, 8, 9 + len(r.prompt_token_ids)]
        counted["n"] = 0
        tokens, lps = Sampler(64, torch.device("cpu"))(torch.randn(batch, 64), reqs)
        assert len(tokens) == batch and all(len(d) >= 3 for d in lps)
        return counted["n"]

    assert trips(2) == trips(16) <= 3


def _mixed(batch: int) -> list[Request]:
    """Every option a row can take, cycled over the batch: greedy, the default random row, seeded, penalties,
    logprobs, min_tokens not yet reached, top-k / top-p / min-p."""
    kinds = [
        dict(temperature=0),
        dict(),
        dict(seed=3),
        dict(repetition_penalty=1.2, frequency_penalty=0.5, presence_penalty=0.3),
        dict(logprobs=2),
        dict(min_tokens=4, stop_token_ids=[5, 6]),
        dict(top_k=5, top_p=0.9, min_p=0.05, temperature=0.7),
    ]
    reqs = []
    for i in range(batch):
        r = _req([3, 4][: i % 3], prompt_ids=range(2, 6 + i), **kinds[i % len(kinds)])
        if r.params.seed is not None:
            r.generator = torch.Generator().manual_seed(r.params.seed)
        reqs.append(r)
    return reqs


def test_sampling_indexes_no_device_tensor_with_a_list():
    """On CUDA, indexing with a Python list is a blocking host-to-device copy: the default random step (temperature
    1, nothing else) sends only its temperatures, through pinned memory, and a batch that mixes every option
    sends a fixed number of pinned copies, none of them blocking."""
    from tests.host_copies import count_host_copies

    s = Sampler(32, torch.device("cpu"))
    for batch in (1, 8):
        reqs = [_req([], prompt_ids=[1, 2]) for _ in range(batch)]
        with count_host_copies() as c:
            tokens, _ = s(torch.randn(batch, 32), reqs)
        assert len(tokens) == batch
        assert (c["list_index"], c["tensor"], c["h2d"]) == (0, 0, 1)  # the temperature column

    def copies(batch: int) -> tuple[int, int, int]:
        with count_host_copies() as c:
            tokens, lps = s(torch.randn(batch, 32), _mixed(batch))
        assert len(tokens) == batch and sum(d is not None for d in lps) == batch // 7 + (batch % 7 > 4)
        return c["list_index"], c["tensor"], c["h2d"]

    assert copies(7)[:2] == (0, 0)
    assert copies(7) == copies(21)


def test_row_subsets_sample_as_each_row_alone():
    """Random rows among greedy ones are read and written through one index: each row's token is the one the
    same row gets alone, seeded, and greedy rows keep their argmax."""
    logits = torch.randn(7, 32)
    reqs = _mixed(7)
    tokens, _ = Sampler(32, torch.device("cpu"))(logits.clone(), reqs)
    for i, r in enumerate(_mixed(7)):
        if r.params.greedy or r.generator is not None:
            assert Sampler(32, torch.device("cpu"))(logits[i : i + 1].clone(), [r])[0] == [tokens[i]]
    assert tokens[0] == int(logits[0].argmax())


@pytest.mark.parametrize("vocab", [300, 49152, 50257, 257])
def test_chunked_argmax_is_torchs_argmax(vocab):
    """argmax_rows (a chunked argmax for CPU) gives torch.argmax's index and amax's value on every row with a
    finite max: ties inside a chunk, across chunks and in the short tail chunk resolve to the first; a bad row
    (NaN, +inf, all -inf) has a non-finite max, which the sampler turns into -1 as before."""
    from engine.sampler import argmax_rows

    g = torch.Generator().manual_seed(vocab)
    x = torch.randn(12, vocab, generator=g)
    x[0, [vocab // 3, vocab // 2, vocab - 1]] = 9.0  # ties across chunks: the first wins
    x[1, [5, 6]] = 9.0  # a tie inside a chunk
    x[2, vocab - 1] = 9.0  # the max in the tail's last column
    x[3] = 0.0  # every column ties
    x[4] = -1e30
    x[4, vocab - 2] = -1e29
    x[5, 7] = float("nan")
    x[6, 3] = float("inf")
    x[7] = float("-inf")
    x[8, : vocab // 2] = torch.finfo(torch.float32).max  # a half of the row at fp32's max
    tokens, top = argmax_rows(x)
    assert torch.equal(top.isnan(), x.amax(-1).isnan())
    good = torch.isfinite(x.amax(-1))
    assert good.sum() == 9 and not good[5:8].any()
    assert torch.equal(tokens[good], x.argmax(-1)[good]) and torch.equal(top[good], x.amax(-1)[good])
    assert not torch.isfinite(top[~good]).any()
    greedy = [Request("r", [1], SamplingParams(temperature=0)) for _ in range(12)]
    picked, _ = Sampler(vocab, torch.device("cpu"))(x, greedy)
    assert picked == [t if ok else -1 for t, ok in zip(x.argmax(-1).tolist(), good.tolist())]
