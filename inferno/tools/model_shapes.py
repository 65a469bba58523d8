"""The shapes make-model writes: presets, and per architecture its config.json and its tensors."""

from __future__ import annotations

import math
from dataclasses import dataclass

from inferno.tools import deepseek_shapes as ds
from inferno.tools import llama4_shapes as l4

INIT_STD = 0.02

# --------------------------------------------------------------------------------------------
# Presets
# --------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class Preset:
    """Model shapes. vocab_size None means: the tokenizer's size rounded up to a multiple of 64."""

    hidden_size: int
    num_hidden_layers: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    intermediate_size: int
    vocab_size: int | None
    max_position_embeddings: int
    rope_theta: float = 10000.0
    rope_scaling: dict | None = None
    rms_norm_eps: float = 1e-5
    tie_word_embeddings: bool = False
    architecture: str = "LlamaForCausalLM"  # used when write_model gets arch=None
    # Used instead of rope_scaling when the architecture is LlamaForCausalLM: lets the tiny Llama
    # exercise Llama-3.1's frequency scaling while the other tiny architectures keep plain RoPE.
    llama_rope_scaling: dict | None = None
    # Mixture of experts, used when the architecture is one (Mixtral, Qwen2/3-MoE, OLMoE): the
    # number of experts, how many a token goes to, each one's intermediate size, Qwen2-MoE's shared
    # expert, and whether the top-k weights are renormalised (Qwen3-MoE's norm_topk_prob).
    num_experts: int = 0
    num_experts_per_tok: int = 0
    moe_intermediate_size: int = 0
    shared_expert_intermediate_size: int = 0
    norm_topk_prob: bool = False
    # DeepSeek-V2/V3's own config keys (latent attention, routing, YaRN): deepseek_shapes.py; None
    # takes the tiny ones there.
    deepseek: dict | None = None
    # Llama 4's own config keys (iRoPE, chunked attention, temperature tuning, routing): llama4_shapes.py;
    # None takes the tiny ones there. Its dense layers' width is intermediate_size, its experts'
    # moe_intermediate_size.
    llama4: dict | None = None

    def rope_scaling_for(self, arch: str) -> dict | None:
        if arch == "LlamaForCausalLM" and self.llama_rope_scaling is not None:
            return dict(self.llama_rope_scaling)
        return dict(self.rope_scaling) if self.rope_scaling else None


# Llama-3.1's frequency scaling (every size of the family uses the same).
LLAMA_3_1_ROPE_SCALING = {
    "factor": 8.0,
    "low_freq_factor": 1.0,
    "high_freq_factor": 4.0,
    "original_max_position_embeddings": 8192,
    "rope_type": "llama3",
}

