"""Multi-LoRA deltas for a flat varlen batch (Punica's SGMV/BGMV): Triton kernels, launchers and torch references.

Slot layout, one set of tensors per target projection (q_proj, k_proj, ..., down_proj):
  lora_a [S, R, IN], lora_b [S, OUT, R]: adapters resident in S fixed device slots. R is the largest rank a slot
    may hold; a smaller rank r is zero-padded (rows r: of A and columns r: of B are 0, so they add nothing).
  token_slot [T] int32/int64: the slot of each token of the flat batch, -1 for no adapter (no delta, untouched).
  Scaling: alpha / r (alpha / sqrt(r) for rsLoRA) is folded into B when an adapter is loaded into a slot, so
  the ops take no scale: delta[t] = B[s] @ (A[s] @ x[t]).

Ops:
- lora_shrink(x [T, IN], lora_a, token_slot) -> y [T, R] fp32 (fp32 accumulation; rows of slot -1 are 0).
- lora_expand(y [T, R], lora_b, token_slot, out, offset=0, add=True): out[t, offset:offset+OUT] += B[s] @ y[t]
  (add=False overwrites instead), summed in fp32 with one rounding to out.dtype. Returns out.
- add_lora(out, x, lora_a, lora_b, token_slot, offset=0): both.
Fused projections: qkv's output is [T, q | k | v], so the q adapter is applied with offset=0, k with offset=q,
v with offset=q+kv (each with its own A, B and OUT); gate_up likewise. When the three share R, one stacked
lora_a [S, 3R, IN] does the three shrinks in one call and each expand reads its column slice y[:, iR:(i+1)R]
(row-strided y and out are accepted; only the last dim must be contiguous).

Design:
- Reference (the CPU serving path): tokens grouped by slot with one stable sort and one host sync, then one
  matmul per slot present. A slot whose tokens form one contiguous run (one request, or one adapter for the
  whole batch: the usual cases) is addressed with a slice, so nothing is gathered or scattered.
- Triton (SGMV): tokens sorted by slot on the device (no host sync, CUDA-graph friendly); grid (token tile,
  column tile, slot). A program takes BLOCK_M of its slot's tokens through the sort order and runs a tiled GEMM
  against that slot's weights; the token-tile axis is sized for one slot holding every token, and programs past
  their slot's count exit at once, so the same grid serves prefill (few slots, many tokens) and decode. Each
  (token, column) is written by exactly one program: in-place accumulation needs no atomics.
- Precision: as paged_attention. Off CUDA (interpreter) tl.dot gets fp32 operands with ieee precision (bf16
  tl.dot is wrong there, triton#11584; fp32 on a GPU would otherwise mean tf32). On CUDA with 16-bit weights the
  shrink feeds tl.dot the 16-bit operands (exact products, fp32 sum), and the expand, whose y is fp32, runs in
  tf32: bf16/fp16 weights are exact in tf32, so only y loses bits (2^-11 relative), 8x less than casting y to
  bf16 as Punica does.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from kernels._common import cdiv, jit, native_dot_for, next_power_of_2, round_to, tl, use_triton
from kernels._library import no_output, triton_op


@jit
def _sgmv_kernel(
    x_ptr,
    w_ptr,
    out_ptr,
    order_ptr,
    start_ptr,
    count_ptr,
    N,
    K,
    col_offset,
    stride_xt,
    stride_ws,
    stride_wn,
    stride_ot,
    ADD: tl.constexpr,
    DOT: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
):
    # out[t, col_offset + n] (+)= sum_k x[t, k] * w[s, n, k] for the tokens t of slot s = program_id(2).
    # Shrink: x [T, IN], w = lora_a [S, R, IN], out = y [T, R]. Expand: x = y, w = lora_b [S, OUT, R].
    pid_m = tl.program_id(0)
    slot = tl.program_id(2)
    count = tl.load(count_ptr + slot)
    if pid_m * BLOCK_M >= count:
        return  # the grid is sized for one slot holding every token; this slot has fewer
    start = tl.load(start_ptr + slot)
    i = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)  # [BLOCK_M] positions in the slot's sorted run
    row_ok = i < count
    tok = tl.load(order_ptr + start + i, mask=row_ok, other=0).to(tl.int64)  # [BLOCK_M] token indices
    rn = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)  # [BLOCK_N]
    n_ok = rn < N
    rk = tl.arange(0, BLOCK_K)  # [BLOCK_K]
    x_rows = x_ptr + tok[:, None] * stride_xt  # [BLOCK_M, 1]
    w_cols = w_ptr + slot.to(tl.int64) * stride_ws + rn.to(tl.int64)[None, :] * stride_wn  # [1, BLOCK_N]
    acc = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
    for k0 in range(0, K, BLOCK_K):
        kk = k0 + rk
        k_ok = kk < K
        x = tl.load(x_rows + kk[None, :], mask=row_ok[:, None] & k_ok[None, :], other=0.0)  # [BLOCK_M, BLOCK_K]
        w = tl.load(w_cols + kk[:, None], mask=k_ok[:, None] & n_ok[None, :], other=0.0)  # [BLOCK_K, BLOCK_N]
        if DOT == "native":  # 16-bit x and w on CUDA: tensor cores, exact products, fp32 sum
            acc += tl.dot(x, w)
        elif DOT == "tf32":  # fp32 y, 16-bit B on CUDA: B widens exactly, y rounds to tf32
            acc += tl.dot(x.to(tl.float32), w.to(tl.float32), input_precision="tf32")
        else:
            acc += tl.dot(x.to(tl.float32), w.to(tl.float32), input_precision="ieee")
    dt = out_ptr.dtype.element_ty
    o_ptrs = out_ptr + tok[:, None] * stride_ot + col_offset + rn[None, :]  # [BLOCK_M, BLOCK_N]
    o_mask = row_ok[:, None] & n_ok[None, :]
    if ADD:
        acc += tl.load(o_ptrs, mask=o_mask, other=0.0).to(tl.float32)
    tl.store(o_ptrs, round_to(acc, dt).to(dt), mask=o_mask)  # round_to: the interpreter's bf16 cast truncates


def _slot_runs(token_slot: torch.Tensor, num_slots: int):
    """Device-side grouping, no host sync: (order [T] token indices sorted by slot, start [S], count [S]):
    slot s owns order[start[s] : start[s] + count[s]]. Tokens of slot -1 sort first and belong to no run."""
    sorted_slot, order = torch.sort(token_slot.long(), stable=True)  # [T], [T]
    ids = torch.arange(num_slots, device=token_slot.device)  # [S]
    start = torch.searchsorted(sorted_slot, ids)  # [S]
    return order, start, torch.searchsorted(sorted_slot, ids, right=True) - start


def _dot_mode(x: torch.Tensor, w: torch.Tensor, native_dot: bool | None) -> str:
    if native_dot is None:
        native_dot = native_dot_for(x, w.dtype)
    if not native_dot:
        return "ieee"
    return "native" if x.dtype == w.dtype else "tf32"


def _sgmv(x, w, out, runs, offset: int, add: bool, native_dot: bool | None) -> None:
    """out[:, offset:offset+N] (+)= per-slot x @ w[s].T. x [T, K], w [S, N, K], out [T, >= offset+N]."""
    t, k = x.shape
    s, n, _ = w.shape
    if t == 0 or s == 0 or n == 0:
        return
    block_m = min(64, max(16, next_power_of_2(t)))  # tl.dot wants every block dim >= 16
    block_n = min(64, max(16, next_power_of_2(n)))
    block_k = min(64, max(16, next_power_of_2(k)))
    order, start, count = runs
    _sgmv_kernel[(cdiv(t, block_m), cdiv(n, block_n), s)](
        x,
        w,
        out,
        order,
        start,
        count,
        n,
        k,
        offset,
        x.stride(0),
        w.stride(0),
        w.stride(1),
        out.stride(0),
        ADD=add,
        DOT=_dot_mode(x, w, native_dot),
        BLOCK_M=block_m,
        BLOCK_N=block_n,
        BLOCK_K=block_k,
    )


def _check(x, w, token_slot, what: str) -> None:
    assert x.dim() == 2 and w.dim() == 3, f"{what}: x [T, K] and weights [S, N, K], got {x.shape}, {w.shape}"
    assert w.shape[2] == x.shape[1], f"{what}: weights {tuple(w.shape)} do not take x [.., {x.shape[1]}]"
    assert token_slot.shape == (x.shape[0],) and token_slot.dtype in (torch.int32, torch.int64), (
        f"{what}: token_slot must be [T] int32/int64, got {tuple(token_slot.shape)} {token_slot.dtype}"
    )
    assert x.stride(-1) == 1 and w.stride(-1) == 1, f"{what}: last dims must be contiguous"
    assert w.dtype in (torch.float32, torch.float16, torch.bfloat16), w.dtype


def _check_out(y, lora_b, out, offset: int) -> None:
    assert out.dim() == 2 and out.shape[0] == y.shape[0] and out.stride(-1) == 1, (
        f"out must be [T, N] with contiguous columns, got {tuple(out.shape)}"
    )
    assert 0 <= offset and offset + lora_b.shape[1] <= out.shape[1], (
        f"columns {offset}:{offset + lora_b.shape[1]} outside out [.., {out.shape[1]}]"
    )


def lora_shrink_triton(x, lora_a, token_slot, native_dot: bool | None = None, runs=None) -> torch.Tensor:
    _check(x, lora_a, token_slot, "lora_shrink")
    y = torch.zeros((x.shape[0], lora_a.shape[1]), dtype=torch.float32, device=x.device)  # [T, R]; -1 rows: 0
    _sgmv(x, lora_a, y, runs or _slot_runs(token_slot, lora_a.shape[0]), 0, False, native_dot)
    return y


def lora_expand_triton(
    y, lora_b, token_slot, out, offset: int = 0, add: bool = True, native_dot: bool | None = None, runs=None
) -> torch.Tensor:
    _check(y, lora_b, token_slot, "lora_expand")
    _check_out(y, lora_b, out, offset)
    _sgmv(y, lora_b, out, runs or _slot_runs(token_slot, lora_b.shape[0]), offset, add, native_dot)
    return out


def _slot_groups(token_slot: torch.Tensor) -> list[tuple[int, slice | torch.Tensor]]:
    """[(slot, rows)] for each slot >= 0 present: rows is a slice when the slot's tokens are one contiguous run
    (the stable sort keeps them ascending, so first..last spanning count tokens means no gaps), else the indices."""
    sorted_slot, order = torch.sort(token_slot.long(), stable=True)  # [T], [T]
    slots, counts = torch.unique_consecutive(sorted_slot, return_counts=True)  # [G], [G]
    ends = counts.cumsum(0)  # [G]
    starts = ends - counts
    groups = []
    for s, a, b, first, last in zip(*(v.tolist() for v in (slots, starts, ends, order[starts], order[ends - 1]))):
        if s >= 0:
            groups.append((s, slice(first, last + 1) if last - first + 1 == b - a else order[a:b]))
    return groups


def lora_shrink_ref(x, lora_a, token_slot, groups=None) -> torch.Tensor:
    y = torch.zeros((x.shape[0], lora_a.shape[1]), dtype=torch.float32, device=x.device)  # [T, R]
    for s, rows in groups if groups is not None else _slot_groups(token_slot):
        y[rows] = x[rows].float() @ lora_a[s].float().t()  # [n, IN] @ [IN, R]
    return y


def lora_expand_ref(y, lora_b, token_slot, out, offset: int = 0, add: bool = True, groups=None) -> torch.Tensor:
    dst = out[:, offset : offset + lora_b.shape[1]]  # [T, OUT], a view: writes land in out
    for s, rows in groups if groups is not None else _slot_groups(token_slot):
        b_t = lora_b[s].float().t()  # [R, OUT]
        # [n, OUT] = dst + [n, R] @ [R, OUT] in fp32 (addmm saves a pass over dst), one rounding to out.dtype
        dst[rows] = (torch.addmm(dst[rows].float(), y[rows].float(), b_t) if add else y[rows].float() @ b_t).to(
            out.dtype
        )
    return out


def add_lora_ref(out, x, lora_a, lora_b, token_slot, offset: int = 0) -> torch.Tensor:
    groups = _slot_groups(token_slot)
    return lora_expand_ref(
        lora_shrink_ref(x, lora_a, token_slot, groups), lora_b, token_slot, out, offset, groups=groups
    )


def add_lora_triton(out, x, lora_a, lora_b, token_slot, offset: int = 0, native_dot: bool | None = None):
    assert lora_a.shape[0] == lora_b.shape[0] and lora_a.shape[1] == lora_b.shape[2], (
        f"lora_a {tuple(lora_a.shape)} and lora_b {tuple(lora_b.shape)} disagree on slots or rank"
    )
    runs = _slot_runs(token_slot, lora_a.shape[0])
    y = lora_shrink_triton(x, lora_a, token_slot, native_dot, runs)
    return lora_expand_triton(y, lora_b, token_slot, out, offset, True, native_dot, runs)


@dataclass
class SlotGroups:
    """A step's tokens grouped by adapter slot, computed once and shared by every layer's calls (CPU path).

    runs: (slot, first, end) for each run of >= MIN_RUN consecutive rows with one adapter (a prefill chunk):
      sliced matmuls, no gather, no padding. The other rows with an adapter (decodes, short chunks) go through
      one gather-based bmm: idx [G, L] each slot's rows padded with row 0, mask [G, L, 1] 1 on real rows,
      slots [G]; rows [N] those rows, real [N] their positions in idx.flatten()."""

    runs: list[tuple[int, int, int]]
    idx: torch.Tensor
    mask: torch.Tensor
    slots: torch.Tensor
    rows: torch.Tensor
    real: torch.Tensor
    dense: bool = False  # slots == 0..S-1: the stacked weights are used as stored, no gather


MIN_RUN = 16  # shorter runs are cheaper padded into the bmm than as their own matmuls


def slot_groups(token_slot: torch.Tensor, num_slots: int | None = None) -> SlotGroups:
    """Group a step's tokens by slot (once per step). num_slots: S of the stacked weights, if known."""
    ts = token_slot.long().cpu()  # [T]
    n = len(ts)
    cuts = ((ts[1:] != ts[:-1]).nonzero().flatten() + 1).tolist()
    runs = [(int(ts[a]), a, b) for a, b in zip([0] + cuts, cuts + [n]) if b - a >= MIN_RUN and ts[a] >= 0]
    rest = ts.clone()
    for _, a, b in runs:
        rest[a:b] = -1
    sorted_slot, order = torch.sort(rest, stable=True)  # [T], [T]
    slots, counts = torch.unique_consecutive(sorted_slot, return_counts=True)  # [G0], [G0]
    keep = slots >= 0
    starts = counts.cumsum(0) - counts  # [G0]
    group = torch.repeat_interleave(torch.arange(len(slots)), counts)  # [T]: group of each sorted token
    pos = torch.arange(n) - starts[group]  # [T]: rank within its group
    width = int(counts[keep].max()) if keep.any() else 0
    idx = torch.zeros(len(slots), width, dtype=torch.long)  # [G0, L]
    mask = torch.zeros(len(slots), width, 1)
    real = sorted_slot >= 0
    idx[group[real], pos[real]] = order[real]
    mask[group[real], pos[real]] = 1.0
    idx, mask, present = idx[keep], mask[keep], slots[keep]
    real_pos = mask.flatten().nonzero().flatten()  # [N]
    dense = num_slots is not None and present.tolist() == list(range(num_slots))
    dev = token_slot.device
    return SlotGroups(
        runs, idx.to(dev), mask.to(dev), present.to(dev), idx.flatten()[real_pos].to(dev), real_pos.to(dev), dense
    )


