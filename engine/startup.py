"""The cold start as functions that return values, in the order LLMEngine.__init__ calls them: what the config
files say (`resolve` -> ModelFacts), the memory plan (`device_plan` -> MemoryPlan; engine/memory.py does the
arithmetic), one rank's weights (`load_rank`), then its runner (`build_rank`: KV pool, attention with fp8 KV scales,
LoRA slots, CUDA graphs). Every tensor-parallel rank starts with the same resolve, load_rank and build_rank
(engine/parallel/worker.py). `plan_memory`, `memory_needs` and `draft_model` are also what `python -m warmup.plan`
calls, with simulated numbers."""

from __future__ import annotations

import dataclasses
import functools
import gc
import logging
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import torch

import kernels
from engine import memory
from engine.block_manager import BlockManager
from engine.config import EngineConfig
from engine.cpu_native import native_dir, start_cpu
from engine.cuda_graphs import IdleWork, cuda_graph_factory
from engine.device import check_fp8_support, cuda_driver_version, gpu_line, model_dtype
from engine.errors import ConfigError
from engine.host_memory import HostMemory, cpu_pool_bytes, read_host_memory
from engine.kv_cache import CALIBRATION_TEXT, Prefaulter, allocate, growth_chunk, kv_scales
from engine.layers.attention import build_attention
from engine.lora.manager import LoRASlots
from engine.memory import MemoryPlan
from engine.model_runner import ModelRunner
from engine.models.qwen3_next import refuse_for_hybrid
from engine.models.spec import ModelSpec
from engine.parallel import shard
from engine.parallel.rank import rank_model
from engine.scheduler import Scheduler
from engine.state_cache import StatePool
from engine.state_slots import StateSlots
from engine.tokenizer import Tokenizer
from engine.weights import LoadedWeights, load_model, read_json, resolve_model_path, safetensors_files

log = logging.getLogger("engine")


@dataclass(frozen=True)
class ModelFacts:
    """What one rank's start knows from the config files alone, before a weight is read."""

    path: Path  # the model's folder
    spec: ModelSpec  # the whole model
    rank_spec: ModelSpec  # the shapes this rank holds (all of them at tensor_parallel_size 1)
    rank: int
    device: torch.device
    dtype: torch.dtype  # the model's
    kv_dtype: torch.dtype  # the KV pool's: fp8 e4m3 with KV_CACHE_DTYPE=fp8, else the model's
    kernel_backend: str  # "triton" or "torch"
    draft_path: Path | None = None  # speculative decoding's draft model (rank 0's only); its bytes are planned too
    draft_spec: ModelSpec | None = None
    host: HostMemory | None = None  # CPU: the memory available at start, which an automatic KV pool is sized from


def resolve(cfg: EngineConfig, rank: int = 0) -> ModelFacts:
    """Rank `rank`'s ModelFacts; refuses a pickle-only checkpoint and a tensor-parallel size the model or the
    machine cannot take, before anything is loaded."""
    device = rank_device(cfg, rank)
    path = resolve_model_path(cfg)
    safetensors_files(path)  # refuse pickle-only checkpoints before anything else
    hf_cfg = read_json(path / "config.json")
    spec = ModelSpec.from_hf(hf_cfg, read_json(path / "generation_config.json"), cfg.quantization)
    if spec.hybrid:
        refuse_for_hybrid(cfg, spec)
    cuda = device.type == "cuda"
    shard.check(spec, cfg.tensor_parallel_size, torch.cuda.device_count() if cuda else None)
    if cuda and rank == 0:  # configs read, nothing loaded yet
        props = torch.cuda.get_device_properties(device)
        cap = (props.major, props.minor)
        log.info("%s", gpu_line(props.name, cap, props.total_memory, torch.version.cuda, cuda_driver_version()))
    dtype = model_dtype(cfg.dtype, hf_cfg, device.type)
    draft_path, draft_spec = draft_model(cfg) if rank == 0 else (None, None)  # the draft runs on rank 0
    return ModelFacts(
        path=path,
        spec=spec,
        rank_spec=shard.local_spec(spec, cfg.tensor_parallel_size),
        rank=rank,
        device=device,
        dtype=dtype,
        kv_dtype=torch.float8_e4m3fn if cfg.kv_cache_dtype.startswith("fp8") else dtype,
        # triton on CUDA; on CPU only when forced (it then needs TRITON_INTERPRET=1, as the tests set)
        kernel_backend=cfg.kernel_backend if cfg.kernel_backend != "auto" else ("triton" if cuda else "torch"),
        draft_path=draft_path,
        draft_spec=draft_spec,
        host=read_host_memory() if not cuda else None,  # read once: the plans before and after the load agree
    )


