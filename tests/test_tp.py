"""Tensor parallelism on CPU with gloo: TP=2 and TP=4 give TP=1's greedy tokens (fp32) and logprobs within
tolerance, with chunked prefill, preemption and prefix caching; bad sizes are refused at start; a rank that dies
or hangs fails the engine with an error naming it, and no process is left behind."""

from __future__ import annotations

import contextlib
import functools
import os
import signal
import time

import pytest
import torch

from engine import LLM, ConfigError, EngineFault, SamplingParams, startup
from engine.parallel import shard
from tests.utils import build_tiny_model

pytestmark = pytest.mark.slow  # tensor-parallel ranks as processes

PROMPTS = [[5, 9, 13, 5, 9, 13, 5, 9], [100, 101, 102, 103], list(range(20, 60)), [7] * 10]
GREEDY = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True, logprobs=3)
TOL = 2e-4  # fp32 logprobs: the reductions add partial sums in another order


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    root = tmp_path_factory.mktemp("tp")
    wide = dict(hidden_size=128, num_attention_heads=8, num_key_value_heads=4, intermediate_size=256)
    return {
        "llama": build_tiny_model(root / "llama", "llama", **wide),
        "qwen2": build_tiny_model(root / "qwen2", "qwen2", **wide),  # q/k/v biases, random
        "qwen3": build_tiny_model(root / "qwen3", "qwen3", **wide, vocab_size=390),  # 390 rows: padded shards
        "kv2": build_tiny_model(root / "kv2", "llama", **{**wide, "num_key_value_heads": 2}),  # 2 KV heads, 4 ranks
    }


@contextlib.contextmanager
def engine(path, tp: int = 1, **kw):
    kw = {"dtype": "float32", "log_stats_interval": 0, "num_kv_blocks": 64, **kw}
    llm = LLM(str(path), tensor_parallel_size=tp, **kw)
    try:
        yield llm
    finally:
        llm.engine.shutdown()
        if tp > 1:
            assert not any(p.is_alive() for p in llm.engine.tp_group.procs)


def generate(llm, prompts=PROMPTS, params=GREEDY):
    return llm.generate([{"prompt_token_ids": p} for p in prompts], params)


def assert_same(ref, got) -> None:
    for a, b in zip(ref, got):
        ra, rb = a.outputs[0], b.outputs[0]
        assert ra.token_ids == rb.token_ids
        for la, lb in zip(ra.logprobs, rb.logprobs):
            assert la.keys() == lb.keys() and all(abs(la[t] - lb[t]) < TOL for t in la), (la, lb)


