"""Memory planner: will this model and context fit a GPU, and how many sequences at once?

    python -m warmup.plan --model PATH_OR_REPO [--gpu-mem 80GiB] [--gpu-memory-utilization 0.9]
                          [--max-model-len N] [--quantization fp8] [--kv-cache-dtype fp8]
                          [--max-num-seqs N] [--max-num-batched-tokens N] [--requests N] [--json]

Reads config.json only (no weights are loaded) and asks engine/memory.py, the planner the engine itself uses, for
a device of --gpu-mem with nothing else on it: the weights and the CUDA context in use after the load, the
activation reserve set aside, and the rest of GPU_MEMORY_UTILIZATION x the device for the KV cache. The engine
plans again from measured memory once its weights are resident, so on a real card the pool can differ by the
difference between the predicted and the real CUDA context. --json prints one object (fits, error, and the
numbers); the exit code is 0 when it fits, 1 when it does not or the input is bad."""

from __future__ import annotations

import argparse
import json
import re
import sys

from engine import ConfigError, EngineConfig, EngineError, ModelSpec, memory, tensor_parallel, weights

_UNITS = {"": 1, "B": 1, "KB": 10**3, "MB": 10**6, "GB": 10**9, "TB": 10**12}
_UNITS |= {"KIB": 2**10, "MIB": 2**20, "GIB": 2**30, "TIB": 2**40}
_DTYPE_BYTES = {"bfloat16": 2, "float16": 2, "float32": 4, "auto": 2}


def parse_bytes(text: str) -> int:
    m = re.fullmatch(r"\s*([\d.]+)\s*([KMGT]I?B|B)?\s*", text.upper())
    if not m:
        raise ValueError(f"not a size: {text!r} (e.g. 80GiB, 141GB)")
    return int(float(m.group(1)) * _UNITS[m.group(2) or ""])


def make_plan(
    spec,
    gpu_bytes: int,
    *,
    utilization: float = 0.9,
    max_model_len: int | None = None,
    quantization: str | None = None,
    kv_cache_dtype: str = "auto",
    dtype: str = "bfloat16",
    max_num_seqs: int | None = None,
    max_num_batched_tokens: int | None = None,
    enforce_eager: bool = True,
    tensor_parallel_size: int = 1,
) -> dict:
    """The engine's plan for an empty device of `gpu_bytes`: {"fits", "error", and the numbers}. With tensor
    parallelism, for one rank (each has its own device of `gpu_bytes`)."""
    try:
        tensor_parallel.check(spec, tensor_parallel_size)
    except ConfigError as e:
        return {"fits": False, "error": str(e), "tensor_parallel_size": tensor_parallel_size}
    full_vocab, spec = spec.vocab_size, tensor_parallel.local_spec(spec, tensor_parallel_size)
    defaults = EngineConfig()
    seqs = max_num_seqs or defaults.max_num_seqs
    tokens = max_num_batched_tokens or defaults.max_num_batched_tokens
    el = _DTYPE_BYTES[dtype]
    w = memory.weight_bytes(spec, el, quantization)
    per_token = memory.kv_bytes_per_token(spec, 1 if kv_cache_dtype.startswith("fp8") else el)
    graphs = 0 if enforce_eager else memory.graph_pool_bytes(spec, seqs, el)
    reserve = memory.activation_reserve(spec, tokens, seqs, el, graph_pool_bytes=graphs)
    reserve += memory.tp_reserve(spec, full_vocab, tensor_parallel_size, seqs)
    out = {
        "weight_bytes": w,
        "kv_bytes_per_token": per_token,
        "activation_reserve_bytes": reserve,
        "graph_pool_bytes": graphs,
        "budget_bytes": int(gpu_bytes * utilization),
        "kv_tokens": 0,
        "max_model_len": max_model_len,
        "max_concurrent_seqs": 0.0,
        "fits": False,
        "error": None,
        "tensor_parallel_size": tensor_parallel_size,
    }
    try:
        p = memory.plan_gpu_start(
            total=gpu_bytes,
            free=gpu_bytes,
            utilization=utilization,
            weights=w,
            reserve=reserve,
            quantization=quantization,
            kv_bytes_per_token=per_token,
            block_size=defaults.block_size,
            model_max_len=spec.max_position_embeddings,
            max_model_len=max_model_len,
        )
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
        f"weights: {plan['weight_bytes'] / gib:.2f} GiB ({plan['weight_bytes'] / 1e9:.1f} GB)",
        f"KV per token: {plan['kv_bytes_per_token']:,} B ({plan['kv_bytes_per_token'] / 1024:.0f} KiB)",
        f"GPU: {gpu_bytes / gib:.1f} GiB x {utilization:.2f} utilization = {plan['budget_bytes'] / gib:.2f} GiB "
        f"budget; activation reserve {plan['activation_reserve_bytes'] / gib:.2f} GiB, CUDA context "
        f"{memory.CUDA_CONTEXT_BYTES / gib:.2f} GiB",
    ]
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


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default=None, help="local dir or HF repo id in the HF cache (default: SmolLM2)")
    ap.add_argument("--gpu-mem", default="80GiB", help="the device's total memory (80GiB, 141GB, ...)")
    ap.add_argument("--gpu-memory-utilization", type=float, default=0.9)
    ap.add_argument("--max-model-len", type=int, default=None, help="default: min(the model's limit, the pool)")
    ap.add_argument("--quantization", choices=["fp8"], default=None)
    ap.add_argument("--kv-cache-dtype", choices=["auto", "fp8", "fp8_e4m3"], default="auto")
    ap.add_argument("--dtype", choices=sorted(_DTYPE_BYTES), default="bfloat16")
    ap.add_argument("--max-num-seqs", type=int, default=None)
    ap.add_argument("--max-num-batched-tokens", type=int, default=None)
    ap.add_argument("--requests", type=int, default=None, help="also size this many full-length requests")
    ap.add_argument("--tensor-parallel-size", type=int, default=1, help="plan one of this many ranks (GPUs)")
    ap.add_argument("--no-enforce-eager", dest="enforce_eager", action="store_false", help="count CUDA graphs' pool")
    ap.add_argument("--json", action="store_true", help="print one JSON object")
    args = ap.parse_args(argv)
    try:
        path = weights.resolve_model_path(EngineConfig(model=args.model))
        spec = ModelSpec.from_hf(weights.read_json(path / "config.json"))
        gpu = parse_bytes(args.gpu_mem)
    except (EngineError, ValueError, json.JSONDecodeError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 1
    plan = make_plan(
        spec,
        gpu,
        utilization=args.gpu_memory_utilization,
        max_model_len=args.max_model_len,
        quantization=args.quantization,
        kv_cache_dtype=args.kv_cache_dtype,
        dtype=args.dtype,
        max_num_seqs=args.max_num_seqs,
        max_num_batched_tokens=args.max_num_batched_tokens,
        enforce_eager=args.enforce_eager,
        tensor_parallel_size=args.tensor_parallel_size,
    )
    print(json.dumps(plan) if args.json else render(spec, plan, gpu, args.gpu_memory_utilization, args.requests))
    return 0 if plan["fits"] else 1


if __name__ == "__main__":
    sys.exit(main())
