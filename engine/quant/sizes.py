"""Bytes of a quantized model as the engine holds it where the Triton kernels run it (packed), for the memory
planner (engine/memory.py weight_bytes); torch-free arithmetic. tests/test_quant_formats.py checks each format
against the tensors a loaded model allocates."""

from __future__ import annotations


def linear_shapes(spec, layer: int | None = None) -> list[tuple[int, int, int]]:
    """(in, out, projections) of a layer's fused linears: qkv (with a hybrid's gate rows), o_proj, gate_up, down; a
    hybrid's linear-attention layer (`layer` given) has in_proj (q, k, v, z, b, a) and out_proj instead."""
    h, d, i = spec.hidden_size, spec.head_dim, spec.intermediate_size
    la = getattr(spec, "linear_attn", None)
    if layer is not None and la is not None and spec.is_linear(layer):
        kd, vd = la.k_heads * la.k_dim, la.v_heads * la.v_dim
        mixer = [(h, 2 * kd + 2 * vd + 2 * la.v_heads, 4), (vd, h, 1)]
    else:
        q = spec.num_heads * d * (2 if getattr(spec, "attn_gate", False) else 1)
        mixer = [(h, q + 2 * spec.num_kv_heads * d, 3), (spec.num_heads * d, h, 1)]
    return mixer + [(h, 2 * i, 2), (i, h, 1)]


def quantized_bytes(spec, dtype_bytes: int, q) -> int:
    """Int formats: per linear the packed words [N, ceil(K / P)] int32, scales [N, G] (fp16 for AWQ and GPTQ, as
    they ship; else the model dtype), zero
    points [N, G] uint8 (asymmetric) and the act-order permutation [K] int64 (engine/quant/linear.py). Block fp8:
    e4m3 [N, K] and one fp32 scale per block; its experts are requantized per channel (1 byte + fp32 per row).
    Everything else (embeddings, lm_head, norms, routers) in the model dtype."""
    linear = quantized = 0
    for layer in range(spec.num_layers):
        moe = spec.is_moe(layer)
        for k, n, _ in linear_shapes(spec)[:2] if moe else linear_shapes(spec):
            linear += k * n
            if q.kind == "int":
                g = -(-k // (q.group_size or k))
                scale = 2 if q.source in ("awq", "gptq") else dtype_bytes
                quantized += n * -(-k // (32 // q.bits)) * 4 + n * g * (scale + (0 if q.symmetric else 1))
                quantized += k * 8 if q.desc_act else 0
            else:
                quantized += n * k + -(-n // q.block[0]) * -(-k // q.block[1]) * 4
        if moe:  # block fp8 only (int experts are refused): per-channel fp8 after requantization
            e, h, inter = spec.num_experts, spec.hidden_size, spec.moe_intermediate_size
            linear += e * 3 * h * inter
            quantized += e * 3 * h * inter + e * (2 * inter + h) * 4
    return quantized + (spec.num_params() - linear) * dtype_bytes
