"""Public API of the inference engine. The handler imports only from here."""
from engine.async_engine import AsyncEngine
from engine.config import EngineConfig, default_cache_root, writable_dir
from engine.errors import (ConfigError, EngineError, EngineFault, InvalidRequestError, ModelNotFoundError,
                           UnsupportedModelError)
from engine.llm import LLM
from engine.llm_engine import LLMEngine
from engine.types import CompletionOutput, LoRARequest, RequestMetrics, RequestOutput, SamplingParams
from warmup.timeline import Timeline

__all__ = ["AsyncEngine", "CompletionOutput", "ConfigError", "EngineConfig", "EngineError", "EngineFault",
           "InvalidRequestError", "LLM", "LLMEngine", "LoRARequest", "ModelNotFoundError", "RequestMetrics",
           "RequestOutput", "SamplingParams", "Timeline", "UnsupportedModelError", "default_cache_root",
           "writable_dir"]
