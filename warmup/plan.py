"""Memory planner: will this model and context fit a GPU, and how many sequences at once?

    python -m warmup.plan [--model PATH_OR_REPO] [--gpu-mem 80GiB] [--max-model-len N] ... [--json]   (--help: all)

The engine's configuration is built as the worker builds it: the environment through handler.settings, each flag
standing in for its variable (--max-loras 4 is MAX_LORAS=4, validated the same way). Only config.json is read (the
draft model's too, for SPECULATIVE_CONFIG with a model), no weights, and the engine's own planning function
(engine.plan_memory, the one LLMEngine's start calls) answers for one rank on a device of --gpu-mem with
--gpu-free of it free (default: all of it) and compute capability --capability (fp8 is refused below 8.9 as the
engine refuses it; unset: not checked). That is the engine's prediction before its weights load: on a real card
it plans again from measured memory after the load, so the pool can differ by the difference between the
predicted and the real CUDA context. --json prints one object (fits, error, and the numbers); the exit code is 0
when it fits, 1 when it does not or the input is bad."""

from __future__ import annotations

import argparse
import json
import re
import sys

from engine import (
    ConfigError,
    EngineConfig,
    EngineError,
    ModelSpec,
    draft_model,
    memory,
    memory_needs,
    model_dtype,
    plan_memory,
    weights,
)
from handler.settings import SettingsError, load_settings

_UNITS = {"": 1, "B": 1, "KB": 10**3, "MB": 10**6, "GB": 10**9, "TB": 10**12}
_UNITS |= {"KIB": 2**10, "MIB": 2**20, "GIB": 2**30, "TIB": 2**40}
# flag (argparse dest) -> the variable it stands in for
FLAGS = {
    "model": "MODEL_NAME",
    "gpu_memory_utilization": "GPU_MEMORY_UTILIZATION",
    "max_model_len": "MAX_MODEL_LEN",
    "dtype": "DTYPE",
    "quantization": "QUANTIZATION",
    "kv_cache_dtype": "KV_CACHE_DTYPE",
    "max_num_seqs": "MAX_NUM_SEQS",
    "max_num_batched_tokens": "MAX_NUM_BATCHED_TOKENS",
    "tensor_parallel_size": "TENSOR_PARALLEL_SIZE",
    "enforce_eager": "ENFORCE_EAGER",
    "enable_lora": "ENABLE_LORA",
    "max_loras": "MAX_LORAS",
    "max_lora_rank": "MAX_LORA_RANK",
    "speculative_config": "SPECULATIVE_CONFIG",
}


def parse_bytes(text: str) -> int:
    m = re.fullmatch(r"\s*([\d.]+)\s*([KMGT]I?B|B)?\s*", text.upper())
    if not m:
        raise ValueError(f"not a size: {text!r} (e.g. 80GiB, 141GB)")
    return int(float(m.group(1)) * _UNITS[m.group(2) or ""])


def parse_capability(text: str) -> tuple[int, int]:
    m = re.fullmatch(r"\s*(\d+)\.(\d)\s*", text)
    if not m:
        raise ValueError(f"not a compute capability: {text!r} (e.g. 8.0, 8.9, 9.0)")
    return int(m.group(1)), int(m.group(2))


def engine_config(flags: dict[str, str]) -> EngineConfig:
    """The EngineConfig the worker would build from this environment, with `flags` ({variable: text}) in place of
    their variables."""
    settings = load_settings()
    if flags:
        given = load_settings(flags)  # the flags alone, validated as those variables are
        settings = settings.model_copy(update={name: getattr(given, name) for name in flags})
    return settings.engine_config()


