"""The memory planner (engine/memory.py) on simulated devices: what fits, what is refused and with which numbers,
and the engine's use of it (a faked torch.cuda.mem_get_info stands in for the GPU)."""

from __future__ import annotations

import logging
import re
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

from engine import ConfigError, EngineConfig, LLMEngine, ModelSpec, memory, startup
from engine.startup import ModelFacts
from warmup.plan import make_plan

GB = 10**9
DEVICES = {"L4": 24 * GB, "L40S": 48 * GB, "H100": 80 * GB, "H200": 141 * GB}  # as marketed
LLAMA31_8B = {
    "architectures": ["LlamaForCausalLM"],
    "vocab_size": 128256,
    "hidden_size": 4096,
    "intermediate_size": 14336,
    "num_hidden_layers": 32,
    "num_attention_heads": 32,
    "num_key_value_heads": 8,
    "max_position_embeddings": 131072,
    "rms_norm_eps": 1e-5,
    "rope_theta": 500000.0,
    "tie_word_embeddings": False,
    "rope_scaling": {
        "rope_type": "llama3",
        "factor": 8.0,
        "low_freq_factor": 1.0,
        "high_freq_factor": 4.0,
        "original_max_position_embeddings": 8192,
    },
}
LLAMA3_70B = LLAMA31_8B | {
    "hidden_size": 8192,
    "intermediate_size": 28672,
    "num_hidden_layers": 80,
    "num_attention_heads": 64,
}
QWEN25_05B = {
    "architectures": ["Qwen2ForCausalLM"],
    "vocab_size": 151936,
    "hidden_size": 896,
    "intermediate_size": 4864,
    "num_hidden_layers": 24,
    "num_attention_heads": 14,
    "num_key_value_heads": 2,
    "max_position_embeddings": 32768,
    "rms_norm_eps": 1e-6,
    "rope_theta": 1e6,
    "tie_word_embeddings": True,
}
MODELS = {
    "llama-3.1-8b": (LLAMA31_8B, None, "auto"),
    "llama-3.1-8b fp8": (LLAMA31_8B, "fp8", "auto"),
    "llama-3.1-8b fp8 KV": (LLAMA31_8B, None, "fp8"),
    "qwen2.5-0.5b": (QWEN25_05B, None, "auto"),
    "llama-3-70b fp8": (LLAMA3_70B, "fp8", "fp8"),
}
_NUMBERS = re.compile(r"\d+\.\d\d GiB")


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("model", MODELS)
def test_what_fits_stays_within_the_budget(device, model):
    cfg, quant, kv_dtype = MODELS[model]
    spec, total = ModelSpec.from_hf(cfg), DEVICES[device]
    p = make_plan(spec, total, quantization=quant, kv_cache_dtype=kv_dtype)
    if p["fits"]:
        used = p["weight_bytes"] + memory.CUDA_CONTEXT_BYTES
        kv = p["kv_tokens"] * p["kv_bytes_per_token"]
        assert used + kv + p["activation_reserve_bytes"] <= 0.9 * total
        assert p["kv_tokens"] >= p["max_model_len"] >= 1 and p["error"] is None
    else:
        assert len(_NUMBERS.findall(p["error"])) >= 3, p["error"]  # weights, reserve, budget


def test_the_expected_verdicts():
    verdict = {
        (m, d): make_plan(
            ModelSpec.from_hf(MODELS[m][0]), DEVICES[d], quantization=MODELS[m][1], kv_cache_dtype=MODELS[m][2]
        )["fits"]
        for m in MODELS
        for d in DEVICES
    }
    assert verdict[("llama-3.1-8b", "L4")] and verdict[("llama-3.1-8b fp8", "L4")]  # 15 GiB of bf16 on a 24 GB card
    assert not verdict[("llama-3-70b fp8", "H100")]  # 67.7 GiB of fp8 weights > 0.9 x 80 GB
    assert verdict[("llama-3-70b fp8", "H200")] and not verdict[("llama-3-70b fp8", "L40S")]
    assert all(verdict[("qwen2.5-0.5b", d)] for d in DEVICES)


