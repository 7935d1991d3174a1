"""The GPU warm-up's promises, on CPU with the Triton kernels under the interpreter:
- the padding-only warm steps (ModelRunner.warm, run after ready by the step loop's IdleWork on CUDA) launch every
  compile variant that serving then asks for, LoRA's included, so no request waits for a compile;
- a step's host-to-device traffic does not grow with the layer count (no per-layer copy or scalar tensor)."""

from __future__ import annotations

import importlib
import inspect

import pytest
import torch

import kernels
from engine import LLM, SamplingParams
from tests.utils import build_tiny_model

pytestmark = pytest.mark.slow  # whole engines under the Triton interpreter

KERNEL_MODULES = ("rmsnorm", "activation", "rotary", "cache_write", "paged_attention", "prefill_attention", "fp8")
ENGINE = dict(
    dtype="float32",
    kernel_backend="triton",
    block_size=8,
    max_num_seqs=8,
    max_num_batched_tokens=24,  # prompts of 30 tokens are prefilled in chunks
    num_kv_blocks=64,
    max_model_len=96,
    log_stats_interval=0,
)


class Recorder:
    """Wraps a Triton kernel: each launch records what Triton compiles a variant for (constexprs, tensor dtypes and
    16-byte alignment, the value class of every specialized int), then runs the kernel; helper calls pass through."""

    def __init__(self, name, kernel, seen):
        self.name, self.kernel, self.seen = name, kernel, seen
        params = inspect.signature(getattr(kernel, "fn", kernel)).parameters
        self.names = list(params)
        dns = kernel.kwargs["do_not_specialize"] if hasattr(kernel, "kwargs") else kernel.do_not_specialize
        self.skip = {n if isinstance(n, str) else self.names[n] for n in dns or ()}

    def __call__(self, *args, **kw):
        return self.kernel(*args, **kw)

    def __getitem__(self, grid):
        def launch(*args, **constexprs):
            key = []
            for n, a in zip(self.names, args):
                if isinstance(a, torch.Tensor):
                    key.append((n, str(a.dtype), a.data_ptr() % 16 == 0))
                elif type(a) is int and n not in self.skip:
                    key.append((n, a == 1, a % 16 == 0))
            self.seen.add((self.name, tuple(key), tuple(sorted(constexprs.items()))))
            return self.kernel[grid](*args, **constexprs)

        return launch


def record_kernels(monkeypatch, seen: set, modules=KERNEL_MODULES) -> None:
    kernels.load_triton()  # the modules' kernels are JITFunctions (interpreted here) from then on
    for mod_name in modules:
        mod = importlib.import_module(f"kernels.{mod_name}")
        for name, obj in list(vars(mod).items()):
            if type(obj).__name__ in ("JITFunction", "InterpretedFunction") and name.startswith("_"):
                monkeypatch.setattr(mod, name, Recorder(name, obj, seen))


def test_warm_steps_compile_what_serving_launches(tiny_llama, monkeypatch):
    llm = LLM(str(tiny_llama), **ENGINE)
    runner = llm.engine.runner
    warm, served = set(), set()
    record_kernels(monkeypatch, warm)
    shapes = runner.warm_shapes()
    # tokens {1, 3, 16} x {decode, full tiles} x {narrow, full-width table}, less 16 decodes (max_num_seqs is 8),
    # and one 17-token chunk for the prefill kernel
    assert len(shapes) == 11 and (16, 1, 1) not in shapes
    for shape in shapes:
        runner.warm(*shape)
    assert {k[0] for k in warm} >= {"_paged_attn_kernel", "_prefill_attn_kernel", "_reshape_and_cache_kernel"}
    monkeypatch.undo()
    record_kernels(monkeypatch, served)
    g = torch.Generator().manual_seed(0)
    for batch in (1, 3, 5):  # decode batches of 1, 3 and 5; prompts of 2 to 30 tokens, chunked at 24 per step
        prompts = [
            {"prompt_token_ids": torch.randint(3, 200, (int(n),), generator=g).tolist()} for n in (2, 30, 9, 17, 5)
        ]
        llm.generate(prompts[:batch], SamplingParams(temperature=0, max_tokens=20, ignore_eos=True))
    new = served - warm
    assert not new, f"{len(new)} variants compiled while serving, e.g. {sorted(new)[:2]}"


