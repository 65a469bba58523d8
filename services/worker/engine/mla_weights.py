"""Where a latent-attention layer's checkpoint tensors land (DeepSeek's names), whole or as one rank's heads."""

from __future__ import annotations

from services.worker.engine.model_config import ModelConfig
from services.worker.engine.placement import Placement, ShardedTensor, Slice


def mla_tensors(cfg: ModelConfig, local: ModelConfig, src: str, attn: str,
                tp_rank: int = 0) -> dict[str, ShardedTensor]:
    """Checkpoint name → what a rank built with `local` (ParallelLayout.local_config) loads of one
    layer (src "model.layers.{i}.self_attn.", attn its module). The query projection (q_proj, or
    q_a_proj before the bottleneck) and kv_a_proj_with_mqa fill the rows of one fused input
    projection, as q, k and v do for the other families. Tensor parallelism takes the rank's heads
    of q_proj / q_b_proj and kv_b_proj (rows) and of o_proj (columns); the latent's projection,
    its norms and so the cache are whole on every rank."""
    mla, h, heads, mine = cfg.mla, cfg.hidden_size, cfg.num_attention_heads, local.num_attention_heads
    qk, kv_b = mla.qk_nope_head_dim + mla.qk_rope_head_dim, mla.qk_nope_head_dim + mla.v_head_dim
    split = mine < heads
    first = tp_rank * mine

    def whole(shape, param, row=0):
        return ShardedTensor(shape, Placement(param, row, shape))

    def head_rows(width, cols, param):
        return ShardedTensor((heads * width, cols), Placement(param, 0, (mine * width, cols)),
                             Slice(0, first * width, mine * width) if split else None)

    fused = attn + "qkv_proj.weight"
    q_out = mla.q_lora_rank or mine * qk
    out = {
        src + "kv_a_proj_with_mqa.weight": whole((mla.latent_dim, h), fused, q_out),
        src + "kv_a_layernorm.weight": whole((mla.kv_lora_rank,), attn + "kv_a_layernorm"),
        src + "kv_b_proj.weight": head_rows(kv_b, mla.kv_lora_rank, attn + "kv_b_proj"),
        src + "o_proj.weight": ShardedTensor(
            (h, heads * mla.v_head_dim), Placement(attn + "o_proj.weight", 0, (h, mine * mla.v_head_dim)),
            Slice(1, first * mla.v_head_dim, mine * mla.v_head_dim) if split else None),
    }
    if mla.q_lora_rank:
        out[src + "q_a_proj.weight"] = whole((mla.q_lora_rank, h), fused)
        out[src + "q_a_layernorm.weight"] = whole((mla.q_lora_rank,), attn + "q_a_layernorm")
        out[src + "q_b_proj.weight"] = head_rows(qk, mla.q_lora_rank, attn + "q_b_proj.weight")
    else:
        out[src + "q_proj.weight"] = head_rows(qk, h, fused)
    return out
