"""GPU kernel timings at serving shapes (Llama-3-8B geometry), against a device-to-device copy.

Run on a CUDA machine (bench/gpu_check.sh does): each kernel is timed with triton.testing.do_bench (median),
its bytes moved are counted, and achieved bandwidth is compared with a plain D2D copy of a large buffer
measured in the same run. Targets: decode attention >= 70 % of copy bandwidth; RMSNorm and SiLU-mul >= 80 %.
Compute-bound prefill work (4k- and 16k-token attention, a 2048-token MoE) is reported as TFLOP/s against the
device's bf16 tensor-core peak.
Writes the tables to docs/kernels.md (between markers) and prints them last. Whole decode steps (eager and CUDA
graphs) are bench/decode_step.py's."""

from __future__ import annotations

import argparse
from pathlib import Path

import torch

from bench._common import producer, write_section

H, KVH, D, B, BS = 32, 8, 128, 64, 16  # Llama-3-8B attention geometry, batch 64, block 16
HIDDEN, INTER, VOCAB, LAYERS = 4096, 14336, 128256, 32
CTX = 1024  # decode step: tokens already in the KV cache
DOC = Path(__file__).resolve().parents[1] / "docs" / "kernels.md"


def bench(fn, warmup: int = 25, rep: int = 100) -> float:
    from triton.testing import do_bench

    return do_bench(fn, warmup=warmup, rep=rep, return_mode="median") * 1e-3  # seconds


def copy_bandwidth() -> float:
    src = torch.empty(1 << 30, dtype=torch.uint8, device="cuda")
    dst = torch.empty_like(src)
    return 2 * src.numel() / bench(lambda: dst.copy_(src))  # read + write bytes / s


def rows(dtype=torch.bfloat16):
    from kernels.activation import silu_and_mul
    from kernels.cache_write import reshape_and_cache
    from kernels.paged_attention import paged_attention
    from kernels.rmsnorm import add_rms_norm, rms_norm
    from kernels.rotary import rotary_embedding

    out = []
    el = torch.tensor([], dtype=dtype).element_size()
    for ctx in (1024, 4096):
        for kv_dtype in (dtype, torch.float8_e4m3fn):
            nblk = ctx // BS
            num_blocks = B * nblk + 8
            kc = torch.randn(KVH, num_blocks, BS, D, device="cuda").to(kv_dtype)
            vc = torch.randn(KVH, num_blocks, BS, D, device="cuda").to(kv_dtype)
            tables = torch.randperm(B * nblk, device="cuda", dtype=torch.int32).view(B, nblk)
            q = torch.randn(B, H, D, device="cuda", dtype=dtype)
            lens = torch.full((B,), ctx, device="cuda", dtype=torch.int32)
            qsl = torch.arange(B + 1, device="cuda", dtype=torch.int32)
            scale = torch.tensor(1.0, device="cuda")

            # bind this iteration's tensors now: a closure would see the loop's last ones
            def fn(q=q, kc=kc, vc=vc, tables=tables, lens=lens, qsl=qsl, scale=scale):
                return paged_attention(
                    q, kc, vc, tables, lens, qsl, D**-0.5, k_scale=scale, v_scale=scale, max_query_len=1
                )

            kv_bytes = 2 * B * ctx * KVH * D * kc.element_size()
            out.append(
                (
                    f"decode attention ctx {ctx}, KV {str(kv_dtype).split('.')[-1]}",
                    fn,
                    kv_bytes + 2 * q.numel() * el,
                    0.70,
                )
            )
    # the norms' bandwidth at 8192 tokens (64 MiB per tensor, past L2): at a decode batch's [64, 4096] a call moves
    # 1-2 MiB, a few µs of launch and latency against well under 1 µs of bandwidth time, so no kernel meets a
    # bandwidth target there
    x = torch.randn(8192, HIDDEN, device="cuda", dtype=dtype)
    res = torch.randn_like(x)  # a separate residual: the same tensor twice would be read once from DRAM
    w = torch.randn(HIDDEN, device="cuda", dtype=dtype)
    out.append(("rms_norm [8192, 4096]", lambda: rms_norm(x, w, 1e-5), 2 * x.numel() * el, 0.80))
    out.append(("add_rms_norm [8192, 4096]", lambda: add_rms_norm(x, res, w, 1e-5), 4 * x.numel() * el, 0.80))
    xg = torch.randn(B * 16, 2 * INTER, device="cuda", dtype=dtype)  # 1024 tokens
    out.append(("silu_and_mul [1024, 2x14336]", lambda: silu_and_mul(xg), 1.5 * xg.numel() * el, 0.80))
    T = 1024
    qr = torch.randn(T, H, D, device="cuda", dtype=dtype)
    kr = torch.randn(T, KVH, D, device="cuda", dtype=dtype)
    cos = torch.randn(8192, D, device="cuda")
    pos = torch.randint(0, 8192, (T,), device="cuda")
    out.append(
        (
            "rotary q+k [1024 tokens]",
            lambda: rotary_embedding(qr, kr, cos, cos, pos),
            2 * (qr.numel() + kr.numel()) * el,
            None,
        )
    )
    cache = torch.zeros(KVH, 4096, BS, D, device="cuda", dtype=dtype)
    slots = torch.randperm(4096 * BS, device="cuda")[:T]
    out.append(
        (
            "reshape_and_cache [1024 tokens]",
            lambda: reshape_and_cache(kr, kr, cache, cache, slots),
            4 * kr.numel() * el,
            None,
        )
    )
    out += moe_rows(dtype)
    return out


