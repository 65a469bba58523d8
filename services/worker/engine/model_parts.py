"""The parts of a model's shape (rope scaling, latent attention, Llama 4's layers, experts) and the
error of a config that cannot be served: what model_config.py and config_families.py share."""

from __future__ import annotations

import math
from dataclasses import dataclass

DEEPSEEK_ARCHITECTURES = ("DeepseekV2ForCausalLM", "DeepseekV3ForCausalLM")


class ModelConfigError(ValueError):
    """config.json is missing, unreadable, or describes something we cannot run."""


@dataclass(frozen=True, slots=True)
class RopeScaling:
    """Llama-3.1 style frequency scaling (rope_scaling.rope_type == "llama3")."""

    factor: float
    low_freq_factor: float
    high_freq_factor: float
    original_max_position_embeddings: int


@dataclass(frozen=True, slots=True)
class RopeFreqFactors:
    """Per-frequency divisors of the rotary inverse frequencies: how llama.cpp stores Llama-3.1's
    scaling (the rope_freqs.weight tensor of a GGUF) instead of the four llama3 parameters."""

    freq_factors: tuple[float, ...]


@dataclass(frozen=True, slots=True)
class YarnScaling:
    """YaRN (rope_type "yarn", as DeepSeek's configs use it): the low frequencies divided by the
    factor, the high ones kept, a linear ramp between; cos and sin scaled by attention_factor, and
    the attention's softmax scale by mscale(mscale_all_dim)² (transformers' yarn_apply_mscale)."""

    factor: float
    original_max_position_embeddings: int
    beta_fast: float = 32.0
    beta_slow: float = 1.0
    mscale: float = 0.0
    mscale_all_dim: float = 0.0
    truncate: bool = True

    @staticmethod
    def get_mscale(scale: float, mscale: float = 1.0) -> float:
        return 1.0 if scale <= 1 else 0.1 * mscale * math.log(scale) + 1.0

    @property
    def attention_factor(self) -> float:
        if self.mscale and self.mscale_all_dim:
            return self.get_mscale(self.factor, self.mscale) / self.get_mscale(self.factor, self.mscale_all_dim)
        return self.get_mscale(self.factor)

    @property
    def softmax_scale_factor(self) -> float:
        return self.get_mscale(self.factor, self.mscale_all_dim) ** 2 if self.mscale_all_dim else 1.0


@dataclass(frozen=True, slots=True)
class MLAConfig:
    """Multi-head latent attention (DeepSeek-V2/V3, Kimi K2): per token and layer the cache keeps
    only the latent (kv_lora_rank, after its norm) and the shared rotary key (qk_rope_head_dim);
    kv_b_proj expands the latent to each head's no-rope key and value."""

    kv_lora_rank: int
    qk_nope_head_dim: int
    qk_rope_head_dim: int
    v_head_dim: int
    q_lora_rank: int = 0  # 0: q_proj straight from the hidden state (V2-Lite); else q_a → norm → q_b
    # The checkpoint's rotary dimensions come in interleaved pairs (V2 always; V3 where rope_interleave).
    rope_interleave: bool = True

    @property
    def latent_dim(self) -> int:
        """One cache row: the latent and the rotary key."""
        return self.kv_lora_rank + self.qk_rope_head_dim


@dataclass(frozen=True, slots=True)
class Llama4Config:
    """Llama 4's text model (iRoPE): most layers rotate q and k (in interleaved pairs, as its
    complex-number rotary does) and attend only within their chunk of attention_chunk_size positions
    (chunk = position // size); the NoPE layers rotate nothing, attend to the whole context and
    multiply each query by log(1 + floor((position + 1) / floor_scale)) * attn_scale + 1 (temperature
    tuning). Layer ids are the built model's (ParallelLayout.local_config renumbers a stage's)."""

    nope_layers: tuple[int, ...]
    chunked_layers: tuple[int, ...]
    attention_chunk_size: int  # 0: no layer is chunked
    qk_norm: bool  # use_qk_norm: q and k L2-normed per head (no weight) after the rotation, on the RoPE layers
    temperature_tuning: bool
    floor_scale: float
    attn_scale: float

    def uses_rope(self, layer: int) -> bool:
        return layer not in self.nope_layers

    def chunk(self, layer: int) -> int:
        """The layer's attention chunk in positions; 0: it attends to the whole context."""
        return self.attention_chunk_size if layer in self.chunked_layers else 0


@dataclass(frozen=True, slots=True)
class MoEConfig:
    """A mixture-of-experts MLP: the router picks top_k of num_experts per token (softmax in fp32,
    then top-k, renormalised over the chosen when renormalize); a shared expert, where there is one,
    sees every token through a sigmoid gate (Qwen2-MoE). No capacity factor: no token is dropped."""

    num_experts: int
    top_k: int
    intermediate_size: int  # each expert's
    renormalize: bool
    shared_intermediate_size: int = 0  # 0: no shared expert
    sparse_layers: tuple[int, ...] = ()  # the layers with experts; the others have a dense MLP
    # Expert parallelism: this rank holds experts [first_expert, first_expert + local_experts)
    # (ParallelLayout.local_config); one process holds them all.
    first_expert: int = 0
    local_experts: int = 0  # 0: all of them
    # DeepSeek's routers: "sigmoid" scores (V3) with a learnt bias that only steers the choice
    # (score_bias), experts chosen within the topk_group best of n_group groups (a group scored by
    # its best expert, or by its best two with the bias where score_bias), the weights multiplied by
    # routed_scaling_factor. A shared expert there has no gate (shared_gate False).
    scoring: str = "softmax"
    score_bias: bool = False
    n_group: int = 1
    topk_group: int = 1
    routed_scaling_factor: float = 1.0
    shared_gate: bool = True
    # Llama 4: the router's weight scales each chosen expert's input, not its output (transformers'
    # Llama4TextMoe). For a SiLU-gated expert f(w·x) ≠ w·f(x), so this is not the same model.
    scale_inputs: bool = False

    @property
    def held_experts(self) -> int:
        return self.local_experts or self.num_experts
