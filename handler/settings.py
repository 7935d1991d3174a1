"""The only module that reads the environment. It parses worker-vllm's variable names with pydantic and
builds the frozen EngineConfig. An invalid value fails fast with a message naming the variable.

The engine's variables are not declared here: each EngineConfig field is one, named as the field upper-cased
(`max_num_seqs` is MAX_NUM_SEQS) unless ENV_NAMES spells it as worker-vllm does, typed and defaulted by the
dataclass, and checked by EngineConfig itself when the settings load. Adding an engine knob is one EngineConfig
field and one row in docs/configuration.md (tests/test_settings.py checks the row, and
tests/test_no_silent_settings.py wants a case showing what the variable changes). Only the worker's own
variables are declared below, in Settings."""

from __future__ import annotations

import dataclasses
import json
import logging
import os
import shutil
import sys
import typing
from collections.abc import Mapping
from pathlib import Path
from types import NoneType
from typing import Literal

from pydantic import ConfigDict, Field, SecretStr, ValidationError, create_model, field_validator, model_validator

from engine import ConfigError, EngineConfig, default_cache_root, writable_dir

log = logging.getLogger("handler")

# EngineConfig fields whose variable worker-vllm names otherwise; every other field's is its name upper-cased
ENV_NAMES = {"model": "MODEL_NAME", "revision": "MODEL_REVISION", "tokenizer": "TOKENIZER_NAME"}
# EngineConfig fields that are no variable: the worker derives the caches from BASE_PATH and HF_*, and the rest
# serve tests and the Python API (a CPU-only pool size, the device, thread counts, log and collective timing)
NOT_VARIABLES = (
    "cache_root",
    "hf_cache_dirs",
    "device",
    "num_kv_blocks",
    "num_threads",
    "log_stats_interval",
    "distributed_timeout_s",
)
# a variable's type where its text is not the field's type: the JSON that EngineConfig parses itself
ENV_TYPES = {"speculative_config": str | None}
# second names of the worker's own variables: worker-vllm documents DEFAULT_* but reads these; accept both (the
# DEFAULT_* name wins)
ALIASES = {"MIN_BATCH_SIZE": "DEFAULT_MIN_BATCH_SIZE", "BATCH_SIZE_GROWTH_FACTOR": "DEFAULT_BATCH_SIZE_GROWTH_FACTOR"}

# environment variable -> EngineConfig field
ENGINE_FIELDS = {
    ENV_NAMES.get(f.name, f.name.upper()): f.name
    for f in dataclasses.fields(EngineConfig)
    if f.name not in NOT_VARIABLES
}


def _engine_variables() -> dict[str, tuple]:
    """The engine part of Settings, for pydantic's create_model: {variable: (type, EngineConfig's default)}."""
    types = typing.get_type_hints(EngineConfig)
    defaults = {f.name: f.default for f in dataclasses.fields(EngineConfig)}
    return {env: (ENV_TYPES.get(name, types[name]), defaults[name]) for env, name in ENGINE_FIELDS.items()}


_EngineVariables = create_model(
    "_EngineVariables", __config__=ConfigDict(extra="ignore", frozen=True), **_engine_variables()
)
# an empty value of an optional text is unset (Dockerfiles and templates set MODEL_NAME="")
_OPTIONAL_TEXT = [
    env for env, f in _EngineVariables.model_fields.items() if set(typing.get_args(f.annotation)) == {str, NoneType}
]


class SettingsError(ValueError):
    """An environment variable with a value we cannot use; the message names it."""