@pytest.mark.parametrize("name,sizes", [("llama", (2, 4)), ("qwen2", (2,)), ("qwen3", (2, 4)), ("kv2", (4,))])
def test_parity_with_one_rank(models, name, sizes):
    with engine(models[name]) as one:
        ref = generate(one)
    for tp in sizes:
        with engine(models[name], tp) as llm:
            assert llm.engine.rank_spec.num_heads == 8 // tp
            assert llm.engine.rank_spec.num_kv_heads == max(1, llm.engine.spec.num_kv_heads // tp)
            assert_same(ref, generate(llm))


def test_chunked_prefill_preemption_and_prefix_cache_under_tp2(models):
    long = [list(range(3, 90)), [11, 12, 13] * 25, [8] * 60]
    sp = SamplingParams(temperature=0, max_tokens=20, ignore_eos=True, logprobs=2)
    kw = dict(max_num_batched_tokens=32, num_kv_blocks=16, block_size=8)
    with engine(models["llama"], **kw) as one:
        ref = generate(one, long, sp)
    with engine(models["llama"], 2, **kw) as llm:
        got = generate(llm, long, sp)
        assert llm.engine.scheduler.num_preemptions > 0  # the small pool preempted someone
        assert_same(ref, got)
        first = generate(llm, long[:1], sp)[0]
        again = generate(llm, long[:1], sp)[0]  # its prefix is cached now, on every rank
        assert again.metrics.cached_prompt_tokens >= 80
        assert_same(ref[:1], [first])
        assert_same(ref[:1], [again])


def test_sampling_and_seed_under_tp2(models):
    sp = SamplingParams(temperature=0.9, top_p=0.9, max_tokens=10, seed=7, ignore_eos=True)
    with engine(models["llama"]) as one:
        ref = generate(one, PROMPTS[:2], sp)
    with engine(models["llama"], 2) as llm:
        got = generate(llm, PROMPTS[:2], sp)
    assert [o.outputs[0].token_ids for o in got] == [o.outputs[0].token_ids for o in ref]


def test_smollm2_three_ranks(smollm2_path):
    """SmolLM2 has 9 heads and 3 KV heads: 3 ranks shard it (2 cannot, and say why)."""
    prompt = "The capital of France is"
    sp = SamplingParams(temperature=0, max_tokens=12, logprobs=3)
    kw = dict(kv_cache_memory=32 << 20, num_kv_blocks=None)
    with engine(smollm2_path, **kw) as one:
        ref = one.generate(prompt, sp)
    with engine(smollm2_path, 3, **kw) as llm:
        assert_same(ref, llm.generate(prompt, sp))
    with pytest.raises(ConfigError, match=r"tensor_parallel_size=2: .*9 attention heads are not divisible by 2"):
        LLM(str(smollm2_path), tensor_parallel_size=2, dtype="float32")


def test_bad_sizes_are_refused_with_the_reason(models):
    """Each refusal alone, with its reason and no other (the messages end there)."""
    from engine import ModelSpec

    with pytest.raises(ConfigError, match="8 attention heads are not divisible by 3"):
        LLM(str(models["llama"]), tensor_parallel_size=3, dtype="float32")
    hf = {
        "architectures": ["LlamaForCausalLM"], "vocab_size": 100, "hidden_size": 64, "intermediate_size": 96,
        "num_hidden_layers": 1, "num_attention_heads": 8, "num_key_value_heads": 4, "max_position_embeddings": 64,
    }  # fmt: skip
    heads_divide = ModelSpec.from_hf(hf)
    for tp, gpus in ((2, None), (4, 4), (8, 8)):  # 8 ranks: each of the 4 KV heads replicated on 2
        shard.check(heads_divide, tp, gpus)
    with pytest.raises(ConfigError, match=r"cannot shard LlamaForCausalLM: this machine has 2 GPUs$"):
        shard.check(heads_divide, 4, 2)
    with pytest.raises(ConfigError, match=r"cannot shard LlamaForCausalLM: this machine has 1 GPU$"):
        shard.check(heads_divide, 2, 1)
    kv3 = ModelSpec.from_hf({**hf, "num_key_value_heads": 3})
    kv_refusal = (
        r"cannot shard LlamaForCausalLM: 3 KV heads neither divide into 2 ranks nor divide 2 \(to be replicated\)$"
    )
    with pytest.raises(ConfigError, match=kv_refusal):
        shard.check(kv3, 2, 2)  # enough GPUs: the KV heads alone
    with pytest.raises(ConfigError, match=kv_refusal):
        shard.check(kv3, 2)
    with pytest.raises(ConfigError, match="tensor_parallel_size"):
        LLM(str(models["llama"]), tensor_parallel_size=0)


def test_a_rank_that_dies_fails_the_engine_and_leaves_nothing(models):
    with engine(models["llama"], 2) as llm:
        e = llm.engine
        e.add_request("r", {"prompt_token_ids": PROMPTS[0]}, SamplingParams(max_tokens=200, ignore_eos=True))
        e.step()
        e.step()
        os.kill(e.tp_group.procs[0].pid, signal.SIGKILL)
        t = time.monotonic()
        with pytest.raises(EngineFault, match="tensor-parallel rank 1"):
            for _ in range(5):
                e.step()
        assert time.monotonic() - t < 10
        assert not any(p.is_alive() for p in e.tp_group.procs)


def test_a_rank_that_hangs_fails_the_engine_after_the_timeout(models):
    with engine(models["llama"], 2, distributed_timeout_s=3) as llm:
        e = llm.engine
        e.add_request("r", {"prompt_token_ids": PROMPTS[0]}, SamplingParams(max_tokens=200, ignore_eos=True))
        e.step()
        pid = e.tp_group.procs[0].pid
        os.kill(pid, signal.SIGSTOP)  # alive, but never answers
        t = time.monotonic()
        try:
            with pytest.raises(EngineFault, match="collective failed"):
                for _ in range(5):
                    e.step()
        finally:
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGCONT)
        assert 2 < time.monotonic() - t < 30
        assert not any(p.is_alive() for p in e.tp_group.procs)


