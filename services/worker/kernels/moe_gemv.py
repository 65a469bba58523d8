"""The experts at decode sizes: two GEMV launches that read only the chosen experts' rows.

At a few tokens an MoE layer is a read of the chosen experts' weights (8 of 128 for Qwen3-30B-A3B)
and nothing else. The grouped GEMMs of fused_moe.py first sort the assignments by expert (their
own launches), then pad each to a 16-row tensor-core tile; here no sorting is needed: a program
takes one assignment (token, k) and reads its expert's rows directly, as the dense GEMV does.

  gate/up:  grid (T*K, I / BLOCK_N): silu(gate) * up of one assignment's BLOCK_N columns   [T*K, I]
  down+sum: grid (T, H / BLOCK_N): for each of the token's K experts, its down rows times the
            router weight, summed in registers: the top-k sum costs no launch of its own      [T, H]

An expert two tokens share is read twice, which is why TritonOps sends only a few tokens here.
Same contract and numerics as fused_moe_ref (rounded where the unfused path rounds).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from services.worker.kernels._common import cast_rtne, pdl_args, pdl_enter

# The most tokens this path takes; past it the grouped GEMMs' tiles share each weight read.
MAX_TOKENS = 4


@triton.jit
def _gate_up_gemv_kernel(x_ptr, w_ptr, s_ptr, ids_ptr, out_ptr, top_k, hidden, inter, first_expert, num_experts,
                         HAS_SCALE: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
                         PDL: tl.constexpr = False):
    pdl_enter(PDL)
    a = tl.program_id(0).to(tl.int64)  # the assignment: token a // top_k, its k-th expert
    e = tl.load(ids_ptr + a).to(tl.int64) - first_expert
    if (e < 0) | (e >= num_experts):  # another rank's expert: its row of h is never read
        return
    cols = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    in_n = cols < inter
    ks = tl.arange(0, BLOCK_K)
    x_row = x_ptr + (a // top_k) * hidden
    gate_rows = w_ptr + (e * 2 * inter + cols[:, None]) * hidden
    up_rows = gate_rows + inter * hidden
    act_ty = x_ptr.dtype.element_ty
    gate = tl.zeros([BLOCK_N, BLOCK_K], dtype=tl.float32)
    up = tl.zeros([BLOCK_N, BLOCK_K], dtype=tl.float32)
    for k in range(0, hidden, BLOCK_K):
        in_k = ks + k < hidden
        x = tl.load(x_row + k + ks, mask=in_k, other=0.0).to(tl.float32)[None, :]
        mask = in_n[:, None] & in_k[None, :]
        gate += tl.load(gate_rows + k + ks[None, :], mask=mask, other=0.0).to(tl.float32) * x
        up += tl.load(up_rows + k + ks[None, :], mask=mask, other=0.0).to(tl.float32) * x
    g, u = tl.sum(gate, axis=1), tl.sum(up, axis=1)
    if HAS_SCALE:
        s = s_ptr + e * 2 * inter + cols
        g *= tl.load(s, mask=in_n, other=0.0)
        u *= tl.load(s + inter, mask=in_n, other=0.0)
    g = cast_rtne(g, act_ty).to(tl.float32)
    u = cast_rtne(u, act_ty).to(tl.float32)
    act = cast_rtne(g / (1.0 + tl.exp(-g)), act_ty).to(tl.float32)
    tl.store(out_ptr + a * inter + cols, cast_rtne(act * u, act_ty), mask=in_n)


@triton.jit
def _down_sum_gemv_kernel(h_ptr, w_ptr, s_ptr, ids_ptr, weights_ptr, out_ptr, top_k, hidden, inter, first_expert,
                          num_experts, HAS_SCALE: tl.constexpr, TOP_K: tl.constexpr, BLOCK_N: tl.constexpr,
                          BLOCK_K: tl.constexpr, PDL: tl.constexpr = False):
    """One token's BLOCK_N output columns from all of its K experts at once: each step loads a
    [K, BLOCK_N, BLOCK_K] tile across the experts' rows (K loads in flight, not K loops one after
    another: the H200 read Qwen3-30B-A3B's down rows at 1.5 TB/s with the experts in turn)."""
    pdl_enter(PDL)
    t = tl.program_id(0).to(tl.int64)
    cols = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    in_n = cols < hidden
    js = tl.arange(0, TOP_K)
    a = t * top_k + js  # the token's assignments
    e = tl.load(ids_ptr + a, mask=js < top_k, other=-1).to(tl.int64) - first_expert
    local = (js < top_k) & (e >= 0) & (e < num_experts)  # another rank's expert (or padding) adds nothing
    e = tl.where(local, e, 0)
    ks = tl.arange(0, BLOCK_K)
    rows = w_ptr + ((e[:, None] * hidden + cols[None, :]) * inter)[:, :, None]  # [K, N, 1]
    h_rows = h_ptr + (a * inter)[:, None]  # [K, 1]
    act_ty = h_ptr.dtype.element_ty
    acc = tl.zeros([TOP_K, BLOCK_N, BLOCK_K], dtype=tl.float32)
    for k in range(0, inter, BLOCK_K):
        in_k = ks + k < inter
        h = tl.load(h_rows + k + ks[None, :], mask=local[:, None] & in_k[None, :], other=0.0).to(tl.float32)
        w_mask = (local[:, None] & in_n[None, :])[:, :, None] & in_k[None, None, :]
        acc += tl.load(rows + k + ks[None, None, :], mask=w_mask, other=0.0).to(tl.float32) * h[:, None, :]
    y = tl.sum(acc, axis=2)  # [K, N]
    if HAS_SCALE:
        y *= tl.load(s_ptr + e[:, None] * hidden + cols[None, :], mask=local[:, None] & in_n[None, :], other=0.0)
    # As fused_moe_ref: each projection rounded, times its router weight rounded, then summed.
    weight = cast_rtne(tl.load(weights_ptr + a, mask=local, other=0.0), act_ty).to(tl.float32)
    y = cast_rtne(y, act_ty).to(tl.float32) * weight[:, None]
    total = tl.sum(tl.where(local[:, None], y, 0.0), axis=0)
    tl.store(out_ptr + t * hidden + cols, cast_rtne(total, out_ptr.dtype.element_ty), mask=in_n)


