"""DeepSeek-V2/V3 (and Kimi K2) shapes for make-model: their config keys and their tensors."""

from __future__ import annotations

# The keys a tiny preset takes on a DeepSeek architecture: latent attention with a query bottleneck
# (V3) or without (V2), 8 experts in 4 groups of which 2 are chosen, a dense first layer, YaRN.
TINY_V3 = {
    "q_lora_rank": 32, "kv_lora_rank": 32, "qk_nope_head_dim": 16, "qk_rope_head_dim": 8, "v_head_dim": 16,
    "n_routed_experts": 8, "num_experts_per_tok": 2, "n_group": 4, "topk_group": 2, "n_shared_experts": 1,
    "moe_intermediate_size": 32, "first_k_dense_replace": 1, "routed_scaling_factor": 2.5,
    "norm_topk_prob": True, "rope_interleave": True,
    "rope_scaling": {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 256,
                     "beta_fast": 32, "beta_slow": 1, "mscale": 1.0, "mscale_all_dim": 0.8},
}
TINY_V2 = {
    **TINY_V3, "q_lora_rank": None, "topk_method": "group_limited_greedy", "n_shared_experts": 2,
    "routed_scaling_factor": 1.5, "norm_topk_prob": False,
    "rope_scaling": {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 256,
                     "beta_fast": 32, "beta_slow": 1, "mscale": 0.707, "mscale_all_dim": 0.707},
}
del TINY_V2["rope_interleave"]  # (V2 always interleaves)

_YARN_V3 = {"rope_type": "yarn", "factor": 40.0, "original_max_position_embeddings": 4096, "beta_fast": 32,
            "beta_slow": 1, "mscale": 1.0, "mscale_all_dim": 1.0}
_MLA = {"kv_lora_rank": 512, "qk_nope_head_dim": 128, "qk_rope_head_dim": 64, "v_head_dim": 128}

# The published configs' keys (what the Preset fields do not hold).
DEEPSEEK_V2_LITE = {
    **_MLA, "q_lora_rank": None, "n_routed_experts": 64, "num_experts_per_tok": 6, "topk_method": "greedy",
    "n_group": 1, "topk_group": 1, "n_shared_experts": 2, "moe_intermediate_size": 1408, "first_k_dense_replace": 1,
    "routed_scaling_factor": 1.0, "norm_topk_prob": False,
    "rope_scaling": {**_YARN_V3, "mscale": 0.707, "mscale_all_dim": 0.707},
}
MOONLIGHT_16B_A3B = {
    **_MLA, "q_lora_rank": None, "n_routed_experts": 64, "num_experts_per_tok": 6, "n_group": 1, "topk_group": 1,
    "n_shared_experts": 2, "moe_intermediate_size": 1408, "first_k_dense_replace": 1,
    "routed_scaling_factor": 2.446, "norm_topk_prob": True, "rope_interleave": True, "rope_scaling": None,
}
DEEPSEEK_V3 = {
    **_MLA, "q_lora_rank": 1536, "n_routed_experts": 256, "num_experts_per_tok": 8, "n_group": 8, "topk_group": 4,
    "n_shared_experts": 1, "moe_intermediate_size": 2048, "first_k_dense_replace": 3, "routed_scaling_factor": 2.5,
    "norm_topk_prob": True, "rope_interleave": True, "rope_scaling": _YARN_V3,
}
KIMI_K2 = {
    **DEEPSEEK_V3, "n_routed_experts": 384, "n_group": 1, "topk_group": 1, "first_k_dense_replace": 1,
    "routed_scaling_factor": 2.827, "rope_scaling": {**_YARN_V3, "factor": 32.0},
}


def deepseek_keys(arch: str, preset_keys: dict | None) -> dict:
    """The DeepSeek config keys of a preset: its own, or the tiny ones of the architecture."""
    if preset_keys is not None:
        return dict(preset_keys)
    return dict(TINY_V2 if arch == "DeepseekV2ForCausalLM" else TINY_V3)


def deepseek_config(arch: str, keys: dict, num_heads: int) -> dict:
    """The config.json entries beyond the common ones (model_shapes.model_config_dict)."""
    cfg = {k: v for k, v in keys.items() if k != "rope_scaling"}
    cfg.update(num_key_value_heads=num_heads, attention_bias=False, head_dim=keys["qk_rope_head_dim"],
               rope_scaling=keys.get("rope_scaling"))
    if arch == "DeepseekV3ForCausalLM":
        cfg.setdefault("rope_interleave", True)
    return cfg


def deepseek_layer_specs(tensor_spec, mlp_specs, v3: bool, keys: dict, layer: int, prefix: str, hidden: int,
                         heads: int, intermediate: int) -> list:
    """One decoder layer's tensors in transformers' state-dict order (tensor_spec: model_shapes'
    TensorSpec; mlp_specs(prefix, h, inter): a gate/up/down triple)."""
    attn = prefix + "self_attn."
    qk = keys["qk_nope_head_dim"] + keys["qk_rope_head_dim"]
    lora, q_lora = keys["kv_lora_rank"], keys.get("q_lora_rank")
    specs = []
    if q_lora:
        specs += [tensor_spec(attn + "q_a_proj.weight", (q_lora, hidden), "weight"),
                  tensor_spec(attn + "q_a_layernorm.weight", (q_lora,), "norm"),
                  tensor_spec(attn + "q_b_proj.weight", (heads * qk, q_lora), "weight")]
    else:
        specs.append(tensor_spec(attn + "q_proj.weight", (heads * qk, hidden), "weight"))
    specs += [tensor_spec(attn + "kv_a_proj_with_mqa.weight", (lora + keys["qk_rope_head_dim"], hidden), "weight"),
              tensor_spec(attn + "kv_a_layernorm.weight", (lora,), "norm"),
              tensor_spec(attn + "kv_b_proj.weight", (heads * (keys["qk_nope_head_dim"] + keys["v_head_dim"]), lora),
                          "weight"),
              tensor_spec(attn + "o_proj.weight", (hidden, heads * keys["v_head_dim"]), "weight")]
    mlp = prefix + "mlp."
    if layer < keys["first_k_dense_replace"]:
        return specs + mlp_specs(mlp, hidden, intermediate)
    n, inter = keys["n_routed_experts"], keys["moe_intermediate_size"]
    specs.append(tensor_spec(mlp + "gate.weight", (n, hidden), "weight"))
    if v3:  # the score correction bias
        specs.append(tensor_spec(mlp + "gate.e_score_correction_bias", (n,), "bias"))
    for e in range(n):
        specs += mlp_specs(f"{mlp}experts.{e}.", hidden, inter)
    return specs + mlp_specs(mlp + "shared_experts.", hidden, inter * keys["n_shared_experts"])