def moe_rows(dtype):
    """The fused MoE layer at Mixtral-8x7B's shapes (8 experts of 14336, hidden 4096, top-2): decode batches read
    the weights of the experts they reach (bytes = those experts' w13 + w2, at batch 64 all 8)."""
    from kernels.fused_moe import fused_moe

    e, h, inter, k = 8, 4096, 14336, 2
    w13 = torch.randn(e, 2 * inter, h, device="cuda", dtype=dtype) * 0.02
    w2 = torch.randn(e, h, inter, device="cuda", dtype=dtype) * 0.02
    out = []
    for t in (1, 64):
        x = torch.randn(t, h, device="cuda", dtype=dtype)
        ids = torch.stack([torch.randperm(e, device="cuda")[:k] for _ in range(t)])
        w = torch.rand(t, k, device="cuda").softmax(-1).to(dtype)
        reached = len(set(ids.flatten().tolist()))
        nbytes = reached * 3 * inter * h * w13.element_size()
        out.append(
            (
                f"fused_moe Mixtral-8x7B [{t} tokens, {reached} experts]",
                lambda x=x, ids=ids, w=w: fused_moe(x, w13, w2, w, ids),
                nbytes,
                None,
            )
        )
    return out


# dense bf16 tensor-core TFLOP/s with fp32 accumulation, from the datasheets; the first name that matches wins
TC_PEAK_TFLOPS = (
    ("H100 PCIe", 756), ("H100 NVL", 835), ("H100", 989), ("H200", 989), ("B200", 2250), ("A100", 312),
    ("L40S", 362), ("L4", 121), ("A40", 150), ("A10", 125), ("RTX 4090", 165), ("RTX 3090", 71),
)  # fmt: skip


def tensor_core_peak() -> tuple[float, str]:
    """The device's bf16 tensor-core peak in FLOP/s, and where it comes from (a datasheet, or a GEMM measured here
    for a device not in the table)."""
    name = torch.cuda.get_device_name()
    for key, tflops in TC_PEAK_TFLOPS:
        if key in name:
            return tflops * 1e12, f"{name}, datasheet"
    a = torch.randn(8192, 8192, device="cuda", dtype=torch.bfloat16)
    return 2 * 8192**3 / bench(lambda: a @ a), f"{name}: a bf16 8192^3 GEMM measured here"