def rank_device(cfg: EngineConfig, rank: int) -> torch.device:
    """EngineConfig.device ("auto": CUDA when there is one); under tensor parallelism rank r runs on cuda:r."""
    dev = torch.device(cfg.device if cfg.device != "auto" else ("cuda" if torch.cuda.is_available() else "cpu"))
    if cfg.tensor_parallel_size == 1 or dev.type != "cuda":
        return dev
    if dev.index not in (None, 0):
        raise ConfigError(
            f"EngineConfig.device={cfg.device!r}: with tensor_parallel_size={cfg.tensor_parallel_size} rank r runs "
            "on cuda:r; use device cuda (or cuda:0), and CUDA_VISIBLE_DEVICES to choose the GPUs",
            field="device",
        )
    return torch.device("cuda", rank) if rank else dev


def open_tokenizer(cfg: EngineConfig, facts: ModelFacts) -> tuple[Tokenizer, frozenset[int]]:
    """The engine's tokenizer (Rust; transformers only if asked for), and the tokens that end a sequence: the
    generation config's EOS ids and the tokenizer's."""
    tok = Tokenizer(cfg.tokenizer or facts.path)
    eos = set(facts.spec.eos_token_ids) | ({tok.eos_token_id} if tok.eos_token_id is not None else set())
    return tok, frozenset(eos)


def device_plan(cfg: EngineConfig, facts: ModelFacts, loaded_len: int | None = None) -> MemoryPlan:
    """The KV pool and context length on this device (plan_memory). CPU: from KV_CACHE_MEMORY, or automatic from
    facts.host (engine/host_memory.py), the same plan before and after the load. CUDA: before the load (loaded_len
    None), refuse what cannot fit and predict the rest; after it (loaded_len: the context the model was built for),
    plan from the memory measured now."""
    if loaded_len is None:
        _say_what_is_ignored(cfg, facts)
    gpu = None
    if facts.device.type == "cuda":
        gc.collect()  # an engine dropped earlier in this process, and blocks freed while loading: back to the device
        torch.cuda.empty_cache()  # (torch's cache would count them as in use)
        free, total = torch.cuda.mem_get_info(facts.device)
        props = torch.cuda.get_device_properties(facts.device)
        gpu = memory.GPU(total, free, (props.major, props.minor), props.name)
    plan = plan_memory(
        cfg,
        facts.spec,
        gpu,
        facts.dtype,
        draft_spec=facts.draft_spec,
        kernel_backend=facts.kernel_backend,
        loaded_len=loaded_len,
        host=facts.host,
    )
    if gpu is not None:
        log.info("memory plan (%s): %s", "predicted" if loaded_len is None else "measured", plan.as_dict())
    return plan


def _say_what_is_ignored(cfg: EngineConfig, facts: ModelFacts) -> None:
    """Settings for another kind of device, or that cannot work here: said once, at start."""
    default, kind = EngineConfig(), facts.device.type
    if kind != "cuda" and cfg.gpu_memory_utilization != default.gpu_memory_utilization:
        log.warning("GPU_MEMORY_UTILIZATION is ignored on %s: the KV pool is KV_CACHE_MEMORY (or automatic)", kind)
    if kind == "cuda" and cfg.kv_cache_memory is not None:
        log.warning("KV_CACHE_MEMORY is ignored on CUDA: the pool is sized by GPU_MEMORY_UTILIZATION")
    if not cfg.enforce_eager and (why := memory.graphs_unusable(cfg, kind, facts.kernel_backend)):
        log.warning("ENFORCE_EAGER=false is ignored: %s; decode steps run eagerly", why)
    if facts.spec.hybrid and cfg.enable_prefix_caching:
        log.info("prefix caching is off for %s: a hybrid model's linear layers keep a state per sequence, not per "
                 "block (docs/decisions.md, \"Hybrid models\")", facts.spec.architecture)  # fmt: skip


