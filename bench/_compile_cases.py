"""What bench/compile_arch.py compiles for each arch: tiny engines run end to end, and real models' sizes through
the launchers.

The engines find the specializations. Each runs with kernel_backend="triton" on CPU tensors under the stand-in
(bench/_standin.py): its own warm-up shapes (ModelRunner.warm_shapes, every variant a step can ask for: the list
IdleWork compiles after ready on a GPU), then requests (prompts over PREFILL_TILE_MIN_QUERY tokens, chunked prefill
beside decodes, decodes), so a kernel or variant that a new code path reaches is compiled here without being listed.
The models are tiny except where a kernel specializes on them: the attention geometry (query heads, KV heads, head
size) is a real model's, so attention, rotary and the cache write compile as they do for it. The launcher cases
add what follows the hidden, intermediate and vocabulary sizes (norms, activations, fp8 quantization and GEMM
blocks, LoRA, the MoE GEMM tiles at 1 to 512 tokens) at real models' sizes; their weights are torch.empty, never
touched, since nothing launches.

Grammar masks: the engine applies them through kernels/grammar_mask.py, which on a CUDA tensor calls xgrammar's
Triton launcher (on CPU xgrammar's C++ loop, so no engine here reaches the kernel). `grammar_mask` compiles that
kernel with the arguments xgrammar's launcher passes (the launcher asks torch.cuda for the SM count, so it cannot be
called here), over the row counts IdleWork warms. No Triton kernel of ours touches the masks."""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import tempfile
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

import torch

BF16, FP8 = torch.bfloat16, torch.float8_e4m3fn


@dataclass(frozen=True)
class EngineCase:
    name: str
    family: str  # a tests/utils.py TINY_ARCHS key
    geometry: dict  # config overrides: a real model's attention geometry
    engine: dict = field(default_factory=dict)  # EngineConfig overrides
    fp8: bool = False  # needs fp8 kernels (check_fp8_support refuses it below sm89)
    quant: str = ""  # a quantized checkpoint written from the tiny one (bench/quant_writers.py): awq, gptq, fp8-block


def _heads(h: int, kvh: int, d: int) -> dict:
    # transformers wants the hidden size a multiple of the heads; the kernels see only heads and head size
    return dict(num_attention_heads=h, num_key_value_heads=kvh, head_dim=d, hidden_size=4 * h)


FP8_ENGINE = dict(quantization="fp8", kv_cache_dtype="fp8")
# shorter than the longest prompt, and a multiple of 16 as real windows are (4096, 1024): Triton specializes an int
# argument on its value class, so the tiny models' window of 6 would compile variants no real model reaches
WINDOW = dict(sliding_window=32)
MIXTRAL = _heads(32, 8, 128) | dict(num_local_experts=8)
QUANT_GEOMETRY = _heads(32, 8, 128) | dict(intermediate_size=256)
ENGINE_CASES = [
    EngineCase("engine Llama-3.1-8B heads bf16", "llama", _heads(32, 8, 128)),
    EngineCase("engine Llama-3.1-8B heads fp16", "llama", _heads(32, 8, 128), dict(dtype="float16")),
    EngineCase("engine Llama-3.1-8B heads fp8 W+KV", "llama", _heads(32, 8, 128), FP8_ENGINE, fp8=True),
    EngineCase("engine SmolLM2 heads LoRA", "llama", _heads(9, 3, 64), dict(enable_lora=True, max_lora_rank=16)),
    EngineCase("engine Qwen2.5-7B heads", "llama", _heads(28, 4, 128)),  # 7 query heads per KV head
    EngineCase("engine Phi-3-mini heads", "llama", _heads(32, 32, 96)),  # head 96: padded to 128 lanes
    EngineCase("engine Mixtral-8x7B MoE", "mixtral", MIXTRAL),
    EngineCase("engine Mixtral-8x7B MoE fp8", "mixtral", MIXTRAL, FP8_ENGINE, fp8=True),
    EngineCase("engine Gemma-2-9B heads", "gemma2", _heads(16, 8, 256) | WINDOW),  # soft-caps, sliding windows
    EngineCase("engine Gemma-3-12B heads", "gemma3", _heads(16, 8, 256) | WINDOW),  # head 256 without soft-caps
    # quantized checkpoints (engine/quant/), kept packed on the Triton path; 256: whole 128-row scale blocks
    EngineCase("engine Llama-3.1-8B heads AWQ", "llama", QUANT_GEOMETRY, quant="awq"),
    EngineCase("engine Llama-3.1-8B heads GPTQ act-order", "llama", QUANT_GEOMETRY, quant="gptq"),
    EngineCase("engine Llama-3.1-8B heads block fp8", "llama", QUANT_GEOMETRY, fp8=True, quant="fp8-block"),
]  # fmt: skip


