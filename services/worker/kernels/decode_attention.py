"""Paged decode attention (one new token per sequence, GQA, split-KV flash-decoding): kernels and reference."""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from services.worker.kernels._common import (
    cast_rtne, check, check_paged_attention_args, check_shape, check_tensor, dot_precision, mma,
    next_power_of_2, pdl_args, pdl_enter)

# A split should stream enough KV to hide its fixed cost; the grid should cover the GPU about
# twice. (Tuned on an H100 at Llama-3.1-8B shapes: B=1 ctx 384 -> 6 splits, B=64 ctx 512 -> 1.)
_MIN_TOKENS_PER_SPLIT = 64
_TARGET_PROGRAMS = 264  # 2 waves of 132 SMs (H100 SXM)
_MAX_SPLITS = 64


def paged_decode_attention_ref(
    q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, block_tables: torch.Tensor,
    seq_lens: torch.Tensor, scale: float, chunk: int = 0,
) -> torch.Tensor:
    """q: [B, Hq, D]; each sequence b attends to its first seq_lens[b] cached tokens (fp32 math);
    with chunk > 0 only to those of its last position's chunk (Llama 4's chunked local attention).

    A sequence with seq_lens[b] == 0 (a padding row) gets zeros.
    """
    n_seqs, n_q, head_dim = q.shape
    page, n_kv = k_cache.shape[1], k_cache.shape[2]
    group = n_q // n_kv
    out = torch.zeros_like(q)
    if n_seqs == 0:
        return out
    max_len = int(seq_lens.max())
    if max_len == 0:
        return out
    pos = torch.arange(max_len, device=q.device)
    valid = pos[None, :] < seq_lens[:, None].long()  # [B, L]
    if chunk:
        valid &= pos[None, :] >= ((seq_lens.long() - 1).clamp(min=0) // chunk * chunk)[:, None]
    # Table entries past a sequence's end may hold anything: never follow them.
    blocks = torch.where(valid, block_tables[:, pos // page].long(), 0)
    k = k_cache[blocks, pos % page].float()  # [B, L, Hkv, D]
    v = v_cache[blocks, pos % page].float().masked_fill(~valid[:, :, None, None], 0.0)
    qf = q.float().view(n_seqs, n_kv, group, head_dim)
    scores = torch.einsum("bhgd,blhd->bhgl", qf, k) * scale
    scores = scores.masked_fill(~valid[:, None, None, :], float("-inf"))
    probs = torch.softmax(scores, dim=-1)
    probs = torch.nan_to_num(probs, nan=0.0)  # rows with no context at all
    o = torch.einsum("bhgl,blhd->bhgd", probs, v)
    return o.reshape(n_seqs, n_q, head_dim).to(q.dtype)


# The split count and the block table's width change between steps; specialising on them would
# compile new variants while serving (seconds of the step thread each), for no gain.
@triton.jit(do_not_specialize=["num_splits", "bt_stride", "pl_stride_b", "pl_stride_h"])
def _decode_split_kernel(
    q_ptr, k_cache_ptr, v_cache_ptr, block_tables_ptr, seq_lens_ptr, out_ptr, part_o_ptr, part_lse_ptr,
    scale, num_splits,
    q_stride_b, q_stride_h,
    kc_stride_b, kc_stride_o, kc_stride_h, vc_stride_b, vc_stride_o, vc_stride_h,
    bt_stride,
    out_stride_b, out_stride_h,
    po_stride_b, po_stride_h, po_stride_s, pl_stride_b, pl_stride_h,
    GROUP: tl.constexpr, BLOCK_G: tl.constexpr, HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr,
    PAGE: tl.constexpr, BLOCK_N: tl.constexpr, DIRECT: tl.constexpr, PRECISION: tl.constexpr,
    CHUNK: tl.constexpr = 0, PDL: tl.constexpr = False,
):
    pdl_enter(PDL)
    seq = tl.program_id(0).to(tl.int64)
    kv_head = tl.program_id(1)
    split = tl.program_id(2)

    seq_len = tl.load(seq_lens_ptr + seq)
    # Each sequence's keys (CHUNK > 0: those of its last position's chunk, the earlier ones unread)
    # are cut into num_splits equal runs of whole BLOCK_N tiles.
    kv_start = 0
    if CHUNK > 0:
        kv_start = tl.maximum(seq_len - 1, 0) // CHUNK * CHUNK
    split_len = tl.cdiv(tl.cdiv(seq_len - kv_start, num_splits), BLOCK_N) * BLOCK_N
    start = kv_start + split * split_len
    end = tl.minimum(start + split_len, seq_len)

    g = tl.arange(0, BLOCK_G)
    d = tl.arange(0, BLOCK_D)
    g_mask = g < GROUP
    d_mask = d < HEAD_DIM
    heads = kv_head * GROUP + g
    q = tl.load(q_ptr + seq * q_stride_b + heads[:, None] * q_stride_h + d[None, :],
                mask=g_mask[:, None] & d_mask[None, :], other=0.0)
    if k_cache_ptr.dtype.element_ty == tl.float8e4nv and q.dtype == tl.bfloat16:
        # e4m3 widens to fp16 in one instruction per pair (to bf16 it takes more), and at half
        # the bytes the widening is what bounds this kernel: the dots run in fp16 (q clamped to
        # its range; p and the fp8 values lose nothing there).
        q = tl.clamp(q.to(tl.float32), -65504.0, 65504.0).to(tl.float16)

    m_i = tl.full([BLOCK_G], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_G], tl.float32)
    acc = tl.zeros([BLOCK_G, BLOCK_D], tl.float32)
    bt_row = block_tables_ptr + seq * bt_stride
    for n0 in range(start, end, BLOCK_N):
        tok = n0 + tl.arange(0, BLOCK_N)
        t_mask = tok < end
        block = tl.load(bt_row + tok // PAGE, mask=t_mask, other=0).to(tl.int64)
        offset = tok % PAGE
        kv_mask = t_mask[:, None] & d_mask[None, :]
        # An fp8 cache is read at half the bytes and widened to q's dtype for the dots.
        k = tl.load(k_cache_ptr + block[:, None] * kc_stride_b + offset[:, None] * kc_stride_o
                    + kv_head * kc_stride_h + d[None, :], mask=kv_mask, other=0.0).to(q.dtype)
        v = tl.load(v_cache_ptr + block[:, None] * vc_stride_b + offset[:, None] * vc_stride_o
                    + kv_head * vc_stride_h + d[None, :], mask=kv_mask, other=0.0).to(q.dtype)
        s = mma(q, tl.trans(k), tl.zeros([BLOCK_G, BLOCK_N], tl.float32), PRECISION) * scale
        s = tl.where(t_mask[None, :], s, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(s, axis=1))
        alpha = tl.exp(m_i - m_new)
        p = tl.exp(s - m_new[:, None])
        l_i = l_i * alpha + tl.sum(p, axis=1)
        acc = mma(cast_rtne(p, v.dtype), v, acc * alpha[:, None], PRECISION)
        m_i = m_new

    has = l_i > 0.0
    o = acc / tl.where(has, l_i, 1.0)[:, None]
    mask = g_mask[:, None] & d_mask[None, :]
    if DIRECT:
        tl.store(out_ptr + seq * out_stride_b + heads[:, None] * out_stride_h + d[None, :],
                 cast_rtne(o, out_ptr.dtype.element_ty), mask=mask)
    else:
        tl.store(part_o_ptr + seq * po_stride_b + heads[:, None] * po_stride_h + split * po_stride_s + d[None, :],
                 o, mask=mask)
        lse = tl.where(has, m_i + tl.log(tl.where(has, l_i, 1.0)), float("-inf"))
        tl.store(part_lse_ptr + seq * pl_stride_b + heads * pl_stride_h + split, lse, mask=g_mask)


@triton.jit(do_not_specialize=["num_splits", "pl_stride_b", "pl_stride_h"])
def _decode_reduce_kernel(
    part_o_ptr, part_lse_ptr, out_ptr, num_splits,
    po_stride_b, po_stride_h, po_stride_s, pl_stride_b, pl_stride_h, out_stride_b, out_stride_h,
    HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_S: tl.constexpr,
    PDL: tl.constexpr = False,
):
    pdl_enter(PDL)
    seq = tl.program_id(0).to(tl.int64)
    head = tl.program_id(1)
    s = tl.arange(0, BLOCK_S)
    d = tl.arange(0, BLOCK_D)
    s_mask = s < num_splits
    d_mask = d < HEAD_DIM
    lse = tl.load(part_lse_ptr + seq * pl_stride_b + head * pl_stride_h + s, mask=s_mask, other=float("-inf"))
    m = tl.max(lse, axis=0)
    m = tl.where(m > float("-inf"), m, 0.0)  # no context at all: every weight is exp(-inf) = 0
    w = tl.exp(lse - m)
    total = tl.sum(w, axis=0)
    part = tl.load(part_o_ptr + seq * po_stride_b + head * po_stride_h + s[:, None] * po_stride_s + d[None, :],
                   mask=(s_mask & (w > 0.0))[:, None] & d_mask[None, :], other=0.0)
    o = tl.sum(part * w[:, None], axis=0) / tl.where(total > 0.0, total, 1.0)
    tl.store(out_ptr + seq * out_stride_b + head * out_stride_h + d, cast_rtne(o, out_ptr.dtype.element_ty),
             mask=d_mask)


def launch_config(head_dim: int) -> tuple[int, int, int]:
    """(BLOCK_N tokens per KV tile, num_warps, num_stages) of the split kernel."""
    return (64 if head_dim <= 128 else 32), 4, 2


def choose_num_splits(batch: int, num_kv_heads: int, max_seq_len: int) -> int:
    """Enough splits to fill the GPU, never so many that a split streams under 64 tokens."""
    by_len = triton.cdiv(max(1, max_seq_len), _MIN_TOKENS_PER_SPLIT)
    by_grid = triton.cdiv(_TARGET_PROGRAMS, max(1, batch * num_kv_heads))
    return max(1, min(by_len, by_grid, _MAX_SPLITS))


def paged_decode_attention(
    q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, block_tables: torch.Tensor,
    seq_lens: torch.Tensor, scale: float, num_splits: int | None = None, max_seq_len: int | None = None,
    out: torch.Tensor | None = None, chunk: int = 0,
) -> torch.Tensor:
    """Same contract as paged_decode_attention_ref. No host sync and no value-dependent allocation:
    num_splits comes from max_seq_len (a host-side hint, else the block table's width), so a
    CUDA graph captured for a bucket replays with any seq_lens up to that bound. `out` (q's shape
    and dtype, rows contiguous): where to write, e.g. the leading rows of a mixed step's output."""
    page, n_kv = check_paged_attention_args(q, k_cache, v_cache, block_tables)
    device = q.device
    n_seqs, n_q, head_dim = q.shape
    check(block_tables.shape[0] == n_seqs, "block_tables has {} rows for {} sequences", block_tables.shape[0], n_seqs)
    check_tensor(seq_lens, "seq_lens", ndim=1, dtypes=(torch.int32,), device=device, contiguous=True)
    check_shape(seq_lens, "seq_lens", (n_seqs,))

    if out is None:
        out = torch.empty((n_seqs, n_q, head_dim), dtype=q.dtype, device=device)
    else:
        check_tensor(out, "out", ndim=3, dtypes=(q.dtype,), device=device)
        check_shape(out, "out", tuple(q.shape))
        check(out.stride(2) == 1, "out needs unit stride in its last dim, got {}", out.stride())
    if n_seqs == 0:
        return out
    group = n_q // n_kv
    check(chunk >= 0, "chunk must be non-negative, got {}", chunk)
    if num_splits is None:
        bound = max_seq_len if max_seq_len is not None else block_tables.shape[1] * page
        bound = min(bound, chunk) if chunk else bound  # a chunk is all a sequence reads
        num_splits = choose_num_splits(n_seqs, n_kv, bound)
    check(num_splits >= 1, "num_splits must be positive, got {}", num_splits)
    block_d = next_power_of_2(head_dim)
    block_n, num_warps, num_stages = launch_config(block_d)
    direct = num_splits == 1
    if direct:
        part_o = out  # unused
        part_lse = out
        po_strides, pl_strides = (0, 0, 0), (0, 0)
    else:
        part_o = torch.empty((n_seqs, n_q, num_splits, head_dim), dtype=torch.float32, device=device)
        part_lse = torch.empty((n_seqs, n_q, num_splits), dtype=torch.float32, device=device)
        po_strides = (part_o.stride(0), part_o.stride(1), part_o.stride(2))
        pl_strides = (part_lse.stride(0), part_lse.stride(1))
    _decode_split_kernel[(n_seqs, n_kv, num_splits)](
        q, k_cache, v_cache, block_tables, seq_lens, out, part_o, part_lse,
        float(scale), num_splits,
        q.stride(0), q.stride(1),
        k_cache.stride(0), k_cache.stride(1), k_cache.stride(2),
        v_cache.stride(0), v_cache.stride(1), v_cache.stride(2),
        block_tables.stride(0),
        out.stride(0), out.stride(1),
        *po_strides, *pl_strides,
        GROUP=group, BLOCK_G=max(16, next_power_of_2(group)), HEAD_DIM=head_dim, BLOCK_D=block_d,
        PAGE=page, BLOCK_N=block_n, DIRECT=direct, PRECISION=dot_precision(q.dtype), CHUNK=chunk,
        num_warps=num_warps, num_stages=num_stages, **pdl_args(device),
    )
    if not direct:
        _decode_reduce_kernel[(n_seqs, n_q)](
            part_o, part_lse, out, num_splits,
            *po_strides, *pl_strides, out.stride(0), out.stride(1),
            HEAD_DIM=head_dim, BLOCK_D=block_d, BLOCK_S=next_power_of_2(num_splits),
            num_warps=1 if block_d <= 64 else 2, **pdl_args(device),
        )
    return out