PRESETS: dict[str, Preset] = {
    # Tests and the demo: fast on CPU. As a Llama it has llama3 rope scaling, scaled down so
    # that its 8 frequencies fall in all three bands (kept: wavelength < 64, blended: 64..256,
    # divided by the factor: > 256).
    "tiny": Preset(
        hidden_size=64, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
        head_dim=16, intermediate_size=128, vocab_size=None, max_position_embeddings=2048,
        rope_theta=10000.0,
        num_experts=4, num_experts_per_tok=2, moe_intermediate_size=32, shared_expert_intermediate_size=64,
        llama_rope_scaling={
            "factor": 8.0,
            "low_freq_factor": 1.0,
            "high_freq_factor": 4.0,
            "original_max_position_embeddings": 256,
            "rope_type": "llama3",
        },
    ),
    # A mid-size CPU benchmark model (~0.1 B parameters).
    "small": Preset(
        hidden_size=512, num_hidden_layers=8, num_attention_heads=8, num_key_value_heads=4,
        head_dim=64, intermediate_size=1536, vocab_size=32000, max_position_embeddings=8192,
        rope_theta=10000.0,
    ),
    # Exact Llama-3.1-8B shapes.
    "llama-3.1-8b": Preset(
        hidden_size=4096, num_hidden_layers=32, num_attention_heads=32, num_key_value_heads=8,
        head_dim=128, intermediate_size=14336, vocab_size=128256, max_position_embeddings=131072,
        rope_theta=500000.0,
        rope_scaling=LLAMA_3_1_ROPE_SCALING,
        rms_norm_eps=1e-5,
        tie_word_embeddings=False,
    ),
    # Llama-3.2-1B shapes (Llama 3's tokenizer, tied embeddings): a draft model for the 8B.
    "llama-3.2-1b": Preset(
        hidden_size=2048, num_hidden_layers=16, num_attention_heads=32, num_key_value_heads=8,
        head_dim=64, intermediate_size=8192, vocab_size=128256, max_position_embeddings=131072,
        rope_theta=500000.0,
        rope_scaling={**LLAMA_3_1_ROPE_SCALING, "factor": 32.0},
        rms_norm_eps=1e-5,
        tie_word_embeddings=True,
    ),
    # Llama-3.2-3B and Qwen2.5-1.5B shapes: the small models several of which share one GPU (issue 38).
    "llama-3.2-3b": Preset(
        hidden_size=3072, num_hidden_layers=28, num_attention_heads=24, num_key_value_heads=8,
        head_dim=128, intermediate_size=8192, vocab_size=128256, max_position_embeddings=131072,
        rope_theta=500000.0,
        rope_scaling={**LLAMA_3_1_ROPE_SCALING, "factor": 32.0},
        rms_norm_eps=1e-5,
        tie_word_embeddings=True,
    ),
    "qwen2.5-1.5b": Preset(
        hidden_size=1536, num_hidden_layers=28, num_attention_heads=12, num_key_value_heads=2,
        head_dim=128, intermediate_size=8960, vocab_size=151936, max_position_embeddings=32768,
        rope_theta=1000000.0, rms_norm_eps=1e-6, tie_word_embeddings=True,
        architecture="Qwen2ForCausalLM",
    ),
    # Exact Llama-3.1-70B shapes (141 GB in bf16: serve it with --load-format dummy and a
    # directory written with --config-only, rather than writing its weights).
    "llama-3.1-70b": Preset(
        hidden_size=8192, num_hidden_layers=80, num_attention_heads=64, num_key_value_heads=8,
        head_dim=128, intermediate_size=28672, vocab_size=128256, max_position_embeddings=131072,
        rope_theta=500000.0,
        rope_scaling=LLAMA_3_1_ROPE_SCALING,
        rms_norm_eps=1e-5,
        tie_word_embeddings=False,
    ),
    # Qwen2.5-7B shapes (q/k/v bias).
    "qwen2.5-7b": Preset(
        hidden_size=3584, num_hidden_layers=28, num_attention_heads=28, num_key_value_heads=4,
        head_dim=128, intermediate_size=18944, vocab_size=152064, max_position_embeddings=32768,
        rope_theta=1000000.0, rms_norm_eps=1e-6, tie_word_embeddings=False,
        architecture="Qwen2ForCausalLM",
    ),
    # Qwen3-8B shapes (q/k norms, explicit head_dim).
    "qwen3-8b": Preset(
        hidden_size=4096, num_hidden_layers=36, num_attention_heads=32, num_key_value_heads=8,
        head_dim=128, intermediate_size=12288, vocab_size=151936, max_position_embeddings=40960,
        rope_theta=1000000.0, rms_norm_eps=1e-6, tie_word_embeddings=False,
        architecture="Qwen3ForCausalLM",
    ),
    # Mixtral-8x7B shapes (8 experts, 2 per token; 47 B parameters, 13 B active).
    "mixtral-8x7b": Preset(
        hidden_size=4096, num_hidden_layers=32, num_attention_heads=32, num_key_value_heads=8,
        head_dim=128, intermediate_size=14336, vocab_size=32000, max_position_embeddings=32768,
        rope_theta=1000000.0, architecture="MixtralForCausalLM",
        num_experts=8, num_experts_per_tok=2, moe_intermediate_size=14336, norm_topk_prob=True,
    ),
    # Qwen3-30B-A3B shapes (128 experts, 8 per token; 3.3 B active).
    "qwen3-30b-a3b": Preset(
        hidden_size=2048, num_hidden_layers=48, num_attention_heads=32, num_key_value_heads=4,
        head_dim=128, intermediate_size=6144, vocab_size=151936, max_position_embeddings=40960,
        rope_theta=1000000.0, rms_norm_eps=1e-6, architecture="Qwen3MoeForCausalLM",
        num_experts=128, num_experts_per_tok=8, moe_intermediate_size=768, norm_topk_prob=True,
    ),
    # Qwen3-235B-A22B shapes (470 GB in bf16: --config-only and --load-format dummy).
    "qwen3-235b-a22b": Preset(
        hidden_size=4096, num_hidden_layers=94, num_attention_heads=64, num_key_value_heads=4,
        head_dim=128, intermediate_size=12288, vocab_size=151936, max_position_embeddings=40960,
        rope_theta=1000000.0, rms_norm_eps=1e-6, architecture="Qwen3MoeForCausalLM",
        num_experts=128, num_experts_per_tok=8, moe_intermediate_size=1536, norm_topk_prob=True,
    ),
    # Qwen2-57B-A14B shapes (64 experts, 8 per token, and a shared expert).
    "qwen2-57b-a14b": Preset(
        hidden_size=3584, num_hidden_layers=28, num_attention_heads=28, num_key_value_heads=4,
        head_dim=128, intermediate_size=18944, vocab_size=151936, max_position_embeddings=32768,
        rope_theta=1000000.0, rms_norm_eps=1e-6, architecture="Qwen2MoeForCausalLM",
        num_experts=64, num_experts_per_tok=8, moe_intermediate_size=2560, shared_expert_intermediate_size=20480,
    ),
    # OLMoE-1B-7B shapes (64 experts, 8 per token; QK-norm over all of q and k).
    "olmoe-1b-7b": Preset(
        hidden_size=2048, num_hidden_layers=16, num_attention_heads=16, num_key_value_heads=16,
        head_dim=128, intermediate_size=1024, vocab_size=50304, max_position_embeddings=4096,
        architecture="OlmoeForCausalLM", num_experts=64, num_experts_per_tok=8, moe_intermediate_size=1024,
    ),
    # DeepSeek-V2-Lite shapes (16 B, 2.4 B active; latent attention without a query bottleneck).
    "deepseek-v2-lite": Preset(
        hidden_size=2048, num_hidden_layers=27, num_attention_heads=16, num_key_value_heads=16,
        head_dim=64, intermediate_size=10944, vocab_size=102400, max_position_embeddings=163840,
        rms_norm_eps=1e-6, architecture="DeepseekV2ForCausalLM", deepseek=ds.DEEPSEEK_V2_LITE,
    ),
    # Moonlight-16B-A3B shapes (DeepSeek-V3's architecture at V2-Lite's size).
    "moonlight-16b-a3b": Preset(
        hidden_size=2048, num_hidden_layers=27, num_attention_heads=16, num_key_value_heads=16,
        head_dim=64, intermediate_size=11264, vocab_size=163840, max_position_embeddings=8192,
        rope_theta=50000.0, architecture="DeepseekV3ForCausalLM", deepseek=ds.MOONLIGHT_16B_A3B,
    ),
    # DeepSeek-V3 shapes (671 B, 37 B active: --config-only and --load-format dummy).
    "deepseek-v3": Preset(
        hidden_size=7168, num_hidden_layers=61, num_attention_heads=128, num_key_value_heads=128,
        head_dim=64, intermediate_size=18432, vocab_size=129280, max_position_embeddings=163840,
        rms_norm_eps=1e-6, architecture="DeepseekV3ForCausalLM", deepseek=ds.DEEPSEEK_V3,
    ),
    # Kimi K2 shapes (DeepSeek-V3's architecture: 1 T parameters, 384 experts, 64 heads).
    "kimi-k2": Preset(
        hidden_size=7168, num_hidden_layers=61, num_attention_heads=64, num_key_value_heads=64,
        head_dim=64, intermediate_size=18432, vocab_size=163840, max_position_embeddings=131072,
        rope_theta=50000.0, rms_norm_eps=1e-6, architecture="DeepseekV3ForCausalLM", deepseek=ds.KIMI_K2,
    ),
    # Llama-4-Scout-17B-16E's text model (109 B, 17 B active: --config-only and --load-format dummy).
    "llama-4-scout-17b-16e": Preset(
        hidden_size=5120, num_hidden_layers=48, num_attention_heads=40, num_key_value_heads=8,
        head_dim=128, intermediate_size=16384, vocab_size=202048, max_position_embeddings=10485760,
        rope_theta=500000.0, rms_norm_eps=1e-5, architecture="Llama4ForCausalLM",
        num_experts=16, num_experts_per_tok=1, moe_intermediate_size=8192, llama4=l4.LLAMA_4_SCOUT,
    ),
    # Llama-4-Maverick-17B-128E's text model (400 B, 17 B active; experts on every other layer).
    "llama-4-maverick-17b-128e": Preset(
        hidden_size=5120, num_hidden_layers=48, num_attention_heads=40, num_key_value_heads=8,
        head_dim=128, intermediate_size=16384, vocab_size=202048, max_position_embeddings=1048576,
        rope_theta=500000.0, rms_norm_eps=1e-5, architecture="Llama4ForCausalLM",
        num_experts=128, num_experts_per_tok=1, moe_intermediate_size=8192, llama4=l4.LLAMA_4_MAVERICK,
    ),
}

