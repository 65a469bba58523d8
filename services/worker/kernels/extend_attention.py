"""Causal prefill/extend attention over the paged KV cache for a varlen batch: the Triton kernel and its reference."""

from __future__ import annotations

import numpy as np
import torch
import triton
import triton.language as tl

from services.worker.kernels._common import (
    cast_rtne, check, check_paged_attention_args, check_shape, check_tensor, dot_precision, mma,
    next_power_of_2)
from services.worker.kernels.decode_attention import paged_decode_attention_ref


def paged_extend_attention_ref(
    q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, block_tables: torch.Tensor,
    query_start_loc: torch.Tensor, seq_lens: torch.Tensor, scale: float, chunk: int = 0,
) -> torch.Tensor:
    """q: [T, Hq, D]. Sequence b owns rows qsl[b]:qsl[b+1] (its q_len new tokens, whose K/V are
    already in the cache) and has seq_lens[b] tokens of context; its new token i sits at position
    seq_lens[b] - q_len + i and sees cache positions 0..that position. fp32 math, HF's order
    (scores = (q @ k^T) * scale, masked, fp32 softmax, @ v), vectorised per sequence.
    chunk > 0: chunked local attention (Llama 4): a token sees only the positions of its own chunk,
    position // chunk."""
    n_tokens, n_q, head_dim = q.shape
    page, n_kv = k_cache.shape[1], k_cache.shape[2]
    group = n_q // n_kv
    qsl = query_start_loc.tolist()
    lens = seq_lens.tolist()
    n_seqs = len(lens)
    if n_seqs == n_tokens and all(qsl[b + 1] - qsl[b] == 1 for b in range(n_seqs)):
        # All decodes: one batched gather instead of a loop over sequences.
        return paged_decode_attention_ref(q, k_cache, v_cache, block_tables, seq_lens, scale, chunk)
    out = torch.zeros_like(q)
    for b in range(n_seqs):
        start, end, ctx = qsl[b], qsl[b + 1], lens[b]
        n = end - start
        if n <= 0:
            continue
        pos = torch.arange(ctx, device=q.device)
        blocks = block_tables[b, pos // page].long()
        k = k_cache[blocks, pos % page].float().permute(1, 2, 0)  # [Hkv, D, L]
        v = v_cache[blocks, pos % page].float().permute(1, 0, 2)  # [Hkv, L, D]
        qb = q[start:end].float().view(n, n_kv, group, head_dim).permute(1, 2, 0, 3)  # [Hkv, G, n, D]
        scores = torch.matmul(qb, k[:, None]) * scale  # [Hkv, G, n, L]
        last = ctx - n + torch.arange(n, device=q.device)
        allowed = pos[None, :] <= last[:, None]  # [n, L]
        if chunk:
            allowed &= pos[None, :] >= (last // chunk * chunk)[:, None]
        scores = scores.masked_fill(~allowed, float("-inf"))
        probs = torch.softmax(scores, dim=-1)
        o = torch.matmul(probs, v[:, None])  # [Hkv, G, n, D]
        out[start:end] = o.permute(2, 0, 1, 3).reshape(n, n_q, head_dim).to(q.dtype)
    return out


# The block table's width and the work list's length change every step (see rmsnorm.py).
@triton.jit(do_not_specialize=["bt_stride", "tiles_stride", "tile_start"])
def _extend_kernel(
    q_ptr, k_cache_ptr, v_cache_ptr, block_tables_ptr, query_start_loc_ptr, seq_lens_ptr, out_ptr,
    scale,
    q_stride_t, q_stride_h,
    kc_stride_b, kc_stride_o, kc_stride_h, vc_stride_b, vc_stride_o, vc_stride_h,
    bt_stride, out_stride_t, out_stride_h,
    tiles_ptr, tiles_stride, tile_start,
    GROUP: tl.constexpr, GROUP_PAD: tl.constexpr, HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr,
    PAGE: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, PRECISION: tl.constexpr,
    TILED: tl.constexpr, CHUNK: tl.constexpr = 0,
):
    """One program: BLOCK_M // GROUP_PAD new tokens of one sequence times the GROUP query heads
    that share one KV head, so every K/V tile read from the cache serves the whole group.
    Row r of the tile is token r // GROUP_PAD, head r % GROUP_PAD of the group.
    TILED: program i takes tile j = tile_start + i (tiles[0, j] = sequence, tiles[1, j] = its token
    tile), a list the host builds per step, so the grid depends only on the list's length (a CUDA
    graph's padded list ends in sequence -1); else the grid is (token tiles of the longest query,
    kv heads, seqs). CHUNK > 0: a row sees only the keys of its position's chunk; the keys before the
    chunk of the tile's first token are no row's, and are not read."""
    BLOCK_T: tl.constexpr = BLOCK_M // GROUP_PAD
    kv_head = tl.program_id(1)
    if TILED:
        j = tile_start + tl.program_id(0)
        seq = tl.load(tiles_ptr + j).to(tl.int64)
        t_tile = tl.load(tiles_ptr + tiles_stride + j)
        if seq < 0:
            return
    else:
        t_tile = tl.program_id(0)
        seq = tl.program_id(2).to(tl.int64)

    q_start = tl.load(query_start_loc_ptr + seq)
    q_len = tl.load(query_start_loc_ptr + seq + 1) - q_start
    t0 = t_tile * BLOCK_T
    if t0 >= q_len:
        return
    seq_len = tl.load(seq_lens_ptr + seq)
    prefix = seq_len - q_len

    r = tl.arange(0, BLOCK_M)
    i = t0 + r // GROUP_PAD
    g = r % GROUP_PAD
    d = tl.arange(0, BLOCK_D)
    row_mask = (i < q_len) & (g < GROUP)
    d_mask = d < HEAD_DIM
    tokens = (q_start + i).to(tl.int64)
    heads = kv_head * GROUP + g
    q = tl.load(q_ptr + tokens[:, None] * q_stride_t + heads[:, None] * q_stride_h + d[None, :],
                mask=row_mask[:, None] & d_mask[None, :], other=0.0)
    last = prefix + i  # the last key position each query row may see

    m_i = tl.full([BLOCK_M], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_M], tl.float32)
    acc = tl.zeros([BLOCK_M, BLOCK_D], tl.float32)
    bt_row = block_tables_ptr + seq * bt_stride
    # Keys past the tile's last token are never seen; without chunks key 0 is seen by every row, so
    # each row's running max is finite after the first tile.
    kv_end = tl.minimum(seq_len, prefix + t0 + BLOCK_T)
    kv_start = 0
    if CHUNK > 0:
        kv_start = (prefix + t0) // CHUNK * CHUNK
        first = last // CHUNK * CHUNK  # the first key each row may see
    for n0 in range(kv_start, kv_end, BLOCK_N):
        tok = n0 + tl.arange(0, BLOCK_N)
        t_mask = tok < kv_end
        block = tl.load(bt_row + tok // PAGE, mask=t_mask, other=0).to(tl.int64)
        offset = tok % PAGE
        kv_mask = t_mask[:, None] & d_mask[None, :]
        # An fp8 cache is read at half the bytes and widened to q's dtype for the dots.
        k = tl.load(k_cache_ptr + block[:, None] * kc_stride_b + offset[:, None] * kc_stride_o
                    + kv_head * kc_stride_h + d[None, :], mask=kv_mask, other=0.0).to(q.dtype)
        v = tl.load(v_cache_ptr + block[:, None] * vc_stride_b + offset[:, None] * vc_stride_o
                    + kv_head * vc_stride_h + d[None, :], mask=kv_mask, other=0.0).to(q.dtype)
        s = mma(q, tl.trans(k), tl.zeros([BLOCK_M, BLOCK_N], tl.float32), PRECISION) * scale
        allowed = t_mask[None, :] & (tok[None, :] <= last[:, None])
        if CHUNK > 0:
            allowed = allowed & (tok[None, :] >= first[:, None])
        s = tl.where(allowed, s, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(s, axis=1))
        m_ref = m_new
        if CHUNK > 0:
            # A row whose chunk starts past this block has seen no key yet: its max is still -inf,
            # taken as 0 here so its weights are exp(-inf) = 0, not NaN.
            m_ref = tl.where(m_new == float("-inf"), 0.0, m_new)
        alpha = tl.exp(m_i - m_ref)
        p = tl.exp(s - m_ref[:, None])
        l_i = l_i * alpha + tl.sum(p, axis=1)
        acc = mma(cast_rtne(p, v.dtype), v, acc * alpha[:, None], PRECISION)
        m_i = m_new

    o = acc / tl.where(l_i > 0.0, l_i, 1.0)[:, None]
    tl.store(out_ptr + tokens[:, None] * out_stride_t + heads[:, None] * out_stride_h + d[None, :],
             cast_rtne(o, out_ptr.dtype.element_ty), mask=row_mask[:, None] & d_mask[None, :])


def launch_config(max_query_len: int, group_pad: int, head_dim: int) -> tuple[int, int, int, int]:
    """(BLOCK_M rows = tokens x padded group, BLOCK_N keys, num_warps, num_stages) per program."""
    # Tuned on an H100 (8 x 256 new tokens, GQA 4, head_dim 128, bf16): 64 x 32 tiles, 4 warps.
    block_m = max(16, group_pad, min(64, next_power_of_2(max_query_len) * group_pad))
    block_n = 32 if head_dim >= 128 else 64
    num_warps = 4 if block_m * head_dim <= 64 * 128 else 8
    return block_m, block_n, num_warps, 2


TILE_TOKENS = 16  # new tokens per program in the tiled launch


def query_tiles(query_lens, pad_to: int = 0):
    """The tiled launch's work list for these query lengths (host ints or a numpy array):
    [2, n] int64 numpy, row 0 the sequence, row 1 its token tile; padded with sequence -1."""
    lens = np.asarray(query_lens, dtype=np.int64)
    per_seq = -(-lens // TILE_TOKENS)
    n = int(per_seq.sum())
    out = np.full((2, max(n, pad_to)), -1, dtype=np.int64)
    out[0, :n] = np.repeat(np.arange(len(lens)), per_seq)
    starts = np.cumsum(per_seq) - per_seq
    out[1, :n] = np.arange(n) - np.repeat(starts, per_seq)
    return out


def paged_extend_attention(
    q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, block_tables: torch.Tensor,
    query_start_loc: torch.Tensor, seq_lens: torch.Tensor, scale: float, max_query_len: int,
    tiles: torch.Tensor | None = None, out: torch.Tensor | None = None, tile_start: int = 0, chunk: int = 0,
) -> torch.Tensor:
    """Same contract as paged_extend_attention_ref; max_query_len (host int) sizes the grid.
    tiles ([2, n] int32 from query_tiles, on the device): the grid is n programs per KV head
    instead, whatever the queries' lengths (what a CUDA graph of a mixed step needs). With
    tile_start only the tiles from there on run, writing into `out` when given (q's shape and
    dtype), so a caller may leave the leading sequences to another kernel. (An offset, not a view
    of the list: Triton specialises on a pointer's alignment, and a view's would compile a new
    variant in the middle of serving.)"""
    page, n_kv = check_paged_attention_args(q, k_cache, v_cache, block_tables)
    device = q.device
    n_tokens, n_q, head_dim = q.shape
    n_seqs = block_tables.shape[0]
    check_tensor(query_start_loc, "query_start_loc", ndim=1, dtypes=(torch.int32,), device=device,
                 contiguous=True)
    check_shape(query_start_loc, "query_start_loc", (n_seqs + 1,))
    check_tensor(seq_lens, "seq_lens", ndim=1, dtypes=(torch.int32,), device=device, contiguous=True)
    check_shape(seq_lens, "seq_lens", (n_seqs,))
    check(n_seqs <= 65535, "at most 65535 sequences per launch, got {}", n_seqs)
    check(n_kv <= 65535, "at most 65535 kv heads, got {}", n_kv)
    check(max_query_len >= 0, "max_query_len must be non-negative, got {}", max_query_len)
    check(chunk >= 0, "chunk must be non-negative, got {}", chunk)

    if out is None:
        out = torch.empty((n_tokens, n_q, head_dim), dtype=q.dtype, device=device)
    else:
        check(tiles is not None, "out is only taken with a tile list")
        check_tensor(out, "out", ndim=3, dtypes=(q.dtype,), device=device)
        check_shape(out, "out", tuple(q.shape))
        check(out.stride(2) == 1, "out needs unit stride in its last dim, got {}", out.stride())
    if n_tokens == 0 or n_seqs == 0 or max_query_len == 0:
        return out
    block_d = next_power_of_2(head_dim)
    group = n_q // n_kv
    group_pad = next_power_of_2(group)
    if tiles is not None:
        check_tensor(tiles, "tiles", ndim=2, dtypes=(torch.int32,), device=device)
        check(tiles.shape[0] == 2 and tiles.stride(1) == 1, "tiles must be [2, n] with unit column stride, "
              "got shape {} strides {}", tuple(tiles.shape), tiles.stride())
        block_m, block_n, num_warps, num_stages = launch_config(TILE_TOKENS, group_pad, block_d)
        block_m = TILE_TOKENS * group_pad
        num_warps = 4 if block_m * block_d <= 64 * 128 else 8
        check(0 <= tile_start < tiles.shape[1], "tile_start {} outside the list's {} tiles", tile_start, tiles.shape[1])
        grid = (tiles.shape[1] - tile_start, n_kv)
    else:
        block_m, block_n, num_warps, num_stages = launch_config(max_query_len, group_pad, block_d)
        grid = (triton.cdiv(max_query_len, block_m // group_pad), n_kv, n_seqs)
    _extend_kernel[grid](
        q, k_cache, v_cache, block_tables, query_start_loc, seq_lens, out,
        float(scale),
        q.stride(0), q.stride(1),
        k_cache.stride(0), k_cache.stride(1), k_cache.stride(2),
        v_cache.stride(0), v_cache.stride(1), v_cache.stride(2),
        block_tables.stride(0), out.stride(0), out.stride(1),
        tiles if tiles is not None else seq_lens, 0 if tiles is None else tiles.stride(0), tile_start,
        GROUP=group, GROUP_PAD=group_pad, HEAD_DIM=head_dim, BLOCK_D=block_d, PAGE=page,
        BLOCK_M=block_m, BLOCK_N=block_n, PRECISION=dot_precision(q.dtype), TILED=tiles is not None, CHUNK=chunk,
        num_warps=num_warps, num_stages=num_stages,
    )
    return out