def moe_gemv(x, w13, w2, topk_weights, topk_ids, first_expert=0, w13_scale=None, w2_scale=None) -> torch.Tensor:
    """fused_moe's contract for up to MAX_TOKENS tokens (fused_moe checks the arguments and sends
    them here). At T = 1 the gate/up launch has K * I / 16 programs (384 for Qwen3-30B-A3B) and the
    down launch H / 4 (512), each streaming its rows once."""
    tokens, hidden = x.shape
    num_experts, inter = w2.shape[0], w2.shape[2]
    top_k = topk_ids.shape[1]
    ids = topk_ids.contiguous()
    h = torch.empty((tokens * top_k, inter), dtype=x.dtype, device=x.device)
    out = torch.empty_like(x)
    # (gate/up rows, down rows, their K steps) a program. H200, batch 1, in a CUDA graph (the two
    # launches, the down one looping over the experts then): Qwen3-30B-A3B 34.7 us (16, 16, 256, 256:
    # 49.1), Mixtral-8x7B 181.9 us = 3.87 TB/s (254.5): the down launch wants 4 rows a program, for
    # T x H / 4 programs to stream at once; it now loads the K experts' tiles together (W1 262.5 ->
    # 275.7 tok/s), 128 columns a step to hold [K, 4, 128] in registers.
    up_n, down_n, up_k, down_k = 16, 4, 512, 128
    scaled = w13_scale is not None
    pdl = pdl_args(x.device)
    _gate_up_gemv_kernel[(tokens * top_k, triton.cdiv(inter, up_n))](
        x, w13, w13_scale if scaled else x, ids, h, top_k, hidden, inter, first_expert, num_experts,
        HAS_SCALE=scaled, BLOCK_N=up_n, BLOCK_K=min(up_k, triton.next_power_of_2(hidden)), num_warps=4, **pdl)
    _down_sum_gemv_kernel[(tokens, triton.cdiv(hidden, down_n))](
        h, w2, w2_scale if scaled else x, ids, topk_weights, out, top_k, hidden, inter, first_expert, num_experts,
        HAS_SCALE=scaled, TOP_K=triton.next_power_of_2(top_k), BLOCK_N=down_n,
        BLOCK_K=min(down_k, triton.next_power_of_2(inter)), num_warps=4, **pdl)
    return out
