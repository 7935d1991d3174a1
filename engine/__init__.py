"""Public API of the inference engine. handler/ and warmup/ import only from here (tests/test_structure.py).

`weights` is the model-files API (find a model, its safetensors, the fp8 snapshot) that `python -m warmup` uses;
`memory` is the memory planner (pure arithmetic) and `plan_memory` the engine's plan from its whole configuration,
both shared with `python -m warmup.plan` (with `memory_needs`, `draft_model` and `model_dtype`, which the start
uses to read the same inputs);
`tensor_parallel` says what one rank of a tensor-parallel engine holds (the planner plans one rank)."""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING

# torch-free: what handler/settings.py needs, imported at once (the load-balancing server answers /ping before
# torch is imported)
from engine.config import EngineConfig, default_cache_root, writable_dir
from engine.errors import (
    ConfigError,
    EngineError,
    EngineFault,
    InvalidRequestError,
    ModelNotFoundError,
    RequestFault,
    UnsupportedModelError,
)

# the rest on first use (PEP 562): name -> (module, attribute; None: the module itself)
_LAZY = {
    "memory": ("engine.memory", None),
    "weights": ("engine.weights", None),
    "tensor_parallel": ("engine.parallel.shard", None),
    "AsyncEngine": ("engine.async_engine", "AsyncEngine"),
    "model_dtype": ("engine.device", "model_dtype"),
    "ValidRequest": ("engine.intake", "ValidRequest"),
    "LLM": ("engine.llm", "LLM"),
    "LLMEngine": ("engine.llm_engine", "LLMEngine"),
    "ModelSpec": ("engine.models.spec", "ModelSpec"),
    "draft_model": ("engine.startup", "draft_model"),
    "memory_needs": ("engine.startup", "memory_needs"),
    "plan_memory": ("engine.startup", "plan_memory"),
    "Timeline": ("engine.timeline", "Timeline"),
    "Tokenizer": ("engine.tokenizer", "Tokenizer"),
    "compare_with_transformers": ("engine.tokenizer", "compare_with_transformers"),
    "template_iterates_content": ("engine.tokenizer", "template_iterates_content"),
    **{
        n: ("engine.types", n)
        for n in (
            "CompletionOutput",
            "LoRARequest",
            "PoolingParams",
            "RequestMetrics",
            "RequestOutput",
            "SamplingParams",
            "StructuredOutputsParams",
        )
    },
    "model_pooling": ("engine.pooling", "model_pooling"),
}


def __getattr__(name: str):
    if name not in _LAZY:
        raise AttributeError(f"module 'engine' has no attribute {name!r}")
    module, attr = _LAZY[name]
    value = importlib.import_module(module)
    value = value if attr is None else getattr(value, attr)
    globals()[name] = value  # once
    return value


if TYPE_CHECKING:
    from engine import memory, weights
    from engine.async_engine import AsyncEngine
    from engine.device import model_dtype
    from engine.intake import ValidRequest
    from engine.llm import LLM
    from engine.llm_engine import LLMEngine
    from engine.models.spec import ModelSpec
    from engine.parallel import shard as tensor_parallel
    from engine.pooling import model_pooling
    from engine.startup import draft_model, memory_needs, plan_memory
    from engine.timeline import Timeline
    from engine.tokenizer import Tokenizer, compare_with_transformers, template_iterates_content
    from engine.types import (
        CompletionOutput,
        LoRARequest,
        PoolingParams,
        RequestMetrics,
        RequestOutput,
        SamplingParams,
        StructuredOutputsParams,
    )

__all__ = [
    "AsyncEngine",
    "CompletionOutput",
    "ConfigError",
    "EngineConfig",
    "EngineError",
    "EngineFault",
    "RequestFault",
    "InvalidRequestError",
    "LLM",
    "LLMEngine",
    "LoRARequest",
    "ModelNotFoundError",
    "ModelSpec",
    "PoolingParams",
    "RequestMetrics",
    "RequestOutput",
    "SamplingParams",
    "StructuredOutputsParams",
    "Timeline",
    "Tokenizer",
    "UnsupportedModelError",
    "ValidRequest",
    "compare_with_transformers",
    "default_cache_root",
    "draft_model",
    "memory",
    "memory_needs",
    "model_dtype",
    "model_pooling",
    "plan_memory",
    "template_iterates_content",
    "tensor_parallel",
    "weights",
    "writable_dir",
]
