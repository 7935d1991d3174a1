"""The memory planner: how many bytes the weights, the KV pool and a step's activations take, and how large the KV
pool may be. Pure arithmetic on plain numbers (no torch, no device calls). engine.startup.plan_memory applies it
to the engine's whole configuration (engine_needs: LoRA slots, a draft model, tensor parallelism, fp8, the CUDA
graph pools, the target's and a draft model's, where cuda_graphs says graphs run); the engine's start calls it with
the device's numbers and `python -m warmup.plan` with simulated ones, so both get the same answer.

GPU_MEMORY_UTILIZATION has vLLM's meaning: the fraction of the device's total memory this worker may use for
everything (weights, KV, activations, sampler buffers, LoRA slots, the CUDA graph pools, workspace). The pool is
what is left of that budget once the weights are resident and the activation reserve is set aside:

    kv = total x utilization - used (measured after the load: weights, CUDA context, other processes) - reserve

Before anything is allocated the same budget is predicted from the weights' size, so a model that cannot fit is
refused with its numbers instead of running out of memory halfway through the start."""

from __future__ import annotations

from dataclasses import asdict, dataclass

from engine.errors import ConfigError
from engine.graph_plan import (  # noqa: F401 - also the planner's: when graphs run, which shapes they are captured at
    DRAFT_GRAPH_QUERY_LENS,
    GRAPH_MAX_QUERY,
    cuda_graphs,
    graph_buckets,
    graph_query_lens,
    graphs_unusable,
)
from engine.parallel import shard
from engine.quant.sizes import linear_shapes, quantized_bytes

GIB = 2**30
CUDA_CONTEXT_BYTES = 512 << 20  # predicted before the load (CUDA context, cuBLAS workspace); measured after it
# NCCL's communicator buffers, allocated at the first collective (after the pool is sized): held back per rank
TP_COMM_BYTES = 1 << 30


def kv_bytes_per_token(spec, kv_dtype_bytes: int) -> int:
    """2 (K and V) x layers x kv_heads x head_dim x bytes (a hybrid's attention layers only)."""
    return 2 * spec.num_kv_layers * spec.num_kv_heads * spec.head_dim * kv_dtype_bytes


def weight_bytes(spec, dtype_bytes: int, quantization: str | None, packed: bool = True) -> int:
    """Bytes of the weights as the engine holds them. fp8: the linear layers at 1 byte plus one fp32 scale per
    output channel; embeddings, lm_head and norms stay in the model dtype (as vLLM). A quantized checkpoint in its
    own layout (packed: where the Triton kernels run it) counts its real bytes (quantized_bytes); dequantized at
    load (CPU) it is a 16-bit model."""
    q = getattr(spec, "quant", None)
    own_layout = q is not None and (q.kind == "int" or q.strategy == "block")
    if own_layout and packed:
        return quantized_bytes(spec, dtype_bytes, q)
    if getattr(spec, "mxfp4", False) and spec.keeps_mxfp4(packed, quantization):  # GPT-OSS's experts, 4-bit
        moe_layers = sum(spec.is_moe(layer) for layer in range(spec.num_layers))
        experts = moe_layers * spec.num_experts * 3 * spec.hidden_size * spec.moe_intermediate_size
        return experts * 17 // 32 + (spec.num_params() - experts) * dtype_bytes  # 4 bits + an 8-bit scale per 32
    if own_layout or (quantization != "fp8" and q is None):
        return spec.num_params() * dtype_bytes
    linear = scales = 0
    for layer in range(spec.num_layers):
        moe = getattr(spec, "is_moe", lambda _: False)(layer)
        shapes = linear_shapes(spec, layer)[:2] if moe else linear_shapes(spec, layer)  # a MoE layer's: its experts
        linear += sum(i * o for i, o, _ in shapes)
        scales += sum(o for _, o, _ in shapes) * 4
        if moe:  # every expert's gate, up and down in fp8, with per-expert per-channel scales
            e, h, inter = spec.num_experts, spec.hidden_size, spec.moe_intermediate_size
            linear += e * 3 * h * inter
            scales += e * (2 * inter + h) * 4
    return linear + scales + (spec.num_params() - linear) * dtype_bytes


