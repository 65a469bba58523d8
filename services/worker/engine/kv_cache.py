"""The paged KV pool: one K and one V tensor per layer, [num_blocks, block_size, kv_heads, head_dim]."""

from __future__ import annotations

import torch

from services.worker.engine.model_config import ModelConfig


def kv_cache_dtype(name: str, model_dtype: torch.dtype) -> torch.dtype:
    """The pool's dtype for --kv-cache-dtype NAME (EngineConfig.kv_cache_dtype)."""
    return model_dtype if name == "auto" else torch.float8_e4m3fn


def kv_bytes_per_block(cfg: ModelConfig, block_size: int, dtype: torch.dtype) -> int:
    return 2 * cfg.num_hidden_layers * block_size * cfg.kv_size * dtype.itemsize


def num_blocks_for_budget(cfg: ModelConfig, block_size: int, dtype: torch.dtype, budget_bytes: int) -> int:
    return max(0, budget_bytes // kv_bytes_per_block(cfg, block_size, dtype))


class KVCache:
    def __init__(self, cfg: ModelConfig, num_blocks: int, block_size: int, dtype: torch.dtype, device):
        if num_blocks < 1:
            raise ValueError("the KV cache needs at least one block; raise the memory budget or num_blocks")
        self.num_blocks = num_blocks
        self.block_size = block_size
        shape = (cfg.num_hidden_layers, 2, num_blocks, block_size, cfg.num_key_value_heads, cfg.head_dim)
        # One allocation for the whole pool: a single free-memory figure, one tensor to hand to UCX later.
        # Zeroed, so padded graph rows that read block 0 see finite values.
        self.pool = torch.zeros(shape, dtype=dtype, device=device)
        self.layers = [(self.pool[i, 0], self.pool[i, 1]) for i in range(cfg.num_hidden_layers)]

    @property
    def nbytes(self) -> int:
        return self.pool.numel() * self.pool.element_size()
