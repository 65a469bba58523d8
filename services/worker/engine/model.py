"""The decoder-only transformer shared by Llama, Mistral, Qwen2, Qwen3, their mixture-of-experts kin
(Mixtral, Qwen2-MoE, Qwen3-MoE, OLMoE), DeepSeek-V2/V3 (latent attention) and Llama 4 (iRoPE), with
fused weights."""

from __future__ import annotations

import torch
from torch import nn

from services.worker.engine.attention_metadata import AttentionMetadata
from services.worker.engine.layers import MLP, Embedding, Linear
from services.worker.engine.llama4 import Llama4Attention
from services.worker.engine.mla import MLAttention
from services.worker.engine.model_config import ModelConfig
from services.worker.engine.moe import MoE
from services.worker.engine.ops import TorchOps
from services.worker.kernels.rope import rope_cos_sin_cache


class Attention(nn.Module):
    def __init__(self, cfg: ModelConfig, ops: TorchOps):
        super().__init__()
        self.num_heads = cfg.num_attention_heads
        self.num_kv_heads = cfg.num_key_value_heads
        self.head_dim = cfg.head_dim
        self.q_size, self.kv_size = cfg.q_size, cfg.kv_size
        self.scale = self.head_dim ** -0.5
        self.eps = cfg.rms_norm_eps
        # q, k and v in one GEMM: the rows are [q | k | v], filled by the loader from three tensors.
        self.qkv_proj = Linear(cfg.hidden_size, self.q_size + 2 * self.kv_size, ops, bias=cfg.attention_bias)
        self.o_proj = Linear(self.q_size, cfg.hidden_size, ops)
        # QK-norm: over each head (Qwen3), or over the whole of q and of k (OLMoE).
        self.qk_norm_whole = cfg.qk_norm_whole
        self.q_norm = nn.Parameter(torch.empty(self.q_size if self.qk_norm_whole else self.head_dim)) if (
            cfg.qk_norm) else None
        self.k_norm = nn.Parameter(torch.empty(self.kv_size if self.qk_norm_whole else self.head_dim)) if (
            cfg.qk_norm) else None
        self.clip_qkv = cfg.clip_qkv

    def forward(self, qkv, positions, cos_sin, kv_cache, meta: AttentionMetadata, ops: TorchOps):
        """qkv: qkv_proj of the layer's normed input (DecoderLayer makes it: the norm may be fused into it)."""
        n = qkv.shape[0]
        q, k, v = qkv.split([self.q_size, self.kv_size, self.kv_size], dim=-1)
        if self.qk_norm_whole:
            q, k = ops.rmsnorm_all_heads(q, self.q_norm, self.eps), ops.rmsnorm_all_heads(k, self.k_norm, self.eps)
        elif self.q_norm is not None:
            q = ops.rmsnorm(q.reshape(-1, self.head_dim), self.q_norm, self.eps)
            k = ops.rmsnorm(k.reshape(-1, self.head_dim), self.k_norm, self.eps)
        if self.clip_qkv is not None:
            q, k, v = (t.clamp(-self.clip_qkv, self.clip_qkv) for t in (q, k, v))
        q = q.view(n, self.num_heads, self.head_dim)
        k = k.view(n, self.num_kv_heads, self.head_dim)
        v = v.view(n, self.num_kv_heads, self.head_dim)
        k_cache, v_cache = kv_cache
        q, _ = ops.rope_kv_write(q, k, v, positions, cos_sin, k_cache, v_cache, meta.slot_mapping)
        out = ops.attention(q, k_cache, v_cache, meta, self.scale)
        return self.o_proj(out.reshape(n, self.q_size))


class DecoderLayer(nn.Module):
    def __init__(self, cfg: ModelConfig, ops: TorchOps, layer_id: int = 0):
        """layer_id: the layer's index in the model this one builds (a pipeline stage's are
        renumbered from 0; ParallelLayout.local_config renumbers an MoE's sparse layers too)."""
        super().__init__()
        self.eps = cfg.rms_norm_eps
        self.input_layernorm = nn.Parameter(torch.empty(cfg.hidden_size))
        if cfg.mla is not None:
            self.self_attn = MLAttention(cfg, ops)
        elif cfg.llama4 is not None:
            self.self_attn = Llama4Attention(cfg, ops, layer_id)
        else:
            self.self_attn = Attention(cfg, ops)
        self.post_attention_layernorm = nn.Parameter(torch.empty(cfg.hidden_size))
        self.mlp = MoE(cfg, ops) if cfg.is_sparse(layer_id) else MLP(cfg, ops)
        # An EAGLE-3 head reads the residual stream at this layer's input: kept as `stream` when set
        # (DecoderLM.keep_streams). It is the sum the input norm makes, all-reduced under tensor parallelism.
        self.keep_stream = False
        self.stream: torch.Tensor | None = None

    def forward(self, x, residual, positions, cos_sin, kv_cache, meta, ops: TorchOps):
        # Each norm with the projection that reads it: one kernel where the ops fuse them (decode).
        qkv_proj = self.self_attn.qkv_proj
        if residual is None:
            residual = x
            qkv = qkv_proj(ops.rmsnorm(x, self.input_layernorm, self.eps))
        else:
            qkv, residual = ops.add_rmsnorm_linear(x, residual, self.input_layernorm, self.eps, qkv_proj)
        if self.keep_stream:
            self.stream = residual
        h = self.self_attn(qkv, positions, cos_sin, kv_cache, meta, ops)
        return self.mlp(h, residual, self.post_attention_layernorm, self.eps, ops)