def lora_bytes(spec, max_loras: int, max_rank: int, dtype_bytes: int) -> int:
    """The LoRA slots: A [L, S, n*R, in] and B [L, S, out, n*R] per fused linear."""
    per_slot = sum(n * max_rank * (i + o) for i, o, n in linear_shapes(spec))
    return spec.num_layers * max_loras * per_slot * dtype_bytes


def graph_pool_bytes(spec, max_num_seqs: int, dtype_bytes: int, query_lens: tuple[int, ...] = (1,)) -> int:
    """One model's CUDA graph pool: all its graphs share it, so it holds the activations of the largest one (the
    activation_reserve terms at T = max_num_seqs x the longest query, with the split scratch counted per token) plus
    every graph's output (each bucket at each query length), doubled like the reserve."""
    tokens = max_num_seqs * max(query_lens)
    outputs = sum(graph_buckets(max_num_seqs)) * sum(query_lens) * spec.hidden_size * dtype_bytes
    return 2 * (_step_bytes(spec, tokens, tokens, dtype_bytes) + outputs)


def _step_bytes(spec, tokens: int, rows: int, dtype_bytes: int) -> int:
    """One layer's activations for `tokens` tokens (activation_reserve lists the terms), plus flash-decoding's fp32
    split scratch for `rows` sequences."""
    h, i = spec.hidden_size, spec.intermediate_size
    qkv = (spec.num_heads + 2 * spec.num_kv_heads) * spec.head_dim
    per_layer = (4 * h + qkv + 3 * i) * tokens * dtype_bytes + tokens * (max(h, i) + 4)
    return per_layer + 32 * rows * spec.num_heads * (spec.head_dim + 2) * 4


def tp_reserve(spec, full_vocab: int, tp: int, logits_rows: int) -> int:
    """What tensor parallelism adds to one rank's reserve: rank 0's logits are the full vocabulary's (gathered, then
    sampled), not its shard's (as activation_reserve counts logits: three copies, doubled), plus the gather's
    buffers, and NCCL's buffers come after the pool is sized. logits_rows: as activation_reserve's."""
    if tp == 1:
        return 0
    logits = 2 * 3 * logits_rows * (full_vocab - spec.vocab_size) * 4 + logits_rows * full_vocab * 4
    return TP_COMM_BYTES + logits


def sampled_rows(max_num_seqs: int, num_speculative_tokens: int) -> int:
    """The most logits rows one step samples or verifies: one per sequence, or with speculation each sequence's k
    drafts and the token after them. (Prompt logprobs are computed in slices of at most max_num_seqs rows.)"""
    return max_num_seqs * (num_speculative_tokens + 1)


def activation_reserve(
    spec,
    max_num_batched_tokens: int,
    max_num_seqs: int,
    dtype_bytes: int,
    *,
    lora: tuple[int, int] | None = None,
    graph_pool_bytes: int = 0,
    logits_rows: int | None = None,
) -> int:
    """Bytes a step may need beyond the weights and the KV pool, by formula (no profiling run: the cold start
    matters more). T = max_num_batched_tokens tokens through one layer at a time:
    - hidden states and the residual, the fused qkv output, attention output: (4 x hidden + qkv width) x T;
    - the MLP: gate_up (2 x intermediate) and its activation (intermediate): 3 x intermediate x T;
    - fp8 activation copies and per-token scales (at most the widest input), and flash-decoding's fp32 split
      scratch (32 splits x max_num_seqs x heads x (head_dim + 2));
    - the sampler: fp32 logits of `logits_rows` rows (sampled_rows: max_num_seqs, or with speculation each
      sequence's k + 1 verified rows), three times over (logits, probabilities, a sorted copy);
    - LoRA slots (lora = (max_loras, max_lora_rank)) and the CUDA graph pool.
    Doubled for the allocator's rounding and fragmentation."""
    t = max_num_batched_tokens
    logits = 3 * (logits_rows or max_num_seqs) * spec.vocab_size * 4
    lora_b = lora_bytes(spec, lora[0], lora[1], dtype_bytes) + t * 4 * lora[1] * 4 if lora else 0
    return 2 * (_step_bytes(spec, t, max_num_seqs, dtype_bytes) + logits) + lora_b + graph_pool_bytes