def make_plan(
    spec,
    gpu_bytes: int,
    *,
    cfg: EngineConfig | None = None,
    free: int | None = None,
    capability: tuple[int, int] | None = None,
    draft_spec=None,
    hf_cfg: dict | None = None,
    utilization: float = 0.9,
    dtype: str = "bfloat16",
    **fields,
) -> dict:
    """engine.plan_memory's prediction for one rank of the engine configured by `cfg` (without one:
    EngineConfig(gpu_memory_utilization=utilization, dtype=dtype, **fields)) on a device of `gpu_bytes`, `free` of
    them free (default: all): {"fits", "error", and the numbers}. hf_cfg: the model's config.json, for DTYPE=auto."""
    if cfg is None:
        cfg = EngineConfig(gpu_memory_utilization=utilization, dtype=dtype, **fields)
    free = gpu_bytes if free is None else free
    gpu = memory.GPU(gpu_bytes, free, capability, "the GPU of --capability")
    dt = model_dtype(cfg.dtype, hf_cfg or {}, "cuda")
    tp = cfg.tensor_parallel_size
    try:
        needs = memory_needs(cfg, spec, dt, "cuda", draft_spec=draft_spec)
    except ConfigError as e:  # the model cannot be sharded this way
        return {"fits": False, "error": str(e), "tensor_parallel_size": tp}
    sc = cfg.speculative_config
    out = {
        "weight_bytes": needs.weight_bytes,
        "draft_weight_bytes": needs.draft_weight_bytes,
        "kv_bytes_per_token": needs.kv_bytes_per_token,
        "activation_reserve_bytes": needs.reserve_bytes,
        "graph_pool_bytes": needs.graph_pool_bytes,
        "state_bytes": needs.state_bytes,  # a hybrid's state pool: max_num_seqs slots (0 for other models)
        "state_slots": cfg.max_num_seqs if needs.state_bytes else 0,
        "gpu_bytes": gpu_bytes,
        "gpu_free_bytes": free,
        "budget_bytes": int(gpu_bytes * cfg.gpu_memory_utilization),
        "kv_tokens": 0,
        "max_model_len": cfg.max_model_len,
        "max_concurrent_seqs": 0.0,
        "fits": False,
        "error": None,
        "tensor_parallel_size": tp,
        "lora": [cfg.max_loras, cfg.max_lora_rank] if cfg.enable_lora else None,
        "speculative": sc.describe() if sc is not None else None,
    }
    try:
        p = plan_memory(cfg, spec, gpu, dt, draft_spec=draft_spec)
    except ConfigError as e:
        return out | {"error": str(e)}
    return out | {
        "kv_tokens": p.kv_tokens,
        "max_model_len": p.max_model_len,
        "max_concurrent_seqs": round(p.max_concurrent_seqs, 2),
        "fits": True,
        "used_bytes": p.used_bytes,
    }


def render(spec, plan: dict, gpu_bytes: int, utilization: float, requests: int | None = None) -> str:
    gib = 2**30
    if "weight_bytes" not in plan:  # the model cannot be sharded this way
        return f"does not fit: {plan['error']}"
    tp = plan.get("tensor_parallel_size", 1)
    lines = [f"tensor parallel: {tp} ranks, one GPU each; the numbers below are one rank's"] if tp > 1 else []
    lines += [
        f"model: {spec.architecture}, {spec.num_layers} layers, {spec.num_heads} heads / {spec.num_kv_heads} kv "
        f"heads, head_dim {spec.head_dim}, {spec.num_params() / 1e9:.2f} B params",
        f"weights: {plan['weight_bytes'] / gib:.2f} GiB ({plan['weight_bytes'] / 1e9:.1f} GB)"
        + (
            f", of which the draft model {plan['draft_weight_bytes'] / gib:.2f} GiB"
            if plan["draft_weight_bytes"]
            else ""
        ),
        f"KV per token: {plan['kv_bytes_per_token']:,} B ({plan['kv_bytes_per_token'] / 1024:.0f} KiB)"
        + (" (the draft's included)" if plan["draft_weight_bytes"] else ""),
        f"GPU: {gpu_bytes / gib:.1f} GiB ({plan['gpu_free_bytes'] / gib:.1f} GiB free) x {utilization:.2f} "
        f"utilization = {plan['budget_bytes'] / gib:.2f} GiB budget; activation reserve "
        f"{plan['activation_reserve_bytes'] / gib:.2f} GiB, CUDA context {memory.CUDA_CONTEXT_BYTES / gib:.2f} GiB",
    ]
    extras = [f"LoRA: {plan['lora'][0]} slots of rank {plan['lora'][1]}"] if plan["lora"] else []
    extras += [f"CUDA graph pool {plan['graph_pool_bytes'] / gib:.2f} GiB"] if plan["graph_pool_bytes"] else []
    if plan.get("state_bytes"):  # a hybrid model's linear-attention state: fixed per sequence, beside the KV
        per_seq = plan["state_bytes"] / plan["state_slots"] / 2**20
        extras.append(f"state pool {plan['state_bytes'] / gib:.2f} GiB ({plan['state_slots']} sequences x "
                      f"{per_seq:.1f} MiB)")  # fmt: skip
    extras += [f"speculative decoding: {plan['speculative']}"] if plan["speculative"] else []
    lines += [f"in the reserve and KV: {'; '.join(extras)}"] if extras else []
    if plan["fits"]:
        kv_gib = plan["kv_tokens"] * plan["kv_bytes_per_token"] / gib
        lines.append(
            f"fits on one GPU: {plan['kv_tokens']:,} KV tokens ({kv_gib:.1f} GiB), {plan['max_concurrent_seqs']:.1f} "
            f"concurrent sequences at max_model_len={plan['max_model_len']}"
        )
    else:
        lines.append(f"does NOT fit: {plan['error']}")
    if requests and plan["max_model_len"]:
        total = requests * plan["max_model_len"] * plan["kv_bytes_per_token"]
        lines.append(
            f"{requests} requests x {plan['max_model_len']} tokens: {total / 1024:,.0f} KiB of KV "
            f"({total / gib:.1f} GiB, {total / 1e9:.1f} GB)"
        )
    return "\n".join(lines)


