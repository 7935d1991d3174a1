"""The cold start's builders, in the order LLMEngine.__init__ calls them: resolve the model (config files only),
plan memory (engine/memory.py, per tensor-parallel rank), build the model, attention (fp8 KV scales), LoRA and
speculative decoding, and the ready line. A mixin: LLMEngine holds the state. `plan_memory` (and `draft_model`,
which reads the draft's config) are the functions `python -m warmup.plan` calls too, with simulated numbers."""

from __future__ import annotations

import logging
from pathlib import Path

import torch

from engine import memory
from engine.config import EngineConfig
from engine.device import check_fp8_support, model_dtype
from engine.errors import ConfigError
from engine.kv_cache import CALIBRATION_TEXT, kv_scales
from engine.layers.attention import build_attention
from engine.memory import MemoryPlan
from engine.models.llama import LlamaForCausalLM, ModelSpec
from engine.parallel import shard
from engine.parallel.group import rank_model
from engine.spec_decode.speculator import Speculator
from engine.tokenizer import Tokenizer
from engine.weights import read_json, resolve_model_path, safetensors_files

log = logging.getLogger("engine")


class EngineBuilders:
    def _resolve_model(self) -> None:
        """model_path, spec, dtype, tok, eos_token_ids: from config files alone, no weights read."""
        cfg = self.cfg
        self.model_path = resolve_model_path(cfg)
        safetensors_files(self.model_path)  # refuse pickle-only checkpoints before anything else
        hf_cfg = read_json(self.model_path / "config.json")
        self.spec = ModelSpec.from_hf(hf_cfg, read_json(self.model_path / "generation_config.json"))
        self.tp = cfg.tensor_parallel_size
        cuda = self.device.type == "cuda"
        shard.check(self.spec, self.tp, torch.cuda.device_count() if cuda else None)
        if self.tp > 1 and cuda and self.device.index not in (None, 0):
            raise ConfigError(
                f"EngineConfig.device={cfg.device!r}: with tensor_parallel_size={self.tp} rank r runs on cuda:r; "
                "use device cuda (or cuda:0), and CUDA_VISIBLE_DEVICES to choose the GPUs"
            )
        self.rank_spec = shard.local_spec(self.spec, self.tp)  # the shapes this rank holds (all of them at tp 1)
        self.dtype = model_dtype(cfg.dtype, hf_cfg, self.device.type)
        self.tok = Tokenizer(cfg.tokenizer or self.model_path)  # Rust; transformers only if asked for
        self.draft_path, self.draft_spec = draft_model(cfg)  # its bytes are planned with the target's
        eos = set(self.spec.eos_token_ids)
        if self.tok.eos_token_id is not None:
            eos.add(self.tok.eos_token_id)
        self.eos_token_ids = frozenset(eos)

    def _plan_memory(self, loaded: bool) -> MemoryPlan:
        """The KV pool and context length (plan_memory). CPU: from KV_CACHE_MEMORY. CUDA: before the load, refuse
        what cannot fit and predict the rest; after it, plan from the memory measured now."""
        gpu, default = None, EngineConfig()
        if not loaded:  # a budget set for the other kind of device: say so once, at start
            if self.device.type != "cuda" and self.cfg.gpu_memory_utilization != default.gpu_memory_utilization:
                log.warning("GPU_MEMORY_UTILIZATION is ignored on %s: the KV pool is KV_CACHE_MEMORY", self.device)
            if self.device.type == "cuda" and self.cfg.kv_cache_memory != default.kv_cache_memory:
                log.warning("KV_CACHE_MEMORY is ignored on CUDA: the pool is sized by GPU_MEMORY_UTILIZATION")
        if self.device.type == "cuda":
            if loaded:  # blocks freed while loading stay in torch's cache and would count as used
                torch.cuda.empty_cache()
            free, total = torch.cuda.mem_get_info(self.device)
            props = torch.cuda.get_device_properties(self.device)
            gpu = memory.GPU(total, free, (props.major, props.minor), props.name)
        plan = plan_memory(
            self.cfg,
            self.spec,
            gpu,
            self.dtype,
            draft_spec=self.draft_spec,
            kernel_backend=self.kernel_backend,
            loaded_len=self.max_model_len if loaded else None,
        )
        if gpu is not None:
            log.info("memory plan (%s): %s", "measured" if loaded else "predicted", plan.as_dict())
        return plan

    def _build_model(self) -> LlamaForCausalLM:
        return rank_model(self.spec, 0, self.tp, self.dtype, self.device, self.max_model_len, self.cfg.quantization)

    def _build_attention(self):
        attn = build_attention(self.spec, self.cfg.block_size, self.kernel_backend)
        if self.kv_dtype == torch.float8_e4m3fn:
            attn.set_kv_scales(*kv_scales(self.model, self._calibration_ids(), self.device))
            self.timeline.mark("fp8 KV scales")
        return attn

    def _build_lora(self):
        if not self.cfg.enable_lora:
            return None
        from engine.lora.manager import LoRAManager  # boto3 and friends only when LoRA is on

        shards = [shard.Shard(self.spec, r, self.tp) for r in range(self.tp)] if self.tp > 1 else ()
        return LoRAManager(self.cfg, self.spec, self.dtype, self.device, self.tp_group, shards)

    def _build_speculator(self) -> Speculator | None:
        sc = self.cfg.speculative_config
        if sc is None:
            return None
        draft = None
        if sc.method == "draft_model":
            from engine.spec_decode.draft import DraftProposer

            draft = DraftProposer(self, self.draft_path, self.draft_spec)
            self.timeline.mark("draft model", str(draft.path))
        spec = Speculator(sc, self.max_model_len, draft)
        self.scheduler.lookahead = spec.lookahead
        log.info("speculative decoding: %s", sc.describe())
        return spec

    def _log_ready(self, seconds: float) -> None:
        other_dtype = self.dtype if self.kv_dtype != self.dtype else torch.float8_e4m3fn
        other = self.memory.tokens_with(memory.kv_bytes_per_token(self.rank_spec, other_dtype.itemsize))
        log.info(
            "model %s (%s, %s) on %s in %.1fs; %s [KV %s]%s",
            self.model_path,
            self.spec.architecture,
            str(self.dtype).removeprefix("torch."),
            self.device,
            seconds,
            self.memory.describe(),
            str(self.kv_dtype).removeprefix("torch."),
            f"; with KV {'fp8' if self.kv_dtype == self.dtype else 'auto'} it would be {other} tokens, "
            f"{other / self.max_model_len:.1f} sequences"
            if self.cfg.num_kv_blocks is None
            else "",
        )

    def _calibration_ids(self) -> list[int] | None:
        """The tokens fp8 KV scales are calibrated on; None when the checkpoint has every layer's (or KV is 16-bit)."""
        ck = self.model.checkpoint_kv_scales
        if self.kv_dtype != torch.float8_e4m3fn or (
            len(ck) == self.spec.num_layers and all(set(v) == {"k", "v"} for v in ck.values())
        ):
            return None
        return self.tok.encode(CALIBRATION_TEXT)[: self.max_model_len]