def add_lora_bmm(out, x, lora_a, lora_b, g: SlotGroups, offset: int = 0) -> torch.Tensor:
    """The CPU serving path: sliced matmuls for long runs of one adapter, and one gather-based bmm (Punica's
    BGMV, gathering weights per slot rather than per token) for the other rows, so the op count does not grow
    with the number of adapters or decodes. fp32 math, one rounding of out + delta, as the reference."""
    dst = out[:, offset : offset + lora_b.shape[1]]  # a view: the writes land in out
    for s, a, b in g.runs:
        y = x[a:b].float() @ lora_a[s].float().t()  # [n, R]
        # (out + delta) in fp32, rounded once: rounding the delta first loses bits when it cancels against out
        dst[a:b] = torch.addmm(dst[a:b].float(), y, lora_b[s].float().t()).to(out.dtype)
    if g.slots.numel() == 0:
        return out
    G, L = g.idx.shape
    wa = lora_a if g.dense else lora_a.index_select(0, g.slots)  # [G, R, IN]
    wb = lora_b if g.dense else lora_b.index_select(0, g.slots)  # [G, OUT, R]
    xg = x.index_select(0, g.idx.flatten()).view(G, L, -1).float()  # [G, L, IN]
    y = torch.bmm(xg, wa.float().transpose(1, 2)).mul_(g.mask)  # [G, L, R]; padding rows -> 0
    d = torch.bmm(y, wb.float().transpose(1, 2)).view(G * L, -1).index_select(0, g.real)  # [N, OUT], g.rows order
    dst.index_copy_(0, g.rows, dst.index_select(0, g.rows).float().add_(d).to(out.dtype))  # one rounding
    return out


