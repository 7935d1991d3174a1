"""warmup.plan reproduces tests/test_memory.py's worked example (Llama-3-70B, fp8 KV) from a config alone, and
gives the engine's own answer: one simulated GPU, the engine's start and `python -m warmup.plan --json` for each
configuration, the same KV tokens."""

from __future__ import annotations

import json
from types import SimpleNamespace

import pytest
import torch

from engine import ConfigError, EngineConfig, LLMEngine, memory, startup
from engine.models.spec import ModelSpec
from engine.parallel import group as group_module
from engine.parallel.group import NoRanks
from tests.test_memory import LLAMA3_70B, LLAMA31_8B
from warmup.plan import main, make_plan, parse_bytes


def test_worked_example(tmp_path, capsys):
    spec = ModelSpec.from_hf(LLAMA3_70B)
    p = make_plan(spec, parse_bytes("80GiB"), max_model_len=4096, quantization="fp8", kv_cache_dtype="fp8")
    assert p["kv_bytes_per_token"] == 160 * 1024  # 2 x 80 layers x 8 kv heads x 128 x 1 byte
    total_kib = 100 * 4096 * p["kv_bytes_per_token"] / 1024
    assert total_kib == 65_536_000  # "about 65.5 GB": 65.5 million KiB
    assert 70e9 < p["weight_bytes"] < 75e9  # 70.6 B params, linear layers at 1 byte, embeddings in bf16
    assert p["fits"]  # ~72.7 GB of fp8 weights fit an 80 GiB card, with room for a 4k sequence
    bf16 = make_plan(spec, parse_bytes("80GiB"), max_model_len=4096)
    assert bf16["kv_bytes_per_token"] == 2 * p["kv_bytes_per_token"] and not bf16["fits"]

    (tmp_path / "config.json").write_text(json.dumps(LLAMA3_70B))
    argv = [
        "--model",
        str(tmp_path),
        "--gpu-mem",
        "80GiB",
        "--max-model-len",
        "4096",
        "--quantization",
        "fp8",
        "--kv-cache-dtype",
        "fp8",
    ]
    assert main([*argv, "--requests", "100"]) == 0
    out = capsys.readouterr().out
    assert "163,840 B (160 KiB)" in out and "65,536,000 KiB" in out and "fits on one GPU" in out
    assert main([*argv, "--json"]) == 0
    j = json.loads(capsys.readouterr().out)
    assert (
        {
            "weight_bytes",
            "kv_bytes_per_token",
            "activation_reserve_bytes",
            "kv_tokens",
            "max_model_len",
            "max_concurrent_seqs",
            "fits",
            "error",
        }
        <= set(j)
        and j["fits"]
        and j["error"] is None
    )
    # on an 80 GB card (decimal) it does not fit, and says so: exit 1, the numbers in the error
    assert main(["--model", str(tmp_path), "--gpu-mem", "80GB", "--quantization", "fp8", "--json"]) == 1
    j = json.loads(capsys.readouterr().out)
    assert not j["fits"] and "does not fit" in j["error"] and "67.69 GiB" in j["error"]


def test_bad_inputs(tmp_path, capsys):
    assert main(["--model", str(tmp_path / "missing")]) == 1
    assert "error" in capsys.readouterr().err
    assert parse_bytes("141GB") == 141 * 10**9 and parse_bytes("80 GiB") == 80 * 2**30


def test_cuda_graphs_pool_is_planned(tmp_path, capsys):
    """--no-enforce-eager sets the graph pool aside: the reserve grows by it and the KV pool shrinks by as much."""
    from tests.test_memory import LLAMA31_8B

    (tmp_path / "config.json").write_text(json.dumps(LLAMA31_8B))
    argv = ["--model", str(tmp_path), "--gpu-mem", "80GiB", "--max-model-len", "8192", "--json"]
    assert main(argv) == 0
    eager = json.loads(capsys.readouterr().out)
    assert main([*argv, "--no-enforce-eager"]) == 0
    graphs = json.loads(capsys.readouterr().out)
    assert eager["graph_pool_bytes"] == 0 < graphs["graph_pool_bytes"]
    grow = graphs["activation_reserve_bytes"] - eager["activation_reserve_bytes"]
    assert grow == graphs["graph_pool_bytes"]
    lost = (eager["kv_tokens"] - graphs["kv_tokens"]) * eager["kv_bytes_per_token"]
    assert 0 <= grow - lost < 16 * eager["kv_bytes_per_token"]  # down to one 16-token block