def draft_model(cfg: EngineConfig) -> tuple[Path | None, ModelSpec | None]:
    """The draft model's folder and spec (its config.json alone), or (None, None) without one."""
    sc = cfg.speculative_config
    if sc is None or sc.method != "draft_model":
        return None, None
    path = resolve_model_path(cfg.replace(model=sc.model, speculative_config=None))
    return path, ModelSpec.from_hf(read_json(path / "config.json"), {})


def memory_needs(
    cfg: EngineConfig, spec: ModelSpec, dtype: torch.dtype, device_type: str, *, draft_spec=None, kernel_backend=None
) -> memory.Needs:
    """One rank's weights, KV bytes per token and reserve (memory.engine_needs), with the CUDA graph pool counted
    by the rule LLMEngine.graphs_enabled follows. kernel_backend: the engine's (None: cfg.kernel_backend)."""
    graphs = memory.cuda_graphs(cfg, device_type, kernel_backend or cfg.kernel_backend)
    return memory.engine_needs(cfg, spec, dtype.itemsize, graphs=graphs, draft_spec=draft_spec)


def plan_memory(
    cfg: EngineConfig,
    spec: ModelSpec,
    gpu: memory.GPU | None,
    dtype: torch.dtype,
    *,
    draft_spec: ModelSpec | None = None,
    kernel_backend: str | None = None,
    loaded_len: int | None = None,
) -> MemoryPlan:
    """The memory plan of one rank for the engine's whole configuration: the engine's start calls it (twice on
    CUDA) and so does `python -m warmup.plan`. `spec`: the full model (sharded by cfg.tensor_parallel_size);
    `gpu` None: CPU, the pool is KV_CACHE_MEMORY. Before the load (loaded_len None): refuse fp8 below capability
    8.9 and weights that cannot fit, then predict the pool with the weights (the draft's too) and the CUDA context
    counted as in use. After it (loaded_len: the context the model was built for): gpu.free is measured with the
    target's weights resident, and the draft's, loaded after the pool, are held back from it."""
    device_type = "cpu" if gpu is None else "cuda"
    needs = memory_needs(cfg, spec, dtype, device_type, draft_spec=draft_spec, kernel_backend=kernel_backend)
    kv = dict(
        kv_bytes_per_token=needs.kv_bytes_per_token,
        block_size=cfg.block_size,
        max_model_len=cfg.max_model_len,
        num_blocks=cfg.num_kv_blocks,
        weights=needs.weight_bytes,
    )
    if gpu is None:
        budget = cfg.kv_cache_memory
        return memory.plan(kv_budget=budget, budget=budget, model_max_len=spec.max_position_embeddings, **kv)
    kv |= dict(total=gpu.total, utilization=cfg.gpu_memory_utilization)
    if loaded_len is not None:
        reserve = needs.reserve_bytes + needs.draft_weight_bytes
        return memory.plan_gpu(used=gpu.total - gpu.free, reserve=reserve, model_max_len=loaded_len, **kv)
    if gpu.capability is not None:
        check_fp8_support(cfg, spec.prequantized, gpu.name, gpu.capability)
    return memory.plan_gpu_start(
        free=gpu.free,
        reserve=needs.reserve_bytes,
        quantization=cfg.quantization,
        model_max_len=spec.max_position_embeddings,
        **kv,
    )