class DecoderLM(nn.Module):
    """Embeddings, N decoder layers, final norm and the LM head (tied or not)."""

    def __init__(self, cfg: ModelConfig, ops: TorchOps):
        super().__init__()
        self.cfg = cfg
        self.ops = ops
        self.embed_tokens = Embedding(cfg.vocab_size, cfg.hidden_size)
        self.layers = nn.ModuleList(DecoderLayer(cfg, ops, i) for i in range(cfg.num_hidden_layers))
        self.norm = nn.Parameter(torch.empty(cfg.hidden_size))
        self.lm_head = None if cfg.tie_word_embeddings else nn.Parameter(
            torch.empty(cfg.vocab_size, cfg.hidden_size))
        # Rotary tables are computed, not loaded: a buffer filled by init_rope() after loading.
        self.register_buffer("cos_sin", torch.empty(0), persistent=False)
        # Layers whose input (the residual stream there) an EAGLE-3 head reads, and that input of the
        # last forward's tokens, concatenated [T, len(aux_layers) * hidden] (eagle3_drafter.py).
        self.aux_layers: tuple[int, ...] = ()
        self.aux_hidden: torch.Tensor | None = None

    def keep_streams(self, layer_ids) -> None:
        """Keep the residual stream at these layers' inputs, concatenated in this order, as aux_hidden
        after each forward (an EAGLE-3 head's inputs; a layer may be named twice)."""
        self.aux_layers = tuple(layer_ids)
        for i, layer in enumerate(self.layers):
            layer.keep_stream = i in self.aux_layers

    def init_rope(self, max_positions: int, device) -> None:
        cfg = self.cfg
        self.cos_sin = rope_cos_sin_cache(
            cfg.rope_dim, max_positions, cfg.rope_theta, cfg.rope_scaling).to(device)

    def forward(self, input_ids, positions, kv_caches, meta: AttentionMetadata) -> torch.Tensor:
        h = self.embed_tokens(input_ids)
        residual = None
        for layer, kv_cache in zip(self.layers, kv_caches):
            h, residual = layer(h, residual, positions, self.cos_sin, kv_cache, meta, self.ops)
        if self.aux_layers:  # (a forward over the first layers only, as the memory profile's, keeps none)
            self.aux_hidden = torch.cat([self.layers[i].stream for i in self.aux_layers], dim=-1) if len(
                kv_caches) == len(self.layers) else None
        h, _ = self.ops.add_rmsnorm(h, residual, self.norm, self.cfg.rms_norm_eps)
        return h

    def keep_fp32(self) -> "DecoderLM":
        """After a cast to the serving dtype: the parameters kept in fp32 as they were trained (an MoE
        router's score correction bias, whose small differences pick the experts) back to fp32."""
        for module in self.modules():
            bias = getattr(module, "score_bias", None)
            if isinstance(bias, nn.Parameter):
                module.score_bias = nn.Parameter(bias.float(), requires_grad=False)
        return self

    def finish_load(self) -> None:
        """What the loaded weights become before serving: DeepSeek's shared experts into the stacked
        experts (MoE.fuse_shared_experts)."""
        for module in self.layers.modules():
            if isinstance(module, MoE):
                module.fuse_shared_experts()

    def quantize_fp8(self) -> None:
        """Every projection of every layer to e4m3 weights; embeddings and the LM head stay as
        they are (as vLLM's fp8: the head's precision shows in every sampled token), and so do the
        MoE routers (a few rows, whose rounding would move tokens between experts; an 8-row gate
        is no GEMM shape for fp8 either)."""
        routers = {id(m.gate) for m in self.layers.modules() if isinstance(m, MoE)}
        for module in self.layers.modules():
            if isinstance(module, (Linear, MoE)) and id(module) not in routers:
                module.quantize_fp8()

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        head = self.embed_tokens.weight if self.lm_head is None else self.lm_head
        # In the model's dtype: the GEMM rounds to it anyway, so an fp32 copy would hold the same
        # values at twice the bytes for every reader (the draw reads a row two or three times).
        # The sampler's kernels and argmax read bf16; penalties and logprobs widen first.
        return self.ops.linear(hidden, head)