# ---- one simulated GPU, the engine's start and warmup.plan -------------------------------------------------------
GPU = memory.GPU(total=80 * 2**30, free=78 * 2**30, capability=(9, 0), name="NVIDIA H100 80GB HBM3")  # 2 GiB in use
DEVICE_FLAGS = ["--gpu-mem", "80GiB", "--gpu-free", "78GiB", "--capability", "9.0"]
LLAMA32_1B = LLAMA31_8B | {  # the draft: the target's vocabulary, a sixth of its size
    "hidden_size": 2048,
    "intermediate_size": 8192,
    "num_hidden_layers": 16,
    "head_dim": 64,
    "tie_word_embeddings": True,
}
NGRAM = '{"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_max": 3}'
DRAFT = '{"model": "<draft>", "num_speculative_tokens": 4}'
LORA = ["--enable-lora", "--max-loras", "4", "--max-lora-rank", "64"]
# name -> (warmup.plan's flags, the engine's EngineConfig fields): the same configuration, spelled both ways
CASES = {
    "plain": ([], {}),
    "lora": (LORA, dict(enable_lora=True, max_loras=4, max_lora_rank=64)),
    "ngram": (["--speculative-config", NGRAM], dict(speculative_config=NGRAM)),
    "draft": (["--speculative-config", DRAFT], dict(speculative_config=DRAFT)),
    "graphs": (["--no-enforce-eager"], dict(enforce_eager=False)),
    "tp2": (["--tensor-parallel-size", "2"], dict(tensor_parallel_size=2)),
    "tp2 no-enforce-eager": (["--tensor-parallel-size", "2", "--no-enforce-eager"],
                             dict(tensor_parallel_size=2, enforce_eager=False)),
    "fp8 kv": (["--kv-cache-dtype", "fp8"], dict(kv_cache_dtype="fp8")),
    "lora + graphs + fp8 kv": ([*LORA, "--no-enforce-eager", "--kv-cache-dtype", "fp8"],
                               dict(enable_lora=True, max_loras=4, max_lora_rank=64, enforce_eager=False,
                                    kv_cache_dtype="fp8")),
    "draft + graphs": (["--speculative-config", DRAFT, "--no-enforce-eager"],
                       dict(speculative_config=DRAFT, enforce_eager=False)),
    "draft + tp2 + fp8 weights": (["--speculative-config", DRAFT, "--tensor-parallel-size", "2", "--quantization",
                                   "fp8"], dict(speculative_config=DRAFT, tensor_parallel_size=2, quantization="fp8")),
    "lora + ngram + tp2, 32k context, 64 seqs": (
        [*LORA, "--speculative-config", NGRAM, "--tensor-parallel-size", "2", "--max-model-len", "32768",
         "--max-num-seqs", "64"],
        dict(enable_lora=True, max_loras=4, max_lora_rank=64, speculative_config=NGRAM, tensor_parallel_size=2,
             max_model_len=32768, max_num_seqs=64)),
}  # fmt: skip


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory):
    """Llama-3.1-8B and a Llama-3.2-1B-shaped draft as config-only checkpoints (the start reads no weights before
    the load, which is simulated), the target with a tokenizer, as the engine's start needs one."""
    from tests.utils import tiny_tokenizer as _tiny_tokenizer

    root = tmp_path_factory.mktemp("plan")
    for name, cfg in (("target", LLAMA31_8B), ("draft", LLAMA32_1B)):
        (root / name).mkdir()
        (root / name / "config.json").write_text(json.dumps(cfg))
        (root / name / "model.safetensors").write_bytes(b"")  # not read: the load is simulated
    _tiny_tokenizer(root / "target")
    return root


@pytest.fixture
def clean_env(monkeypatch):
    """No engine variable from the environment: warmup.plan reads it (as the worker does), the engine here does not."""
    from handler.settings import ENGINE_FIELDS

    for name in [*ENGINE_FIELDS, "BASE_PATH", "RUNPOD_POD_ID", "RUNPOD_ENDPOINT_ID"]:
        monkeypatch.delenv(name, raising=False)


class _Stop(Exception):
    """Where the simulated start stops: the KV pool's allocation, the first real device allocation."""