def build_models(root: Path) -> dict[str, Path]:
    """Each engine case's tiny checkpoint, built once under `root` (keyed by family and geometry)."""
    from tests.utils import build_tiny_model

    paths = {}
    for case in ENGINE_CASES:
        key = hashlib.sha256(json.dumps([case.family, case.geometry, case.quant], sort_keys=True).encode()).hexdigest()
        path = root / f"{case.family}-{key[:16]}"
        if not (path / "config.json").is_file():
            tmp = path.with_name(f"{path.name}.{os.getpid()}.tmp")
            build_tiny_model(tmp, case.family, **case.geometry)
            if case.quant:
                _quantize(tmp, case.quant)
            try:
                tmp.rename(path)  # whole or absent: a concurrent run's half-written checkpoint is never read
            except OSError:  # that run finished it first
                shutil.rmtree(tmp)
        paths[case.name] = path
    return paths


def _quantize(path: Path, quant: str) -> None:
    """Replace the tiny checkpoint at `path` by its quantized form."""
    from bench import quant_writers as qw

    write = {"awq": lambda s, q, r: qw.write_awq(s, q, r, group=128),
             "gptq": lambda s, q, r: qw.write_gptq(s, q, r, bits=4, group=128, sym=True, desc_act=True),
             "fp8-block": lambda s, q, r: qw.write_fp8_block(s, q, r, block=(128, 128))}[quant]  # fmt: skip
    q, ref = path.with_name(path.name + ".q"), path.with_name(path.name + ".ref")
    write(path, q, ref)
    shutil.rmtree(path)
    shutil.rmtree(ref)
    q.rename(path)


def run_engine(path: Path, engine: dict) -> None:
    """A tiny engine's warm-up shapes, then requests: what a worker compiles after ready and on its first jobs. Its
    cache root is a fresh directory. With fp8 weights a second engine starts on it: the first quantized the
    checkpoint online and wrote its snapshot, the second loads that (a worker's later starts), and its scales lie
    at other offsets, so some pointers are 16-byte aligned in one and not the other: variants of their own."""
    with tempfile.TemporaryDirectory() as root:
        for _ in range(2 if engine.get("quantization") == "fp8" else 1):
            _engine_run(path, engine | dict(cache_root=root))


def _engine_run(path: Path, engine: dict) -> None:
    from engine import LLM, SamplingParams

    llm = LLM(
        str(path), kernel_backend="triton", block_size=16, max_num_seqs=8, max_num_batched_tokens=64,
        num_kv_blocks=96, max_model_len=512, log_stats_interval=0, **engine,
    )  # fmt: skip
    runner = llm.engine.runner
    if runner.lora is not None:  # LoRASlots keeps fp32 weights on CPU (its bmm path), the model's dtype on CUDA
        dtype = getattr(torch, engine.get("dtype", "bfloat16"))
        slots = runner.lora
        slots.w_dtype = dtype
        slots.a = {lin: w.to(dtype) for lin, w in slots.a.items()}
        slots.b = {lin: w.to(dtype) for lin, w in slots.b.items()}
    for shape in runner.warm_shapes():  # called directly: IdleWork would log a compile error and carry on
        runner.warm(*shape)
    prompts = [{"prompt_token_ids": [3 + (7 * i) % 300 for i in range(n)]} for n in (2, 9, 30, 150)]
    llm.generate(prompts, SamplingParams(temperature=0, max_tokens=4, ignore_eos=True))


@dataclass(frozen=True)
class Model:
    name: str
    hidden: int
    inter: int
    vocab: int
    gelu: bool = False
    experts: tuple[int, int] | None = None  # (experts, top-k)


MODELS = [
    Model("Llama-3.1-8B", 4096, 14336, 128256),
    Model("Gemma-2-9B", 3584, 14336, 256000, gelu=True),
    Model("Mixtral-8x7B", 4096, 14336, 32000, experts=(8, 2)),
    Model("Qwen2.5-7B", 3584, 18944, 152064),
    Model("Phi-3-mini", 3072, 8192, 32064),
    Model("SmolLM2-135M", 576, 1536, 49152),
]
TOKENS = (1, 64, 512)  # a decode, a chunk, a long prefill: the row-count-dependent tiles (fp8 GEMM, MoE blocks)