def load_rank(
    cfg: EngineConfig, facts: ModelFacts, max_positions: int, on_built: Callable[[], object] = lambda: None
) -> tuple[torch.nn.Module, LoadedWeights]:
    """This rank's model, built for contexts up to `max_positions` (then `on_built()`), and filled: its shard of the
    checkpoint, or the fp8 snapshot (engine/weights/load.py)."""
    build = functools.partial(
        rank_model, facts.spec, facts.rank, cfg.tensor_parallel_size, facts.dtype, facts.device, max_positions,
        cfg.quantization, facts.kernel_backend == "triton",
    )  # fmt: skip
    return load_model(cfg, facts.path, facts.spec.prequantized, build, facts.device, facts.dtype, on_built)


def calibration_ids(facts: ModelFacts, model, tok: Tokenizer, max_len: int) -> list[int] | None:
    """The tokens fp8 KV scales are calibrated on; None when the checkpoint has every layer's (or KV is 16-bit)."""
    ck = model.checkpoint_kv_scales
    if facts.kv_dtype != torch.float8_e4m3fn or (
        len(ck) == facts.spec.num_kv_layers and all(set(v) == {"k", "v"} for v in ck.values())
    ):
        return None
    return tok.encode(CALIBRATION_TEXT)[:max_len]


def kv_prefaulter(cfg: EngineConfig, facts: ModelFacts, plan: MemoryPlan) -> Prefaulter | None:
    """CPU: what faults the pools' pages in (engine/kv_cache.py), a chunk ahead of the block manager's open region
    (growth_chunk blocks; a fixed num_kv_blocks pool is open and populated whole). None on CUDA: device memory is
    the pool's from the start."""
    if facts.device.type == "cuda":
        return None
    return Prefaulter(plan.num_blocks, growth_chunk(plan) if cfg.num_kv_blocks is None else None)


def early_pool(cfg: EngineConfig, facts: ModelFacts, plan: MemoryPlan) -> tuple[Prefaulter | None, torch.Tensor | None]:
    """CPU: the prefaulter and the KV pool, made before the weights are read (the CPU plan does not depend on them),
    so that the pool's first chunks fault in on the core the start leaves idle while the tokenizer loads (which
    holds the GIL; the prefault thread does not need it). Made after the weights, that fault-in met the first
    token: its first matmul took 50-60 ms instead of 2 here, an OpenMP region waiting for a core. CUDA: (None,
    None): the pool is sized from the memory left after the load."""
    pf = kv_prefaulter(cfg, facts, plan)
    return (pf, allocate(facts.rank_spec, plan, facts.kv_dtype, facts.device, pf)) if pf is not None else (None, None)


def idle_work(cfg: EngineConfig, facts: ModelFacts, runner: ModelRunner, grammar, draft, tok) -> IdleWork:
    """What runs after ready, in the loop's idle gaps and its share of busy time: the chat templates' compiles, the
    Triton kernel warm steps on one GPU (they run on rank 0 alone), the grammar mask's, then the CUDA graph
    captures, a draft model's included."""
    one_gpu = facts.device.type == "cuda" and cfg.tensor_parallel_size == 1
    draft = getattr(draft, "runner", None)
    return IdleWork(runner, warm_kernels=one_gpu, grammar=grammar, draft=draft, host=tok.warm_pieces())


def pool_note(plan: MemoryPlan, prefault: Prefaulter | None) -> str:
    """The timeline's note on the KV pool: its size, and on CPU that it is address space opened by chunks."""
    opened = f" of address space, opened {prefault.chunk} blocks at a time" if prefault and prefault.chunk else ""
    return f"{plan.num_blocks} blocks, {plan.kv_bytes / 2**20:.0f} MiB{opened}"


def block_manager(cfg: EngineConfig, plan: MemoryPlan, prefault: Prefaulter | None) -> BlockManager:
    """The pool's block ids: on CPU handed out from an open region that grows by the prefaulter's chunks (which it
    faults in ahead of the region); on CUDA all open."""
    growth = (prefault.chunk, prefault.open) if prefault is not None else (None, None)
    return BlockManager(plan.num_blocks, cfg.block_size, *growth)


