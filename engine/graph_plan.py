"""When CUDA graphs run and at which shapes they are captured: rules the memory planner (engine/memory.py, which
re-exports them) and the engine's start share. Pure arithmetic on the config, no torch."""

from __future__ import annotations


def graph_buckets(max_num_seqs: int) -> tuple[int, ...]:
    """The decode batch sizes engine/cuda_graphs.py captures: 1, 2, 4, 8, then steps of 8, and max_num_seqs last."""
    small = [b for b in (1, 2, 4, 8) if b < max_num_seqs]
    return tuple(small + list(range(16, max_num_seqs, 8)) + [max_num_seqs])


# The longest query a graph is captured for: engine/layers/attention.py's PREFILL_TILE_MIN_QUERY (tests/test_memory.py
# checks they agree). Up to it a step takes the paged decode kernel, whose metadata a graph holds static; a verify
# step of more tokens per sequence (k >= 16, unusual) runs eagerly
GRAPH_MAX_QUERY = 16
# A draft model's graphs: its one-token steps, and the catch-up of a sequence that speculated in the last step (the
# target's token after the accepted drafts, and the last accepted draft when all k were: one or two tokens)
DRAFT_GRAPH_QUERY_LENS = (1, 2)


def graph_query_lens(cfg) -> tuple[int, ...]:
    """The query lengths the target's graphs are captured for: 1 (decode), and with speculation k + 1 (verification:
    each speculating sequence's last token and its k drafts; a sequence with fewer is padded), where k + 1 <=
    GRAPH_MAX_QUERY."""
    k = cfg.speculative_config.num_speculative_tokens if cfg.speculative_config is not None else 0
    return (1, k + 1) if 0 < k < GRAPH_MAX_QUERY else (1,)


def graphs_unusable(cfg, device_type: str, kernel_backend: str) -> str | None:
    """Why CUDA graphs cannot run with this configuration on this device (None: they can). kernel_backend "auto"
    is Triton on CUDA, as the engine resolves it."""
    if kernel_backend == "auto":
        kernel_backend = "triton" if device_type == "cuda" else "torch"
    if device_type != "cuda":
        return f"CUDA graphs need a CUDA device, and this engine runs on {device_type}"
    if kernel_backend != "triton":
        return "the graphs capture the Triton kernels, and KERNEL_BACKEND=torch runs the torch references"
    if cfg.tensor_parallel_size > 1:
        return "graphs are captured on one GPU only, and TENSOR_PARALLEL_SIZE > 1"
    return None


def cuda_graphs(cfg, device_type: str, kernel_backend: str) -> bool:
    """Whether decode and verify steps (and a draft model's steps) run from CUDA graphs (LLMEngine.graphs_enabled),
    and so whether their pools are planned: ENFORCE_EAGER=false, on CUDA, with the Triton kernels, on one GPU."""
    return not cfg.enforce_eager and graphs_unusable(cfg, device_type, kernel_backend) is None