ARCHITECTURES = {
    "LlamaForCausalLM": "llama",
    "MistralForCausalLM": "mistral",
    "Qwen2ForCausalLM": "qwen2",
    "Qwen3ForCausalLM": "qwen3",
    "MixtralForCausalLM": "mixtral",
    "Qwen2MoeForCausalLM": "qwen2_moe",
    "Qwen3MoeForCausalLM": "qwen3_moe",
    "OlmoeForCausalLM": "olmoe",
    "DeepseekV2ForCausalLM": "deepseek_v2",
    "DeepseekV3ForCausalLM": "deepseek_v3",
    "Llama4ForCausalLM": "llama4_text",
}
DEEPSEEK_TYPES = ("deepseek_v2", "deepseek_v3")
MOE_TYPES = ("mixtral", "qwen2_moe", "qwen3_moe", "olmoe")

# --------------------------------------------------------------------------------------------
# Config
# --------------------------------------------------------------------------------------------


def round_up(n: int, multiple: int) -> int:
    return (n + multiple - 1) // multiple * multiple


def model_config_dict(arch: str, preset: Preset, vocab_size: int, dtype: str, tied: bool,
                      bos_token_id: int, eos_token_ids: list[int]) -> dict:
    """config.json as transformers writes it for `arch` (keys sorted, as save_pretrained does)."""
    if arch not in ARCHITECTURES:
        raise ValueError(f"unknown architecture {arch!r}; choose from {', '.join(ARCHITECTURES)}")
    model_type = ARCHITECTURES[arch]
    no_head_dim = model_type in ("qwen2", "qwen2_moe", "olmoe")
    if no_head_dim and preset.hidden_size != preset.num_attention_heads * preset.head_dim:
        # Qwen2's config has no head_dim: it is always hidden_size / num_attention_heads.
        raise ValueError(f"{arch} needs hidden_size == num_attention_heads * head_dim")
    cfg: dict = {
        "architectures": [arch],
        "attention_dropout": 0.0,
        "bos_token_id": bos_token_id,
        "eos_token_id": eos_token_ids,
        "hidden_act": "silu",
        "hidden_size": preset.hidden_size,
        "initializer_range": INIT_STD,
        "intermediate_size": preset.intermediate_size,
        "max_position_embeddings": preset.max_position_embeddings,
        "model_type": model_type,
        "num_attention_heads": preset.num_attention_heads,
        "num_hidden_layers": preset.num_hidden_layers,
        "num_key_value_heads": preset.num_key_value_heads,
        "rms_norm_eps": preset.rms_norm_eps,
        "rope_scaling": preset.rope_scaling_for(arch),
        "rope_theta": preset.rope_theta,
        "tie_word_embeddings": tied,
        "torch_dtype": dtype,
        "transformers_version": "4.45.0",
        "use_cache": True,
        "vocab_size": vocab_size,
    }
    if model_type == "llama":
        cfg.update(attention_bias=False, head_dim=preset.head_dim, mlp_bias=False, pretraining_tp=1)
    elif model_type == "mistral":
        cfg.update(head_dim=preset.head_dim, sliding_window=None)
    elif model_type == "qwen2":
        cfg.update(max_window_layers=preset.num_hidden_layers, sliding_window=None,
                   use_sliding_window=False)
    elif model_type in ("qwen3", "qwen3_moe"):
        cfg.update(attention_bias=False, head_dim=preset.head_dim,
                   max_window_layers=preset.num_hidden_layers, sliding_window=None,
                   use_sliding_window=False)
    elif model_type == "qwen2_moe":
        cfg.update(max_window_layers=preset.num_hidden_layers, sliding_window=None, use_sliding_window=False,
                   shared_expert_intermediate_size=preset.shared_expert_intermediate_size)
    elif model_type == "mixtral":
        cfg.update(head_dim=preset.head_dim, sliding_window=None, num_local_experts=preset.num_experts)
    elif model_type == "olmoe":
        cfg.update(attention_bias=False, clip_qkv=None)
    elif model_type in DEEPSEEK_TYPES:
        cfg.update(ds.deepseek_config(arch, ds.deepseek_keys(arch, preset.deepseek), preset.num_attention_heads))
    elif model_type == "llama4_text":
        cfg.update(l4.llama4_config(l4.llama4_keys(preset.llama4), preset.num_experts, preset.moe_intermediate_size,
                                    preset.intermediate_size, preset.head_dim))
    if model_type in MOE_TYPES:
        cfg.update(num_experts_per_tok=preset.num_experts_per_tok, output_router_logits=False,
                   router_aux_loss_coef=0.001)
        if model_type in ("mixtral", "olmoe"):  # their intermediate_size is each expert's
            cfg["intermediate_size"] = preset.moe_intermediate_size
        if model_type != "mixtral":
            cfg.update(num_experts=preset.num_experts, norm_topk_prob=preset.norm_topk_prob)
        if model_type in ("qwen2_moe", "qwen3_moe"):
            cfg.update(moe_intermediate_size=preset.moe_intermediate_size, decoder_sparse_step=1, mlp_only_layers=[])
    return dict(sorted(cfg.items()))


