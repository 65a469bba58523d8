"""The paged KV pool: per layer one K and one V tensor [num_blocks, block_size, kv_heads, head_dim], or
MLA's one latent tensor [num_blocks, block_size, 1, kv_lora_rank + qk_rope_head_dim]."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from services.worker.engine.model_config import ModelConfig


def kv_cache_dtype(name: str, model_dtype: torch.dtype) -> torch.dtype:
    """The pool's dtype for --kv-cache-dtype NAME (EngineConfig.kv_cache_dtype)."""
    return model_dtype if name == "auto" else torch.float8_e4m3fn


@dataclass(frozen=True, slots=True)
class CacheLayout:
    """What one token keeps in one layer: `planes` tensors of heads × dim each, K and V (2 planes), or
    MLA's latent with the rotary key appended (1 plane, 1 head). The model's attention reads the layer
    as the tuple of its planes."""

    planes: int
    heads: int
    dim: int

    @classmethod
    def of(cls, cfg: ModelConfig) -> "CacheLayout":
        if cfg.mla is not None:
            return cls(1, 1, cfg.mla.latent_dim)
        return cls(2, cfg.num_key_value_heads, cfg.head_dim)

    @property
    def graphs_mixed_steps(self) -> bool:
        """Whether steps with prompt chunks can replay CUDA graphs: not over latents, whose prefill
        (kernels/mla_prefill.py) pads to the step's longest query and context, which a graph would
        fix at their bounds (2,048 queries × the longest context, per sequence)."""
        return self.planes == 2

    @property
    def token_elements(self) -> int:
        return self.planes * self.heads * self.dim


def kv_bytes_per_block(cfg: ModelConfig, block_size: int, dtype: torch.dtype) -> int:
    return cfg.num_hidden_layers * block_size * CacheLayout.of(cfg).token_elements * dtype.itemsize


def num_blocks_for_budget(cfg: ModelConfig, block_size: int, dtype: torch.dtype, budget_bytes: int) -> int:
    return max(0, budget_bytes // kv_bytes_per_block(cfg, block_size, dtype))


class KVCache:
    def __init__(self, cfg: ModelConfig, num_blocks: int, block_size: int, dtype: torch.dtype, device):
        if num_blocks < 1:
            raise ValueError("the KV cache needs at least one block; raise the memory budget or num_blocks")
        self.num_blocks = num_blocks
        self.block_size = block_size
        layout = CacheLayout.of(cfg)
        shape = (cfg.num_hidden_layers, layout.planes, num_blocks, block_size, layout.heads, layout.dim)
        # One allocation for the whole pool: a single free-memory figure, one tensor to hand to UCX later.
        # Zeroed, so padded graph rows that read block 0 see finite values.
        self.pool = torch.zeros(shape, dtype=dtype, device=device)
        self.layers = [tuple(self.pool[i, p] for p in range(layout.planes)) for i in range(cfg.num_hidden_layers)]

    @property
    def nbytes(self) -> int:
        return self.pool.numel() * self.pool.element_size()
