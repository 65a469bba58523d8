"""Llama 4's attention (iRoPE): chunked local attention with rotary and QK-norm, or global NoPE attention."""

from __future__ import annotations

import torch
from torch import nn

from services.worker.engine.attention_metadata import AttentionMetadata
from services.worker.engine.layers import Linear
from services.worker.engine.model_config import ModelConfig
from services.worker.engine.ops import TorchOps


def attention_temperature(positions: torch.Tensor, floor_scale: float, attn_scale: float) -> torch.Tensor:
    """[T] float32: the factor on each query of a NoPE layer, log(1 + floor((position + 1) / floor_scale))
    * attn_scale + 1, in transformers' fp32 steps. It grows with the log of the distance a global layer
    must look back, keeping the softmax sharp over long contexts (arXiv 2501.19399)."""
    return torch.log1p(torch.floor((positions.float() + 1.0) / floor_scale)) * attn_scale + 1.0


class Llama4Attention(nn.Module):
    """Llama 4's layer of attention. A RoPE layer rotates q and k in interleaved pairs (transformers'
    complex-number rotary; the kernel reads them so and writes the half-split order, for q and the
    cached k alike, which leaves every dot product as it was), L2-norms them per head where
    use_qk_norm, and attends within its chunk of positions. A NoPE layer rotates nothing, scales the
    queries by attention_temperature where attn_temperature_tuning, and attends to the whole context.
    Under tensor parallelism a rank holds its heads, as for Attention."""

    def __init__(self, cfg: ModelConfig, ops: TorchOps, layer_id: int):
        super().__init__()
        llama4 = cfg.llama4
        self.num_heads, self.num_kv_heads = cfg.num_attention_heads, cfg.num_key_value_heads
        self.head_dim = cfg.head_dim
        self.q_size, self.kv_size = cfg.q_size, cfg.kv_size
        self.scale = self.head_dim ** -0.5
        self.qkv_proj = Linear(cfg.hidden_size, self.q_size + 2 * self.kv_size, ops)
        self.o_proj = Linear(self.q_size, cfg.hidden_size, ops)
        self.rope = llama4.uses_rope(layer_id)
        self.chunk = llama4.chunk(layer_id)
        self.norm_eps = cfg.rms_norm_eps if llama4.qk_norm and self.rope else None
        self.temperature = (llama4.floor_scale, llama4.attn_scale) if (
            llama4.temperature_tuning and not self.rope) else None

    def forward(self, qkv, positions, cos_sin, kv_cache, meta: AttentionMetadata, ops: TorchOps):
        n = qkv.shape[0]
        q, k, v = qkv.split([self.q_size, self.kv_size, self.kv_size], dim=-1)
        q = q.view(n, self.num_heads, self.head_dim)
        k = k.view(n, self.num_kv_heads, self.head_dim)
        v = v.view(n, self.num_kv_heads, self.head_dim)
        q_scale = attention_temperature(positions, *self.temperature) if self.temperature else None
        k_cache, v_cache = kv_cache
        q, _ = ops.rope_kv_write(q, k, v, positions, cos_sin if self.rope else None, k_cache, v_cache,
                                 meta.slot_mapping, interleave=True, norm_eps=self.norm_eps, q_scale=q_scale)
        out = ops.attention(q, k_cache, v_cache, meta, self.scale, self.chunk)
        return self.o_proj(out.reshape(n, self.q_size))