class Settings(_EngineVariables):
    """Field names are the environment variable names (worker-vllm's where one exists): the engine's, from
    EngineConfig (above), and the worker's own, declared here."""

    BASE_PATH: str | None = None  # Runpod network volume; default /runpod-volume on Runpod
    HF_HOME: str | None = None
    HF_HUB_CACHE: str | None = None
    HF_HUB_OFFLINE: bool = False  # python -m warmup downloads a missing model unless this is set
    HF_TOKEN: SecretStr | None = None  # gated models, for python -m warmup (never logged)
    TRITON_CACHE_DIR: str | None = None  # triton reads the env itself; set_library_defaults moves an unwritable one
    RUNPOD_POD_ID: str | None = None
    LOCAL_EMULATOR: bool = False  # set by python -m handler.local for its worker: Runpod's protocol, not Runpod
    RUNPOD_ENDPOINT_ID: str | None = None
    RUNPOD_WEBHOOK_GET_JOB: str | None = None  # set on Runpod (and by handler.local); unset = local test mode
    # job handling (worker-vllm names)
    MAX_CONCURRENCY: int = Field(default=30, ge=1)
    DEFAULT_BATCH_SIZE: int = Field(default=50, ge=1)
    DEFAULT_MIN_BATCH_SIZE: int = Field(default=1, ge=1)
    DEFAULT_BATCH_SIZE_GROWTH_FACTOR: float = Field(default=3.0, ge=1)
    SHUTDOWN_GRACE_S: float = Field(default=8.0, ge=0)  # after SIGTERM, in-flight jobs get this long to finish
    STREAM_FLUSH_MS: float = Field(default=100.0, gt=0)  # a streamed yield waits at most this for its count
    OPENAI_SERVED_MODEL_NAME_OVERRIDE: str | None = None
    CUSTOM_CHAT_TEMPLATE: str | None = None
    # vLLM's --trust-request-chat-template: a request's own `chat_template` (Jinja code from the client) is rendered
    # only when this is true; without it such a request is refused, as in vLLM
    TRUST_REQUEST_CHAT_TEMPLATE: bool = False
    # tool calling (worker-vllm's names): tool_choice "auto" parses the output in TOOL_CALL_PARSER's format
    ENABLE_AUTO_TOOL_CHOICE: bool = False
    TOOL_CALL_PARSER: (
        Literal["hermes", "llama3_json", "mistral", "pythonic", "llama4_pythonic", "qwen3_coder", "qwen3_xml", "openai"]
        | None
    ) = None
    # vLLM's --reasoning-parser (worker-vllm's variable): thinking apart from the answer (handler/reasoning.py)
    # openai_gptoss: GPT-OSS's harmony channels, which its replies get whatever this says (handler/harmony.py)
    REASONING_PARSER: Literal["qwen3", "deepseek_r1", "openai_gptoss"] | None = None
    # /v1/embeddings (handler/openai_embeddings.py): unset, each comes from the checkpoint (sentence-transformers'
    # modules, config.json's is_matryoshka), else last-token pooling, normalized, no truncation
    POOLING: Literal["last", "mean", "cls"] | None = None
    NORMALIZE: bool | None = None
    IS_MATRYOSHKA: bool | None = None
    # load-balancing endpoints (handler/lb.py; the mode rule is endpoint_mode below). Runpod's names: PORT,
    # PORT_HEALTH, HEALTH_CHECK_PATH; the rest are ours
    RUNPOD_ENDPOINT_TYPE: Literal["queue", "lb"] | None = None
    PORT: int | None = Field(default=None, ge=1, le=65535)
    PORT_HEALTH: int | None = Field(default=None, ge=1, le=65535)  # default: PORT
    HEALTH_CHECK_PATH: str = "/ping"
    API_KEY: SecretStr | None = None  # as `vllm serve --api-key`: every route but the health check needs it
    MAX_REQUEST_BYTES: int = Field(default=30 * 2**20, ge=1024)  # Runpod's cap on a load-balanced request
    LB_MAX_WAITING: int = Field(default=16, ge=0)  # requests waiting for one of MAX_CONCURRENCY slots, at most
    LB_MAX_WAIT_S: float = Field(default=30.0, gt=0)  # then 503: Runpod runs a request 5.5 minutes at most

    @field_validator(
        *_OPTIONAL_TEXT,
        "BASE_PATH",
        "HF_HOME",
        "HF_HUB_CACHE",
        "HF_TOKEN",
        "TRITON_CACHE_DIR",
        "OPENAI_SERVED_MODEL_NAME_OVERRIDE",
        "CUSTOM_CHAT_TEMPLATE",
        "RUNPOD_ENDPOINT_TYPE",
        "REASONING_PARSER",
        "PORT",
        "PORT_HEALTH",
        "API_KEY",
        mode="before",
    )
    @classmethod
    def _empty_is_unset(cls, v):
        return None if isinstance(v, str) and not v.strip() else v

    @field_validator("LORA_MODULES", mode="before")
    @classmethod
    def _lora_modules(cls, v):
        # worker-vllm takes one JSON object {"name", "path"}; we also take a list of them
        if isinstance(v, str):
            if not v.strip():
                return ()
            try:
                v = json.loads(v)
            except json.JSONDecodeError as e:
                raise ValueError(f'must be JSON: {{"name": ..., "path": ...}} or a list of them ({e})') from None
        items = [v] if isinstance(v, dict) else v
        if not isinstance(items, (list, tuple)):
            raise ValueError('must be {"name": ..., "path": ...} or a list of them')
        out = []
        for m in items:
            if isinstance(m, dict):
                if not isinstance(m.get("name"), str) or not isinstance(m.get("path"), str):
                    raise ValueError('each module needs string "name" and "path"')
                m = (m["name"], m["path"])
            elif not isinstance(m, (list, tuple)):  # a [name, path] pair passes on to the type check
                raise ValueError('each module must be {"name": ..., "path": ...}')
            out.append(tuple(m))
        return tuple(out)

    @field_validator("LORA_ALLOWED_BUCKETS", mode="before")
    @classmethod
    def _buckets(cls, v):
        return tuple(b.strip() for b in v.split(",") if b.strip()) if isinstance(v, str) else v

    @field_validator("DTYPE", mode="before")
    @classmethod
    def _dtype_alias(cls, v):
        # vLLM's aliases, which worker-vllm users set
        v = str(v).strip().lower()
        v = {"half": "float16", "float": "float32", "bf16": "bfloat16", "fp16": "float16", "fp32": "float32"}.get(v, v)
        if v not in ("auto", "float32", "bfloat16", "float16"):
            raise ValueError("must be auto, float32 (float), bfloat16 or float16 (half)")
        return v

    @model_validator(mode="after")
    def _engine_accepts(self) -> Settings:
        # EngineConfig holds the engine's rules (MAX_NUM_SEQS >= 1, BLOCK_SIZE one of 8 to 128, ...): apply them now,
        # so a bad value fails the load as a bad type does, not later at the engine's start
        self._engine(self._engine_values())
        return self

    def endpoint_mode(self) -> tuple[str, str]:
        """("lb" or "queue", why). A queue worker always has RUNPOD_WEBHOOK_GET_JOB (Runpod and handler.local set
        it), so PORT alone never turns one into a load-balancing worker: only RUNPOD_ENDPOINT_TYPE=lb does that."""
        if self.RUNPOD_ENDPOINT_TYPE == "lb":
            why = "RUNPOD_ENDPOINT_TYPE=lb"
            return "lb", why + (
                " (RUNPOD_WEBHOOK_GET_JOB is set too, and ignored)" if self.RUNPOD_WEBHOOK_GET_JOB else ""
            )
        if self.RUNPOD_ENDPOINT_TYPE == "queue":
            return "queue", "RUNPOD_ENDPOINT_TYPE=queue"
        if self.RUNPOD_WEBHOOK_GET_JOB:
            return "queue", "RUNPOD_WEBHOOK_GET_JOB is set" + (" (PORT is ignored)" if self.PORT else "")
        if self.PORT:
            return "lb", f"PORT={self.PORT} is set and RUNPOD_WEBHOOK_GET_JOB is not"
        return "queue", "neither RUNPOD_ENDPOINT_TYPE, RUNPOD_WEBHOOK_GET_JOB nor PORT is set"

    @property
    def on_runpod(self) -> bool:
        return bool(self.RUNPOD_POD_ID or self.RUNPOD_ENDPOINT_ID) and not self.LOCAL_EMULATOR

    def cache_root(self) -> str | None:
        """Where the worker's caches live (converted default model, fp8 snapshots, LoRA adapters): BASE_PATH when
        set, /runpod-volume on Runpod; None: the engine's user cache (~/.cache/rp-llm-worker)."""
        if self.BASE_PATH:
            return self.BASE_PATH
        return "/runpod-volume" if self.on_runpod else None

    def hf_cache_dirs(self) -> tuple[str, ...]:
        dirs = [self.HF_HUB_CACHE, self.HF_HOME and str(Path(self.HF_HOME) / "hub")]
        root = self.cache_root()
        if root:
            dirs.append(str(Path(root) / "huggingface-cache" / "hub"))  # Runpod's model store layout
        dirs.append(str(Path.home() / ".cache" / "huggingface" / "hub"))
        return tuple(dict.fromkeys(d for d in dirs if d))

    def ignored(self) -> list[str]:
        """Variables set to values that have no effect (logged at start)."""
        out = []
        if self.LORA_MODULES and not self.ENABLE_LORA:
            out.append("LORA_MODULES (ignored unless ENABLE_LORA=true)")
        # CUDA graphs need one GPU and the Triton kernels; the engine logs the device case (no CUDA) at start
        if not self.ENFORCE_EAGER and self.TENSOR_PARALLEL_SIZE > 1:
            out.append("ENFORCE_EAGER=false (ignored with TENSOR_PARALLEL_SIZE > 1: CUDA graphs run on one GPU only)")
        if not self.ENFORCE_EAGER and self.KERNEL_BACKEND == "torch":
            out.append(
                "ENFORCE_EAGER=false (ignored with KERNEL_BACKEND=torch: CUDA graphs capture the Triton kernels)"
            )
        return out

    def engine_config(self) -> EngineConfig:
        kw = self._engine_values()
        kw["hf_cache_dirs"] = self.hf_cache_dirs()  # the volume's HF cache is read even when it cannot be written
        root = self.cache_root()
        if root and not writable_dir(root):
            log.warning(
                "%s cannot be written by this user (read-only, or missing and not creatable): caches go to "
                "%s instead, and are lost with the container. Make the volume writable to keep them.",
                root,
                default_cache_root(),
            )
        elif root:
            kw["cache_root"] = root
        return self._engine(kw)

    def _engine_values(self) -> dict:
        return {field: getattr(self, env) for env, field in ENGINE_FIELDS.items()}

    @staticmethod
    def _engine(kw: dict) -> EngineConfig:
        try:
            return EngineConfig(**kw)
        except ConfigError as e:
            env = {field: env for env, field in ENGINE_FIELDS.items()}.get((e.field or "").split(".")[0])
            raise SettingsError(f"environment variable {env}: {e}" if env else f"invalid engine setting: {e}") from e