_shrink_op = triton_op(
    "lora_shrink(Tensor x, Tensor lora_a, Tensor token_slot) -> Tensor",
    lambda x, lora_a, token_slot: x.new_empty((x.shape[0], lora_a.shape[1]), dtype=torch.float32),
)(lora_shrink_triton)


@triton_op(
    "lora_expand(Tensor y, Tensor lora_b, Tensor token_slot, Tensor(a!) out, int offset, bool add) -> ()", no_output
)
def _expand_op(y, lora_b, token_slot, out, offset: int, add: bool) -> None:
    lora_expand_triton(y, lora_b, token_slot, out, offset, add)


@triton_op(
    "add_lora(Tensor(a!) out, Tensor x, Tensor lora_a, Tensor lora_b, Tensor token_slot, int offset) -> ()", no_output
)
def _add_lora_op(out, x, lora_a, lora_b, token_slot, offset: int) -> None:
    add_lora_triton(out, x, lora_a, lora_b, token_slot, offset)


def lora_shrink(x: torch.Tensor, lora_a: torch.Tensor, token_slot: torch.Tensor) -> torch.Tensor:
    """x [T, IN], lora_a [S, R, IN], token_slot [T] (-1: none) -> y [T, R] fp32, y[t] = A[slot[t]] @ x[t]."""
    return _shrink_op(x, lora_a, token_slot) if use_triton(x) else lora_shrink_ref(x, lora_a, token_slot)