def dense(m: Model, dtype: torch.dtype) -> None:
    """Norms, the gated activation and LoRA (rank 16, four slots) at m's sizes."""
    import kernels
    from kernels.activation import gelu_tanh_and_mul

    x = torch.empty(16, m.hidden, dtype=dtype)
    w = torch.empty(m.hidden, dtype=dtype)
    kernels.rms_norm(x, w, 1e-6)
    kernels.add_rms_norm(x, torch.empty_like(x), w, 1e-6)
    act = gelu_tanh_and_mul if m.gelu else kernels.silu_and_mul
    act(torch.empty(16, 2 * m.inter, dtype=dtype))
    for t in (1, 17, 64):  # engine/model_runner.py's LORA_WARM_TOKENS: 16, 32 and 64-row tiles
        x = torch.empty(t, m.hidden, dtype=dtype)
        a, b = torch.empty(4, 16, m.hidden, dtype=dtype), torch.empty(4, m.hidden, 16, dtype=dtype)
        kernels.add_lora(torch.empty_like(x), x, a, b, torch.zeros(t, dtype=torch.int64))


def fp8_linears(m: Model) -> None:
    """The W8A8 linears at m's sizes: per-token quantization of the activations, the fp8 GEMM."""
    import kernels

    for k, n in ((m.hidden, 2 * m.inter), (m.inter, m.hidden)):
        w, s = torch.empty(n, k, dtype=FP8), torch.empty(n, 1)
        for t in TOKENS:
            kernels.fp8_linear(torch.empty(t, k, dtype=BF16), w, s)


