"""Each family's own config.json keys (DeepSeek's latent attention and routers, Llama 4's layers,
the mixtures of experts), read as transformers reads them into ModelConfig's parts."""

from __future__ import annotations

from services.worker.engine.model_parts import (DEEPSEEK_ARCHITECTURES, Llama4Config, MLAConfig, ModelConfigError,
                                                 MoEConfig, YarnScaling)


def yarn(rs: dict, raw: dict, source: str) -> YarnScaling:
    try:
        original = int(rs["original_max_position_embeddings"])
    except KeyError as e:
        raise ModelConfigError(f"{source}: rope_scaling of type yarn lacks 'original_max_position_embeddings'") from e
    factor = rs.get("factor") or raw.get("max_position_embeddings", original) / original
    return YarnScaling(factor=float(factor), original_max_position_embeddings=original,
                       beta_fast=float(rs.get("beta_fast") or 32), beta_slow=float(rs.get("beta_slow") or 1),
                       mscale=float(rs.get("mscale") or 0), mscale_all_dim=float(rs.get("mscale_all_dim") or 0),
                       truncate=bool(rs.get("truncate", True)))


def mla_config(arch: str, raw: dict, source: str) -> MLAConfig | None:
    if arch not in DEEPSEEK_ARCHITECTURES:
        return None
    dims = {}
    for key in ("kv_lora_rank", "qk_nope_head_dim", "qk_rope_head_dim", "v_head_dim"):
        value = raw.get(key)
        if not isinstance(value, int) or isinstance(value, bool) or value <= 0:
            raise ModelConfigError(f"{source}: {key} must be a positive integer, got {value!r}")
        dims[key] = value
    if raw.get("attention_bias"):
        raise ModelConfigError(f"{source}: attention_bias is not supported for {arch}")
    if dims["qk_rope_head_dim"] % 2:
        raise ModelConfigError(f"{source}: qk_rope_head_dim ({dims['qk_rope_head_dim']}) must be even")
    interleave = arch == "DeepseekV2ForCausalLM" or bool(raw.get("rope_interleave", True))
    return MLAConfig(**dims, q_lora_rank=int(raw.get("q_lora_rank") or 0), rope_interleave=interleave)


