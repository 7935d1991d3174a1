"""Writers of quantized checkpoints, each following its format's published layout (AutoAWQ's gemm.py packing,
AutoGPTQ's pack(), compressed-tensors' own compressor, HF's fine-grained fp8), for tests and benches. Each writes
two folders from one 16-bit checkpoint: the quantized one, and a 16-bit one holding exactly the weights the
quantized one stands for (dequantized), which HF transformers runs as the reference.

Round-to-nearest quantization (no calibration): what matters here is the layout, not the quality."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file

LINEARS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
AWQ_PACK_ORDER = (0, 2, 4, 6, 1, 3, 5, 7)  # AutoAWQ: nibble i of a word holds column order_map[i]


def rtn(w: torch.Tensor, bits: int, group_of: torch.Tensor, n_groups: int, sym: bool):
    """w [N, K] fp32; group_of [K] each column's group -> (q unsigned [N, K], scales [N, G], zeros unsigned [N, G])."""
    n, _ = w.shape
    top = (1 << bits) - 1
    lo = torch.full((n, n_groups), float("inf")).scatter_reduce(1, group_of.expand(n, -1), w, "amin")
    hi = torch.full((n, n_groups), -float("inf")).scatter_reduce(1, group_of.expand(n, -1), w, "amax")
    if sym:
        scales = torch.maximum(lo.abs(), hi.abs()).clamp(min=1e-8) / ((top + 1) // 2 - 1)
        zeros = torch.full_like(scales, (top + 1) // 2)
    else:
        scales = (hi - lo).clamp(min=1e-8) / top
        zeros = torch.round(-lo / scales).clamp(0, top)
    q = torch.clamp(torch.round(w / scales[:, group_of]) + zeros[:, group_of], 0, top)
    return q.to(torch.int64), scales, zeros.to(torch.int64)


def dequant(q, scales, zeros, group_of) -> torch.Tensor:
    return (q - zeros[:, group_of]).float() * scales[:, group_of]


def pack_words(v: torch.Tensor, bits: int, order=None) -> torch.Tensor:
    """Values [R, C] (unsigned) -> int32 [R, C / P], along the last dim; value order[i] of each P at bits i*bits."""
    per = 32 // bits
    order = order or tuple(range(per))
    v = v.reshape(v.shape[0], -1, per)[..., list(order)].to(torch.int64)
    words = (v << (torch.arange(per) * bits)).sum(-1)
    return torch.where(words >= 2**31, words - 2**32, words).to(torch.int32)


def _each_linear(src: Path, dst_q: Path, dst_ref: Path, quantize, config: dict) -> None:
    """quantize(name, w fp32 [N, K]) -> (tensors for the quantized checkpoint, dequantized w)."""
    tensors = load_file(str(src / "model.safetensors"))
    out_q, out_ref = {}, {}
    for name, t in tensors.items():
        module = name.removesuffix(".weight")
        if name.endswith(".weight") and module.rsplit(".", 1)[-1] in LINEARS:
            qt, w = quantize(module, t.float())
            out_q |= qt
            out_ref[name] = w.to(t.dtype)
        else:
            out_q[name] = out_ref[name] = t
    for folder, out, qc in ((dst_q, out_q, config), (dst_ref, out_ref, None)):
        folder.mkdir(parents=True)
        save_file(out, str(folder / "model.safetensors"), metadata={"format": "pt"})
        for f in src.iterdir():
            if f.name != "model.safetensors":
                shutil.copy(f, folder / f.name)
        if qc is not None:
            cfg = json.loads((folder / "config.json").read_text())
            (folder / "config.json").write_text(json.dumps({**cfg, "quantization_config": qc}))


def write_awq(src: Path, dst_q: Path, dst_ref: Path, group: int = 32) -> None:
    def quantize(module, w):
        n, k = w.shape
        g = torch.arange(k) // group
        q, s, z = rtn(w, 4, g, -(-k // group), sym=False)
        tensors = {
            f"{module}.qweight": pack_words(q.t().contiguous(), 4, AWQ_PACK_ORDER),  # [K, N / 8]
            f"{module}.qzeros": pack_words(z.t().contiguous(), 4, AWQ_PACK_ORDER),  # [G, N / 8]
            f"{module}.scales": s.t().contiguous().half(),  # [G, N]
        }
        return tensors, dequant(q, s.half().float(), z, g)

    config = {"quant_method": "awq", "bits": 4, "group_size": group, "zero_point": True, "version": "gemm"}
    _each_linear(src, dst_q, dst_ref, quantize, config)


def write_gptq(src: Path, dst_q: Path, dst_ref: Path, bits=4, group=32, sym=True, desc_act=False, seed=0,
               v2=False) -> None:  # fmt: skip
    """v2: GPTQModel's "gptq_v2" checkpoint format (zero points stored as they are, not less one)."""
    gen, perms = torch.Generator().manual_seed(seed), {}
    shared = {"q_proj": "qkv", "k_proj": "qkv", "v_proj": "qkv", "gate_proj": "gate_up", "up_proj": "gate_up"}

    def quantize(module, w):
        n, k = w.shape
        size = group or k  # None: one group per output channel (group_size -1)
        # act-order follows the input's Hessian: linears that read the same input (q, k, v; gate, up) share it
        parent, proj = module.rsplit(".", 1)
        key = (parent.rsplit(".", 1)[0], shared.get(proj, proj))
        perm = perms.setdefault(key, torch.randperm(k, generator=gen)) if desc_act else torch.arange(k)
        g_idx = torch.empty(k, dtype=torch.int64)
        g_idx[perm] = torch.arange(k) // size  # groups are chunks of the act-order
        q, s, z = rtn(w, bits, g_idx, -(-k // size), sym)
        s = s.half().float()
        tensors = {
            f"{module}.qweight": pack_words(q, bits).t().contiguous(),  # AutoGPTQ packs K: [K / P, N]
            # the "gptq" format stores zero - 1, packed along N: [G, N / P]
            f"{module}.qzeros": pack_words(((z - (0 if v2 else 1)) & ((1 << bits) - 1)).t().contiguous(), bits),
            f"{module}.scales": s.t().contiguous().half(),  # [G, N]
            f"{module}.g_idx": g_idx.to(torch.int32),
        }
        return tensors, dequant(q, s, z, g_idx)

    _each_linear(src, dst_q, dst_ref, quantize,
                 {"quant_method": "gptq", "bits": bits, "group_size": group or -1, "desc_act": desc_act, "sym": sym,
                  "checkpoint_format": "gptq_v2" if v2 else "gptq"})  # fmt: skip


def write_compressed_tensors(src: Path, dst_q: Path, dst_ref: Path, bits=4, group=32, sym=True) -> None:
    """With compressed-tensors' own compressor (the library vLLM's loader reads): signed codes, zero point 0
    when symmetric. group None: the "channel" strategy."""
    from compressed_tensors.compressors.pack_quantized.base import PackedQuantizationCompressor
    from compressed_tensors.quantization import QuantizationArgs, QuantizationScheme

    strategy = dict(strategy="group", group_size=group) if group else dict(strategy="channel")
    args = QuantizationArgs(num_bits=bits, type="int", symmetric=sym, **strategy)
    scheme = QuantizationScheme(targets=["Linear"], weights=args)

    def quantize(module, w):
        n, k = w.shape
        size = group or k
        g = torch.arange(k) // size
        q, s, z = rtn(w, bits, g, -(-k // size), sym)
        half = 1 << (bits - 1)
        state = {"weight": w, "weight_scale": s, "weight_zero_point": (z - half).to(torch.int8)}
        packed = PackedQuantizationCompressor.compress(state, scheme)
        tensors = {f"{module}.{key}": t for key, t in packed.items()}
        return tensors, dequant(q, s, z, g)

    weights = args.model_dump(mode="json")
    config = {"quant_method": "compressed-tensors", "format": "pack-quantized", "ignore": ["lm_head"],
              "config_groups": {"group_0": {"targets": ["Linear"], "weights": weights}}}  # fmt: skip
    _each_linear(src, dst_q, dst_ref, quantize, config)


def write_fp8_block(src: Path, dst_q: Path, dst_ref: Path, block=(128, 128)) -> None:
    """HF's fine-grained fp8: e4m3 weights, weight_scale_inv [ceil(N/bn), ceil(K/bk)] fp32 (w = wq * scale_inv)."""
    bn, bk = block

    def quantize(module, w):
        n, k = w.shape
        padded = torch.nn.functional.pad(w, (0, (-k) % bk, 0, (-n) % bn))
        blocks = padded.reshape(padded.shape[0] // bn, bn, padded.shape[1] // bk, bk)
        s = blocks.abs().amax(dim=(1, 3)).clamp(min=1e-12) / 448.0  # [N/bn, K/bk]
        full = s.repeat_interleave(bn, 0)[:n].repeat_interleave(bk, 1)[:, :k]
        wq = (w / full).clamp(-448, 448).to(torch.float8_e4m3fn)
        return {f"{module}.weight": wq, f"{module}.weight_scale_inv": s}, wq.float() * full

    _each_linear(src, dst_q, dst_ref, quantize,
                 {"quant_method": "fp8", "activation_scheme": "dynamic", "weight_block_size": list(block)})  # fmt: skip


def write_fp8_static(src: Path, dst_q: Path, dst_ref: Path, calibrate: list[list[int]]) -> None:
    """compressed-tensors FP8 with static per-tensor activation scales, as llm-compressor calibrates them: each
    linear's input_scale = max |input| / 448 over `calibrate` (run through HF on the 16-bit model); weights per
    tensor."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(str(src), dtype=torch.float32)
    amax: dict[str, float] = {}
    hooks = [m.register_forward_hook(lambda mod, inp, out, name=name: amax.__setitem__(
                 name, max(amax.get(name, 0.0), inp[0].abs().max().item())))
             for name, m in model.named_modules() if name.rsplit(".", 1)[-1] in LINEARS]  # fmt: skip
    with torch.no_grad():
        for ids in calibrate:
            model(torch.tensor([ids]))
    for h in hooks:
        h.remove()

    def quantize(module, w):
        scale = w.abs().max() / 448.0
        wq = (w / scale).clamp(-448, 448).to(torch.float8_e4m3fn)
        tensors = {f"{module}.weight": wq, f"{module}.weight_scale": scale.reshape(1),
                   f"{module}.input_scale": torch.tensor([amax[module] / 448.0])}  # fmt: skip
        return tensors, wq.float() * scale

    weights = {"num_bits": 8, "type": "float", "strategy": "tensor", "symmetric": True}
    acts = {"num_bits": 8, "type": "float", "strategy": "tensor", "dynamic": False}
    group = {"targets": ["Linear"], "weights": weights, "input_activations": acts}
    config = {"quant_method": "compressed-tensors", "format": "float-quantized", "config_groups": {"group_0": group},
              "ignore": ["lm_head"]}  # fmt: skip
    _each_linear(src, dst_q, dst_ref, quantize, config)
