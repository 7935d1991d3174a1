"""Memory planner: will this model and context fit, and how many sequences at once?

    python -m warmup.plan --model PATH_OR_REPO [--gpu-mem 80GiB] [--max-model-len 8192]
                          [--quantization fp8] [--kv-cache-dtype fp8] [--gpu-memory-utilization 0.9]

Reads config.json only (no weights are loaded). Weight bytes: params x 2 (bf16), or with fp8 the linear layers
at 1 byte plus their per-channel fp32 scales while embeddings, lm_head and norms stay 16-bit (as vLLM).
KV bytes per token = 2 x layers x kv_heads x head_dim x (2, or 1 for fp8), the seed's formula."""

from __future__ import annotations

import argparse
import json
import re
import sys
from dataclasses import dataclass

from engine import EngineConfig, EngineError, ModelSpec, weights

_UNITS = {
    "": 1,
    "B": 1,
    "KB": 10**3,
    "MB": 10**6,
    "GB": 10**9,
    "TB": 10**12,
    "KIB": 2**10,
    "MIB": 2**20,
    "GIB": 2**30,
    "TIB": 2**40,
}
ACTIVATION_RESERVE = 0.05  # of usable memory, for activations and the sampler's logits


def parse_bytes(text: str) -> int:
    m = re.fullmatch(r"\s*([\d.]+)\s*([KMGT]I?B|B)?\s*", text.upper())
    if not m:
        raise ValueError(f"not a size: {text!r} (e.g. 80GiB, 141GB)")
    return int(float(m.group(1)) * _UNITS[m.group(2) or ""])


@dataclass(frozen=True)
class Plan:
    spec: ModelSpec
    weight_bytes: int
    kv_bytes_per_token: int
    gpu_bytes: int
    utilization: float
    max_model_len: int

    @property
    def usable(self) -> float:
        return self.gpu_bytes * self.utilization * (1 - ACTIVATION_RESERVE)

    def kv_bytes_for(self, tensor_parallel: int) -> float:
        """KV room per GPU when the weights are split over `tensor_parallel` GPUs."""
        return self.usable - self.weight_bytes / tensor_parallel

    @property
    def tensor_parallel(self) -> int | None:
        """Smallest power-of-two TP size (<= 8, dividing kv heads) that leaves room for one full sequence."""
        for tp in (1, 2, 4, 8):
            if self.spec.num_kv_heads % tp and tp > 1:
                continue
            if self.kv_bytes_for(tp) >= self.kv_bytes_per_token / tp * self.max_model_len:
                return tp
        return None

    def max_sequences(self, tp: int) -> float:
        return self.kv_bytes_for(tp) * tp / self.kv_bytes_per_token / self.max_model_len


def weight_bytes(spec: ModelSpec, quantization: str | None) -> int:
    h, v = spec.hidden_size, spec.vocab_size
    embeds = v * h * (1 if spec.tie_word_embeddings else 2)
    linear = spec.num_params() - embeds - h * (2 * spec.num_layers + 1)
    norms = h * (2 * spec.num_layers + 1)
    if quantization == "fp8":
        out_channels = spec.num_layers * (
            spec.num_heads * spec.head_dim + 2 * spec.num_kv_heads * spec.head_dim + h + 2 * spec.intermediate_size + h
        )
        return linear + 4 * out_channels + 2 * (embeds + norms)
    return 2 * spec.num_params()


def make_plan(
    spec: ModelSpec,
    gpu_bytes: int,
    max_model_len: int,
    quantization: str | None,
    kv_cache_dtype: str,
    utilization: float = 0.9,
) -> Plan:
    kv_el = 1 if kv_cache_dtype.startswith("fp8") else 2
    return Plan(
        spec,
        weight_bytes(spec, quantization),
        2 * spec.num_layers * spec.num_kv_heads * spec.head_dim * kv_el,
        gpu_bytes,
        utilization,
        max_model_len,
    )


def render(p: Plan, requests: int | None = None) -> str:
    s = p.spec
    gib = 2**30
    lines = [
        f"model: {s.architecture}, {s.num_layers} layers, {s.num_heads} heads / {s.num_kv_heads} kv heads, "
        f"head_dim {s.head_dim}, {s.num_params() / 1e9:.2f} B params",
        f"weights: {p.weight_bytes / gib:.2f} GiB ({p.weight_bytes / 1e9:.1f} GB)",
        f"KV per token: {p.kv_bytes_per_token:,} B ({p.kv_bytes_per_token / 1024:.0f} KiB)",
        f"GPU: {p.gpu_bytes / gib:.1f} GiB x {p.utilization:.2f} utilization, "
        f"{ACTIVATION_RESERVE:.0%} kept for activations",
    ]
    tp = p.tensor_parallel
    if tp is None:
        lines.append(f"does NOT fit on 8 such GPUs at max_model_len={p.max_model_len}")
    else:
        where = "fits on one GPU" if tp == 1 else f"needs tensor parallel {tp}"
        lines.append(
            f"{where}: {p.max_sequences(tp):.1f} concurrent sequences at max_model_len={p.max_model_len} "
            f"({p.kv_bytes_for(tp) * tp / gib:.1f} GiB of KV in all)"
        )
    if requests:
        total = requests * p.max_model_len * p.kv_bytes_per_token
        lines.append(
            f"{requests} requests x {p.max_model_len} tokens: {total / 1024:,.0f} KiB of KV "
            f"({total / gib:.1f} GiB, {total / 1e9:.1f} GB)"
        )
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default=None, help="local dir or HF repo id in the HF cache (default: SmolLM2)")
    ap.add_argument("--gpu-mem", default="80GiB")
    ap.add_argument("--gpu-memory-utilization", type=float, default=0.9)
    ap.add_argument("--max-model-len", type=int, default=None, help="default: the model's max_position_embeddings")
    ap.add_argument("--quantization", choices=["fp8"], default=None)
    ap.add_argument("--kv-cache-dtype", choices=["auto", "fp8", "fp8_e4m3"], default="auto")
    ap.add_argument("--requests", type=int, default=None, help="also size this many full-length requests")
    args = ap.parse_args(argv)
    try:
        path = weights.resolve_model_path(EngineConfig(model=args.model))
        spec = ModelSpec.from_hf(weights.read_json(path / "config.json"))
        plan = make_plan(
            spec,
            parse_bytes(args.gpu_mem),
            args.max_model_len or spec.max_position_embeddings,
            args.quantization,
            args.kv_cache_dtype,
            args.gpu_memory_utilization,
        )
    except (EngineError, ValueError, json.JSONDecodeError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 1
    print(render(plan, args.requests))
    return 0


if __name__ == "__main__":
    sys.exit(main())