@dataclass(frozen=True)
class GPU:
    """One device's numbers as the planner takes them: torch.cuda's at the engine's start, simulated ones in
    `python -m warmup.plan`."""

    total: int  # bytes
    free: int  # bytes free now (before the load: other processes' use; after it: the weights' too)
    capability: tuple[int, int] | None = None  # None: not known, fp8 support is not checked
    name: str = "GPU"


@dataclass(frozen=True)
class Needs:
    """What the engine's configuration asks of one rank's device besides the KV pool (bytes)."""

    weight_bytes: int  # the rank's shard of the target, plus the draft model (whole, on rank 0)
    draft_weight_bytes: int  # loaded after the pool is sized: held back from it once the target's are measured
    kv_bytes_per_token: int  # the rank's KV heads, plus the draft's KV (model dtype) under the same block ids
    # activations, verified logits rows, LoRA slots, the CUDA graph pool, TP's logits and NCCL, the draft's step
    reserve_bytes: int
    graph_pool_bytes: int  # the target's graph pool and the draft model's (in reserve_bytes already)
    state_bytes: int = 0  # a hybrid model's state pool: max_num_seqs slots (engine/state_cache.py)


def engine_needs(cfg, spec, dtype_bytes: int, *, graphs: bool, draft_spec=None, packed: bool = True) -> Needs:
    """One rank's needs for EngineConfig `cfg`, the full model `spec` (sharded here by cfg.tensor_parallel_size;
    refused with the reason when it cannot be), the model dtype's bytes, whether CUDA graphs run (cuda_graphs) and
    the draft model's spec, if any."""
    tp, seqs, tokens = cfg.tensor_parallel_size, cfg.max_num_seqs, cfg.max_num_batched_tokens
    shard.check(spec, tp)
    local = shard.local_spec(spec, tp)
    weights = weight_bytes(local, dtype_bytes, cfg.quantization, packed)
    per_token = kv_bytes_per_token(local, 1 if cfg.kv_cache_dtype.startswith("fp8") else dtype_bytes)
    graph_pool = graph_pool_bytes(local, seqs, dtype_bytes, graph_query_lens(cfg)) if graphs else 0
    lora = (cfg.max_loras, cfg.max_lora_rank) if cfg.enable_lora else None
    k = cfg.speculative_config.num_speculative_tokens if cfg.speculative_config is not None else 0
    rows = sampled_rows(seqs, k)
    reserve = activation_reserve(
        local, tokens, seqs, dtype_bytes, lora=lora, graph_pool_bytes=graph_pool, logits_rows=rows
    )
    reserve += tp_reserve(local, spec.vocab_size, tp, rows)
    draft_w = 0
    if draft_spec is not None:  # its KV for every token of the target's blocks, a step of its own, its graphs
        draft_w = weight_bytes(draft_spec, dtype_bytes, None)
        per_token += kv_bytes_per_token(draft_spec, dtype_bytes)
        draft_pool = graph_pool_bytes(draft_spec, seqs, dtype_bytes, DRAFT_GRAPH_QUERY_LENS) if graphs else 0
        reserve += activation_reserve(draft_spec, tokens, seqs, dtype_bytes, graph_pool_bytes=draft_pool)
        reserve += seqs * k * draft_spec.vocab_size * 4  # sampled drafts' q rows, kept until they are verified
        graph_pool += draft_pool
    state = (seqs + graphs) * local.state_bytes_per_seq(dtype_bytes)  # a hybrid's slots (graphs: and a spare)
    return Needs(weights + draft_w, draft_w, per_token, reserve, graph_pool, state)