def test_planner_plans_one_rank():
    from engine import ModelSpec
    from warmup.plan import make_plan

    llama70b = ModelSpec.from_hf(
        {
            "architectures": ["LlamaForCausalLM"], "vocab_size": 128256, "hidden_size": 8192,
            "intermediate_size": 28672, "num_hidden_layers": 80, "num_attention_heads": 64,
            "num_key_value_heads": 8, "max_position_embeddings": 8192,
        }
    )  # fmt: skip
    h100 = 80 * 10**9  # as marketed: 67.7 GiB of fp8 weights are over 0.9 x 80 GB
    one = make_plan(llama70b, h100, quantization="fp8")
    two = make_plan(llama70b, h100, quantization="fp8", tensor_parallel_size=2)
    assert not one["fits"] and two["fits"] and two["tensor_parallel_size"] == 2
    assert two["weight_bytes"] < one["weight_bytes"] / 2 + (1 << 30)
    assert two["kv_bytes_per_token"] == one["kv_bytes_per_token"] // 2
    bad = make_plan(llama70b, h100, tensor_parallel_size=3)
    assert not bad["fits"] and "64 attention heads are not divisible by 3" in bad["error"]


def test_lora_requests_under_tp2(models, tmp_path):
    """Adapters are cut as vLLM cuts them (B rows for column-parallel, A columns for row-parallel): a batch mixing
    two adapters and the base model gives TP=1's tokens."""
    from engine import LoRARequest
    from tests.lora_fixtures import make_peft_adapter

    paths = {
        n: make_peft_adapter(models["llama"], tmp_path / n, b_std=0.3, seed=s)[0] for n, s in (("a1", 1), ("a2", 2))
    }
    kw = dict(enable_lora=True, lora_modules=tuple((n, str(p)) for n, p in paths.items()), cache_root=str(tmp_path),
              max_loras=2, max_lora_rank=8)  # fmt: skip
    prompts = [{"prompt_token_ids": p} for p in (PROMPTS[0], PROMPTS[0], PROMPTS[2], PROMPTS[2])]
    loras = [LoRARequest("a1"), None, LoRARequest("a2"), None]
    with engine(models["llama"], **kw) as one:
        ref = one.generate(prompts, GREEDY, lora=loras)
    out = [o.outputs[0].token_ids for o in ref]
    assert out[0] != out[1] and out[2] != out[3]  # each adapter changes its prompt's output: the test can fail
    with engine(models["llama"], 2, **kw) as llm:
        assert_same(ref, llm.generate(prompts, GREEDY, lora=loras))


def test_a_rank_killed_mid_generation_fails_the_stream_through_async_engine(models):
    """What the handler sees: the in-flight request ends with an EngineFault naming the rank, a new request is
    refused with it, and no rank is left running."""
    import asyncio

    from engine import AsyncEngine, EngineConfig

    cfg = EngineConfig(model=str(models["llama"]), dtype="float32", num_kv_blocks=64, log_stats_interval=0,
                       tensor_parallel_size=2)  # fmt: skip
    eng = AsyncEngine(cfg)
    procs = eng.engine.tp_group.procs

    async def go():
        n = 0
        with pytest.raises(EngineFault, match="tensor-parallel rank 1"):
            async for _ in eng.generate({"prompt_token_ids": PROMPTS[0]}, SamplingParams(max_tokens=400,
                                        ignore_eos=True), "r1"):  # fmt: skip
                n += 1
                if n == 3:
                    os.kill(procs[0].pid, signal.SIGKILL)
        with pytest.raises(EngineFault):
            async for _ in eng.generate({"prompt_token_ids": PROMPTS[1]}, SamplingParams(max_tokens=4), "r2"):
                pass

    try:
        asyncio.run(asyncio.wait_for(go(), 60))
        assert not any(p.is_alive() for p in procs)
    finally:
        eng.shutdown()


def test_a_rank_that_dies_while_starting_fails_the_start_cleanly(models, monkeypatch):
    """The start fails naming the rank, nothing is left running, and the next engine in this process starts."""
    import torch.distributed as dist

    from engine.parallel.group import TPGroup

    real, seen = TPGroup.expect, []

    def dying(self, what, timeout_s):
        if what == "loaded":  # rank 1 dies while it loads its shard
            seen.extend(self.procs)
            os.kill(self.procs[0].pid, signal.SIGKILL)
        return real(self, what, timeout_s)

    monkeypatch.setattr(TPGroup, "expect", dying)
    with pytest.raises(EngineFault, match="tensor-parallel rank 1: exited while starting"):
        LLM(str(models["llama"]), tensor_parallel_size=2, dtype="float32", num_kv_blocks=16)
    assert seen and not any(p.is_alive() for p in seen) and not dist.is_initialized()
    monkeypatch.setattr(TPGroup, "expect", real)
    with engine(models["llama"], 2) as llm:
        assert len(generate(llm, PROMPTS[:1])[0].outputs[0].token_ids) == GREEDY.max_tokens


