"""The whole engine on the Triton path (interpreter on CPU, or real kernels on DEVICE; tiny Llama, a few tokens)
gives the torch path's tokens."""

from __future__ import annotations

import sys

import pytest

from engine import LLM, SamplingParams
from tests.kernels.conftest import DEVICE

pytestmark = pytest.mark.slow  # a whole engine under the Triton interpreter


def test_tiny_llama_triton_path_matches_torch_path(tiny_models):
    prompts = [
        {"prompt_token_ids": [5, 9, 33, 7, 21, 2 + 60, 11]},
        {"prompt_token_ids": [40, 41]},
        {"prompt_token_ids": list(range(50, 70))},
    ]
    params = SamplingParams(temperature=0, max_tokens=4, ignore_eos=True)
    # chunked prefill (budget 8) mixes a prefill chunk that starts mid-block with decodes in one launch
    kw = dict(
        device=str(DEVICE),
        dtype="float32",
        block_size=8,
        max_num_batched_tokens=8,
        num_kv_blocks=16,
        max_model_len=64,
        log_stats_interval=0,
    )
    for arch in ("llama3-rope-tied", "qwen3"):
        path = str(tiny_models[arch])
        ref = LLM(model=path, kernel_backend="torch", **kw).generate(prompts, params)
        tri_llm = LLM(model=path, kernel_backend="triton", **kw)
        assert tri_llm.engine.kernel_backend == "triton"
        tri = tri_llm.generate(prompts, params)
        assert [o.outputs[0].token_ids for o in tri] == [o.outputs[0].token_ids for o in ref], arch


def test_long_chunks_take_the_prefill_kernel(tiny_models, monkeypatch):
    """A 24-token budget: the 30-token prompt runs as chunks of 24 and 6, the 20-token one whole beside decodes, so
    steps with a chunk longer than PREFILL_TILE_MIN_QUERY go through kernels/prefill_attention.py (its 16-row
    interpreter tiles make several query tiles a chunk); the tokens are still the torch path's."""
    pa = sys.modules["kernels.prefill_attention"]  # the package exports a function of the same name

    calls = []
    op = pa._prefill_attention_op  # the operator the engine's calls go through (kernels/_library.py)
    monkeypatch.setattr(pa, "_prefill_attention_op", lambda *a, **k: calls.append(1) or op(*a, **k))
    monkeypatch.setattr(pa, "pick_tiles", lambda *a: pa.Tiles(16, 16, 1, 4))
    prompts = [{"prompt_token_ids": list(range(50, 70))}, {"prompt_token_ids": [40, 41]}]
    prompts.append({"prompt_token_ids": [(7 * i) % 200 + 3 for i in range(30)]})
    params = SamplingParams(temperature=0, max_tokens=3, ignore_eos=True)
    kw = dict(device=str(DEVICE), dtype="float32", block_size=8, max_num_batched_tokens=24, num_kv_blocks=24)
    kw.update(max_model_len=64, log_stats_interval=0)
    path = str(tiny_models["llama3-rope-tied"])
    ref = LLM(model=path, kernel_backend="torch", **kw).generate(prompts, params)
    tri = LLM(model=path, kernel_backend="triton", **kw).generate(prompts, params)
    assert calls, "no step ran the prefill kernel"
    assert [o.outputs[0].token_ids for o in tri] == [o.outputs[0].token_ids for o in ref]