def test_refusals_name_the_numbers_and_what_would_fit():
    spec = ModelSpec.from_hf(LLAMA3_70B)
    err = make_plan(spec, DEVICES["H100"], quantization="fp8", kv_cache_dtype="fp8")["error"]
    assert "does not fit" in err and "67.69 GiB" in err and "67.06 GiB" in err  # the weights, and 0.9 x 80 GB
    assert "GPU_MEMORY_UTILIZATION=0.98" not in err and "more GPUs" in err
    bf16 = make_plan(spec, DEVICES["H200"])["error"]
    assert "QUANTIZATION=fp8" in bf16  # what would fit
    # a context longer than the pool: the error names the largest length that fits, as vLLM's does
    small = make_plan(ModelSpec.from_hf(LLAMA31_8B), DEVICES["L4"])
    long = make_plan(ModelSpec.from_hf(LLAMA31_8B), DEVICES["L4"], max_model_len=131072)
    assert not long["fits"] and f"the largest max_model_len that fits is {small['kv_tokens']}" in long["error"]


def test_worked_example_kv_bytes():
    """A worked example: Llama-3-70B with fp8 KV at 4096 tokens, 100 requests: 160 KiB per token, 65.5 GB."""
    p = make_plan(
        ModelSpec.from_hf(LLAMA3_70B), 80 * 2**30, max_model_len=4096, quantization="fp8", kv_cache_dtype="fp8"
    )
    assert p["kv_bytes_per_token"] == 160 * 1024
    assert 100 * 4096 * p["kv_bytes_per_token"] / 1024 == 65_536_000
    assert p["fits"] and p["max_concurrent_seqs"] >= 1  # on 80 GiB (not 80 GB) the weights fit, with room for 4k


def _fake_start(config: dict | None = None, hf_config: dict = LLAMA31_8B) -> tuple[EngineConfig, ModelFacts]:
    """What startup.resolve would find on a CUDA device for this model, without its files."""
    spec = ModelSpec.from_hf(hf_config)
    facts = ModelFacts(
        path=Path("m"),
        spec=spec,
        rank_spec=spec,
        rank=0,
        device=torch.device("cuda"),
        dtype=torch.bfloat16,
        kv_dtype=torch.bfloat16,
        kernel_backend="triton",  # as the start resolves "auto" on CUDA
    )
    return EngineConfig(**(config or {})), facts


@pytest.fixture
def h100_props(monkeypatch):
    """The simulated device's name and capability (the plan refuses fp8 below 8.9, as the start does)."""
    props = SimpleNamespace(name="NVIDIA H100 80GB HBM3", major=9, minor=0, total_memory=80 * GB)
    monkeypatch.setattr(torch.cuda, "get_device_properties", lambda device=None: props)


def test_engine_plans_after_the_load_from_measured_memory(monkeypatch, h100_props):
    total, other = 80 * GB, 3 * GB  # another process holds 3 GB
    cfg, facts = _fake_start()
    calls = []
    free = {"now": total - other}
    monkeypatch.setattr(torch.cuda, "mem_get_info", lambda device=None: calls.append(1) or (free["now"], total))
    predicted = startup.device_plan(cfg, facts)
    free["now"] = total - other - predicted.weight_bytes - (700 << 20)  # weights resident, a 700 MiB context
    measured = startup.device_plan(cfg, facts, loaded_len=predicted.max_model_len)
    budget = int(total * 0.9)
    assert measured.kv_budget_bytes == budget - (total - free["now"]) - measured.activation_reserve_bytes
    assert measured.kv_bytes <= measured.kv_budget_bytes and measured.max_model_len <= predicted.max_model_len
    assert len(calls) == 2
    # the start-up log's comparison with the other KV dtype comes from the plan: the device is not asked again
    monkeypatch.setattr(torch.cuda, "mem_get_info", lambda device=None: pytest.fail("asked the device again"))
    startup.log_ready(cfg, facts, measured, 1.0)


