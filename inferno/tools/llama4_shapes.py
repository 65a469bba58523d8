"""Llama 4 (Scout, Maverick) text shapes for make-model: their config keys and their tensors."""

from __future__ import annotations

# The keys a tiny preset takes on Llama4ForCausalLM: layer 0 a RoPE layer (chunked by 16 positions,
# QK-norm, a dense MLP), layer 1 a NoPE layer (global, temperature-tuned from the fourth token on, the
# experts); top-1 routing; Scout's form of llama3 rope scaling (low_freq_factor == high_freq_factor).
TINY = {
    "attention_chunk_size": 16, "no_rope_layer_interval": 2, "interleave_moe_layer_step": 2,
    "num_experts_per_tok": 1, "use_qk_norm": True, "attn_temperature_tuning": True, "floor_scale": 4,
    "attn_scale": 0.5,
    "rope_scaling": {"rope_type": "llama3", "factor": 16.0, "low_freq_factor": 1.0, "high_freq_factor": 1.0,
                     "original_max_position_embeddings": 64},
}

# The published configs' keys (what the Preset fields do not hold).
LLAMA_4_SCOUT = {
    "attention_chunk_size": 8192, "no_rope_layers": [], "no_rope_layer_interval": 4, "interleave_moe_layer_step": 1,
    "num_experts_per_tok": 1, "use_qk_norm": True, "attn_temperature_tuning": True, "floor_scale": 8192,
    "attn_scale": 0.1,
    "rope_scaling": {"rope_type": "llama3", "factor": 16.0, "low_freq_factor": 1.0, "high_freq_factor": 1.0,
                     "original_max_position_embeddings": 8192},
}
LLAMA_4_MAVERICK = {**LLAMA_4_SCOUT, "interleave_moe_layer_step": 2, "use_qk_norm": False, "rope_scaling": None}


def llama4_keys(preset_keys: dict | None) -> dict:
    """The Llama 4 config keys of a preset: its own, or the tiny ones."""
    return dict(TINY if preset_keys is None else preset_keys)


def llama4_config(keys: dict, num_experts: int, expert_intermediate: int, dense_intermediate: int,
                  head_dim: int) -> dict:
    """The config.json entries beyond the common ones (model_shapes.model_config_dict): Llama 4's
    intermediate_size is each expert's, intermediate_size_mlp the dense layers'."""
    cfg = dict(keys)
    cfg.update(num_local_experts=num_experts, intermediate_size=expert_intermediate,
               intermediate_size_mlp=dense_intermediate, head_dim=head_dim, attention_bias=False,
               output_router_logits=False, router_aux_loss_coef=0.001, router_jitter_noise=0.0)
    return cfg


def moe_layers(keys: dict, num_layers: int) -> list[int]:
    step = keys.get("interleave_moe_layer_step", 1)
    return keys.get("moe_layers") or list(range(step - 1, num_layers, step))


def llama4_feed_forward_specs(tensor_spec, mlp_specs, keys: dict, layer: int, prefix: str, hidden: int,
                              num_experts: int, expert_intermediate: int, dense_intermediate: int,
                              num_layers: int) -> list:
    """One layer's feed_forward tensors in transformers' state-dict order (tensor_spec: model_shapes'
    TensorSpec; mlp_specs(prefix, h, inter): a gate/up/down triple): a dense MLP, or the stacked
    experts, the router and the shared expert."""
    ff = prefix + "feed_forward."
    if layer not in moe_layers(keys, num_layers):
        return mlp_specs(ff, hidden, dense_intermediate)
    return [tensor_spec(ff + "experts.gate_up_proj", (num_experts, hidden, 2 * expert_intermediate), "weight"),
            tensor_spec(ff + "experts.down_proj", (num_experts, expert_intermediate, hidden), "weight"),
            tensor_spec(ff + "router.weight", (num_experts, hidden), "weight"),
            *mlp_specs(ff + "shared_expert.", hidden, expert_intermediate)]