def load_settings(env: Mapping[str, str] | None = None) -> Settings:
    env = os.environ if env is None else env
    values = {k: v for k, v in env.items() if k in Settings.model_fields}
    for alias, name in ALIASES.items():
        if alias in env and name not in values:
            values[name] = env[alias]
    try:
        return Settings.model_validate(values)
    except ValidationError as e:
        err = e.errors()[0]
        cause = err.get("ctx", {}).get("error")
        if isinstance(cause, SettingsError):  # EngineConfig refused it; the message names the variable
            raise SettingsError(str(cause)) from None
        name = err["loc"][0] if err["loc"] else "?"
        shown = name if name in env else next((a for a, n in ALIASES.items() if n == name and a in env), name)
        raise SettingsError(f"environment variable {shown}={env.get(shown)!r}: {err['msg']}") from None


# what the load-balancing server needs to serve at all: read on their own when another variable is invalid, so that
# the worker still serves its endpoint kind and reports the error on every request (a crash loop says nothing)
_SERVING = ("RUNPOD_ENDPOINT_TYPE", "RUNPOD_WEBHOOK_GET_JOB", "PORT", "PORT_HEALTH", "HEALTH_CHECK_PATH", "API_KEY",
            "RUNPOD_POD_ID", "MAX_REQUEST_BYTES", "SHUTDOWN_GRACE_S")  # fmt: skip