def deepseek_moe(arch: str, raw: dict, num_layers: int, source: str) -> MoEConfig | None:
    """DeepSeek's experts as transformers reads them: V2 softmax scores, greedy or best-in-group
    (a group scored by its best expert); V3 sigmoid scores with a bias that steers the choice (a
    group scored by its best two); both times routed_scaling_factor; shared experts without a gate;
    the first first_k_dense_replace layers dense."""
    experts, top_k, inter = raw.get("n_routed_experts"), raw.get("num_experts_per_tok"), raw.get("moe_intermediate_size")
    if experts is None:
        return None
    for key, value in (("n_routed_experts", experts), ("num_experts_per_tok", top_k), ("moe_intermediate_size", inter)):
        if not isinstance(value, int) or isinstance(value, bool) or value <= 0:
            raise ModelConfigError(f"{source}: {key} must be a positive integer, got {value!r}")
    v3 = arch == "DeepseekV3ForCausalLM"
    grouped = v3 or raw.get("topk_method") == "group_limited_greedy"
    n_group = int(raw.get("n_group") or 1) if grouped else 1
    topk_group = int(raw.get("topk_group") or 1) if grouped else 1
    if experts % n_group or not 0 < topk_group <= n_group or top_k > topk_group * (experts // n_group):
        raise ModelConfigError(f"{source}: {experts} experts in {n_group} groups, {topk_group} of them chosen, "
                               f"cannot give {top_k} experts a token")
    first_dense = int(raw.get("first_k_dense_replace") or 0)
    sparse = tuple(range(first_dense, num_layers))  # (transformers, as the published configs, ignores moe_layer_freq)
    return MoEConfig(num_experts=experts, top_k=top_k, intermediate_size=inter,
                     renormalize=v3 and bool(raw.get("norm_topk_prob", False)),
                     shared_intermediate_size=inter * int(raw.get("n_shared_experts") or 0), sparse_layers=sparse,
                     scoring="sigmoid" if v3 else "softmax", score_bias=v3, n_group=n_group, topk_group=topk_group,
                     routed_scaling_factor=float(raw.get("routed_scaling_factor") or 1.0), shared_gate=False)


def llama4_config(arch: str, raw: dict, num_layers: int, source: str) -> Llama4Config | None:
    """Llama4TextConfig's per-layer attention as transformers derives it: no_rope_layers (1 = RoPE;
    absent or empty: every no_rope_layer_interval-th layer is NoPE), layer_types (absent: the RoPE
    layers chunked when attention_chunk_size is set)."""
    if arch != "Llama4ForCausalLM":
        return None
    interval = raw.get("no_rope_layer_interval") or 4
    flags = raw.get("no_rope_layers") or [int((i + 1) % interval != 0) for i in range(num_layers)]
    if len(flags) < num_layers:
        raise ModelConfigError(f"{source}: no_rope_layers has {len(flags)} entries for {num_layers} layers")
    nope = tuple(i for i in range(num_layers) if not flags[i])
    chunk = raw.get("attention_chunk_size")
    if chunk is not None and (not isinstance(chunk, int) or isinstance(chunk, bool) or chunk <= 0):
        raise ModelConfigError(f"{source}: attention_chunk_size must be a positive integer, got {chunk!r}")
    types = raw.get("layer_types") or [
        "chunked_attention" if i not in nope and chunk is not None else "full_attention" for i in range(num_layers)]
    chunked = tuple(i for i, kind in enumerate(types[:num_layers]) if kind == "chunked_attention")
    if chunked and chunk is None:
        raise ModelConfigError(f"{source}: chunked_attention layers need an attention_chunk_size")
    floor_scale = raw.get("floor_scale", 8192)
    if not isinstance(floor_scale, (int, float)) or floor_scale <= 0:
        raise ModelConfigError(f"{source}: floor_scale must be positive, got {floor_scale!r}")
    return Llama4Config(nope_layers=nope, chunked_layers=chunked, attention_chunk_size=chunk or 0,
                        qk_norm=bool(raw.get("use_qk_norm", True)),
                        temperature_tuning=bool(raw.get("attn_temperature_tuning", True)),
                        floor_scale=float(floor_scale), attn_scale=float(raw.get("attn_scale", 0.1)))


def llama4_moe(raw: dict, num_layers: int, source: str) -> MoEConfig:
    """Llama 4's experts: the top num_experts_per_tok router logits, each one's sigmoid scaling the
    token on its way into that expert; a shared expert of the experts' width, without a gate, seen by
    every token; the layers in moe_layers (absent: every interleave_moe_layer_step-th) sparse."""
    experts, top_k, inter = raw.get("num_local_experts"), raw.get("num_experts_per_tok", 1), raw.get(
        "intermediate_size")
    for key, value in (("num_local_experts", experts), ("num_experts_per_tok", top_k), ("intermediate_size", inter)):
        if not isinstance(value, int) or isinstance(value, bool) or value <= 0:
            raise ModelConfigError(f"{source}: {key} must be a positive integer, got {value!r}")
    if top_k > experts:
        raise ModelConfigError(f"{source}: num_experts_per_tok ({top_k}) exceeds the {experts} experts")
    step = raw.get("interleave_moe_layer_step") or 1
    layers = raw.get("moe_layers")
    sparse = tuple(sorted(set(layers))) if layers is not None else tuple(range(step - 1, num_layers, step))
    if any(not 0 <= i < num_layers for i in sparse):
        raise ModelConfigError(f"{source}: moe_layers {list(sparse)} outside the {num_layers} layers")
    return MoEConfig(num_experts=experts, top_k=top_k, intermediate_size=inter, renormalize=False,
                     shared_intermediate_size=inter, sparse_layers=sparse, scoring="sigmoid", shared_gate=False,
                     scale_inputs=True)


def moe_config(arch: str, raw: dict, num_layers: int, source: str) -> MoEConfig | None:
    """The experts of an MoE architecture, each family's keys read as transformers reads them."""
    if arch in DEEPSEEK_ARCHITECTURES:
        return deepseek_moe(arch, raw, num_layers, source)
    if arch == "Llama4ForCausalLM":
        return llama4_moe(raw, num_layers, source)
    if arch not in ("MixtralForCausalLM", "Qwen2MoeForCausalLM", "Qwen3MoeForCausalLM", "OlmoeForCausalLM"):
        return None
    mixtral = arch == "MixtralForCausalLM"
    experts = raw.get("num_local_experts" if mixtral else "num_experts")
    top_k = raw.get("num_experts_per_tok")
    inter = raw.get("intermediate_size" if mixtral or arch == "OlmoeForCausalLM" else "moe_intermediate_size")
    for key, value in (("num_experts", experts), ("num_experts_per_tok", top_k), ("expert intermediate_size", inter)):
        if not isinstance(value, int) or isinstance(value, bool) or value <= 0:
            raise ModelConfigError(f"{source}: {key} must be a positive integer, got {value!r}")
    if top_k > experts:
        raise ModelConfigError(f"{source}: num_experts_per_tok ({top_k}) exceeds the {experts} experts")
    # Qwen's MoE families may keep some layers dense: every decoder_sparse_step-th layer has experts,
    # except those in mlp_only_layers.
    step = int(raw.get("decoder_sparse_step") or 1)
    dense = set(raw.get("mlp_only_layers") or ())
    sparse = tuple(i for i in range(num_layers) if (i + 1) % step == 0 and i not in dense)
    shared = int(raw.get("shared_expert_intermediate_size") or 0) if arch == "Qwen2MoeForCausalLM" else 0
    return MoEConfig(num_experts=experts, top_k=top_k, intermediate_size=inter,
                     renormalize=mixtral or bool(raw.get("norm_topk_prob", False)),
                     shared_intermediate_size=shared, sparse_layers=sparse)
