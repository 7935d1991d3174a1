"""Every Triton launcher registered as an operator (kernels/_library.py): torch.library.opcheck runs each on small
inputs (the Triton interpreter here, the GPU under KERNEL_TEST_DEVICE=cuda) and checks its schema (what it says
it mutates is what it mutates, nothing it returns aliases an input) and that its fake implementation gives the
real outputs' shapes, dtypes, strides and devices: what FakeTensorMode (tests/test_fake_cuda.py) relies on."""

from __future__ import annotations

import pytest
import torch

import kernels  # noqa: F401 - registers the operators
import kernels.fp8_block  # noqa: F401 - and those of the modules the package does not import itself
import kernels.fused_moe  # noqa: F401
import kernels.gated_delta  # noqa: F401
import kernels.grammar_mask  # noqa: F401
import kernels.int_gemm  # noqa: F401
from kernels._common import FP8
from tests.kernels.conftest import DEVICE

T, H, KVH, D, NB, BS = 5, 4, 2, 16, 4, 16
ops = torch.ops.llmw


def _g(*shape, dtype=torch.float32):
    return torch.randn(*shape, generator=torch.Generator().manual_seed(sum(shape))).to(DEVICE, dtype)


def _attention_args():
    caches = [_g(KVH, NB, BS, D) for _ in range(2)]
    tables = torch.tensor([[0, 1], [2, 3]], dtype=torch.int32, device=DEVICE)
    seq_lens = torch.tensor([20, 3], dtype=torch.int32, device=DEVICE)
    qsl = torch.tensor([0, 2, 5], dtype=torch.int32, device=DEVICE)
    return (_g(T, H, D), *caches, tables, seq_lens, qsl, D**-0.5)


def _moe_args():
    topk_ids = torch.tensor([[0, 1], [1, 2], [2, 3], [3, 0], [0, 2]], device=DEVICE)
    return (_g(T, 32), _g(4, 64, 32), _g(4, 32, 32), torch.full((T, 2), 0.5, device=DEVICE), topk_ids)


def _lora_slots():
    return torch.tensor([0, 0, -1, 1, 1], device=DEVICE)


def _bitmask():
    return torch.tensor([[-1, 0x0F0F0F0F], [7, -1]], dtype=torch.int32, device=DEVICE)


def _state_batch():  # two sequences (2 and 3 rows) in slots 2 and 0 of 3
    qsl = torch.tensor([0, 2, 5], dtype=torch.int32, device=DEVICE)
    return qsl, torch.tensor([2, 0], dtype=torch.int32, device=DEVICE)


CASES = {
    "gated_delta_rule": lambda: (
        ops.gated_delta_rule,
        (
            _g(T, KVH, D),
            _g(T, KVH, D),
            _g(T, H, D),
            -_g(T, H).abs(),
            _g(T, H).sigmoid(),
            _g(3, H, D, D),
            *_state_batch(),
        ),
    ),  # fmt: skip
    "causal_conv1d": lambda: (ops.causal_conv1d, (_g(T, 32), _g(32, 4), None, _g(3, 32, 3), *_state_batch())),
    "gated_rms_norm": lambda: (ops.gated_rms_norm, (_g(T, H, D), _g(T, H, D), _g(D), 1e-6)),
    "rms_norm": lambda: (ops.rms_norm, (_g(T, 32), _g(32), 1e-6)),
    "add_rms_norm": lambda: (ops.add_rms_norm, (_g(T, 32), _g(T, 32), _g(32), 1e-6)),
    "act_and_mul": lambda: (ops.act_and_mul, (_g(T, 64), True)),
    "rotary_embedding": lambda: (
        ops.rotary_embedding,
        (_g(T, H, D), _g(T, KVH, D), _g(32, D), _g(32, D), torch.arange(T, device=DEVICE)),
    ),
    "reshape_and_cache": lambda: (
        ops.reshape_and_cache,
        (_g(T, KVH, D), _g(T, KVH, D), _g(KVH, NB, BS, D), _g(KVH, NB, BS, D), torch.arange(T, device=DEVICE)),
    ),
    "paged_attention": lambda: (ops.paged_attention, _attention_args()),
    "prefill_attention": lambda: (ops.prefill_attention, _attention_args()),
    "quant_rows": lambda: (ops.quant_rows, (_g(T, 32),)),
    "fp8_gemm": lambda: (
        ops.fp8_gemm,
        (_g(T, 32).to(FP8), _g(T, 1).abs(), _g(48, 32).to(FP8), _g(48, 1).abs(), None, torch.bfloat16),
    ),
    "fused_moe": lambda: (ops.fused_moe, _moe_args()),
    "int_gemm": lambda: (
        ops.int_gemm,
        (
            _g(T, 32),
            torch.randint(-(2**31), 2**31 - 1, (48, 4), dtype=torch.int32, device=DEVICE),
            _g(48, 2).abs(),
            torch.randint(0, 16, (48, 2), dtype=torch.uint8, device=DEVICE),
            None,
            4,
            16,
            _g(48),
            2,
        ),
    ),  # fmt: skip
    "quant_token_groups": lambda: (ops.quant_token_groups, (_g(T, 40), 16)),
    "fp8_block_gemm": lambda: (
        ops.fp8_block_gemm,
        (_g(T, 32).to(FP8), _g(T, 2).abs(), _g(48, 32).to(FP8), _g(3, 2).abs(), 16, 16, None, torch.bfloat16),
    ),
    "lora_shrink": lambda: (ops.lora_shrink, (_g(T, 32), _g(2, 8, 32), _lora_slots())),
    "lora_expand": lambda: (ops.lora_expand, (_g(T, 8), _g(2, 48, 8), _lora_slots(), _g(T, 64), 16, True)),
    "add_lora": lambda: (ops.add_lora, (_g(T, 48), _g(T, 32), _g(2, 8, 32), _g(2, 48, 8), _lora_slots(), 0)),
    "apply_token_bitmask": lambda: (
        ops.apply_token_bitmask,
        (_g(2, 64), _bitmask(), torch.tensor([0, 1], dtype=torch.int32, device=DEVICE)),
    ),
}


@pytest.mark.parametrize("name", CASES)
def test_operator_and_its_fake_agree(name):
    op, args = CASES[name]()
    # test_schema compares the inputs before and after with allclose, which has no fp8 kernel on CPU or CUDA
    fp8_in = any(isinstance(a, torch.Tensor) and a.dtype == FP8 for a in args)
    torch.library.opcheck(op, args, test_utils=("test_faketensor",) if fp8_in else ("test_schema", "test_faketensor"))


def test_every_operator_is_checked():
    registered = {n.split("::")[1] for n in torch._C._dispatch_get_all_op_names() if n.startswith("llmw::")}
    assert registered == set(CASES)