def serving_settings(env: Mapping[str, str] | None = None) -> tuple[Settings, str | None]:
    """(settings, None), or when the environment is invalid: (the valid _SERVING variables alone, the error). So a
    worker whose MAX_MODEL_LEN (say) is wrong still knows its endpoint kind and its queue's webhook, and reports the
    error on every job or request; an invalid serving variable itself is dropped (its default is used)."""
    env = os.environ if env is None else env
    try:
        return load_settings(env), None
    except SettingsError as e:
        valid = {}
        for k in _SERVING:
            if k in env:
                try:
                    load_settings({k: env[k]})
                    valid[k] = env[k]
                except SettingsError:
                    pass
        return load_settings(valid), str(e)


# Libraries that read environment variables of their own: the worker sets these defaults before they first run (an
# endpoint's own value wins).
LIBRARY_DEFAULTS = {
    # oneDNN, behind torch's CPU bf16 matmuls, caches one primitive per shape (1024 by default, ~0.5 MB each);
    # a step's token count changes almost every step, so the cache alone grew a worker's RSS for minutes. 16 holds
    # the shapes of the last few steps (the soak: +4.2 % RSS after minute 2, no loss of throughput; 64: +6.2 %).
    "ONEDNN_PRIMITIVE_CACHE_CAPACITY": "16",
    # glibc's malloc arenas (see _limit_malloc_arenas); child processes read it at their start
    "MALLOC_ARENA_MAX": "2",
}