def test_engine_refuses_before_loading_what_cannot_fit(monkeypatch, h100_props):
    total = 24 * GB
    cfg, facts = _fake_start(hf_config=LLAMA3_70B)
    monkeypatch.setattr(torch.cuda, "mem_get_info", lambda device=None: (total, total))
    with pytest.raises(ConfigError, match="does not fit: its weights take 131.42 GiB"):
        startup.device_plan(cfg, facts)


def test_a_fixed_pool_needs_what_is_free_not_the_utilization_budget(monkeypatch, h100_props):
    """num_kv_blocks fixes the pool, and GPU_MEMORY_UTILIZATION no longer applies: processes sharing the GPU (the
    GPU check's 8 test workers) may hold more than the budget leaves, and the start asks only that the weights, the
    reserve and the pool fit what is free. Unfixed, the same device is refused by the budget, as before."""
    total, free = 80 * GB, {"now": 20 * GB}  # 60 GB held elsewhere: past the 72 GB budget with an 8B's weights
    monkeypatch.setattr(torch.cuda, "mem_get_info", lambda device=None: (free["now"], total))
    with pytest.raises(ConfigError, match="does not fit"):
        startup.device_plan(*_fake_start())
    plan = startup.device_plan(*_fake_start(config={"num_kv_blocks": 64}))
    assert plan.num_blocks == 64
    free["now"] = 10 * GB  # the weights alone (~15 GB) are more than is free
    with pytest.raises(ConfigError, match=r"a fixed KV pool of 64 blocks with the weights needs 1\d\.\d\d GiB"):
        startup.device_plan(*_fake_start(config={"num_kv_blocks": 64}))


def test_cpu_engine_logs_the_planners_capacity(tiny_llama, caplog):
    cfg = EngineConfig(model=str(tiny_llama), dtype="float32", kv_cache_memory=3 << 20, log_stats_interval=0)
    with caplog.at_level(logging.INFO, logger="engine"):
        eng = LLMEngine(cfg)
    spec = eng.spec
    expected = memory.plan(
        kv_budget=3 << 20,
        budget=3 << 20,
        kv_bytes_per_token=memory.kv_bytes_per_token(spec, 4),
        block_size=cfg.block_size,
        model_max_len=spec.max_position_embeddings,
        weights=memory.weight_bytes(spec, 4, None),
    )
    assert eng.memory == expected and eng.block_manager.num_blocks == expected.num_blocks
    assert expected.describe() in caplog.text


def test_fp8_is_refused_below_sm89_naming_the_gpu():
    from engine.device import check_fp8_support

    a100 = ("NVIDIA A100-SXM4-80GB", (8, 0))
    for kw, prequantized, what in (
        (dict(quantization="fp8"), False, "QUANTIZATION=fp8"),
        (dict(kv_cache_dtype="fp8"), False, "KV_CACHE_DTYPE=fp8"),
        ({}, True, "an fp8 checkpoint"),
    ):
        with pytest.raises(ConfigError, match=rf"{what}.*NVIDIA A100-SXM4-80GB, capability 8\.0"):
            check_fp8_support(EngineConfig(**kw), prequantized, *a100)
    check_fp8_support(EngineConfig(), False, *a100)  # bf16 on an A100: fine
    for gpu in (("NVIDIA L4", (8, 9)), ("NVIDIA H100 80GB HBM3", (9, 0))):
        check_fp8_support(EngineConfig(quantization="fp8", kv_cache_dtype="fp8"), False, *gpu)


def test_auto_dtype_reads_both_config_keys():
    from engine.device import model_dtype

    for key in ("dtype", "torch_dtype"):  # transformers >= 4.56 writes "dtype"
        assert model_dtype("auto", {key: "float16"}, "cuda") == torch.float16
        assert model_dtype("auto", {key: "float16"}, "cpu") == torch.bfloat16
    assert model_dtype("auto", {"dtype": "bfloat16"}, "cuda") == torch.bfloat16
    assert model_dtype("float32", {"dtype": "float16"}, "cuda") == torch.float32


