"""Multi-head latent attention's absorbed decode over the paged latent cache (split-KV
flash-decoding, several heads a program): kernels and reference.

The up-projections are absorbed: a head's query is its no-rope part times W_UK (so it lives in the
latent space) followed by its rotary part, and its output is a weighted sum of latents that W_UV
maps to the head's value afterwards. Every head then reads the same cache rows [latent | k_rot],
as multi-query attention whose key is the whole row and whose value is the row's latent part.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from services.worker.kernels._common import (
    FLOAT_DTYPES, cast_rtne, check, check_shape, check_tensor, dot_precision, kv_dtypes, mma, next_power_of_2,
    pdl_args, pdl_enter)
from services.worker.kernels.decode_attention import _decode_reduce_kernel


def absorb_query(q_nope: torch.Tensor, q_rot: torch.Tensor, kv_b: torch.Tensor) -> torch.Tensor:
    """[T, H, lora + rope]: each head's no-rope query times its W_UK (kv_b_proj's key rows), so it
    meets the cached latents directly, followed by its rotary query."""
    heads, nope = q_nope.shape[1], q_nope.shape[2]
    w_uk = kv_b.view(heads, -1, kv_b.shape[1])[:, :nope]  # [H, nope, lora]
    q_lat = torch.bmm(q_nope.transpose(0, 1), w_uk).transpose(0, 1)  # [T, H, lora]
    return torch.cat((q_lat, q_rot), dim=-1)


def expand_output(o_lat: torch.Tensor, kv_b: torch.Tensor, nope: int) -> torch.Tensor:
    """[T, H, v]: each head's attention-weighted latent through its W_UV (kv_b_proj's value rows)."""
    heads = o_lat.shape[1]
    w_uv = kv_b.view(heads, -1, kv_b.shape[1])[:, nope:]  # [H, v, lora]
    return torch.bmm(o_lat.transpose(0, 1), w_uv.transpose(1, 2)).transpose(0, 1)


def mla_decode_ref(q: torch.Tensor, cache: torch.Tensor, block_tables: torch.Tensor, seq_lens: torch.Tensor,
                   scale: float, lora_rank: int) -> torch.Tensor:
    """q: [B, H, lora_rank + rope] (absorbed query and rotary query); cache: [N, block_size, 1,
    lora_rank + rope]; sequence b attends to its first seq_lens[b] cached rows (fp32 math).
    Returns [B, H, lora_rank] in q's dtype; a row with seq_lens 0 (padding) gets zeros."""
    n, heads, _ = q.shape
    out = torch.zeros((n, heads, lora_rank), dtype=q.dtype, device=q.device)
    if n == 0:
        return out
    max_len = int(seq_lens.max())
    if max_len == 0:
        return out
    page = cache.shape[1]
    pos = torch.arange(max_len, device=q.device)
    valid = pos[None, :] < seq_lens[:, None].long()  # [B, L]
    # Table entries past a sequence's end may hold anything: never follow them.
    blocks = torch.where(valid, block_tables[:, pos // page].long(), 0)
    rows = cache[blocks, pos % page, 0].float()  # [B, L, D]
    scores = torch.einsum("bhd,bld->bhl", q.float(), rows) * scale
    scores = scores.masked_fill(~valid[:, None, :], float("-inf"))
    probs = torch.nan_to_num(torch.softmax(scores, dim=-1), nan=0.0)  # rows with no context at all
    latents = rows[..., :lora_rank].masked_fill(~valid[:, :, None], 0.0)
    return torch.einsum("bhl,bld->bhd", probs, latents).to(q.dtype)


# Several heads share a program (all read the same rows), so one KV tile feeds BLOCK_H heads through
# tensor-core dots; 16 is the smallest M of an mma, and DeepSeek's heads per GPU (128 / TP) are
# multiples of it.
BLOCK_H = 16
# A split should stream enough rows to hide its fixed cost (q's load, the partial's store and its
# reduce). At (32, 4, 3) a program holds ~250 registers a thread and ~93 KB of shared memory, so
# 2 are resident per SM: 264 programs on 132 SMs (H100 / H200 SXM) are one full wave. The split
# count fills that wave without passing it, since a second, partial wave costs as much as a full
# one. H200, B=64 H=16 ctx 4,096: 4 splits (256 programs) 86 us; 6 (384) +31 %; 8 (512) +10 %.
_MIN_TOKENS_PER_SPLIT = 128
_PROGRAMS_PER_WAVE = 264
_MAX_SPLITS = 32


# The split count and the block table's width change between steps; specialising on them would
# compile new variants while serving, for no gain.
@triton.jit(do_not_specialize=["num_splits", "bt_stride", "pl_stride_b", "pl_stride_h"])
def _mla_split_kernel(
    q_ptr, cache_ptr, block_tables_ptr, seq_lens_ptr, out_ptr, part_o_ptr, part_lse_ptr,
    scale, num_splits,
    q_stride_b, q_stride_h, c_stride_b, c_stride_o, bt_stride, out_stride_b, out_stride_h,
    po_stride_b, po_stride_h, po_stride_s, pl_stride_b, pl_stride_h,
    HEADS: tl.constexpr, LORA: tl.constexpr, ROPE: tl.constexpr, BLOCK_L: tl.constexpr,
    BLOCK_R: tl.constexpr, BLOCK_H: tl.constexpr, PAGE: tl.constexpr, BLOCK_N: tl.constexpr,
    DIRECT: tl.constexpr, PRECISION: tl.constexpr, PDL: tl.constexpr = False,
):
    pdl_enter(PDL)
    # Head blocks vary fastest in launch order, so the programs that read the same rows run
    # together and can share them through L2. (With 128 heads, 8 head blocks, a step still costs
    # ~8x the 16-head one on an H200: per-tile work, not bytes, bounds it there.)
    head_block = tl.program_id(0)
    split = tl.program_id(1)
    seq = tl.program_id(2).to(tl.int64)

    seq_len = tl.load(seq_lens_ptr + seq)
    # Each sequence is cut into num_splits equal runs of whole BLOCK_N tiles.
    split_len = tl.cdiv(tl.cdiv(seq_len, num_splits), BLOCK_N) * BLOCK_N
    start = split * split_len
    end = tl.minimum(start + split_len, seq_len)

    h = head_block * BLOCK_H + tl.arange(0, BLOCK_H)
    l = tl.arange(0, BLOCK_L)
    r = tl.arange(0, BLOCK_R)
    h_mask = h < HEADS
    l_mask = l < LORA
    r_mask = r < ROPE
    q_row = q_ptr + seq * q_stride_b + h[:, None] * q_stride_h
    q_lat = tl.load(q_row + l[None, :], mask=h_mask[:, None] & l_mask[None, :], other=0.0)
    q_rope = tl.load(q_row + LORA + r[None, :], mask=h_mask[:, None] & r_mask[None, :], other=0.0)
    if cache_ptr.dtype.element_ty == tl.float8e4nv and q_lat.dtype == tl.bfloat16:
        # As in decode_attention: e4m3 widens to fp16 in one instruction per pair (to bf16 it takes
        # more), so the dots run in fp16 (q clamped to its range; p and the fp8 values lose nothing).
        # Not yet fast: Triton widens the tile in registers once per dot layout and spills, so at
        # the bench's shape an fp8 cache takes 141 us against bf16's 90 whatever the launch config.
        q_lat = tl.clamp(q_lat.to(tl.float32), -65504.0, 65504.0).to(tl.float16)
        q_rope = tl.clamp(q_rope.to(tl.float32), -65504.0, 65504.0).to(tl.float16)

    m_i = tl.full([BLOCK_H], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_H], tl.float32)
    acc = tl.zeros([BLOCK_H, BLOCK_L], tl.float32)
    bt_row = block_tables_ptr + seq * bt_stride
    # Each tile's block ids are read one iteration ahead, so the tile's address comes from the loop
    # carry, not from a load in the same iteration: only then does Triton's pipeliner give the
    # tile num_stages - 1 buffers and load it while the previous one is computed (with the ids
    # loaded in-iteration it keeps one buffer whatever num_stages says: 2.6 TB/s instead of 3.5).
    tok = start + tl.arange(0, BLOCK_N)
    next_block = tl.load(bt_row + tok // PAGE, mask=tok < end, other=0)
    for n0 in range(start, end, BLOCK_N):
        tok = n0 + tl.arange(0, BLOCK_N)
        t_mask = tok < end
        block = next_block.to(tl.int64)
        next_tok = tok + BLOCK_N
        next_block = tl.load(bt_row + next_tok // PAGE, mask=next_tok < end, other=0)
        rows = cache_ptr + block[:, None] * c_stride_b + (tok % PAGE)[:, None] * c_stride_o
        # Padded columns are masked only where there are any: a mask constant along a row keeps
        # the row's loads wide.
        if LORA == BLOCK_L:
            lat_mask = t_mask[:, None]
        else:
            lat_mask = t_mask[:, None] & l_mask[None, :]
        if ROPE == BLOCK_R:
            rope_mask = t_mask[:, None]
        else:
            rope_mask = t_mask[:, None] & r_mask[None, :]
        # The key is the whole row [latent | k_rot] and the value its latent: one tile serves both.
        k_lat = tl.load(rows + l[None, :], mask=lat_mask, other=0.0).to(q_lat.dtype)
        k_rope = tl.load(rows + LORA + r[None, :], mask=rope_mask, other=0.0).to(q_lat.dtype)
        s = mma(q_lat, tl.trans(k_lat), tl.zeros([BLOCK_H, BLOCK_N], tl.float32), PRECISION)
        s = mma(q_rope, tl.trans(k_rope), s, PRECISION) * scale
        s = tl.where(t_mask[None, :], s, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(s, axis=1))
        alpha = tl.exp(m_i - m_new)
        p = tl.exp(s - m_new[:, None])
        l_i = l_i * alpha + tl.sum(p, axis=1)
        acc = mma(cast_rtne(p, k_lat.dtype), k_lat, acc * alpha[:, None], PRECISION)
        m_i = m_new

    has = l_i > 0.0
    o = acc / tl.where(has, l_i, 1.0)[:, None]
    mask = h_mask[:, None] & l_mask[None, :]
    if DIRECT:
        tl.store(out_ptr + seq * out_stride_b + h[:, None] * out_stride_h + l[None, :],
                 cast_rtne(o, out_ptr.dtype.element_ty), mask=mask)
    else:
        tl.store(part_o_ptr + seq * po_stride_b + h[:, None] * po_stride_h + split * po_stride_s + l[None, :],
                 o, mask=mask)
        lse = tl.where(has, m_i + tl.log(tl.where(has, l_i, 1.0)), float("-inf"))
        tl.store(part_lse_ptr + seq * pl_stride_b + h * pl_stride_h + split, lse, mask=h_mask)


def launch_config(block_l: int) -> tuple[int, int, int]:
    """(BLOCK_N rows per KV tile, num_warps, num_stages) of the split kernel for a padded lora width.

    Swept on an H200 at B=64 H=16 ctx 4,096, lora 512 + rope 64, bf16, each at its best split
    count: (32, 4, 3) 3.37-3.50 TB/s of cache read over four runs (79-82 % of a 4.28 TB/s copy);
    (32, 4, 2) 3.12 (one tile in flight); (32, 4, 4) 3.03 (130 KB of buffers: one program an SM);
    (64, 8, 3) 2.89; (16, 4, 3) 2.60; (32, 8, 3) 2.55 (8 warps cannot split a 16 x 32 score
    tile). Four warps keep the BLOCK_H x 512 fp32 accumulator at 64 registers a thread. Neither
    a wgmma form (keys as M: scores^T = K q^T) nor the lora width cut into 4 batched chunks beat it."""
    return 32, 4, 3


def choose_num_splits(batch: int, head_blocks: int, max_seq_len: int) -> int:
    """As many splits as one wave of resident programs holds, never so many that a split streams
    under _MIN_TOKENS_PER_SPLIT rows."""
    by_len = triton.cdiv(max(1, max_seq_len), _MIN_TOKENS_PER_SPLIT)
    by_grid = _PROGRAMS_PER_WAVE // max(1, batch * head_blocks)
    return max(1, min(by_len, by_grid, _MAX_SPLITS))


def mla_decode(q: torch.Tensor, cache: torch.Tensor, block_tables: torch.Tensor, seq_lens: torch.Tensor,
               scale: float, lora_rank: int, max_seq_len: int, out: torch.Tensor | None = None,
               num_splits: int | None = None) -> torch.Tensor:
    """Same contract as mla_decode_ref. No host sync and no value-dependent allocation: the split
    count comes from the shapes and max_seq_len (a host-side bound on seq_lens that only tunes the
    grid; any seq_lens give the right answer), so a CUDA graph captured for a bucket replays with
    any seq_lens up to it. `out` ([B, H, lora_rank], q's dtype, unit stride in its last dim, e.g. a
    view into a larger buffer): where to write. num_splits overrides the split count (tests)."""
    check_tensor(q, "q", ndim=3, dtypes=FLOAT_DTYPES)
    n_seqs, n_heads, width = q.shape
    device = q.device
    check(0 < lora_rank < width, "lora_rank {} must be in (0, {}) (q's last dim, lora + rope)", lora_rank, width)
    rope = width - lora_rank
    check_tensor(cache, "cache", ndim=4, dtypes=kv_dtypes(q.dtype), device=device)
    n_blocks, page = cache.shape[0], cache.shape[1]
    check_shape(cache, "cache", (n_blocks, page, 1, width))
    check(page > 0 and page & (page - 1) == 0, "block size must be a power of two, got {}", page)
    check_tensor(block_tables, "block_tables", ndim=2, dtypes=(torch.int32,), device=device)
    check(block_tables.shape[0] == n_seqs, "block_tables has {} rows for {} sequences", block_tables.shape[0], n_seqs)
    check_tensor(seq_lens, "seq_lens", ndim=1, dtypes=(torch.int32,), device=device, contiguous=True)
    check_shape(seq_lens, "seq_lens", (n_seqs,))
    check(isinstance(max_seq_len, int) and max_seq_len >= 0, "max_seq_len must be a python int >= 0, got {!r}",
          max_seq_len)
    if out is None:
        out = torch.empty((n_seqs, n_heads, lora_rank), dtype=q.dtype, device=device)
    else:
        check_tensor(out, "out", ndim=3, dtypes=(q.dtype,), device=device)
        check_shape(out, "out", (n_seqs, n_heads, lora_rank))
    if n_seqs == 0:
        return out

    head_blocks = triton.cdiv(n_heads, BLOCK_H)
    if num_splits is None:
        num_splits = choose_num_splits(n_seqs, head_blocks, max_seq_len)
    check(num_splits >= 1, "num_splits must be positive, got {}", num_splits)
    block_l = max(16, next_power_of_2(lora_rank))
    block_n, num_warps, num_stages = launch_config(block_l)
    direct = num_splits == 1
    if direct:
        part_o = part_lse = out  # unused
        po_strides, pl_strides = (0, 0, 0), (0, 0)
    else:
        part_o = torch.empty((n_seqs, n_heads, num_splits, lora_rank), dtype=torch.float32, device=device)
        part_lse = torch.empty((n_seqs, n_heads, num_splits), dtype=torch.float32, device=device)
        po_strides = (part_o.stride(0), part_o.stride(1), part_o.stride(2))
        pl_strides = (part_lse.stride(0), part_lse.stride(1))
    _mla_split_kernel[(head_blocks, num_splits, n_seqs)](
        q, cache, block_tables, seq_lens, out, part_o, part_lse,
        float(scale), num_splits,
        q.stride(0), q.stride(1), cache.stride(0), cache.stride(1), block_tables.stride(0),
        out.stride(0), out.stride(1), *po_strides, *pl_strides,
        HEADS=n_heads, LORA=lora_rank, ROPE=rope, BLOCK_L=block_l, BLOCK_R=max(16, next_power_of_2(rope)),
        BLOCK_H=BLOCK_H, PAGE=page, BLOCK_N=block_n, DIRECT=direct, PRECISION=dot_precision(q.dtype),
        num_warps=num_warps, num_stages=num_stages, **pdl_args(device),
    )
    if not direct:
        # The splits' merge is decode attention's: partial outputs and log-sum-exps per (row, head).
        _decode_reduce_kernel[(n_seqs, n_heads)](
            part_o, part_lse, out, num_splits,
            *po_strides, *pl_strides, out.stride(0), out.stride(1),
            HEAD_DIM=lora_rank, BLOCK_D=block_l, BLOCK_S=next_power_of_2(num_splits),
            num_warps=4 if block_l >= 256 else 1, **pdl_args(device),
        )
    return out