def _as_flag(message: str, flags: dict[str, str]) -> str:
    """A settings error names the variable; when a flag gave it, name the flag."""
    for dest, var in FLAGS.items():
        if var in flags and message.startswith(f"environment variable {var}"):
            return message.replace("environment variable", f"--{dest.replace('_', '-')}:", 1)
    return message


def _parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", help="MODEL_NAME: local dir or HF repo id in the HF cache (unset: SmolLM2)")
    ap.add_argument("--gpu-mem", default="80GiB", help="the device's total memory (80GiB, 141GB, ...)")
    ap.add_argument("--gpu-free", default=None, help="its free memory before the start (default: all of it)")
    ap.add_argument("--capability", default=None, help="its compute capability (8.0, 8.9, 9.0): fp8 needs 8.9+")
    ap.add_argument("--gpu-memory-utilization", help="GPU_MEMORY_UTILIZATION")
    ap.add_argument("--max-model-len", help="MAX_MODEL_LEN (default: min(the model's limit, the pool))")
    ap.add_argument("--dtype", help="DTYPE (auto, bfloat16, float16, float32)")
    ap.add_argument("--quantization", help="QUANTIZATION (fp8)")
    ap.add_argument("--kv-cache-dtype", help="KV_CACHE_DTYPE (auto, fp8)")
    ap.add_argument("--max-num-seqs", help="MAX_NUM_SEQS")
    ap.add_argument("--max-num-batched-tokens", help="MAX_NUM_BATCHED_TOKENS")
    ap.add_argument("--tensor-parallel-size", help="TENSOR_PARALLEL_SIZE: plan one of this many ranks (GPUs)")
    graphs = "ENFORCE_EAGER=false: the CUDA graph pool is planned where the engine would capture graphs"
    ap.add_argument("--no-enforce-eager", dest="enforce_eager", action="store_const", const="false", help=graphs)
    ap.add_argument("--enable-lora", action="store_const", const="true", help="ENABLE_LORA=true: plan the slots")
    ap.add_argument("--max-loras", help="MAX_LORAS: adapter slots on the device")
    ap.add_argument("--max-lora-rank", help="MAX_LORA_RANK")
    ap.add_argument("--speculative-config", help="SPECULATIVE_CONFIG (JSON; a draft model's weights and KV count)")
    ap.add_argument("--requests", type=int, default=None, help="also size this many full-length requests")
    ap.add_argument("--json", action="store_true", help="print one JSON object")
    return ap


def main(argv: list[str] | None = None) -> int:
    args = _parser().parse_args(argv)
    flags = {var: value for dest, var in FLAGS.items() if (value := getattr(args, dest)) is not None}
    try:
        cfg = engine_config(flags)
        path = weights.resolve_model_path(cfg)
        hf_cfg = weights.read_json(path / "config.json")
        spec = ModelSpec.from_hf(hf_cfg)
        _, draft_spec = draft_model(cfg)
        gpu = parse_bytes(args.gpu_mem)
        free = parse_bytes(args.gpu_free) if args.gpu_free else None
        capability = parse_capability(args.capability) if args.capability else None
    except (SettingsError, EngineError, ValueError, json.JSONDecodeError) as e:
        print(f"error: {_as_flag(str(e), flags)}", file=sys.stderr)
        return 1
    plan = make_plan(spec, gpu, cfg=cfg, free=free, capability=capability, draft_spec=draft_spec, hf_cfg=hf_cfg)
    util = cfg.gpu_memory_utilization
    print(json.dumps(plan) if args.json else render(spec, plan, gpu, util, args.requests))
    return 0 if plan["fits"] else 1


if __name__ == "__main__":
    sys.exit(main())
