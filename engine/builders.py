"""The cold start's builders, in the order LLMEngine.__init__ calls them: resolve the model (config files only),
plan memory (engine/memory.py, per tensor-parallel rank), build the model, attention (fp8 KV scales), LoRA and
speculative decoding, and the ready line. A mixin: LLMEngine holds the state."""

from __future__ import annotations

import logging

import torch

from engine import memory
from engine.device import model_dtype
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
        self.draft_path = self.draft_spec = None
        sc = cfg.speculative_config
        if sc is not None and sc.method == "draft_model":  # its bytes are planned with the target's
            self.draft_path = resolve_model_path(cfg.replace(model=sc.model, speculative_config=None))
            self.draft_spec = ModelSpec.from_hf(read_json(self.draft_path / "config.json"), {})
        eos = set(self.spec.eos_token_ids)
        if self.tok.eos_token_id is not None:
            eos.add(self.tok.eos_token_id)
        self.eos_token_ids = frozenset(eos)

    def _plan_memory(self, loaded: bool) -> MemoryPlan:
        """The KV pool and context length (engine/memory.py). CPU: from KV_CACHE_MEMORY. CUDA: before the load,
        refuse weights that cannot fit and predict the rest; after it, plan from the measured memory."""
        cfg, spec = self.cfg, self.rank_spec  # per rank: its shard of the weights, its KV heads
        weights = memory.weight_bytes(spec, self.dtype.itemsize, cfg.quantization)
        kv_per_token = memory.kv_bytes_per_token(spec, self.kv_dtype.itemsize)
        draft_reserve = 0
        if self.draft_spec is not None:  # the draft's weights, and its KV for every token of the shared block ids
            draft_w = memory.weight_bytes(self.draft_spec, self.dtype.itemsize, None)
            weights += draft_w
            kv_per_token += memory.kv_bytes_per_token(self.draft_spec, self.dtype.itemsize)
            # it loads after the pool is sized: its weights and a step's activations are held back from the pool
            draft_reserve = draft_w + memory.activation_reserve(
                self.draft_spec, cfg.max_num_batched_tokens, cfg.max_num_seqs, self.dtype.itemsize
            )
        kv = dict(
            kv_bytes_per_token=kv_per_token,
            block_size=cfg.block_size,
            max_model_len=cfg.max_model_len,
            num_blocks=cfg.num_kv_blocks,
        )
        if self.device.type != "cuda":
            return memory.plan(
                kv_budget=cfg.kv_cache_memory,
                budget=cfg.kv_cache_memory,
                weights=weights,
                model_max_len=spec.max_position_embeddings,
                **kv,
            )
        lora = (cfg.max_loras, cfg.max_lora_rank) if cfg.enable_lora else None
        graphs = memory.graph_pool_bytes(spec, cfg.max_num_seqs, self.dtype.itemsize) if self.graphs_enabled else 0
        reserve = memory.activation_reserve(
            spec, cfg.max_num_batched_tokens, cfg.max_num_seqs, self.dtype.itemsize, lora=lora, graph_pool_bytes=graphs
        )
        reserve += memory.tp_reserve(spec, self.spec.vocab_size, self.tp, cfg.max_num_seqs)
        if loaded:  # measured: the draft is not resident yet (predicted, its bytes are in `weights`)
            reserve += draft_reserve
        if loaded:  # blocks freed while loading stay in torch's cache and would count as used
            torch.cuda.empty_cache()
        free, total = torch.cuda.mem_get_info(self.device)
        gpu = dict(total=total, utilization=cfg.gpu_memory_utilization, weights=weights, reserve=reserve, **kv)
        if loaded:  # the weights are resident: what is in use now is measured
            plan = memory.plan_gpu(used=total - free, model_max_len=self.max_model_len, **gpu)
        else:
            plan = memory.plan_gpu_start(
                free=free, quantization=cfg.quantization, model_max_len=spec.max_position_embeddings, **gpu
            )
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
