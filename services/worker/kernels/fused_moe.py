"""The mixture-of-experts layer's expert computation: grouped-GEMM Triton kernels and their torch reference.

Each token's top-k assignments are sorted by expert and each expert's run is padded to a multiple
of block_m (moe_align), so every program of the two grouped GEMMs works on block_m rows of ONE
expert: at batch 1 only the chosen experts' weights are read. Everything is sized by an upper
bound and computed on the device, so a step holds no host read and can be captured in a CUDA graph.

  gate/up: [assignments, H] x w13[e]ᵀ -> silu(gate) * up    [T*K, I]   (two accumulators, one pass)
  down:    [assignments, I] x w2[e]ᵀ  -> times topk weight  [T*K, H]
  sum:     the K rows of each token                          [T, H]

fp8 weights (e4m3, a float32 scale per output row) are widened to x's dtype in the loop and the
scale multiplies the accumulator, as gemv.py's weight-only fp8.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from services.worker.kernels._common import (FLOAT_DTYPES, FP8_KV, INDEX_DTYPES, cast_rtne, check, check_shape,
                                             check_tensor, dot_precision, mma)
from services.worker.kernels import moe_gemv
from services.worker.kernels.gemv import linear_ref
from services.worker.kernels.silu_mul import silu_mul_ref


def fused_moe_ref(x: torch.Tensor, w13: torch.Tensor, w2: torch.Tensor, topk_weights: torch.Tensor,
                  topk_ids: torch.Tensor, first_expert: int = 0, w13_scale: torch.Tensor | None = None,
                  w2_scale: torch.Tensor | None = None) -> torch.Tensor:
    """x [T, H], w13 [E, 2I, H] = [gate | up], w2 [E, H, I], topk_weights fp32 [T, K], topk_ids
    [T, K] (global ids; this rank holds [first_expert, first_expert + E)) -> [T, H] in x.dtype.

    HF's Qwen2MoeExperts step for step (experts in ascending order, each one's tokens gathered by
    slot then token, rounded to x.dtype where it rounds), so fp32 results match transformers. Also
    the CPU path: it loops over the experts actually hit, which reads their ids back to the host."""
    out = torch.zeros_like(x)
    local = topk_ids.long() - first_expert
    for e in torch.unique(local).tolist():
        if not 0 <= e < w13.shape[0]:
            continue  # another rank's expert
        slot, tokens = torch.where(local.t() == e)
        gate_up = linear_ref(x[tokens], w13[e], scale=None if w13_scale is None else w13_scale[e])
        h = linear_ref(silu_mul_ref(gate_up), w2[e], scale=None if w2_scale is None else w2_scale[e])
        out.index_add_(0, tokens, h * topk_weights[tokens, slot, None].to(x.dtype))
    return out


def max_padded(num_assignments: int, num_experts: int, block_m: int) -> int:
    """The most slots moe_align can fill: each expert hit pads its run by at most block_m - 1."""
    n = num_assignments + min(num_assignments, num_experts) * (block_m - 1)
    return triton.cdiv(n, block_m) * block_m


def moe_align_ref(topk_ids: torch.Tensor, num_experts: int, first_expert: int,
                  block_m: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """topk_ids [T, K] -> (sorted_ids int32 [P], block_expert int32 [P // block_m], num_tokens_padded
    int32 [1]), P = max_padded(T*K, num_experts, block_m).

    sorted_ids lists the flat assignments (t*K + k) of local expert 0, then 1, ..., each expert's run
    in token order and padded to a multiple of block_m with T*K (a sentinel); block_expert is each
    block's local expert, -1 past the used length. Non-local assignments are dropped."""
    device = topk_ids.device
    n = topk_ids.numel()
    size = max_padded(n, num_experts, block_m)
    expert = topk_ids.reshape(-1).long() - first_expert
    # Another rank's assignments go to bucket E, which is counted but never placed.
    expert = torch.where((expert >= 0) & (expert < num_experts), expert, num_experts)
    counts = torch.zeros(num_experts + 1, dtype=torch.long, device=device)
    counts.scatter_add_(0, expert, torch.ones_like(expert))
    padded = (counts[:num_experts] + block_m - 1) // block_m * block_m
    ends = torch.cumsum(padded, 0)
    sorted_expert, order = torch.sort(expert, stable=True)
    rank = torch.arange(n, device=device) - (torch.cumsum(counts, 0) - counts)[sorted_expert]
    starts = torch.cat([ends - padded, ends.new_zeros(1)])
    # One spare slot past the end takes every dropped assignment.
    dest = torch.where(sorted_expert < num_experts, starts[sorted_expert] + rank, size)
    sorted_ids = torch.full((size + 1,), n, dtype=torch.int32, device=device)
    sorted_ids.scatter_(0, dest, order.to(torch.int32))
    # A block's expert: the first whose run ends past the block's start (empty runs end where
    # they start, so they are skipped); a start past the last run finds index E.
    block_expert = torch.searchsorted(ends, torch.arange(0, size, block_m, device=device), right=True)
    block_expert = torch.where(block_expert < num_experts, block_expert, -1).to(torch.int32)
    return sorted_ids[:size], block_expert, ends[-1:].to(torch.int32)


@triton.jit
def _chunk_experts(ids_ptr, chunk, n, first_expert, num_experts, CHUNK: tl.constexpr, E_BLOCK: tl.constexpr):
    """[CHUNK, E_BLOCK] int32, 1 where assignment chunk * CHUNK + i goes to local expert e."""
    offs = chunk * CHUNK + tl.arange(0, CHUNK)
    e = tl.load(ids_ptr + offs, mask=offs < n, other=-1) - first_expert
    local = (offs < n) & (e >= 0) & (e < num_experts)
    return ((e[:, None] == tl.arange(0, E_BLOCK)[None, :]) & local[:, None]).to(tl.int32)


@triton.jit
def _count_kernel(ids_ptr, counts_ptr, n, first_expert, num_experts, num_chunks,
                  CHUNK: tl.constexpr, E_BLOCK: tl.constexpr):
    """One program per chunk of assignments: its count for each local expert, counts[e, chunk]."""
    chunk = tl.program_id(0)
    hits = _chunk_experts(ids_ptr, chunk, n, first_expert, num_experts, CHUNK, E_BLOCK)
    tl.store(counts_ptr + tl.arange(0, E_BLOCK) * num_chunks + chunk, tl.sum(hits, axis=0))


@triton.jit
def _place_kernel(ids_ptr, ends_ptr, sorted_ids_ptr, block_expert_ptr, used_ptr,
                  n, first_expert, num_experts, num_chunks, num_blocks,
                  BLOCK_M: tl.constexpr, CHUNK: tl.constexpr, E_BLOCK: tl.constexpr):
    """One program per chunk: each of its local assignments goes to its expert's run start + the
    count of that expert's assignments in earlier chunks + those earlier in this chunk (so runs
    keep token order, and no two programs write one slot). ends_ptr: the counts summed over
    chunks, [E_BLOCK, chunks], inclusive."""
    chunk = tl.program_id(0)
    experts = tl.arange(0, E_BLOCK)
    hits = _chunk_experts(ids_ptr, chunk, n, first_expert, num_experts, CHUNK, E_BLOCK)
    earlier = tl.load(ends_ptr + experts * num_chunks + chunk) - tl.sum(hits, axis=0)
    # Every program derives the runs from the totals (E_BLOCK values: cheaper than another launch).
    totals = tl.load(ends_ptr + experts * num_chunks + num_chunks - 1)
    padded = (totals + BLOCK_M - 1) // BLOCK_M * BLOCK_M
    ends = tl.cumsum(padded, axis=0)
    slot = (ends - padded + earlier)[None, :] + tl.cumsum(hits, axis=0) - hits
    dest = tl.sum(hits * slot, axis=1)
    tl.store(sorted_ids_ptr + dest, chunk * CHUNK + tl.arange(0, CHUNK), mask=tl.sum(hits, axis=1) > 0)
    if chunk == 0:
        tl.store(used_ptr, tl.sum(padded, axis=0))
        for b0 in range(0, num_blocks, CHUNK):
            blocks = b0 + tl.arange(0, CHUNK)
            # How many runs end at or before the block's start: empty runs are skipped, and a
            # start past the last run counts them all (expert >= E, so -1).
            e = tl.sum((ends[None, :] <= blocks[:, None] * BLOCK_M).to(tl.int32), axis=1)
            tl.store(block_expert_ptr + blocks, tl.where(e < num_experts, e, -1), mask=blocks < num_blocks)


def moe_align(topk_ids: torch.Tensor, num_experts: int, first_expert: int,
              block_m: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """moe_align_ref's result, bit for bit: a sentinel fill, then count / cumsum / place launches
    whose programs each take a chunk of assignments, so it scales with T*K. No host read and fixed
    sizes: a CUDA graph can hold it. (H200, Qwen3-30B-A3B's 128 experts, in a graph: 10 us at
    T = 1 and 40 us at T = 4096, against the torch form's 73 and 155; its ~30 small kernels were
    most of a 105 us decode layer.)"""
    check_tensor(topk_ids, "topk_ids", ndim=2, dtypes=INDEX_DTYPES, contiguous=True)
    check(num_experts >= 1 and block_m >= 1, "need num_experts >= 1 and block_m >= 1")
    device = topk_ids.device
    n = topk_ids.numel()
    size = max_padded(n, num_experts, block_m)
    sorted_ids = torch.full((size,), n, dtype=torch.int32, device=device)  # padding: the sentinel
    block_expert = torch.empty((size // block_m,), dtype=torch.int32, device=device)
    used = torch.empty(1, dtype=torch.int32, device=device)
    if n == 0:
        return sorted_ids, block_expert, used.zero_()
    e_block = triton.next_power_of_2(num_experts)
    # A [chunk, E] one-hot tile a program: about 4096 values, 32 a thread.
    chunk = max(16, min(triton.next_power_of_2(n), 4096 // e_block))
    chunks = triton.cdiv(n, chunk)
    # Experts by chunks: torch scans a last dimension in parallel, an outer one a thread a column
    # (1024 chunks took 200 us so).
    counts = torch.empty((e_block, chunks), dtype=torch.int32, device=device)
    _count_kernel[(chunks,)](topk_ids, counts, n, first_expert, num_experts, chunks, CHUNK=chunk, E_BLOCK=e_block)
    ends = torch.cumsum(counts, dim=1, dtype=torch.int32)
    _place_kernel[(chunks,)](topk_ids, ends, sorted_ids, block_expert, used, n, first_expert, num_experts,
                             chunks, size // block_m, BLOCK_M=block_m, CHUNK=chunk, E_BLOCK=e_block)
    return sorted_ids, block_expert, used


@dataclass(frozen=True, slots=True)
class MoeConfig:
    block_m: int     # assignments per program, all one expert's (moe_align pads each run to it)
    block_n: int     # output columns per program: of I for gate/up (each), of H for down
    block_k: int     # reduction columns per loop step
    num_warps: int
    num_stages: int  # loop steps in flight

    def __post_init__(self):
        for name in ("block_m", "block_n", "block_k"):
            value = getattr(self, name)
            check(value >= 16 and value & (value - 1) == 0, "{} must be a power of two >= 16 (tl.dot), got {}",
                  name, value)
        check(self.num_warps >= 1 and self.num_stages >= 1, "num_warps and num_stages must be positive")


def moe_config(num_tokens: int, num_experts: int) -> MoeConfig:
    """Block sizes from the batch alone (graph capture allows no tuning at run time), vLLM's rule
    for the switch. Up to one token per local expert (decode), an expert gets a few rows: block_m
    16 wastes least padding, and narrow N tiles give the few experts hit enough programs to stream
    their weights. Past that (prefill) 64-row blocks reuse each weight tile four times as much.

    A first sweep (H200, Qwen3-30B-A3B, bf16, in a CUDA graph): at T = 1 every decode variant tried
    (block_n 16-64, block_k 64-256, 2-4 warps, 3-5 stages) took 45-55 us, the GEMMs streaming the
    weights at ~3 TB/s; at T = 4096 this prefill config took 1.17 ms, block_n 64 1.30 ms, and
    block_m 128 / block_n 128 / 8 warps 1.09 ms (a third tier to try for long prompts)."""
    if num_tokens <= num_experts:
        return MoeConfig(block_m=16, block_n=32, block_k=128, num_warps=4, num_stages=4)
    return MoeConfig(block_m=64, block_n=128, block_k=64, num_warps=4, num_stages=4)


@triton.jit
def _gate_up_kernel(x_ptr, w_ptr, s_ptr, out_ptr, sorted_ids_ptr, block_expert_ptr,
                    num_assignments, top_k, hidden, inter,
                    HAS_SCALE: tl.constexpr, PRECISION: tl.constexpr,
                    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr):
    """One block of one expert's assignments x one N tile of I: the gate tile and the up tile
    (rows n and I + n of w13[e]) summed side by side, silu(gate) * up stored at each assignment's row."""
    pid_m = tl.program_id(0)
    expert = tl.load(block_expert_ptr + pid_m)
    if expert < 0:  # past the used length (the grid is sized by the upper bound)
        return
    ids = tl.load(sorted_ids_ptr + pid_m * BLOCK_M + tl.arange(0, BLOCK_M))
    valid = ids < num_assignments  # padding slots hold the sentinel
    rows = tl.where(valid, ids // top_k, 0).to(tl.int64)
    cols = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    in_n = cols < inter
    ks = tl.arange(0, BLOCK_K)
    x_ptrs = x_ptr + rows[:, None] * hidden + ks[None, :]
    # [BLOCK_K, BLOCK_N] tiles of w13[e]ᵀ; 64-bit: a layer's experts can pass 2^31 elements.
    w_ptrs = w_ptr + expert.to(tl.int64) * 2 * inter * hidden + cols[None, :].to(tl.int64) * hidden + ks[:, None]
    up_offset = inter * hidden  # within one expert's matrix: 32 bits suffice
    act_ty = x_ptr.dtype.element_ty
    gate = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
    up = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
    for k in range(0, hidden, BLOCK_K):
        in_k = ks < hidden - k
        a = tl.load(x_ptrs + k, mask=valid[:, None] & in_k[None, :], other=0.0)
        w_mask = in_k[:, None] & in_n[None, :]
        wg = tl.load(w_ptrs + k, mask=w_mask, other=0.0).to(act_ty)  # fp8 widens exactly
        wu = tl.load(w_ptrs + up_offset + k, mask=w_mask, other=0.0).to(act_ty)
        gate = mma(a, wg, gate, PRECISION)
        up = mma(a, wu, up, PRECISION)
    if HAS_SCALE:
        s = s_ptr + expert.to(tl.int64) * 2 * inter + cols
        gate *= tl.load(s, mask=in_n, other=0.0)[None, :]
        up *= tl.load(s + inter, mask=in_n, other=0.0)[None, :]
    # Rounded where the unfused path rounds: the projection's output, then silu, then the product.
    g = cast_rtne(gate, act_ty).to(tl.float32)
    u = cast_rtne(up, act_ty).to(tl.float32)
    act = cast_rtne(g / (1.0 + tl.exp(-g)), act_ty).to(tl.float32)
    out_ptrs = out_ptr + ids[:, None].to(tl.int64) * inter + cols[None, :]
    tl.store(out_ptrs, cast_rtne(act * u, act_ty), mask=valid[:, None] & in_n[None, :])


@triton.jit
def _down_kernel(h_ptr, w_ptr, s_ptr, topk_weights_ptr, out_ptr, sorted_ids_ptr, block_expert_ptr,
                 num_assignments, hidden, inter,
                 HAS_SCALE: tl.constexpr, PRECISION: tl.constexpr,
                 BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr):
    """One block of one expert's assignments x one N tile of H: h @ w2[e]ᵀ times each assignment's
    router weight, stored at the assignment's row (the top-k sum is the next kernel's)."""
    pid_m = tl.program_id(0)
    expert = tl.load(block_expert_ptr + pid_m)
    if expert < 0:
        return
    ids = tl.load(sorted_ids_ptr + pid_m * BLOCK_M + tl.arange(0, BLOCK_M))
    valid = ids < num_assignments
    rows = tl.where(valid, ids, 0).to(tl.int64)
    cols = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    in_n = cols < hidden
    ks = tl.arange(0, BLOCK_K)
    h_ptrs = h_ptr + rows[:, None] * inter + ks[None, :]
    w_ptrs = w_ptr + expert.to(tl.int64) * hidden * inter + cols[None, :].to(tl.int64) * inter + ks[:, None]
    act_ty = h_ptr.dtype.element_ty
    acc = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
    for k in range(0, inter, BLOCK_K):
        in_k = ks < inter - k
        a = tl.load(h_ptrs + k, mask=valid[:, None] & in_k[None, :], other=0.0)
        w = tl.load(w_ptrs + k, mask=in_k[:, None] & in_n[None, :], other=0.0).to(act_ty)
        acc = mma(a, w, acc, PRECISION)
    if HAS_SCALE:
        acc *= tl.load(s_ptr + expert.to(tl.int64) * hidden + cols, mask=in_n, other=0.0)[None, :]
    # As HF: the projection rounded to x.dtype, times the router weight cast to x.dtype.
    weight = cast_rtne(tl.load(topk_weights_ptr + rows, mask=valid, other=0.0), act_ty).to(tl.float32)
    y = cast_rtne(acc, act_ty).to(tl.float32) * weight[:, None]
    tl.store(out_ptr + rows[:, None] * hidden + cols[None, :], cast_rtne(y, act_ty),
             mask=valid[:, None] & in_n[None, :])


@triton.jit
def _topk_sum_kernel(y_ptr, topk_ids_ptr, out_ptr, top_k, hidden, first_expert, num_experts, BLOCK: tl.constexpr):
    """out[t] = the sum of token t's K weighted expert rows. Rows of another rank's experts were
    never written (no block holds them), so they are skipped here, not read."""
    t = tl.program_id(0).to(tl.int64)
    cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    in_n = cols < hidden
    acc = tl.zeros([BLOCK], dtype=tl.float32)
    for k in range(0, top_k):
        e = tl.load(topk_ids_ptr + t * top_k + k) - first_expert
        if (e >= 0) & (e < num_experts):
            acc += tl.load(y_ptr + (t * top_k + k) * hidden + cols, mask=in_n, other=0.0).to(tl.float32)
    tl.store(out_ptr + t * hidden + cols, cast_rtne(acc, out_ptr.dtype.element_ty), mask=in_n)


def _fit(block: int, n: int) -> int:
    """A block no wider than the dimension needs (tl.dot's minimum of 16 kept)."""
    return max(16, min(block, triton.next_power_of_2(n)))


def fused_moe(x: torch.Tensor, w13: torch.Tensor, w2: torch.Tensor, topk_weights: torch.Tensor,
              topk_ids: torch.Tensor, first_expert: int = 0, w13_scale: torch.Tensor | None = None,
              w2_scale: torch.Tensor | None = None, config: MoeConfig | None = None) -> torch.Tensor:
    """Same contract as fused_moe_ref: moe_align, then the gate/up, down and top-k sum launches,
    and no host read. All tensors contiguous; with w13_scale [E, 2I] and w2_scale [E, H] (fp32) the weights are
    e4m3, each row standing for w.float() * scale[row]."""
    check_tensor(x, "x", ndim=2, dtypes=FLOAT_DTYPES, contiguous=True)
    device = x.device
    check((w13_scale is None) == (w2_scale is None), "w13_scale and w2_scale come together (fp8 weights) or not at all")
    weight_dtypes = (x.dtype,) if w13_scale is None else (FP8_KV,)
    check_tensor(w13, "w13", ndim=3, dtypes=weight_dtypes, device=device, contiguous=True)
    check_tensor(w2, "w2", ndim=3, dtypes=weight_dtypes, device=device, contiguous=True)
    (tokens, hidden), (num_experts, inter) = x.shape, (w2.shape[0], w2.shape[2])
    check(num_experts >= 1, "w2 holds no experts")
    check_shape(w13, "w13", (num_experts, 2 * inter, hidden))
    check_shape(w2, "w2", (num_experts, hidden, inter))
    if w13_scale is not None:
        check_tensor(w13_scale, "w13_scale", ndim=2, dtypes=(torch.float32,), device=device, contiguous=True)
        check_shape(w13_scale, "w13_scale", (num_experts, 2 * inter))
        check_tensor(w2_scale, "w2_scale", ndim=2, dtypes=(torch.float32,), device=device, contiguous=True)
        check_shape(w2_scale, "w2_scale", (num_experts, hidden))
    check_tensor(topk_ids, "topk_ids", ndim=2, dtypes=INDEX_DTYPES, device=device, contiguous=True)
    top_k = topk_ids.shape[1]
    check_shape(topk_ids, "topk_ids", (tokens, top_k))
    check_tensor(topk_weights, "topk_weights", ndim=2, dtypes=(torch.float32,), device=device, contiguous=True)
    check_shape(topk_weights, "topk_weights", (tokens, top_k))
    check(isinstance(first_expert, int) and first_expert >= 0, "first_expert must be an int >= 0, got {}",
          first_expert)

    out = torch.empty_like(x)
    if tokens == 0 or hidden == 0:
        return out
    if top_k == 0 or inter == 0:
        return out.zero_()
    if tokens <= moe_gemv.MAX_TOKENS and config is None:  # decode: no sort, no padded tiles
        return moe_gemv.moe_gemv(x, w13, w2, topk_weights, topk_ids, first_expert, w13_scale, w2_scale)
    config = config or moe_config(tokens, num_experts)
    sorted_ids, block_expert, _ = moe_align(topk_ids, num_experts, first_expert, config.block_m)
    n = tokens * top_k
    blocks = block_expert.numel()
    common = dict(HAS_SCALE=w13_scale is not None, PRECISION=dot_precision(x.dtype), BLOCK_M=config.block_m,
                  num_warps=config.num_warps, num_stages=config.num_stages)
    # Rows of assignments no block holds (other ranks' experts) stay unwritten here and in y.
    h = torch.empty((n, inter), dtype=x.dtype, device=device)
    block_n, block_k = _fit(config.block_n, inter), _fit(config.block_k, hidden)
    _gate_up_kernel[(blocks, triton.cdiv(inter, block_n))](
        x, w13, w13_scale if w13_scale is not None else x, h, sorted_ids, block_expert,
        n, top_k, hidden, inter, BLOCK_N=block_n, BLOCK_K=block_k, **common)
    y = torch.empty((n, hidden), dtype=x.dtype, device=device)
    block_n, block_k = _fit(config.block_n, hidden), _fit(config.block_k, inter)
    _down_kernel[(blocks, triton.cdiv(hidden, block_n))](
        h, w2, w2_scale if w2_scale is not None else x, topk_weights, y, sorted_ids, block_expert,
        n, hidden, inter, BLOCK_N=block_n, BLOCK_K=block_k, **common)
    block = min(1024, triton.next_power_of_2(hidden))
    _topk_sum_kernel[(tokens, triton.cdiv(hidden, block))](
        y, topk_ids, out, top_k, hidden, first_expert, num_experts, BLOCK=block, num_warps=4)
    return out