# --------------------------------------------------------------------------------------------
# Tensors
# --------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class TensorSpec:
    name: str
    shape: tuple[int, ...]
    kind: str  # "weight" N(0, 0.02) | "norm" 1 + N(0, 0.1) | "bias" N(0, 0.02) | an EAGLE3_MAPS key

    @property
    def numel(self) -> int:
        return math.prod(self.shape)


def tensor_specs(arch: str, preset: Preset, vocab_size: int, tied: bool) -> list[TensorSpec]:
    """Every tensor of the checkpoint, in Hugging Face's state-dict order."""
    model_type = ARCHITECTURES[arch]
    h, hd = preset.hidden_size, preset.head_dim
    q, kv, inter = preset.num_attention_heads * hd, preset.num_key_value_heads * hd, preset.intermediate_size
    specs = [TensorSpec("model.embed_tokens.weight", (vocab_size, h), "weight")]
    for i in range(preset.num_hidden_layers):
        p = f"model.layers.{i}."
        if model_type in DEEPSEEK_TYPES:
            specs += ds.deepseek_layer_specs(TensorSpec, _mlp_specs, model_type == "deepseek_v3",
                                             ds.deepseek_keys(arch, preset.deepseek), i, p, h,
                                             preset.num_attention_heads, inter)
            specs.append(TensorSpec(p + "input_layernorm.weight", (h,), "norm"))
            specs.append(TensorSpec(p + "post_attention_layernorm.weight", (h,), "norm"))
            continue
        bias = model_type in ("qwen2", "qwen2_moe")
        specs.append(TensorSpec(p + "self_attn.q_proj.weight", (q, h), "weight"))
        if bias:
            specs.append(TensorSpec(p + "self_attn.q_proj.bias", (q,), "bias"))
        specs.append(TensorSpec(p + "self_attn.k_proj.weight", (kv, h), "weight"))
        if bias:
            specs.append(TensorSpec(p + "self_attn.k_proj.bias", (kv,), "bias"))
        specs.append(TensorSpec(p + "self_attn.v_proj.weight", (kv, h), "weight"))
        if bias:
            specs.append(TensorSpec(p + "self_attn.v_proj.bias", (kv,), "bias"))
        specs.append(TensorSpec(p + "self_attn.o_proj.weight", (h, q), "weight"))
        if model_type == "llama4_text":
            specs += l4.llama4_feed_forward_specs(TensorSpec, _mlp_specs, l4.llama4_keys(preset.llama4), i, p, h,
                                                  preset.num_experts, preset.moe_intermediate_size, inter,
                                                  preset.num_hidden_layers)
        elif model_type in ("qwen3", "qwen3_moe"):
            specs.append(TensorSpec(p + "self_attn.q_norm.weight", (hd,), "norm"))
            specs.append(TensorSpec(p + "self_attn.k_norm.weight", (hd,), "norm"))
        elif model_type == "olmoe":  # over all of q and all of k
            specs.append(TensorSpec(p + "self_attn.q_norm.weight", (q,), "norm"))
            specs.append(TensorSpec(p + "self_attn.k_norm.weight", (kv,), "norm"))
        if model_type in MOE_TYPES:
            specs += _expert_specs(model_type, preset, p)
        elif model_type != "llama4_text":
            specs += _mlp_specs(p + "mlp.", h, inter)
        specs.append(TensorSpec(p + "input_layernorm.weight", (h,), "norm"))
        specs.append(TensorSpec(p + "post_attention_layernorm.weight", (h,), "norm"))
    specs.append(TensorSpec("model.norm.weight", (h,), "norm"))
    if not tied:
        specs.append(TensorSpec("lm_head.weight", (vocab_size, h), "weight"))
    return specs