def set_library_defaults() -> None:
    for name, value in LIBRARY_DEFAULTS.items():
        os.environ.setdefault(name, value)
    _limit_malloc_arenas(int(os.environ["MALLOC_ARENA_MAX"]))
    triton_cache = os.environ.get("TRITON_CACHE_DIR")
    # the image points it at the volume; a root-owned network volume would make the first kernel compile fail with
    # PermissionError, and a full one with ENOSPC, inside a step: failing the jobs of that step
    why = None
    if triton_cache and not writable_dir(triton_cache):
        why = "cannot be written by this user"
    elif triton_cache and (free := _free_bytes(triton_cache)) < TRITON_CACHE_MIN_FREE:
        why = f"is on a disk with {free / 2**20:.0f} MiB free"
    if why is not None:
        fallback = str(Path.home() / ".triton" / "cache")
        log.warning(
            "TRITON_CACHE_DIR=%s %s: compiled kernels go to %s instead (lost with the container, so each new worker "
            "compiles again). Make room on the volume (or make it writable) to keep them.",
            triton_cache,
            why,
            fallback,
        )
        os.environ["TRITON_CACHE_DIR"] = fallback


def point_tiktoken_at(folder) -> None:
    """Where openai-harmony (handler/harmony.py) reads its tiktoken vocabulary instead of downloading it."""
    os.environ["TIKTOKEN_ENCODINGS_BASE"] = str(folder)


TRITON_CACHE_MIN_FREE = 256 << 20  # a model's compiled kernels take some tens of MiB; less free than this: not there


def _free_bytes(path: str) -> int:
    """Free bytes on the filesystem that holds `path` (its nearest existing folder); unknown: as good as unlimited."""
    p = Path(path).absolute()
    while not p.exists() and p != p.parent:
        p = p.parent
    try:
        return shutil.disk_usage(p).free
    except OSError:
        return 1 << 62


def _limit_malloc_arenas(n: int) -> None:
    """glibc gives each thread that allocates its own arena (up to 8 per core), and memory freed in one is not
    reused by another, so a worker's RSS crept up as the engine, event-loop and torch threads took turns (the
    soak: +7 % after minute 2 with glibc's default). glibc reads MALLOC_ARENA_MAX only at start-up, so it
    is set here with mallopt, before the engine's threads exist."""
    if sys.platform != "linux":
        return
    import ctypes

    try:
        ok = ctypes.CDLL(None).mallopt(-8, n) == 1  # M_ARENA_MAX; mallopt returns 1 on success
    except (OSError, AttributeError):  # not glibc (musl has no mallopt)
        ok = False
    if not ok:  # called once, at start
        log.warning("mallopt(M_ARENA_MAX, %d) failed: RSS may creep up as threads take turns allocating", n)


def inherited_env() -> dict[str, str]:
    """A copy of this process's environment, for a child process (the emulator's worker)."""
    return dict(os.environ)