def test_speculative_decoding_under_tp2(models):
    """Verification rows go through the sharded head like any others; the draft runs whole on rank 0."""
    spec = {"model": str(models["llama"]), "num_speculative_tokens": 3}
    with engine(models["llama"]) as one:
        ref = generate(one)
    with engine(models["llama"], 2, speculative_config=spec) as llm:
        got = generate(llm)
        assert llm.engine.stats()["spec_decode_acceptance_rate"] > 0.9
    assert_same(ref, got)


def test_fp8_weights_and_kv_under_tp2(models, tmp_path, monkeypatch):
    """QUANTIZATION=fp8 and KV_CACHE_DTYPE=fp8 under TP=2: each rank quantizes its own part (a row-parallel weight
    per output channel over its input columns, that linear's input per token over the same columns) and calibrates
    its KV scales on its own KV heads, in step with rank 0. The reference is TP=1's fp8 engine made to quantize as
    the two ranks do (`as_two_ranks`, written apart from engine/parallel/), so the two runs differ only in the
    order of fp32 additions: the same tokens and logprobs within fp32's TOL, on any CPU. fp8 itself moves the
    logprobs by far more than TOL (asserted), so a rank that quantized otherwise, or not at all, would be seen."""
    path = models["llama"]
    fp8 = dict(quantization="fp8", kv_cache_dtype="fp8", cache_root=str(tmp_path), num_threads=1)  # a rank's threads
    with engine(path, num_threads=1) as one:
        ref = generate(one)
    with engine(path, **fp8) as one:
        as_two_ranks(one.engine, path, monkeypatch)
        ref8 = generate(one)
    monkeypatch.undo()
    with engine(path, 2, **fp8) as llm:
        got8 = generate(llm)
        assert llm.engine.runner.kv_caches.dtype == torch.float8_e4m3fn
    fp8_shift = max(abs(x[t] - y[t]) for a, b in zip(ref, ref8) for x, y in zip(a.outputs[0].logprobs,
                    b.outputs[0].logprobs) for t in x if t in y)  # fmt: skip
    assert fp8_shift > 50 * TOL, fp8_shift  # fp8 visibly changes the output: the test can fail
    assert_same(ref8, got8)


