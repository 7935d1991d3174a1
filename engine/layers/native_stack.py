"""The CPU's whole decoder stack in one C call (kernels/cpu_layers.c), for a plain Llama-family model in bf16.

It runs the kernels LlamaForCausalLM.forward's layers call on CPU (the linears' GEMM, add + RMSNorm, rotary,
attention with its cache writes, SiLU-and-mul), in the same order on the same inputs: the same bits, without the
Python between them (kernels/cpu_layers.py says what that cost). `stack_for` says when a step can take it: the model
is LlamaForCausalLM itself with its plain layers (no subclass: Gemma, the MoE and hybrid families change the layer),
16-bit linears with no quantization, LoRA or tensor parallelism, full rotary, no q/k norm, gate or sinks; every
kernel is loaded; and the attention backend's C kernel takes every row of the step, writing a bf16 cache itself.
Otherwise the layers run from Python, with the same result."""

from __future__ import annotations

import torch

from engine.layers import attention as attention_mod
from engine.layers import dense
from kernels import cpu_gemm, cpu_ops
from kernels._common import use_triton
from kernels.cpu_layers import GEMM_KINDS, Layer, Linear, Model, NativeLayers, Step, address
from kernels.rotary import rotary_rows

ENABLED = True  # bench/ab.py's --ab native-stack switches it
NAMES = ("qkv", "o_proj", "gate_up", "down")  # DecoderLayer.LINEARS, as Layer's fields qkv, o, gate_up, down
OTHERS = ("qkv_bias", "o_proj_bias", "input_norm", "post_norm")  # the layer's other tensors the C reads


def _bf16(t) -> bool:
    return t.dtype == torch.bfloat16 and t.device.type == "cpu" and t.is_contiguous()


def _plain(model, family: type, layer: type) -> bool:
    """Whether the model's layers are exactly what run_layers computes: family and layer are LlamaForCausalLM and
    DecoderLayer (engine/models/llama.py passes them); the weights are checked again whenever one changes."""
    s, hd = model.spec, model.spec.head_dim
    shapes = {  # what the C's buffers are sized for
        "qkv": ((s.num_heads + 2 * s.num_kv_heads) * hd, s.hidden_size),
        "o_proj": (s.hidden_size, s.num_heads * hd),
        "gate_up": (2 * s.intermediate_size, s.hidden_size),
        "down": (s.hidden_size, s.intermediate_size),
    }
    return (
        type(model) is family and all(type(x) is layer for x in model.layers)
        and model.embed.device.type == "cpu" and model.embed.dtype == torch.bfloat16
        and model.tp is None and model.quantization is None and model.layer_quant is None and not model.dense
        and not (s.attn_gate or s.qk_norm or s.attention_sinks) and (s.rotary_dim or hd) == hd
        and hd % 32 == 0 and s.intermediate_size % 16 == 0
        and all(x.quant_linears is None and not x.fp8_scales for x in model.layers)
        and all(_bf16(w := getattr(x, n)) and cpu_gemm.fits(w) and tuple(w.shape) == shapes[n] for x in model.layers
                for n in NAMES)
        and all(t is None or _bf16(t) for x in model.layers for t in (getattr(x, n) for n in OTHERS))
    )  # fmt: skip


