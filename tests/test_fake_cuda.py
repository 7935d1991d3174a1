"""The engine's CUDA code path, run on this CPU-only machine under fake CUDA tensors (tests/fake_cuda.py).

A real LLMEngine is built on "cuda:0" for a small Llama shape (head size 64): the planner reads a simulated H100,
the weights are fake tensors (the checkpoint is never read), and every kernel passes through its operator's fake
implementation. Each step then runs the real scheduler, ModelRunner, LM head, grammar masks, sampler and output
processor. Any CPU tensor that meets a CUDA one raises, and so does any op whose output size depends on data; the
host's reads of device values are counted per step: a prefill step and decode steps at batch 1, 8 and 64, greedy
and the default random sampling (temperature 1), each read the device exactly once, the sampled tokens'
`.tolist()`. CUDA graphs are off here (tests/test_cuda_graphs.py checks their capture rules)."""

from __future__ import annotations

from collections import Counter
from concurrent.futures import Future
from contextlib import contextmanager
from unittest import mock

import pytest
import torch
from torch._subclasses.fake_tensor import (
    DynamicOutputShapeException,
    FakeTensorDeviceMismatchError,
    unset_fake_temporarily,
)

from engine import startup
from engine.config import EngineConfig
from engine.llm_engine import LLMEngine
from engine.parallel.rank import rank_model
from engine.types import LoRARequest, SamplingParams, StructuredOutputsParams
from engine.weights.load import LoadedWeights
from kernels.grammar_mask import apply_token_bitmask
from kernels.lora import add_lora
from tests.fake_cuda import DEVICE, fake_cuda
from tests.lora_fixtures import make_peft_adapter
from tests.utils import build_tiny_model

ONE_READ = Counter(tolist=1)
PROMPT = list(range(3, 23))  # 20 tokens: longer than 16, so prefill takes the flash-tile prefill kernel


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    """arch -> config, tokenizer and (unread) weights of a 2-layer model with head size 64 (4 query, 2 KV heads)."""
    root, built = tmp_path_factory.mktemp("fake-cuda"), {}

    def get(arch: str):
        if arch not in built:
            shape = dict(hidden_size=256, intermediate_size=512, num_attention_heads=4, head_dim=64)
            built[arch] = build_tiny_model(root / arch, arch, **shape)
        return built[arch]

    return get


@pytest.fixture(scope="module")
def llama64(models):
    return models("llama")


def _fake_load(cfg, facts, max_positions, on_built=lambda: None):
    """The rank's model built on the fake device, its parameters left unread (they hold no data anyway)."""
    model = rank_model(
        facts.spec, facts.rank, cfg.tensor_parallel_size, facts.dtype, facts.device, max_positions, cfg.quantization,
        facts.kernel_backend == "triton",
    )  # fmt: skip
    if facts.spec.quant is not None and facts.spec.quant.desc_act:  # act-order: a permutation, as loaded
        for layer in model.layers:
            q = layer.quant_linears
            q.perm = {name: torch.arange(k, device=facts.device).flip(0) for name, k in q.k.items()}
    on_built()
    return model, LoadedWeights("checkpoint", [])


class _Now:
    """The adapter loader's executor, run on the calling thread outside the fake mode: real host tensors, as the
    loader thread makes them (HostSyncs, a per-thread mode too, still sees which are pinned)."""

    def submit(self, fn, *args):
        fut = Future()
        with unset_fake_temporarily():
            fut.set_result(fn(*args))
        return fut

    def shutdown(self, **kwargs):
        pass


@contextmanager
def fake_engine(model, **settings):
    cfg = EngineConfig(
        model=str(model), device=str(DEVICE), dtype="bfloat16", max_num_seqs=64, max_num_batched_tokens=2048,
        enforce_eager=True, **settings,
    )  # fmt: skip
    with fake_cuda() as syncs, mock.patch.object(startup, "load_rank", _fake_load):
        engine = LLMEngine(cfg)
        if engine.lora is not None:
            engine.lora._pool = _Now()
        try:
            assert engine.device == DEVICE and engine.runner.kv_caches.is_cuda
            yield engine, syncs
        finally:
            engine.shutdown()


def run_steps(engine, syncs, requests) -> list[Counter]:
    """Add (params, lora) requests, step until all finish; each step's host reads."""
    for i, (params, lora) in enumerate(requests):
        engine.add_request(f"r{i}", {"prompt_token_ids": PROMPT}, params, lora=lora)
    per_step = []
    while engine.has_unfinished():
        syncs.counts.clear()
        engine.step()
        per_step.append(Counter(syncs.counts))
        assert len(per_step) < 50, "the requests never finished"
    return per_step


GREEDY = SamplingParams(temperature=0, max_tokens=3, ignore_eos=True)
RANDOM = SamplingParams(max_tokens=3, ignore_eos=True)  # temperature 1, top_p 1: the OpenAI default


SLOW = pytest.mark.slow  # the fast lane keeps bf16, LoRA and grammar masks


@pytest.mark.parametrize(
    "settings",
    [{}, pytest.param({"quantization": "fp8"}, marks=SLOW), pytest.param({"kv_cache_dtype": "fp8"}, marks=SLOW)],
    ids=["bf16", "fp8-weights", "fp8-kv"],
)
def test_each_step_reads_the_device_once(llama64, settings):
    with fake_engine(llama64, **settings) as (engine, syncs):
        for batch in (1, 8, 64):
            for params in (GREEDY, RANDOM):
                steps = run_steps(engine, syncs, [(params, None)] * batch)
                # one prefill step (every prompt fits the token budget), then decode steps
                assert len(steps) == params.max_tokens, (batch, params.temperature, steps)
                assert steps == [ONE_READ] * len(steps), (batch, params.temperature, steps)