def scheduler(cfg: EngineConfig, facts: ModelFacts, plan: MemoryPlan, bm: BlockManager, lora, speculator) -> Scheduler:
    """The scheduler: LoRA's admission gate, speculation's lookahead, a hybrid's state slots (one a running request)."""
    return Scheduler(
        bm, cfg.max_num_seqs, cfg.max_num_batched_tokens, plan.max_model_len, cfg.long_prefill_token_threshold,
        admission=lora, lookahead=speculator.lookahead,
        state_slots=StateSlots(cfg.max_num_seqs) if facts.spec.hybrid else None,
    )  # fmt: skip


def build_rank(
    cfg: EngineConfig,
    facts: ModelFacts,
    model,
    plan: MemoryPlan,
    calibration: list[int] | None,
    prefault: Prefaulter | None = None,
    kv: torch.Tensor | None = None,
) -> ModelRunner:
    """This rank's runner around its loaded model: the KV pool the plan sized (on CPU, faulted in by `prefault`),
    attention with fp8 KV scales (the checkpoint's, or calibrated on `calibration`: under tensor parallelism in one
    forward with the other ranks), LoRA slots when LoRA is on, and CUDA graphs where they run (captured after ready
    by IdleWork, idle or busy)."""
    if facts.kernel_backend == "triton":
        kernels.load_triton()  # imports triton (about 0.3 s): the torch path never does
    if kv is None:  # (rank 0 on CPU made it early: early_pool)
        kv = allocate(facts.rank_spec, plan, facts.kv_dtype, facts.device, prefault)
    start_cpu(cfg, facts, wait=True)
    attn = build_attention(facts.rank_spec, cfg.block_size, facts.kernel_backend, native_dir(cfg, facts.device))
    if facts.kv_dtype == torch.float8_e4m3fn:
        attn.set_kv_scales(*kv_scales(model, calibration, facts.device))
    lora = None
    if cfg.enable_lora:
        lora = LoRASlots(cfg.max_loras, cfg.max_lora_rank, facts.rank_spec, facts.dtype, facts.device)
    graphs = memory.cuda_graphs(cfg, facts.device.type, facts.kernel_backend)
    # a hybrid's state pool, with a spare slot for CUDA graphs' padding sequences where graphs run
    hybrid = facts.spec.hybrid
    state = StatePool(facts.rank_spec, cfg.max_num_seqs, facts.dtype, facts.device, spare=graphs) if hybrid else None
    return ModelRunner(
        model, kv, attn, cfg.block_size, facts.device, facts.kernel_backend, lora, cfg.max_num_seqs,
        plan.max_model_len, cuda_graph_factory() if graphs else None, memory.graph_query_lens(cfg), state,
    )  # fmt: skip


def log_ready(cfg: EngineConfig, facts: ModelFacts, plan: MemoryPlan, seconds: float) -> None:
    """The start's last line: the model, the pool's capacity, and what the other KV dtype would hold."""
    other_dtype = facts.dtype if facts.kv_dtype != facts.dtype else torch.float8_e4m3fn
    other = plan.tokens_with(memory.kv_bytes_per_token(facts.rank_spec, other_dtype.itemsize))
    log.info(
        "model %s (%s, %s) on %s in %.1fs; %s [KV %s]%s",
        facts.path,
        facts.spec.architecture,
        str(facts.dtype).removeprefix("torch."),
        facts.device,
        seconds,
        plan.describe(),
        str(facts.kv_dtype).removeprefix("torch."),
        f"; with KV {'fp8' if facts.kv_dtype == facts.dtype else 'auto'} it would be {other} tokens, "
        f"{other / plan.max_model_len:.1f} sequences"
        if cfg.num_kv_blocks is None
        else "",
    )


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
    by the rule build_rank follows. kernel_backend: the engine's (None: cfg.kernel_backend)."""
    backend = kernel_backend or cfg.kernel_backend
    graphs = memory.cuda_graphs(cfg, device_type, backend)
    # a quantized checkpoint stays packed where the Triton kernels run it (engine/models/llama.py)
    packed = backend == "triton" or (backend == "auto" and device_type == "cuda")
    return memory.engine_needs(cfg, spec, dtype.itemsize, graphs=graphs, draft_spec=draft_spec, packed=packed)