class NativeStack:
    """One model's structures for run_layers, built again whenever a tensor they point at changes: a parameter
    replaced, changed in place, or given its packed copy (dense.pack)."""

    def __init__(self, model, family: type, layer: type):
        self.model, self.family, self.layer = model, family, layer
        self.layers = (Layer * len(model.layers))()
        self.signature: list | None = None  # what the structures were built from (`_signature`)
        self.held: list = []  # the tensors the signature names by id, and the fp32 biases the C reads: kept alive
        self.plain = False
        self.kv = None

    def _signature(self, kind: str) -> tuple[list, list]:
        """(each tensor the C reads: its id, address and in-place version; the tensors): 0.16 ms a step for
        SmolLM2's 30 layers. A packed copy (dense.pack) is its weight's attribute: by id."""
        copy = dense.COPIES[kind]
        weights = [getattr(layer, n) for layer in self.model.layers for n in NAMES]
        others = [getattr(layer, n) for layer in self.model.layers for n in OTHERS]
        copies = [getattr(w, copy, None) for w in weights]
        tensors = [t for t in weights + others if t is not None]
        sig = [kind, *map(id, copies), *map(id, tensors), *(t.data_ptr() for t in tensors)]
        sig += [t._version for t in tensors]
        held = tensors + copies
        return sig, held

    def _linear(self, w, bias, kind) -> Linear:
        packed = getattr(w, dense.COPIES[kind], None)
        if packed is not None and kind == "thin":  # a ThinWeight
            packed = packed.packed
        b = None if bias is None else bias.float().contiguous()
        self.held.append(b)
        return Linear(w.data_ptr(), None if packed is None else packed.data_ptr(), None if b is None else b.data_ptr(),
                      w.shape[0], w.shape[1])  # fmt: skip

    def _plan(self, kind, signature, held) -> None:
        self.signature, self.held = signature, held
        self.plain = _plain(self.model, self.family, self.layer)
        for layer, c in zip(self.model.layers, self.layers) if self.plain else ():
            c.qkv = self._linear(layer.qkv, layer.qkv_bias, kind)
            c.o = self._linear(layer.o_proj, layer.o_proj_bias, kind)
            c.gate_up = self._linear(layer.gate_up, None, kind)
            c.down = self._linear(layer.down, None, kind)
            c.input_norm, c.post_norm = layer.input_norm.data_ptr(), layer.post_norm.data_ptr()

    def __call__(self, h, positions, kv_caches, attn, meta) -> torch.Tensor | None:
        """The last layer's output + residual for h [T, hidden] (the embedding rows, overwritten), or None when
        this step cannot run here (the caller runs the layers itself)."""
        m, s = self.model, self.model.spec
        # each as the Python path would take it (bench/ab.py's --ab switches turn them off there too)
        if use_triton(h) or h.dtype != torch.bfloat16 or h.device.type != "cpu":
            return None
        # the layers' linears all fit (_plain): one answer for every one of them
        gemm, ops, loop = dense.our_gemm(m.layers[0].qkv, h.shape[0]), cpu_ops.library(h), NativeLayers.loaded()
        native, n = getattr(attn, "native", None), getattr(meta, "native", None)
        if (
            gemm is None
            or ops is None
            or not hasattr(ops, "silu_and_mul_lut")
            or loop is None
            or native is None
            or native.lib is None
            or n is None
            or n.rows is not None
            or not attention_mod.NATIVE_WRITE
            or attn.k_scales is not None
            or kv_caches.dtype != torch.bfloat16
            or not kv_caches.is_contiguous()
            or kv_caches.shape[2] != s.num_kv_heads
            or kv_caches.shape[5] != s.head_dim
            or meta.slot_mapping.dtype != torch.int64
            or meta.slot_mapping.shape != (h.shape[0],)
        ):
            return None  # fmt: skip
        kind, g = gemm
        signature, held = self._signature(kind)
        if signature != self.signature:
            self._plan(kind, signature, held)
        if not self.plain:
            return None
        if self.kv != (kv_caches.data_ptr(), kv_caches.shape, id(attn)):
            base, size = kv_caches.data_ptr(), kv_caches.element_size()
            for i, c in enumerate(self.layers):
                at = base + m.kv_index[i] * kv_caches.stride(0) * size
                c.k_cache, c.v_cache = at, at + kv_caches.stride(1) * size
                c.window = attn.window(i) or 0
            self.kv = (kv_caches.data_ptr(), kv_caches.shape, id(attn))
        t, hd = h.shape[0], s.head_dim
        kvh, blocks, bs = kv_caches.shape[2], kv_caches.shape[3], kv_caches.shape[4]
        ones = native._scale(None, kvh)
        fused = address(f.lib.gemm_silu) if (f := dense.silu_kernel(gemm)) is not None else None
        model = Model(
            address(g.lib.gemm_any if kind == "thin" else g.lib.gemm), GEMM_KINDS[kind], fused,
            address(ops.add_rms_norm), address(ops.rope), address(ops.silu_and_mul_lut),
            address(native.lib.paged_attention),
            cpu_ops.silu_table().data_ptr(), s.hidden_size, s.num_heads, kvh, hd, s.intermediate_size, blocks, bs,
            s.rms_norm_eps, attn.scale, attn.softcap or 0.0, ones.data_ptr(), ones.data_ptr(),
        )  # fmt: skip
        c, sn = rotary_rows(m.rotary.cos, m.rotary.sin, positions, h.dtype)  # [T, 1, D] each
        slots = meta.slot_mapping.contiguous()
        nq, nkv = s.num_heads * hd, kvh * hd
        gu = 0 if fused else 2 * s.intermediate_size  # (fused: gate_up's product is never stored)
        bufs = [h.new_empty(t, w) for w in (s.hidden_size, nq + 2 * nkv, nq, nkv, nq, gu, s.intermediate_size)]
        step = Step(t, n.ctx.shape[0], n.tables.shape[1], c.data_ptr(), sn.data_ptr(), slots.data_ptr(),
                    n.tables.data_ptr(), n.ctx.data_ptr(), n.qsl.data_ptr(), *(b.data_ptr() for b in bufs))  # fmt: skip
        res = torch.empty_like(h)
        loop.run(model, self.layers, step, h.data_ptr(), res.data_ptr(), torch.get_num_threads())
        return h + res


def stack_for(model, family: type, layer: type) -> NativeStack | None:
    """The model's NativeStack when its layers can run in C (its classes and spec: decided once per model; its
    weights: at each step), else None."""
    stack = getattr(model, "_native_stack", False)
    if stack is False:
        stack = model._native_stack = NativeStack(model, family, layer) if _plain(model, family, layer) else None
    return stack if ENABLED else None