def _mlp_specs(prefix: str, h: int, inter: int) -> list[TensorSpec]:
    return [TensorSpec(prefix + "gate_proj.weight", (inter, h), "weight"),
            TensorSpec(prefix + "up_proj.weight", (inter, h), "weight"),
            TensorSpec(prefix + "down_proj.weight", (h, inter), "weight")]


def _expert_specs(model_type: str, preset: Preset, layer: str) -> list[TensorSpec]:
    """A layer's MoE block as each family names it: the router, every expert, a shared expert."""
    h, inter, n = preset.hidden_size, preset.moe_intermediate_size, preset.num_experts
    if model_type == "mixtral":
        block = layer + "block_sparse_moe."
        specs = [TensorSpec(block + "gate.weight", (n, h), "weight")]
        for e in range(n):
            ex = f"{block}experts.{e}."
            specs += [TensorSpec(ex + "w1.weight", (inter, h), "weight"),
                      TensorSpec(ex + "w2.weight", (h, inter), "weight"),
                      TensorSpec(ex + "w3.weight", (inter, h), "weight")]
        return specs
    block = layer + "mlp."
    specs = [TensorSpec(block + "gate.weight", (n, h), "weight")]
    for e in range(n):
        specs += _mlp_specs(f"{block}experts.{e}.", h, inter)
    if model_type == "qwen2_moe":
        specs += _mlp_specs(block + "shared_expert.", h, preset.shared_expert_intermediate_size)
        specs.append(TensorSpec(block + "shared_expert_gate.weight", (1, h), "weight"))
    return specs
