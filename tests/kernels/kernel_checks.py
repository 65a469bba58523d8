"""Helpers of the kernel tests: error norms, tolerances, paged-KV builders."""

from __future__ import annotations

import torch


def rel_err(out: torch.Tensor, ref: torch.Tensor) -> float:
    """||out - ref|| / ||ref|| in float64; NaN anywhere in out makes it NaN (and fail)."""
    out64, ref64 = out.double(), ref.double()
    denom = ref64.norm().item()
    num = (out64 - ref64).norm().item()
    return num / denom if denom > 0 else num


TOL = {torch.float32: 1e-5, torch.bfloat16: 1e-2, torch.float16: 2e-3}


def paged_kv(lens, n_kv, head_dim, page, dtype, device, spare_blocks=3):
    """Caches whose blocks are handed out in shuffled order; every slot no sequence owns is NaN.

    Returns (k_cache, v_cache, block_tables [B, M] int32, dense_k, dense_v) where dense_*[b] is
    sequence b's [len, Hkv, D] K/V in position order, as written into the cache.
    """
    lens = [int(x) for x in lens]
    need = [-(-n // page) for n in lens]
    width = max(1, max(need, default=1))
    n_blocks = sum(need) + spare_blocks
    order = torch.randperm(n_blocks).tolist()
    k_cache = torch.full((n_blocks, page, n_kv, head_dim), float("nan"), dtype=dtype, device=device)
    v_cache = torch.full_like(k_cache, float("nan"))
    # Unused table entries point past the pool: a kernel that follows one reads out of bounds.
    tables = torch.full((len(lens), width), 1 << 30, dtype=torch.int32)
    dense_k, dense_v = [], []
    for b, n in enumerate(lens):
        ids = [order.pop() for _ in range(need[b])]
        tables[b, : need[b]] = torch.tensor(ids, dtype=torch.int32)
        k = torch.randn(n, n_kv, head_dim, device=device).to(dtype)
        v = torch.randn(n, n_kv, head_dim, device=device).to(dtype)
        pos = torch.arange(n)
        blk = torch.tensor(ids, dtype=torch.long)[pos // page] if n else pos
        k_cache[blk.to(device), (pos % page).to(device)] = k
        v_cache[blk.to(device), (pos % page).to(device)] = v
        dense_k.append(k)
        dense_v.append(v)
    return k_cache, v_cache, tables.to(device), dense_k, dense_v


def dense_causal_attention(q, k, v, scale, chunk=0):
    """Naive fp64 attention of q [n, Hq, D] over k/v [L, Hkv, D]; row i sees keys 0..L-n+i (chunk > 0:
    only those of its position's chunk, position // chunk)."""
    n, n_q, _ = q.shape
    length, n_kv, _ = k.shape
    group = n_q // n_kv
    kk = k.double().repeat_interleave(group, dim=1)  # [L, Hq, D]
    vv = v.double().repeat_interleave(group, dim=1)
    scores = torch.einsum("nhd,lhd->hnl", q.double(), kk) * scale
    last = length - n + torch.arange(n)
    allowed = torch.arange(length)[None, :] <= last[:, None]
    if chunk:
        allowed &= torch.arange(length)[None, :] >= (last // chunk * chunk)[:, None]
    scores = scores.masked_fill(~allowed.to(scores.device), float("-inf"))
    return torch.einsum("hnl,lhd->nhd", torch.softmax(scores, dim=-1), vv)


def poison_before_chunks(v_cache, tables, first_positions, chunk, page):
    """NaN into V at every position of sequence b before the chunk of first_positions[b]: a kernel that
    reads any of them (and masks it after) gives NaN, one that skips them does not."""
    for b, first in enumerate(first_positions):
        for pos in range(first // chunk * chunk):
            v_cache[tables[b, pos // page].long(), pos % page] = float("nan")