def engine_start_plans(monkeypatch, cfg: EngineConfig, gpu: memory.GPU):
    """LLMEngine(cfg) on `gpu`, simulated on this CPU: the real start up to the KV pool's allocation, with torch.cuda's
    answers faked (free and total memory, name and capability, device count), the weights' load replaced by its
    footprint (free memory drops by the rank's weight bytes and the CUDA context) and the other TP ranks by a stub.
    Returns the plans the start made: predicted (before the load) and measured (after it)."""
    free, seen = [gpu.free], {}
    props = SimpleNamespace(name=gpu.name, major=gpu.capability[0], minor=gpu.capability[1], total_memory=gpu.total)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 8)
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 0)
    monkeypatch.setattr(torch.cuda, "get_device_properties", lambda device=None: props)
    monkeypatch.setattr(torch.cuda, "mem_get_info", lambda device=None: (free[0], gpu.total))
    monkeypatch.setattr(torch.cuda, "empty_cache", lambda: None)

    def device_plan(cfg, facts, loaded_len=None, _orig=startup.device_plan):
        plan = _orig(cfg, facts, loaded_len)
        if loaded_len is None:
            seen["predicted"], seen["facts"] = plan, facts
        return plan

    def load_model(cfg, path, prequantized, build_model, device, dtype, on_built=lambda: None):
        facts = seen["facts"]
        free[0] -= (
            memory.weight_bytes(facts.rank_spec, facts.dtype.itemsize, cfg.quantization) + memory.CUDA_CONTEXT_BYTES
        )
        model = SimpleNamespace(checkpoint_kv_scales={})  # no weights: fp8 KV scales would be calibrated
        return model, SimpleNamespace(phase="weights (simulated)", note=lambda: "")

    def allocate(spec, plan, kv_dtype, device, prefault=None):
        seen["measured"] = plan
        raise _Stop

    monkeypatch.setattr(startup, "device_plan", device_plan)
    monkeypatch.setattr(startup, "load_model", load_model)
    monkeypatch.setattr(startup, "allocate", allocate)
    monkeypatch.setattr(group_module, "TPGroup", lambda *a, **k: NoRanks())  # the other ranks: a stub
    with pytest.raises(_Stop):
        LLMEngine(cfg.replace(device="cuda", log_stats_interval=0))
    return seen["predicted"], seen["measured"]


def warmup_plan_json(capsys, argv: list[str]) -> dict:
    main([*argv, "--json"])
    return json.loads(capsys.readouterr().out)


def _spelled(case: str, checkpoints) -> tuple[list[str], dict]:
    flags, fields = CASES[case]
    draft = str(checkpoints / "draft")
    flags = [f.replace("<draft>", draft) for f in flags]
    fields = {k: v.replace("<draft>", draft) if isinstance(v, str) else v for k, v in fields.items()}
    return ["--model", str(checkpoints / "target"), *DEVICE_FLAGS, *flags], fields


def test_warmup_plan_gives_the_engines_kv_tokens(checkpoints, clean_env, monkeypatch, capsys):
    """For each configuration: the engine's start (driven on CPU with one simulated H100's numbers, see
    engine_start_plans) and `python -m warmup.plan --json` (in-process, with the same device as flags) plan the same
    KV pool, and the start's plan after the (simulated) load agrees with its prediction. Each feature is seen to
    move the pool (LoRA slots, a draft's weights and KV, the graph pool where graphs run, fp8 KV), so a planner
    that ignored one would differ from the engine here."""
    kv = {}
    for case in CASES:
        argv, fields = _spelled(case, checkpoints)
        plan = warmup_plan_json(capsys, argv)
        predicted, measured = engine_start_plans(monkeypatch, EngineConfig(model=argv[1], **fields), GPU)
        got = (plan["kv_tokens"], predicted.kv_tokens, measured.kv_tokens)
        assert plan["fits"] and got == (predicted.kv_tokens,) * 3, (case, got)
        assert plan["max_model_len"] == predicted.max_model_len == measured.max_model_len, case
        assert plan["weight_bytes"] == predicted.weight_bytes, case
        assert plan["activation_reserve_bytes"] == predicted.activation_reserve_bytes, case
        kv[case] = plan["kv_tokens"]
    assert kv["lora"] < kv["plain"] and kv["draft"] < kv["plain"] and kv["graphs"] < kv["plain"]
    # prompt lookup holds no weights or KV, only the logits of the k + 1 rows each sequence verifies
    assert kv["draft"] < kv["ngram"] < kv["plain"]
    assert kv["draft + graphs"] < kv["draft"]  # the target's decode and verify graphs, and the draft model's own
    assert kv["tp2 no-enforce-eager"] == kv["tp2"]  # no graphs under TP: no pool set aside
    assert kv["fp8 kv"] > 1.9 * kv["plain"]


def test_the_draft_models_graph_pool_is_planned(checkpoints, clean_env, capsys):
    """With a draft model and graphs, the pool set aside is the target's (decode and k + 1-token verify graphs) plus
    the draft's own (its one- and two-token graphs)."""
    plan = warmup_plan_json(capsys, _spelled("draft + graphs", checkpoints)[0])
    target, draft = ModelSpec.from_hf(LLAMA31_8B), ModelSpec.from_hf(LLAMA32_1B)
    want = memory.graph_pool_bytes(target, 128, 2, (1, 5)) + memory.graph_pool_bytes(draft, 128, 2, (1, 2))
    assert plan["graph_pool_bytes"] == want