@dataclass(frozen=True)
class MemoryPlan:
    """What fits: the KV pool and the longest context, with the numbers behind them (bytes)."""

    budget_bytes: int  # total x utilization (GPU), or the KV budget (CPU)
    kv_budget_bytes: int  # what the pool may take: budget - used - reserve (GPU)
    weight_bytes: int
    used_bytes: int  # on the device before the pool: weights, CUDA context, other processes (GPU)
    activation_reserve_bytes: int
    kv_bytes_per_token: int
    block_size: int
    num_blocks: int
    max_model_len: int
    sized_by: str = ""  # CPU: how an automatic pool was sized (engine/host_memory.py), for the start-up log
    state_bytes: int = 0  # a hybrid model's state pool (fixed: state_slots sequences), set aside before the KV
    state_slots: int = 0

    @property
    def kv_tokens(self) -> int:
        return self.num_blocks * self.block_size

    @property
    def kv_bytes(self) -> int:
        return self.kv_tokens * self.kv_bytes_per_token

    @property
    def max_concurrent_seqs(self) -> float:
        return self.kv_tokens / self.max_model_len

    def tokens_with(self, kv_bytes_per_token: int) -> int:
        """KV tokens the same byte budget holds at another KV dtype (the start-up log's comparison; no device call)."""
        return max(self.kv_budget_bytes // (kv_bytes_per_token * self.block_size), 0) * self.block_size

    def describe(self) -> str:
        return (
            f"KV cache: {self.num_blocks} blocks x {self.block_size} = {self.kv_tokens} tokens, "
            f"{self.kv_bytes_per_token} B/token ({self.kv_bytes / 2**20:.0f} MiB), {self.max_concurrent_seqs:.1f} "
            f"concurrent sequences at max_model_len={self.max_model_len}"
            + (f"; activation reserve {_gib(self.activation_reserve_bytes)}" if self.activation_reserve_bytes else "")
            + (
                f"; state pool {self.state_bytes / 2**20:.0f} MiB for {self.state_slots} sequences"
                if self.state_bytes
                else ""
            )  # fmt: skip
            + (f"; {self.sized_by}" if self.sized_by else "")
        )

    def as_dict(self) -> dict:
        return asdict(self) | {
            "kv_tokens": self.kv_tokens,
            "kv_bytes": self.kv_bytes,
            "max_concurrent_seqs": round(self.max_concurrent_seqs, 2),
        }


def plan(
    *,
    kv_budget: int,
    kv_bytes_per_token: int,
    block_size: int,
    model_max_len: int,
    max_model_len: int | None = None,
    num_blocks: int | None = None,
    budget: int = 0,
    weights: int = 0,
    used: int = 0,
    reserve: int = 0,
    fix: str = "",
) -> MemoryPlan:
    """The pool from `kv_budget` bytes (or exactly `num_blocks`) and the context length: max_model_len, or else
    min(the model's limit, the pool). Raises ConfigError naming the numbers when nothing fits; `fix` is what
    would (appended to the error)."""
    per_block = kv_bytes_per_token * block_size
    blocks = num_blocks if num_blocks is not None else max(kv_budget // per_block, 0)
    tokens = blocks * block_size
    if max_model_len is not None and max_model_len > model_max_len:
        raise ConfigError(f"max_model_len={max_model_len} exceeds the model's max_position_embeddings={model_max_len}")
    if blocks < 1:
        raise ConfigError(
            f"no KV block fits: {_gib(kv_budget)} left for the KV cache after {_gib(used)} in use and "
            f"{_gib(reserve)} kept for activations, of a {_gib(budget)} budget; one block of "
            f"{block_size} tokens needs {per_block:,} B.{fix}"
        )
    if max_model_len is not None and max_model_len > tokens:
        raise ConfigError(
            f"max_model_len={max_model_len} is larger than the KV cache: {tokens} tokens "
            f"({blocks} blocks, {_gib(tokens * kv_bytes_per_token)}) fit, so the largest "
            f"max_model_len that fits is {tokens}. Lower MAX_MODEL_LEN.{fix}"
        )
    length = max_model_len if max_model_len is not None else min(model_max_len, tokens)
    return MemoryPlan(budget, kv_budget, weights, used, reserve, kv_bytes_per_token, block_size, blocks, length)


def plan_gpu(
    *,
    total: int,
    utilization: float,
    used: int,
    weights: int,
    reserve: int,
    kv_bytes_per_token: int,
    block_size: int,
    model_max_len: int,
    max_model_len: int | None = None,
    num_blocks: int | None = None,
    quantized: bool = False,
    also: str = "",
) -> MemoryPlan:
    """The pool on a GPU once the weights are resident: `used` = total - free, measured now. quantized: the
    weights are fp8 or a quantized checkpoint already (QUANTIZATION=fp8 is not suggested). also: another fix to
    suggest when nothing fits."""
    budget = int(total * utilization)
    fix = " It would fit with " + ("" if quantized else "QUANTIZATION=fp8, ")
    fix += "KV_CACHE_DTYPE=fp8, a larger GPU_MEMORY_UTILIZATION, or more GPUs." + also
    return plan(
        kv_budget=budget - used - reserve,
        kv_bytes_per_token=kv_bytes_per_token,
        block_size=block_size,
        model_max_len=model_max_len,
        max_model_len=max_model_len,
        num_blocks=num_blocks,
        budget=budget,
        weights=weights,
        used=used,
        reserve=reserve,
        fix=fix,
    )


def plan_gpu_start(
    *,
    total: int,
    free: int,
    utilization: float,
    weights: int,
    reserve: int,
    quantized: bool,
    kv_bytes_per_token: int,
    block_size: int,
    model_max_len: int,
    max_model_len: int | None = None,
    num_blocks: int | None = None,
    also: str = "",
    state: tuple[int, int, int] = (0, 0, 0),
) -> MemoryPlan:
    """Before the load (the engine's start, and `python -m warmup.plan`): refuse weights that cannot fit, then
    predict the pool with the weights and the CUDA context counted as in use. state: a hybrid's state pool (bytes,
    sequences, and the KV of one full context: what a smaller MAX_NUM_SEQS must still leave), set aside before the
    KV pool."""
    if num_blocks is None:
        check_weights_fit(total=total, free=free, utilization=utilization, weights=weights, reserve=reserve,
                          quantized=quantized, state=state)  # fmt: skip
    # a fixed pool (num_kv_blocks) overrides GPU_MEMORY_UTILIZATION (processes sharing a GPU): it must fit what is free
    elif (need := weights + reserve + state[0] + CUDA_CONTEXT_BYTES + num_blocks * block_size * kv_bytes_per_token
          ) > free:  # fmt: skip
        raise ConfigError(f"a fixed KV pool of {num_blocks} blocks with the weights needs {_gib(need)}, and the "
                          f"device has {_gib(free)} free of {_gib(total)}")  # fmt: skip
    return plan_gpu(
        total=total,
        utilization=utilization,
        used=total - free + weights + CUDA_CONTEXT_BYTES,
        weights=weights,
        reserve=reserve + state[0],
        kv_bytes_per_token=kv_bytes_per_token,
        block_size=block_size,
        model_max_len=model_max_len,
        max_model_len=max_model_len,
        num_blocks=num_blocks,
        quantized=quantized,
        also=also,
    )


def check_weights_fit(
    *, total: int, free: int, utilization: float, weights: int, reserve: int, quantized: bool, state=(0, 0, 0)
) -> None:
    """Before anything is allocated: refuse a model whose weights, with the activation reserve, a hybrid's state
    pool (state: bytes, sequences) and the CUDA context, cannot fit the budget. The error names the numbers and
    what would fit."""
    budget, in_use = int(total * utilization), total - free
    need = in_use + weights + reserve + state[0] + CUDA_CONTEXT_BYTES
    if need <= budget:
        return
    hints = [] if quantized else ["QUANTIZATION=fp8 (about half the weight bytes)"]
    per_seq = state[0] // state[1] if state[0] else 0
    if per_seq and (seqs := (budget - need + state[0] - state[2]) // per_seq) >= 1:  # fewer states, and one context
        hints.append(f"MAX_NUM_SEQS={seqs} or fewer (each sequence's state takes {per_seq / 2**20:.0f} MiB)")
    if need <= 0.98 * total:
        hints.append(f"GPU_MEMORY_UTILIZATION={-(-100 * need // total) / 100:.2f} or more")
    hints.append("a GPU with more memory, or more GPUs")
    raise ConfigError(
        f"the model does not fit: its weights take {_gib(weights)}, plus {_gib(reserve)} kept for activations"
        + (f", {_gib(state[0])} for {state[1]} sequences' linear-attention state" if state[0] else "")
        + f" and {_gib(CUDA_CONTEXT_BYTES)} for the CUDA context, with {_gib(in_use)} of the "
        f"device already in use, against a budget of {_gib(budget)} (GPU_MEMORY_UTILIZATION="
        f"{utilization:g} x {_gib(total)}). What would fit: {'; '.join(hints)}."
    )


def _gib(n: int) -> str:
    return f"{n / GIB:.2f} GiB"
