"""A request's KV as pages: one page is one block's K and V (or MLA latents) of every layer, [L, planes,
block_size, heads, dim] (kv_cache.CacheLayout), so a run of pages is one contiguous buffer that moves in one transfer (prefill → decode
hand-off, the kvstore) and any suffix of it (the blocks a receiver lacks) stays contiguous."""

from __future__ import annotations

import torch

from services.worker.engine.kv_cache import CacheLayout, KVCache, kv_bytes_per_block
from services.worker.engine.model_config import ModelConfig
from services.worker.kernels._common import byte_view, copy_rows_


def page_layout(model_id: str, cfg: ModelConfig, block_size: int, dtype: torch.dtype) -> str:
    """What a page's bytes mean; two workers exchange pages only when their layouts are equal."""
    name = str(dtype).removeprefix("torch.")
    layout = CacheLayout.of(cfg)
    return (f"m={model_id}|dt={name}|bs={block_size}|L={cfg.num_hidden_layers}"
            f"|P={layout.planes}|H={layout.heads}|D={layout.dim}")


def page_bytes(cfg: ModelConfig, block_size: int, dtype: torch.dtype) -> int:
    return kv_bytes_per_block(cfg, block_size, dtype)


def page_shape(kv: KVCache) -> tuple[int, ...]:
    """One page of this pool: [L, planes, block_size, heads, dim]."""
    layers, planes, _, bs, h, d = kv.pool.shape
    return layers, planes, bs, h, d


def gather_pages(kv: KVCache, block_ids: list[int], out: torch.Tensor | None = None) -> torch.Tensor:
    """These blocks as contiguous pages [n, L, planes, block_size, H, D] on the pool's device: in `out` (a
    hand-off slot) when given, else in a new tensor."""
    if out is None:
        out = empty_pages(kv, len(block_ids))
    elif out.shape[0] != len(block_ids) or out.shape[1:] != page_shape(kv):
        raise ValueError(f"a slot of shape {tuple(out.shape)} does not hold {len(block_ids)} pages of this pool")
    idx = torch.tensor(block_ids, dtype=torch.long, device=kv.pool.device)
    torch.index_select(byte_view(kv.pool), 2, idx, out=byte_view(out).permute(1, 2, 0, 3, 4, 5))
    return out


def empty_pages(kv: KVCache, n: int) -> torch.Tensor:
    """A receive buffer for n pages, on the pool's device (UCX writes GPU memory directly)."""
    return torch.empty((n, *page_shape(kv)), dtype=kv.pool.dtype, device=kv.pool.device)


def scatter_pages(kv: KVCache, block_ids: list[int], pages: torch.Tensor) -> None:
    """Write pages [n, L, planes, bs, H, D] into these blocks of the pool."""
    if pages.shape[0] != len(block_ids) or pages.shape[1:] != page_shape(kv):
        raise ValueError(f"pages of shape {tuple(pages.shape)} do not fit {len(block_ids)} blocks of this pool")
    idx = torch.tensor(block_ids, dtype=torch.long, device=kv.pool.device)
    copy_rows_(kv.pool, 2, idx, pages.to(kv.pool.device).permute(1, 2, 0, 3, 4, 5))