def compute_rows(dtype=torch.bfloat16):
    """Compute-bound prefill work, as (name, fn, flop): one causal prompt of 4k and 16k tokens through the flash-tiled
    prefill kernel and through the unified kernel's 16-row tiles (Llama-3-8B heads), and the fused MoE at a
    2048-token prefill (Mixtral-8x7B; 2 GEMMs of 3 x 14336 x 4096 per token and expert, top-2)."""
    from kernels.fused_moe import fused_moe
    from kernels.paged_attention import paged_attention
    from kernels.prefill_attention import prefill_attention

    out = []
    for n in (4096, 16384):
        nblk = n // BS
        kc = torch.randn(KVH, nblk + 8, BS, D, device="cuda", dtype=dtype)
        vc = torch.randn_like(kc)
        table = torch.randperm(nblk, device="cuda", dtype=torch.int32)[None]  # [1, nblk]
        q = torch.randn(n, H, D, device="cuda", dtype=dtype)
        lens = torch.tensor([n], device="cuda", dtype=torch.int32)
        qsl = torch.tensor([0, n], device="cuda", dtype=torch.int32)
        flops = 2 * H * D * n * (n + 1)  # QK^T and PV over the causal triangle
        for name, op in (
            ("prefill attention (flash tiles)", prefill_attention),
            ("unified (16-row tiles)", paged_attention),
        ):

            def fn(op=op, q=q, kc=kc, vc=vc, table=table, lens=lens, qsl=qsl, n=n):
                return op(q, kc, vc, table, lens, qsl, D**-0.5, max_query_len=n)

            out.append((f"{name}, {n // 1024}k-token prompt", fn, flops))
    e, h, inter, k, t = 8, 4096, 14336, 2, 2048
    w13 = torch.randn(e, 2 * inter, h, device="cuda", dtype=dtype) * 0.02
    w2 = torch.randn(e, h, inter, device="cuda", dtype=dtype) * 0.02
    x = torch.randn(t, h, device="cuda", dtype=dtype)
    ids = torch.stack([torch.randperm(e, device="cuda")[:k] for _ in range(t)])
    w = torch.rand(t, k, device="cuda").softmax(-1).to(dtype)
    out.append(
        (f"fused_moe Mixtral-8x7B, {t}-token prefill", lambda: fused_moe(x, w13, w2, w, ids), 2 * t * k * 3 * inter * h)
    )
    return out


def fp8_linear_rows(dtype=torch.bfloat16):
    """FP8 W8A8 vs bf16 linear at Llama-3-8B shapes: TFLOP/s and the share of the bf16 matmul rate."""
    from kernels.fp8 import fp8_linear, quant_per_channel

    shapes = {
        "qkv 6144x4096": (6144, 4096),
        "o 4096x4096": (4096, 4096),
        "gate_up 28672x4096": (28672, 4096),
        "down 4096x14336": (4096, 14336),
    }
    out = []
    for m in (1, 16, 256, 4096):
        for name, (n, k) in shapes.items():
            x = torch.randn(m, k, device="cuda", dtype=dtype)
            w = torch.randn(n, k, device="cuda", dtype=dtype)
            wq, ws = quant_per_channel(w)
            t16 = bench(lambda x=x, w=w: torch.nn.functional.linear(x, w))
            t8 = bench(lambda x=x, wq=wq, ws=ws: fp8_linear(x, wq, ws))
            flops = 2 * m * n * k
            out.append((m, name, flops / t16 / 1e12, flops / t8 / 1e12, t16 / t8))
    return out


LLAMA3_8B_LINEARS = {
    "qkv 6144x4096": (6144, 4096),
    "gate_up 28672x4096": (28672, 4096),
    "down 4096x14336": (4096, 14336),
}