def quantized_linears(m: Model, fp8: bool) -> None:
    """A quantized checkpoint's linears at m's sizes (engine/quant/): int4 in groups of 128, with and without zero
    points and an act-order permutation (split-K at a decode), or block-scaled fp8 (128 x 128)."""
    from kernels.fp8_block import fp8_block_linear
    from kernels.int_gemm import int_linear

    for k, n in ((m.hidden, 2 * m.inter), (m.inter, m.hidden)):
        g = -(-k // 128)
        for t in TOKENS:
            x = torch.empty(t, k, dtype=BF16)
            if fp8:
                fp8_block_linear(x, torch.empty(n, k, dtype=FP8), torch.empty(-(-n // 128), g), (128, 128))
                continue
            q, s = torch.empty(n, k // 8, dtype=torch.int32), torch.empty(n, g, dtype=torch.float16)
            int_linear(x, q, s, torch.empty(n, g, dtype=torch.uint8), None, 4, 128)  # AWQ, GPTQ asym
            int_linear(x, q, s, None, torch.arange(k), 4, 128)  # GPTQ symmetric, act-order


def moe(m: Model, fp8: bool) -> None:
    """The fused MoE at m's sizes, 1 to 512 tokens (decode-sized and prefill-sized blocks)."""
    from kernels.fused_moe import fused_moe

    e, top_k = m.experts
    wdt = FP8 if fp8 else BF16
    w13, w2 = torch.empty(e, 2 * m.inter, m.hidden, dtype=wdt), torch.empty(e, m.hidden, m.inter, dtype=wdt)
    s13, s2 = (torch.empty(e, 2 * m.inter, 1), torch.empty(e, m.hidden, 1)) if fp8 else (None, None)
    for t in TOKENS:
        ids = (torch.arange(t * top_k) % e).reshape(t, top_k)  # every expert gets tokens
        fused_moe(torch.empty(t, m.hidden, dtype=BF16), w13, w2, torch.full((t, top_k), 0.5), ids, False, s13, s2)


GPT_OSS_20B = Model("gpt-oss-20b", 2880, 2880, 201088, experts=(32, 4))


def moe_mxfp4(m: Model) -> None:
    """GPT-OSS's experts as they stay on a GPU (engine/models/gpt_oss.py): MXFP4 bytes [N, K / 2] and e8m0 scales
    [N, K / 32], expert biases and the clamped SwiGLU, decoded in the fused MoE's K loop; 1 to 512 tokens."""
    from kernels.fused_moe import fused_moe

    e, top_k = m.experts
    u8, h, i = torch.uint8, m.hidden, m.inter
    w13, s13 = torch.empty(e, 2 * i, h // 2, dtype=u8), torch.empty(e, 2 * i, h // 32, dtype=u8)
    w2, s2 = torch.empty(e, h, i // 2, dtype=u8), torch.empty(e, h, i // 32, dtype=u8)
    b13, b2 = torch.empty(e, 2 * i, dtype=BF16), torch.empty(e, h, dtype=BF16)
    for t in TOKENS:
        ids = (torch.arange(t * top_k) % e).reshape(t, top_k)
        fused_moe(torch.empty(t, h, dtype=BF16), w13, w2, torch.full((t, top_k), 0.25), ids, False, s13, s2, b13, b2,
                  (1.702, 7.0))  # fmt: skip


def grammar_mask(vocab: int, sms: int) -> None:
    """xgrammar's mask kernel as its launcher (apply_token_bitmask_inplace_triton) launches it for the engine's fp32
    logits and int32 row indices (kernels/grammar_mask.py), over the row counts IdleWork warms (MASK_WARM_ROWS)."""
    from xgrammar.kernels.apply_token_bitmask_inplace_triton import apply_token_bitmask_inplace_kernel

    from engine.cuda_graphs import MASK_WARM_ROWS

    block = 4096
    for rows in MASK_WARM_ROWS:
        logits = torch.empty(rows, vocab)
        mask = torch.empty(rows, -(-vocab // 32), dtype=torch.int32)
        indices = torch.arange(rows, dtype=torch.int32)
        apply_token_bitmask_inplace_kernel[(sms,)](
            logits, mask, indices, rows, vocab, logits.stride(0), mask.stride(0), sms, block,
            num_warps=block // 32 // (16 // logits.element_size()), num_stages=3,
        )  # fmt: skip


def gated_delta(t: int = 64) -> None:
    """Qwen3-Next-80B's Gated DeltaNet layer (engine/models/qwen3_next.py) as the model calls it: the causal conv
    (width 4) over q, k, v's 8192 channels, the gated delta rule (16 key heads, 32 value heads, 128 each; q, k, v views
    of the conv's output, b of in_proj's) and the gated norm, sequences in slots of a pool of eight. No size depends
    on the token count (the kernels walk each sequence's rows), so one t."""
    from kernels.gated_delta import causal_conv1d, gated_delta_rule, gated_rms_norm

    hk, hv, d, w = 16, 32, 128, 4
    c = 2 * hk * d + hv * d
    qkv, z, b, _ = torch.empty(t, c + hv * d + 2 * hv, dtype=BF16).split([c, hv * d, hv, hv], dim=-1)  # in_proj's
    qsl, slots = [0, t - 1, t], [5, 2]  # a prefill chunk and a decode
    x = causal_conv1d(qkv, torch.empty(c, w, dtype=BF16), None, torch.empty(8, c, w - 1, dtype=BF16), qsl, slots)
    q, k, v = x.split([hk * d, hk * d, hv * d], dim=-1)
    state = torch.empty(8, hv, d, d)
    o = gated_delta_rule(q.reshape(t, hk, d), k.reshape(t, hk, d), v.reshape(t, hv, d), torch.empty(t, hv), b, state,
                         qsl, slots)  # fmt: skip
    gated_rms_norm(o, z.reshape(t, hv, d), torch.empty(d, dtype=BF16), 1e-6)


@dataclass(frozen=True)
class Case:
    name: str
    run: Callable[[], None]
    fp8: bool = False


def cases(models: dict[str, Path], sms: int) -> list[Case]:
    """Every case for one arch, engines first. `models`: build_models' paths; `sms`: the arch's SM count."""
    out = [Case(c.name, lambda c=c: run_engine(models[c.name], c.engine), c.fp8) for c in ENGINE_CASES]
    for m in MODELS:
        out.append(Case(f"{m.name} norms, act, LoRA bf16", lambda m=m: dense(m, BF16)))
        out.append(Case(f"{m.name} fp8 linears", lambda m=m: fp8_linears(m), fp8=True))
        out.append(Case(f"{m.name} int4 linears", lambda m=m: quantized_linears(m, False)))
        out.append(Case(f"{m.name} block-fp8 linears", lambda m=m: quantized_linears(m, True), fp8=True))
        if m.experts:
            out.append(Case(f"{m.name} MoE bf16", lambda m=m: moe(m, False)))
            out.append(Case(f"{m.name} MoE fp8", lambda m=m: moe(m, True), fp8=True))
    out.append(Case("gpt-oss-20b MoE MXFP4", lambda: moe_mxfp4(GPT_OSS_20B)))
    out.append(Case("Qwen3-Next-80B Gated DeltaNet bf16", gated_delta))
    out.append(Case("Llama-3.1-8B fp16 norms, act, LoRA", lambda: dense(MODELS[0], torch.float16)))
    out.append(Case("grammar masks (xgrammar)", lambda: grammar_mask(MODELS[0].vocab, sms)))
    return out