def test_fp8_on_an_a100_is_refused_by_both(checkpoints, clean_env, monkeypatch, capsys):
    """The capability is one of the device's numbers: fp8 KV below sm89 is refused by the start and by the plan."""
    a100 = memory.GPU(80 * 2**30, 80 * 2**30, (8, 0), "NVIDIA A100-SXM4-80GB")
    argv = ["--model", str(checkpoints / "target"), "--gpu-mem", "80GiB", "--capability", "8.0"]
    plan = warmup_plan_json(capsys, [*argv, "--kv-cache-dtype", "fp8"])
    with pytest.raises(ConfigError) as refused:
        engine_start_plans(monkeypatch, EngineConfig(model=argv[1], kv_cache_dtype="fp8"), a100)
    assert not plan["fits"] and "capability 8.9" in plan["error"] and "capability 8.9" in str(refused.value)


def test_flags_and_variables_mean_the_same(checkpoints, clean_env, monkeypatch, capsys):
    """warmup.plan reads the environment through handler.settings as the worker does; a flag stands in for its
    variable."""
    argv, _ = _spelled("lora + graphs + fp8 kv", checkpoints)
    by_flags = warmup_plan_json(capsys, argv)
    env = {"ENABLE_LORA": "true", "MAX_LORAS": "4", "MAX_LORA_RANK": "64", "ENFORCE_EAGER": "false"}
    for name, value in (env | {"KV_CACHE_DTYPE": "fp8"}).items():
        monkeypatch.setenv(name, value)
    assert warmup_plan_json(capsys, argv[:2] + DEVICE_FLAGS) == by_flags
    assert (
        warmup_plan_json(capsys, [*argv[:2], *DEVICE_FLAGS, "--max-lora-rank", "8"])["kv_tokens"]
        > by_flags["kv_tokens"]
    )


QWEN3_32B = {
    "architectures": ["Qwen3ForCausalLM"], "hidden_size": 5120, "intermediate_size": 25600, "num_hidden_layers": 64,
    "num_attention_heads": 64, "num_key_value_heads": 8, "head_dim": 128, "vocab_size": 151936,
    "tie_word_embeddings": False, "max_position_embeddings": 40960, "rope_theta": 1000000.0, "rms_norm_eps": 1e-6,
}  # fmt: skip


def test_qwen3_32b_awq_on_a_24_gb_card(tmp_path, capsys):
    """Runpod's example of a cached model: Qwen/Qwen3-32B-AWQ (4-bit, groups of 128, zero points). The planner
    counts its packed words, scales and zeros: 19.4 GB of weights, which fit a 24 GiB card (0.9 of it) with about
    5.6k tokens of KV, so a 4k context fits and an 8k one does not (the error says the largest that would, and
    does not suggest QUANTIZATION=fp8 for a checkpoint quantized already); the bf16 model does not fit."""
    awq = {"quant_method": "awq", "bits": 4, "group_size": 128, "zero_point": True, "version": "gemm"}
    (tmp_path / "config.json").write_text(json.dumps({**QWEN3_32B, "quantization_config": awq}))
    assert main(["--model", str(tmp_path), "--gpu-mem", "24GiB", "--max-model-len", "4096", "--json"]) == 0
    j = json.loads(capsys.readouterr().out)
    linear = 64 * (5120 * 10240 + 8192 * 5120 + 5120 * 51200 + 25600 * 5120)  # K x N of qkv, o, gate_up, down
    packed = linear // 2 + linear // 128 * (2 + 1)  # 4 bits a weight; per 128 inputs an fp16 scale and a zero
    rest = 2 * 151936 * 5120 * 2 + 64 * (2 * 5120 + 2 * 128) * 2 + 5120 * 2  # embed, lm_head, norms (bf16)
    assert j["weight_bytes"] == packed + rest and 19.3e9 < j["weight_bytes"] < 19.5e9
    assert j["fits"] and 4096 <= j["kv_tokens"] < 8192, j  # about 5.6k tokens of KV: a 4k context fits, 8k not
    assert main(["--model", str(tmp_path), "--gpu-mem", "24GiB", "--max-model-len", "8192", "--json"]) == 1
    err = json.loads(capsys.readouterr().out)["error"]
    assert "5648" in err and "QUANTIZATION=fp8" not in err  # the largest context that fits; no fp8 on an AWQ model
    (tmp_path / "config.json").write_text(json.dumps(QWEN3_32B))
    assert main(["--model", str(tmp_path), "--gpu-mem", "24GiB", "--json"]) == 1  # 65.5 GB in bf16