def test_lora_warm_steps_compile_what_adapter_steps_launch(tiny_llama, tmp_path, monkeypatch):
    """With LoRA on, the warm steps (slot 0 at 1, 17 and 64 tokens) launch every LoRA kernel variant that steps
    with an adapter then ask for: the kernel's token tile follows the step's token count (16, 32 or 64 rows)."""
    from engine import LoRARequest
    from tests.lora_fixtures import make_peft_adapter

    adapter, _ = make_peft_adapter(tiny_llama, tmp_path / "a1", r=4, seed=1)
    llm = LLM(
        str(tiny_llama), enable_lora=True, max_lora_rank=8, lora_modules=(("a1", str(adapter)),),
        cache_root=str(tmp_path), **{**ENGINE, "max_num_batched_tokens": 64},
    )  # fmt: skip
    runner = llm.engine.runner
    warm, served, modules = set(), set(), KERNEL_MODULES + ("lora",)
    record_kernels(monkeypatch, warm, modules)
    for shape in runner.warm_shapes():
        runner.warm(*shape)
    assert {k[0] for k in warm} >= {"_sgmv_kernel"}
    monkeypatch.undo()
    record_kernels(monkeypatch, served, modules)
    g = torch.Generator().manual_seed(0)
    for batch in (1, 3, 5):  # steps of 1 to 64 tokens, some rows without the adapter
        prompts = [
            {"prompt_token_ids": torch.randint(3, 200, (int(n),), generator=g).tolist()} for n in (2, 40, 9, 17, 5)
        ]
        loras = [LoRARequest("a1") if i % 2 == 0 else None for i in range(batch)]
        llm.generate(prompts[:batch], SamplingParams(temperature=0, max_tokens=6, ignore_eos=True), lora=loras)
    assert {k[0] for k in served} >= {"_sgmv_kernel"}
    new = served - warm
    assert not new, f"{len(new)} variants compiled while serving, e.g. {sorted(new)[:2]}"


def _step_copies(tmp_path, layers: int, monkeypatch) -> int:
    path = build_tiny_model(tmp_path / f"l{layers}", "llama", num_hidden_layers=layers)
    llm = LLM(str(path), **ENGINE)
    prompts = [{"prompt_token_ids": [5, 9, 33, 7]}, {"prompt_token_ids": [40, 41]}]
    llm.generate(prompts, SamplingParams(temperature=0, max_tokens=2, ignore_eos=True))  # everything lazily made
    count = {"n": 0}
    for name in ("tensor", "as_tensor"):
        orig = getattr(torch, name)

        def counted(*a, _orig=orig, **kw):
            count["n"] += 1
            return _orig(*a, **kw)

        monkeypatch.setattr(torch, name, counted)
    orig_to = torch.Tensor.to

    def to(self, *a, **kw):
        count["n"] += 1
        return orig_to(self, *a, **kw)

    monkeypatch.setattr(torch.Tensor, "to", to)
    llm.generate(prompts, SamplingParams(temperature=0, max_tokens=4, ignore_eos=True))
    monkeypatch.undo()
    return count["n"]


def test_step_host_to_device_traffic_does_not_grow_with_layers(tmp_path, monkeypatch):
    """Done means: no per-layer host-to-device copy in a step. Tensors made from host data (torch.tensor,
    torch.as_tensor) and .to() calls over a whole generation are the same count for 2 and 4 layers."""
    two, four = _step_copies(tmp_path, 2, monkeypatch), _step_copies(tmp_path, 4, monkeypatch)
    assert two == four, (two, four)