def quant_linear_rows(dtype=torch.bfloat16):
    """The quantized checkpoints' GEMMs at Llama-3-8B shapes (engine/quant/): W4A16 in groups of 128 with zero points
    at batch 1 and 64 (the weights' bytes: GB/s against the copy rate is what decode feels), and block-scaled fp8
    at 4k tokens (TFLOP/s), each against the bf16 matmul."""
    from kernels.fp8_block import fp8_block_linear
    from kernels.int_gemm import int_linear, pack

    out = []
    for name, (n, k) in LLAMA3_8B_LINEARS.items():
        q = pack(torch.randint(0, 16, (n, k)), 4).cuda()
        s = (torch.rand(n, k // 128) * 0.01).to(dtype).cuda()
        z = torch.randint(0, 16, (n, k // 128)).to(torch.uint8).cuda()
        w = torch.randn(n, k, device="cuda", dtype=dtype)
        for m in (1, 64):
            x = torch.randn(m, k, device="cuda", dtype=dtype)
            t16 = bench(lambda x=x, w=w: torch.nn.functional.linear(x, w))
            t4 = bench(lambda x=x, q=q, s=s, z=z: int_linear(x, q, s, z, None, 4, 128))
            packed = q.numel() * 4 + s.numel() * s.element_size() + z.numel()
            out.append((f"W4A16 g128, M={m}", name, t16 * 1e6, t4 * 1e6, packed / t4 / 1e9, t16 / t4))
        wq = w.to(torch.float8_e4m3fn)
        ws = torch.rand(-(-n // 128), -(-k // 128), device="cuda") * 0.01
        x = torch.randn(4096, k, device="cuda", dtype=dtype)
        t16 = bench(lambda x=x, w=w: torch.nn.functional.linear(x, w))
        t8 = bench(lambda x=x, wq=wq, ws=ws: fp8_block_linear(x, wq, ws, (128, 128)))
        out.append(("fp8 block 128, M=4096", name, t16 * 1e6, t8 * 1e6, 2 * 4096 * n * k / t8 / 1e12, t16 / t8))
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description="GPU kernel and decode-step timings -> docs/kernels.md")
    ap.parse_args()
    assert torch.cuda.is_available(), "bench/kernel_bench.py needs a CUDA device (or --tiny)"
    copy = copy_bandwidth()
    lines = [
        "## Kernel bandwidth on GPU",
        "",
        f"{producer('python -m bench.kernel_bench', 'cuda')} "
        f"Device-to-device copy: **{copy / 1e9:,.0f} GB/s** (read + write). Median of triton.testing.do_bench.",
        "",
        "| kernel | µs | GB/s | % of copy | target |",
        "|---|---:|---:|---:|---:|",
    ]
    for name, fn, nbytes, target in rows():
        s = bench(fn)
        frac = nbytes / s / copy
        ok = "" if target is None else (f"≥ {target:.0%} " + ("✅" if frac >= target else "❌"))
        lines.append(f"| {name} | {s * 1e6:,.1f} | {nbytes / s / 1e9:,.0f} | {frac:.0%} | {ok} |")
    lines += [
        "",
        "FP8 W8A8 linear (per-token activation quant included) vs bf16 `F.linear`, Llama-3-8B shapes:",
        "",
        "| M | layer | bf16 TFLOP/s | fp8 TFLOP/s | fp8 speed-up |",
        "|---:|---|---:|---:|---:|",
    ]
    for m, name, bf16, fp8, speedup in fp8_linear_rows():
        lines.append(f"| {m} | {name} | {bf16:,.1f} | {fp8:,.1f} | {speedup:.2f}x |")
    lines += [
        "",
        "Quantized checkpoints' GEMMs (engine/quant/) vs bf16 `F.linear`, Llama-3-8B shapes: W4A16 with its packed",
        "bytes' GB/s, block fp8 with TFLOP/s:",
        "",
        "| kernel | layer | bf16 µs | quantized µs | GB/s or TFLOP/s | speed-up |",
        "|---|---|---:|---:|---:|---:|",
    ]
    for kind, name, t16, tq, rate, speedup in quant_linear_rows():
        lines.append(f"| {kind} | {name} | {t16:,.1f} | {tq:,.1f} | {rate:,.1f} | {speedup:.2f}x |")
    peak, source = tensor_core_peak()
    lines += [
        "",
        f"Prefill, compute-bound (bf16), against the tensor-core peak: **{peak / 1e12:,.0f} TFLOP/s** ({source}):",
        "",
        "| kernel | ms | TFLOP/s | % of peak |",
        "|---|---:|---:|---:|",
    ]
    for name, fn, flops in compute_rows():
        s = bench(fn)
        lines.append(f"| {name} | {s * 1e3:,.2f} | {flops / s / 1e12:,.0f} | {flops / s / peak:.0%} |")
    md = "\n".join(lines)
    write_section(DOC, "gpu", md)
    print(md)


if __name__ == "__main__":
    main()
