"""Bad input raises a typed error naming the problem, and the engine keeps serving."""

from __future__ import annotations

import asyncio
import json

import pytest

from engine import (
    LLM,
    AsyncEngine,
    ConfigError,
    EngineConfig,
    InvalidRequestError,
    ModelNotFoundError,
    SamplingParams,
    UnsupportedModelError,
)
from engine.weights import resolve_model_path


def test_missing_model_names_paths_searched(tmp_path):
    with pytest.raises(ModelNotFoundError) as e:
        LLM(model="some-org/not-cached", hf_cache_dirs=(str(tmp_path / "hub"),))
    assert "some-org/not-cached" in str(e.value) and str(tmp_path / "hub") in str(e.value)
    with pytest.raises(ModelNotFoundError, match="no/such/dir"):
        LLM(model="/no/such/dir")


def test_pickle_only_checkpoint_refused(tmp_path, tiny_llama):
    (tmp_path / "config.json").write_text((tiny_llama / "config.json").read_text())
    (tmp_path / "pytorch_model.bin").write_bytes(b"\x80\x04not really a pickle")
    with pytest.raises(UnsupportedModelError, match="pytorch_model.bin.*safetensors"):
        LLM(model=str(tmp_path))


def test_hf_cache_resolution_case_insensitive(tmp_path, tiny_llama):
    snap = tmp_path / "hub" / "models--myorg--tiny" / "snapshots" / "abc123"
    snap.parent.mkdir(parents=True)
    snap.symlink_to(tiny_llama, target_is_directory=True)
    (tmp_path / "hub" / "models--myorg--tiny" / "refs").mkdir()
    (tmp_path / "hub" / "models--myorg--tiny" / "refs" / "main").write_text("abc123")
    cfg = EngineConfig(model="MyOrg/Tiny", hf_cache_dirs=(str(tmp_path / "hub"),))
    assert resolve_model_path(cfg) == snap
    with pytest.raises(ModelNotFoundError, match="snapshots/v2"):
        resolve_model_path(cfg.replace(revision="v2"))


def test_sharded_checkpoint_loads(tmp_path, tiny_llama):
    from safetensors.torch import load_file, save_file

    tensors = load_file(str(tiny_llama / "model.safetensors"))
    names = sorted(tensors)
    half = len(names) // 2
    shards = {"model-00001-of-00002.safetensors": names[:half], "model-00002-of-00002.safetensors": names[half:]}
    for f, ns in shards.items():
        save_file({n: tensors[n] for n in ns}, str(tmp_path / f))
    (tmp_path / "model.safetensors.index.json").write_text(
        json.dumps({"metadata": {}, "weight_map": {n: f for f, ns in shards.items() for n in ns}})
    )
    for f in tiny_llama.iterdir():
        if f.suffix == ".json" or f.name.startswith("tokenizer"):
            (tmp_path / f.name).write_bytes(f.read_bytes())
    p = {"prompt_token_ids": [5, 6, 7]}
    sp = SamplingParams(temperature=0, max_tokens=8)
    a = LLM(model=str(tmp_path), dtype="float32").generate(p, sp)[0].outputs[0].token_ids
    b = LLM(model=str(tiny_llama), dtype="float32").generate(p, sp)[0].outputs[0].token_ids
    assert a == b


@pytest.mark.parametrize(
    "kwargs,field",
    [
        ({"temperature": -0.1}, "temperature"),
        ({"top_p": 1.5}, "top_p"),
        ({"top_p": 0}, "top_p"),
        ({"n": 0}, "n"),
        ({"top_k": -2}, "top_k"),
        ({"max_tokens": 0}, "max_tokens"),
        ({"min_p": 2}, "min_p"),
        ({"presence_penalty": 3}, "presence_penalty"),
        ({"repetition_penalty": 0}, "repetition_penalty"),
        ({"logprobs": 50}, "logprobs"),
        ({"min_tokens": 5, "max_tokens": 2}, "min_tokens"),
        ({"stop": [""]}, "stop"),
    ],
)
def test_invalid_sampling_params(kwargs, field):
    with pytest.raises(InvalidRequestError) as e:
        SamplingParams(**kwargs)
    assert e.value.field == field and field in str(e.value)


def test_bad_config_values():
    with pytest.raises(ConfigError, match="dtype"):
        EngineConfig(dtype="float8")
    with pytest.raises(ConfigError, match="block_size"):
        EngineConfig(block_size=7)


def test_config_errors_carry_the_field():
    """As InvalidRequestError does: the worker names the variable from .field, not from the message."""
    with pytest.raises(ConfigError) as e:
        EngineConfig(max_loras=0)
    assert e.value.field == "max_loras"
    with pytest.raises(ConfigError) as e:
        EngineConfig(speculative_config={"method": "ngram", "num_speculative_tokens": 99})
    assert e.value.field == "speculative_config.num_speculative_tokens"
    with pytest.raises(ConfigError) as e:
        EngineConfig(speculative_config="{not json")
    assert e.value.field == "speculative_config"


def test_bad_requests_fail_alone_engine_keeps_serving(tiny_llama):
    eng = AsyncEngine(EngineConfig(model=str(tiny_llama), dtype="float32", max_model_len=64, log_stats_interval=0))

    async def run(prompt, params=None):
        out = None
        async for out in eng.generate(prompt, params or SamplingParams(temperature=0, max_tokens=4)):  # noqa: B007
            pass
        return out

    async def main():
        good = asyncio.create_task(
            run({"prompt_token_ids": [5] * 10}, SamplingParams(temperature=0, max_tokens=30, ignore_eos=True))
        )
        with pytest.raises(InvalidRequestError, match="max_model_len") as e:
            await run({"prompt_token_ids": [5] * 64})
        assert e.value.field == "prompt"
        with pytest.raises(InvalidRequestError) as e:
            await run({"prompt_token_ids": [5, 10_000]})
        assert e.value.field == "prompt_token_ids"
        with pytest.raises(InvalidRequestError):
            await run("")
        out = await good
        assert out.finished and len(out.outputs[0].token_ids) == 30
        return await run({"prompt_token_ids": [5, 6]})

    last = asyncio.run(main())
    assert last.finished
    eng.shutdown()


def test_max_model_len_beyond_pool_is_a_config_error(tiny_llama):
    with pytest.raises(ConfigError, match="max_model_len"):
        LLM(model=str(tiny_llama), num_kv_blocks=2, max_model_len=100)
