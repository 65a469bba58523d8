"""A GGUF's metadata as the config.json dict of the same model, so one ModelConfig path checks both."""

from __future__ import annotations

import numpy as np

from shared.gguf_file import GGUFError, GGUFFile

# llama.cpp's architecture names → the transformers class whose weights layout we serve. Mistral
# files are written as "llama" by llama.cpp (same shapes, same tensor names).
GGUF_ARCHITECTURES = {
    "llama": "LlamaForCausalLM",
    "qwen2": "Qwen2ForCausalLM",
    "qwen3": "Qwen3ForCausalLM",
    "qwen2moe": "Qwen2MoeForCausalLM",
    "qwen3moe": "Qwen3MoeForCausalLM",
    "olmoe": "OlmoeForCausalLM",
}
# Whether the router renormalises the top-k weights, where the file does not say (llama.cpp's choice
# per architecture; Mixtral is written as "llama" with experts).
_NORM_TOPK = {"llama": True, "qwen3moe": True, "qwen2moe": False, "olmoe": False}


def config_from_gguf(gf: GGUFFile) -> dict:
    arch = gf.architecture
    if arch not in GGUF_ARCHITECTURES:
        raise GGUFError(
            f"{gf.path}: unsupported GGUF architecture {arch!r}; supported: {', '.join(GGUF_ARCHITECTURES)}")

    def need(name: str):
        value = gf.arch_key(name)
        if value is None:
            raise GGUFError(f"{gf.path}: metadata key {arch}.{name} is missing")
        return value

    heads = int(need("attention.head_count"))
    hidden = int(need("embedding_length"))
    tokens = gf.get("tokenizer.ggml.tokens")
    embed = gf.tensors.get("token_embd.weight")
    vocab = gf.arch_key("vocab_size") or (embed.shape[0] if embed else None) or (len(tokens) if tokens else None)
    raw = {
        "architectures": [GGUF_ARCHITECTURES[arch]],
        "vocab_size": vocab,
        "hidden_size": hidden,
        "intermediate_size": need("feed_forward_length"),
        "num_hidden_layers": need("block_count"),
        "num_attention_heads": heads,
        "num_key_value_heads": gf.arch_key("attention.head_count_kv") or heads,
        "head_dim": gf.arch_key("attention.key_length") or hidden // heads,
        "rms_norm_eps": float(gf.arch_key("attention.layer_norm_rms_epsilon", 1e-6)),
        "rope_theta": float(gf.arch_key("rope.freq_base", 10000.0)),
        "max_position_embeddings": gf.arch_key("context_length") or 4096,
        # llama.cpp writes the output projection only when it is not the embedding matrix.
        "tie_word_embeddings": "output.weight" not in gf.tensors,
        "bos_token_id": gf.get("tokenizer.ggml.bos_token_id"),
        "eos_token_id": gf.get("tokenizer.ggml.eos_token_id"),
        # GGUF weights are dequantized into the serving dtype; bf16 unless the worker says otherwise.
        "torch_dtype": "bfloat16",
    }
    scaling = gf.arch_key("rope.scaling.type")
    if scaling not in (None, "none"):
        # linear/yarn/longrope scaling are not built; llama3 scaling arrives as rope_freqs.weight.
        raise GGUFError(f"{gf.path}: unsupported rope scaling {scaling!r} (supported: none, llama3 via rope_freqs)")
    freqs = gf.tensors.get("rope_freqs.weight")
    if freqs is not None:
        if freqs.type_name != "F32":
            raise GGUFError(f"{gf.path}: rope_freqs.weight is {freqs.type_name}, expected F32")
        raw["rope_freq_factors"] = np.fromfile(gf.path, dtype="<f4", count=freqs.nbytes // 4,
                                               offset=freqs.offset).tolist()
    experts = gf.arch_key("expert_count")
    if experts:
        # Mixtral is written as "llama"; its expert size is feed_forward_length.
        if arch == "llama":
            raw["architectures"] = ["MixtralForCausalLM"]
            raw["num_local_experts"] = experts
        raw.update(num_experts=experts, num_experts_per_tok=need("expert_used_count"),
                   moe_intermediate_size=gf.arch_key("expert_feed_forward_length") or raw["intermediate_size"],
                   shared_expert_intermediate_size=gf.arch_key("expert_shared_feed_forward_length") or 0,
                   norm_topk_prob=bool(gf.arch_key("expert_weights_norm", _NORM_TOPK.get(arch, False))))
        if arch == "olmoe":
            raw["intermediate_size"] = raw["moe_intermediate_size"]
    return raw