def as_two_ranks(eng, path, monkeypatch) -> None:
    """Make a TP=1 fp8 engine quantize exactly as two tensor-parallel ranks do (Megatron's cut, spelled out here
    rather than taken from engine/parallel/, so a mistake there shows):
    - o_proj and down: one fp8 linear per rank over its half of the input columns (weight per output channel, input
      per token, both over those columns only), the two partial outputs summed as the all-reduce sums them (fp32,
      two terms: the order cannot matter). q/k/v and gate/up are cut by output rows, whose scales the cut keeps.
    - fp8 KV: per-layer scales per rank, max |k| (|v|) over that rank's half of the KV heads / 448 on the
      calibration tokens, through the linears above; the cache written and read per KV head with its rank's scale.
    Measured against the TP=2 engine: bitwise the same logprobs, with AVX-512 and with AVX2; with these linears'
    sums taken in fp64 instead (another order), within 1.5e-6."""
    from safetensors.torch import load_file

    import engine.layers.attention as attention
    from engine.kv_cache import CalibrationAttention
    from engine.models.llama import DecoderLayer
    from kernels import FP8_MAX
    from kernels.cache_write import reshape_and_cache_ref
    from kernels.fp8 import fp8_linear, quant_per_channel

    spec, model, tp = eng.spec, eng.model, 2
    assert spec.num_kv_heads % tp == 0  # each rank holds its own KV heads, none replicated
    ckpt = load_file(str(path / "model.safetensors"))
    cols = {"o_proj": spec.num_heads // tp * spec.head_dim, "down": spec.intermediate_size // tp}  # per rank
    names = {"o_proj": "self_attn.o_proj", "down": "mlp.down_proj"}

    def linear(layer, parts, name, x, bias=None):
        if name not in parts:
            return DecoderLayer.linear(layer, name, x, bias)
        ys = [fp8_linear(x[:, c : c + n].contiguous(), wq, s, None, out_dtype=x.dtype) for c, n, wq, s in parts[name]]
        return sum(ys[1:], ys[0])  # [T, hidden]

    for i, layer in enumerate(model.layers):
        parts = {}
        for name, n in cols.items():
            w = ckpt[f"model.layers.{i}.{names[name]}.weight"].to(eng.dtype)  # [hidden, in]
            parts[name] = [(r * n, n, *quant_per_channel(w[:, r * n : (r + 1) * n])) for r in range(tp)]
        layer.linear = functools.partial(linear, layer, parts)

    class PerHead(CalibrationAttention):  # also max |k|, |v| per layer and KV head
        def forward(self, q, k, v, k_cache, v_cache, meta, layer=0, sinks=None):
            for amax, x in ((k_heads, k), (v_heads, v)):
                amax[layer] = torch.maximum(amax[layer], x.abs().amax(dim=(0, 2)).float())  # x: [T, KVH, D]
            return super().forward(q, k, v, k_cache, v_cache, meta, layer, sinks)

    L, kvh = spec.num_layers, spec.num_kv_heads
    k_heads, v_heads = torch.zeros(L, kvh), torch.zeros(L, kvh)
    ids = startup.calibration_ids(eng.facts, eng.model, eng.tok, eng.max_model_len)
    with torch.inference_mode():
        model(torch.tensor(ids), torch.arange(len(ids)), torch.empty(L, 2, 0), PerHead(L, spec.head_dim**-0.5), None)
    scales = []
    for amax in (k_heads, v_heads):
        per_head = torch.empty(L, kvh)
        n = kvh // tp
        for h0 in range(0, kvh, n):
            rank = amax[:, h0 : h0 + n].amax(dim=1, keepdim=True)  # [L, 1]: what rank r's calibration sees
            per_head[:, h0 : h0 + n] = (rank / FP8_MAX).clamp(min=1e-6)
        scales.append(per_head.view(L, kvh, 1, 1, 1))  # [L, KVH, 1, 1, 1]: broadcasts over a gather's [KVH, n, L, D]
    eng.runner.attn.set_kv_scales(*scales)

    def write(k, v, k_cache, v_cache, slots, ks, vs):  # k, v: [T, KVH, D]; each head with its own scale
        for h in range(k.shape[1]):
            hk, hv = k[:, h : h + 1].contiguous(), v[:, h : h + 1].contiguous()
            reshape_and_cache_ref(hk, hv, k_cache[h : h + 1], v_cache[h : h + 1], slots, ks[h], vs[h])

    monkeypatch.setattr(attention, "reshape_and_cache", write)


@pytest.fixture(scope="module")
def moe_models(tmp_path_factory):
    root = tmp_path_factory.mktemp("tp-moe")
    wide = dict(hidden_size=128, num_attention_heads=8, num_key_value_heads=4)
    return {
        "mixtral": build_tiny_model(root / "mixtral", "mixtral", **wide, intermediate_size=128),
        "qwen2-moe": build_tiny_model(root / "qwen2-moe", "qwen2-moe", **wide),  # a shared expert, a dense layer
        "gpt-oss": build_tiny_model(root / "gpt-oss", "gpt-oss", **wide),  # sinks, biases, the clamped SwiGLU
        # hybrids: Gated DeltaNet layers (2 key heads, 4 value heads: one and two a rank) and gated attention
        "qwen3-next": build_tiny_model(root / "qwen3-next", "qwen3-next", **wide),
        "qwen3.5": build_tiny_model(root / "qwen3.5", "qwen3.5", **wide),
    }


@pytest.mark.parametrize("name", ["mixtral", "qwen2-moe", "gpt-oss", "qwen3-next", "qwen3.5"])
def test_mixtures_of_experts_under_tp2(moe_models, name):
    """Every rank holds every expert's intermediate slice (and the shared expert's); GPT-OSS's sinks follow their
    heads and its o_proj / down biases are added once; a hybrid's linear layers by heads, each rank's state pool
    holding its heads' states: TP=1's tokens and logprobs."""
    with engine(moe_models[name]) as one:
        ref = generate(one)
    with engine(moe_models[name], 2) as llm:
        assert llm.engine.rank_spec.moe_intermediate_size == llm.engine.spec.moe_intermediate_size // 2
        if llm.engine.spec.hybrid:
            assert llm.engine.runner.state.rec.shape[2] == llm.engine.spec.linear_attn.v_heads // 2
        assert_same(ref, generate(llm))


def test_mxfp4_sizes_that_cut_a_block_are_refused():
    from engine import ModelSpec
    from tests.test_gpt_oss import gpt_oss_config

    spec = ModelSpec.from_hf(gpt_oss_config(24, 32))  # 2880 expert columns: 1440 a rank at 2, 720 at 4
    shard.check(spec, 2)
    with pytest.raises(ConfigError, match="720 expert columns per rank cut MXFP4's 32-value blocks"):
        shard.check(spec, 4)