QUANT = {
    "awq": {"quant_method": "awq", "bits": 4, "group_size": 64, "zero_point": True, "version": "gemm"},
    "gptq-act-order": {"quant_method": "gptq", "bits": 4, "group_size": 64, "desc_act": True, "sym": True},
    "fp8-block": {"quant_method": "fp8", "activation_scheme": "dynamic", "weight_block_size": [128, 128]},
}


@SLOW
@pytest.mark.parametrize("fmt", QUANT)
def test_quantized_checkpoints_steps_read_the_device_once(llama64, tmp_path, fmt):
    """The packed int GEMM (split-K at decode, the act-order gather) and the block-fp8 GEMM with its per-token-group
    activation quant, on the CUDA path: no host sync, no device mix-up, one read a step."""
    import json
    import shutil

    model = tmp_path / fmt
    shutil.copytree(llama64, model)
    cfg = json.loads((model / "config.json").read_text())
    (model / "config.json").write_text(json.dumps({**cfg, "quantization_config": QUANT[fmt]}))
    with fake_engine(model) as (engine, syncs):
        layer = engine.model.layers[0]
        assert layer.quant_linears is not None and layer.qkv.is_cuda
        for params in (GREEDY, RANDOM):
            assert run_steps(engine, syncs, [(params, None)] * 8) == [ONE_READ] * 3


@SLOW
@pytest.mark.parametrize("arch", ["mixtral", "gemma2", "gpt-oss", "gpt-oss-mxfp4", "qwen3-next", "qwen3.5"])
def test_moe_and_gemma_steps_read_the_device_once(models, arch, tmp_path):
    """The fused MoE (its prefill-sized blocks too: 20 tokens x 2 of 4 experts), Gemma-2's soft-cap, sliding
    window and GeGLU, GPT-OSS's sinks, biases and clamped SwiGLU, and its MXFP4 experts kept 4-bit; a hybrid's
    Gated DeltaNet kernels over its state pool (the step's slot indices copied once, not per layer)."""
    model = models(arch.removesuffix("-mxfp4"))
    if arch.endswith("mxfp4"):
        import json
        import shutil

        model = shutil.copytree(model, tmp_path / arch)
        cfg = json.loads((model / "config.json").read_text()) | {"quantization_config": {"quant_method": "mxfp4"}}
        (model / "config.json").write_text(json.dumps(cfg))
    with fake_engine(model) as (engine, syncs):
        w13 = getattr(engine.model.layers[0], "w13", None)
        assert (w13 is not None and w13.dtype == torch.uint8) == arch.endswith("mxfp4")
        for params in (GREEDY, RANDOM):
            assert run_steps(engine, syncs, [(params, None)] * 8) == [ONE_READ] * 3


def test_lora_and_grammar_steps_read_the_device_once(llama64, tmp_path):
    adapter, _ = make_peft_adapter(llama64, tmp_path / "ad", r=8)
    settings = dict(enable_lora=True, max_loras=2, max_lora_rank=8, lora_modules=(("ad", str(adapter)),))
    regex = SamplingParams(max_tokens=3, structured_outputs=StructuredOutputsParams(regex=r"[a-z ]+"))
    masks, deltas = mock.Mock(wraps=apply_token_bitmask), mock.Mock(wraps=add_lora)
    with (
        fake_engine(llama64, **settings) as (engine, syncs),
        mock.patch("engine.structured.apply_token_bitmask", masks),
        mock.patch("engine.lora.manager.add_lora", deltas),
    ):
        mixed = [(GREEDY, LoRARequest("ad")), (RANDOM, None), (RANDOM, LoRARequest("ad")), (GREEDY, None)] * 2
        steps = run_steps(engine, syncs, mixed)
        assert steps == [ONE_READ] * 3, steps
        assert deltas.call_count == 3 * 2 * 4  # each step, layer and fused linear: the adapter was applied
        steps = run_steps(engine, syncs, [(regex, None), (RANDOM, LoRARequest("ad")), (GREEDY, None)])
        assert steps and all(s == ONE_READ for s in steps), steps  # the made-up token 0 may end the regex early
        assert masks.call_args_list[0].args[2] == [0], masks.call_args_list  # the regex row was masked


def test_the_harness_catches_what_a_gpu_would_refuse():
    """It can fail: a CPU tensor in a CUDA op, a data-dependent size, and each kind of host read are caught."""
    with fake_cuda() as syncs:
        x = torch.ones(4, 8, device=DEVICE)
        with pytest.raises(FakeTensorDeviceMismatchError):
            x + torch.ones(4, 8)
        with pytest.raises(DynamicOutputShapeException):
            x[x > 0]
        assert x.sum(1).tolist() == [0.0] * 4 and x[0, 0].item() == 0.0 and not bool(x[0, 0])
        x.cpu()
        torch.tensor([1, 2], device=DEVICE)  # pageable host data: the copy waits for the stream
        torch.ones(3).to(DEVICE, non_blocking=True)  # non_blocking from pageable memory waits as well
        pinned = torch.ones(2, 3, pin_memory=True)
        pinned[0].to(DEVICE, non_blocking=True)  # a view of pinned memory: does not wait
        torch.empty(2, 3, device=DEVICE).copy_(pinned, non_blocking=True)
        x[[0, 2]] = x[[1, 3]]  # list indices: each copied from the host, waiting
        assert syncs.counts == Counter(tolist=1, item=1, bool=1, d2h=1, h2d=4), syncs.counts