def test_engine_sets_the_graph_pool_aside(monkeypatch, h100_props):
    total = 80 * GB
    monkeypatch.setattr(torch.cuda, "mem_get_info", lambda device=None: (total, total))
    eager = startup.device_plan(*_fake_start())
    graphs = startup.device_plan(*_fake_start({"enforce_eager": False}))
    pool = memory.graph_pool_bytes(ModelSpec.from_hf(LLAMA31_8B), 128, 2)
    assert graphs.activation_reserve_bytes - eager.activation_reserve_bytes == pool
    assert graphs.kv_budget_bytes == eager.kv_budget_bytes - pool


def test_gpu_log_line_names_the_driver_floor():
    """The start-up line that names the GPU states the driver floor, and says so loudly when the
    driver is older than the CUDA torch was built for (simulated numbers)."""
    from engine.device import gpu_line

    ok = gpu_line("NVIDIA H200", (9, 0), 141 * GB, "13.0", 13000)
    assert "NVIDIA H200, compute capability 9.0, 131.3 GiB" in ok and "needs driver 580+" in ok
    assert "TOO OLD" not in ok and "supports CUDA 13.0" in ok
    old = gpu_line("NVIDIA A10", (8, 6), 24 * GB, "13.0", 12040)
    assert "supports CUDA 12.4" in old and "TOO OLD for CUDA 13.0" in old
    assert "supports CUDA unknown" in gpu_line("GPU", (8, 9), GB, "13.0", None)


def test_speculation_reserves_every_verified_row():
    """With speculation a step's logits are each sequence's k + 1 verified rows, not one: the reserve counts
    max_num_seqs x (k + 1) rows (three fp32 copies, doubled) for n-gram and draft proposals alike, rank 0's
    gathered logits under TP too, and a draft model adds its own step and the q rows its sampled drafts keep."""
    spec, vocab = ModelSpec.from_hf(LLAMA31_8B), LLAMA31_8B["vocab_size"]
    draft = ModelSpec.from_hf(LLAMA31_8B | {"hidden_size": 2048, "num_hidden_layers": 16, "intermediate_size": 8192})
    seqs, k = 128, 5
    row = vocab * 4  # one fp32 logits row

    def reserve(tp=1, spec_cfg=None, draft_spec=None) -> int:
        cfg = EngineConfig(max_num_seqs=seqs, tensor_parallel_size=tp, speculative_config=spec_cfg)
        return memory.engine_needs(cfg, spec, 2, graphs=False, draft_spec=draft_spec).reserve_bytes

    ngram = {"method": "ngram", "num_speculative_tokens": k}
    plain = reserve()
    assert memory.sampled_rows(seqs, 0) == seqs and memory.sampled_rows(seqs, k) == seqs * (k + 1)
    assert reserve(spec_cfg=ngram) - plain == 2 * 3 * seqs * k * row
    assert reserve(spec_cfg=ngram) - plain > 1.8 * 2**30  # 1.83 GiB more for an 8B model at k = 5
    # under TP=2 rank 0's logits are the whole vocabulary's: its shard's three copies, the gathered rest, the gather
    shard = vocab // 2 * 4
    tp_extra = 2 * 3 * seqs * k * shard + 2 * 3 * seqs * k * (row - shard) + seqs * k * row
    assert reserve(tp=2, spec_cfg=ngram) - reserve(tp=2) == tp_extra
    with_draft = reserve(spec_cfg={"model": "d", "num_speculative_tokens": k}, draft_spec=draft)
    draft_step = memory.activation_reserve(draft, 2048, seqs, 2)
    assert with_draft - reserve(spec_cfg=ngram) == draft_step + seqs * k * row