def plan_memory(
    cfg: EngineConfig,
    spec: ModelSpec,
    gpu: memory.GPU | None,
    dtype: torch.dtype,
    *,
    draft_spec: ModelSpec | None = None,
    kernel_backend: str | None = None,
    loaded_len: int | None = None,
    host: HostMemory | None = None,
) -> MemoryPlan:
    """The memory plan of one rank for the engine's whole configuration: the engine's start calls it (twice on
    CUDA) and so does `python -m warmup.plan`. `spec`: the full model (sharded by cfg.tensor_parallel_size);
    `gpu` None: CPU, the pool is KV_CACHE_MEMORY, or unset an automatic one sized from `host` (cpu_kv_budget). Before
    the load (loaded_len None): refuse fp8 below capability 8.9 and weights that cannot fit, then predict the pool
    with the weights (the draft's too) and the CUDA context counted as in use. After it (loaded_len: the context the
    model was built for): gpu.free is measured with the target's weights resident, and the draft's, loaded after the
    pool, are held back from it."""
    device_type = "cpu" if gpu is None else "cuda"
    needs = memory_needs(cfg, spec, dtype, device_type, draft_spec=draft_spec, kernel_backend=kernel_backend)
    kv = dict(
        kv_bytes_per_token=needs.kv_bytes_per_token,
        block_size=cfg.block_size,
        max_model_len=cfg.max_model_len,
        num_blocks=cfg.num_kv_blocks,
        weights=needs.weight_bytes,
    )
    # what a plan that does not fit may suggest: QUANTIZATION=fp8 only for a 16-bit checkpoint
    quantized = cfg.quantization == "fp8" or spec.quant is not None
    state = dict(state_bytes=needs.state_bytes, state_slots=cfg.max_num_seqs if needs.state_bytes else 0)
    if gpu is None:
        budget, why = cpu_kv_budget(cfg, spec, needs, host)
        fix = " Or set KV_CACHE_MEMORY (unset, the pool is at most half the memory at start)." if why else ""
        plan = memory.plan(kv_budget=budget, budget=budget, model_max_len=spec.max_position_embeddings, fix=fix, **kv)
        return dataclasses.replace(plan, sized_by=why, **state)  # CPU: the state pool is its own map, beside
    kv |= dict(total=gpu.total, utilization=cfg.gpu_memory_utilization)
    if needs.state_bytes:  # a hybrid's state pool: fixed by max_num_seqs, set aside before the KV pool
        per_seq = needs.state_bytes / cfg.max_num_seqs / 2**20
        kv["also"] = f" Or lower MAX_NUM_SEQS: each sequence's linear-attention state takes {per_seq:.0f} MiB."
    if loaded_len is not None:
        reserve = needs.reserve_bytes + needs.draft_weight_bytes + needs.state_bytes
        plan = memory.plan_gpu(used=gpu.total - gpu.free, reserve=reserve, model_max_len=loaded_len,
                               quantized=quantized, **kv)  # fmt: skip
        return dataclasses.replace(plan, **state)
    if gpu.capability is not None:
        check_fp8_support(cfg, spec.fp8_checkpoint, gpu.name, gpu.capability)
    context = cfg.max_model_len or spec.max_position_embeddings  # a smaller MAX_NUM_SEQS must leave one's KV
    plan = memory.plan_gpu_start(
        free=gpu.free,
        reserve=needs.reserve_bytes,
        state=(needs.state_bytes, cfg.max_num_seqs, needs.kv_bytes_per_token * context),
        quantized=quantized,
        model_max_len=spec.max_position_embeddings,
        **kv,
    )
    return dataclasses.replace(plan, **state)


def cpu_kv_budget(cfg: EngineConfig, spec: ModelSpec, needs: memory.Needs, host: HostMemory | None) -> tuple[int, str]:
    """The CPU pool's bytes: KV_CACHE_MEMORY, or unset room for MAX_NUM_SEQS sequences of the full context
    (MAX_MODEL_LEN, else the model's), capped by the memory at start (engine/host_memory.py); and how it was sized
    ("" when given, or when num_kv_blocks fixes the pool)."""
    if cfg.kv_cache_memory is not None or cfg.num_kv_blocks is not None:
        return cfg.kv_cache_memory or 0, ""
    context = cfg.max_model_len or spec.max_position_embeddings
    return cpu_pool_bytes(
        bytes_per_block=needs.kv_bytes_per_token * cfg.block_size,
        blocks_per_seq=-(-context // cfg.block_size),
        max_num_seqs=cfg.max_num_seqs,
        host=host or HostMemory(None, "the machine's memory not read"),
        ranks=cfg.tensor_parallel_size,
    )
