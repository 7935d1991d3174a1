"""The whole engine on the Triton path (interpreter on CPU, or real kernels on DEVICE; tiny Llama, a few tokens)
gives the torch path's tokens."""

from __future__ import annotations

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
