"""Multi-head latent attention (DeepSeek-V2/V3, Kimi K2): the layer that caches one latent row per token."""

from __future__ import annotations

import torch
from torch import nn

from services.worker.engine.attention_metadata import AttentionMetadata
from services.worker.engine.layers import Linear
from services.worker.engine.model_config import ModelConfig
from services.worker.engine.ops import TorchOps


class MLAttention(nn.Module):
    """Queries from the hidden state (q_proj) or through a low-rank bottleneck (q_a_proj, its norm,
    q_b_proj); keys and values from one shared latent (kv_a_proj_with_mqa, then its norm) that
    kv_b_proj expands per head, plus one rotary key shared by the heads. The cache keeps the latent
    and the rotary key (CacheLayout: one plane of kv_lora_rank + qk_rope_head_dim): 576 values a
    token and layer against the expanded keys' and values' 16 × 320 at V2-Lite's 16 heads (8.9 ×)
    and 128 × 320 at DeepSeek-V3's (71 ×).

    Under tensor parallelism a rank holds its heads' rows of q and kv_b_proj and columns of
    o_proj; the latent projection and the cache are the same on every rank."""

    def __init__(self, cfg: ModelConfig, ops: TorchOps):
        super().__init__()
        mla = cfg.mla
        self.num_heads = cfg.num_attention_heads
        self.nope, self.rope, self.v_dim = mla.qk_nope_head_dim, mla.qk_rope_head_dim, mla.v_head_dim
        self.lora, self.q_lora = mla.kv_lora_rank, mla.q_lora_rank
        self.interleave = mla.rope_interleave
        self.eps = 1e-6  # the latent norms' own (DeepSeek's code and transformers), not rms_norm_eps
        qk = self.nope + self.rope
        scaling = cfg.rope_scaling
        self.scale = qk ** -0.5 * getattr(scaling, "softmax_scale_factor", 1.0)
        self.q_out = self.q_lora or self.num_heads * qk
        # The layer's input projections in one GEMM (the decoder layer fuses its norm into it):
        # rows [q_proj or q_a_proj | kv_a_proj_with_mqa], filled by the loader.
        self.qkv_proj = Linear(cfg.hidden_size, self.q_out + mla.latent_dim, ops)
        self.q_a_layernorm = nn.Parameter(torch.empty(self.q_lora)) if self.q_lora else None
        self.q_b_proj = Linear(self.q_lora, self.num_heads * qk, ops) if self.q_lora else None
        self.kv_a_layernorm = nn.Parameter(torch.empty(self.lora))
        # [H * (nope + v), lora]: a GEMM in the expanded form, per-head matrices in the absorbed one
        # (so it stays in the model's dtype under --quantization fp8).
        self.kv_b_proj = nn.Parameter(torch.empty(self.num_heads * (self.nope + self.v_dim), self.lora))
        self.o_proj = Linear(self.num_heads * self.v_dim, cfg.hidden_size, ops)

    def forward(self, qkv, positions, cos_sin, kv_cache, meta: AttentionMetadata, ops: TorchOps):
        n = qkv.shape[0]
        q, compressed = qkv.split([self.q_out, self.lora + self.rope], dim=-1)
        if self.q_b_proj is not None:
            q = self.q_b_proj(ops.rmsnorm(q, self.q_a_layernorm, self.eps))
        q = q.view(n, self.num_heads, self.nope + self.rope)
        latent = ops.rmsnorm(compressed[:, :self.lora], self.kv_a_layernorm, self.eps)  # (row stride free)
        (cache,) = kv_cache
        q_rot = ops.mla_rope_write(q[..., self.nope:], compressed[:, self.lora:], latent, positions, cos_sin, cache,
                                   meta.slot_mapping, self.interleave)
        out = ops.mla_attention(q[..., :self.nope], q_rot, cache, self.kv_b_proj, meta, self.scale, self.v_dim)
        return self.o_proj(out.reshape(n, self.num_heads * self.v_dim))