def lora_expand(
    y: torch.Tensor,
    lora_b: torch.Tensor,
    token_slot: torch.Tensor,
    out: torch.Tensor,
    offset: int = 0,
    add: bool = True,
) -> torch.Tensor:
    """In place: out[t, offset:offset+OUT] += B[slot[t]] @ y[t] (add=False: =) for slot >= 0. lora_b [S, OUT, R],
    y [T, R]. Rows of slot -1 and columns outside the slice are not touched. Returns out."""
    if use_triton(y):
        _expand_op(y, lora_b, token_slot, out, offset, add)
        return out
    return lora_expand_ref(y, lora_b, token_slot, out, offset, add)


def add_lora(
    out: torch.Tensor,
    x: torch.Tensor,
    lora_a: torch.Tensor,
    lora_b: torch.Tensor,
    token_slot: torch.Tensor,
    offset: int = 0,
    groups: SlotGroups | None = None,
) -> torch.Tensor:
    """In place: out[:, offset:offset+OUT] += the LoRA delta of x (shrink then expand). Returns out.
    Off CUDA: the gather-based bmm, with `groups` (slot_groups(token_slot), once per step) when given."""
    if use_triton(x):
        _add_lora_op(out, x, lora_a, lora_b, token_slot, offset)
        return out
    return add_lora_bmm(out, x, lora_a, lora_b, groups or slot_groups(token_slot), offset)
