"""Writes a Hugging Face model directory as a GGUF file the way llama.cpp's converter does (names,
q/k permutation for Llama, rope_freqs for llama3 scaling, byte-level tokenizer metadata), so the
GGUF path can be checked against the directory it came from and against transformers."""

from __future__ import annotations

import json
import math
from pathlib import Path

import numpy as np
from safetensors.numpy import load_file

GGUF_ARCH = {"LlamaForCausalLM": "llama", "MistralForCausalLM": "llama",
             "Qwen2ForCausalLM": "qwen2", "Qwen3ForCausalLM": "qwen3", "MixtralForCausalLM": "llama",
             "Qwen2MoeForCausalLM": "qwen2moe", "Qwen3MoeForCausalLM": "qwen3moe", "OlmoeForCausalLM": "olmoe"}
# An MoE block's tensors: the router and the shared expert by name, the experts stacked [E, N, K].
MOE_NAMES = {"gate.weight": "ffn_gate_inp.weight", "shared_expert.gate_proj.weight": "ffn_gate_shexp.weight",
             "shared_expert.up_proj.weight": "ffn_up_shexp.weight",
             "shared_expert.down_proj.weight": "ffn_down_shexp.weight",
             "shared_expert_gate.weight": "ffn_gate_inp_shexp.weight"}
EXPERT_NAMES = {"gate_proj": "ffn_gate_exps", "w1": "ffn_gate_exps", "up_proj": "ffn_up_exps", "w3": "ffn_up_exps",
                "down_proj": "ffn_down_exps", "w2": "ffn_down_exps"}
LAYER_NAMES = {
    "input_layernorm.weight": "attn_norm.weight",
    "self_attn.q_proj.weight": "attn_q.weight", "self_attn.k_proj.weight": "attn_k.weight",
    "self_attn.v_proj.weight": "attn_v.weight", "self_attn.q_proj.bias": "attn_q.bias",
    "self_attn.k_proj.bias": "attn_k.bias", "self_attn.v_proj.bias": "attn_v.bias",
    "self_attn.q_norm.weight": "attn_q_norm.weight", "self_attn.k_norm.weight": "attn_k_norm.weight",
    "self_attn.o_proj.weight": "attn_output.weight", "post_attention_layernorm.weight": "ffn_norm.weight",
    "mlp.gate_proj.weight": "ffn_gate.weight", "mlp.up_proj.weight": "ffn_up.weight",
    "mlp.down_proj.weight": "ffn_down.weight",
}


def gguf_name(hf: str) -> str:
    if hf == "model.embed_tokens.weight":
        return "token_embd.weight"
    if hf == "model.norm.weight":
        return "output_norm.weight"
    if hf == "lm_head.weight":
        return "output.weight"
    _, _, i, rest = hf.split(".", 3)
    if rest in LAYER_NAMES:
        return f"blk.{i}.{LAYER_NAMES[rest]}"
    return f"blk.{i}.{MOE_NAMES[rest.split('.', 1)[1]]}"


def _stack_experts(tensors: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
    """Every expert's projection of a layer in one [E, N, K] tensor named as llama.cpp names it."""
    out, stacks = {}, {}
    for name, t in tensors.items():
        parts = name.split(".")
        if "experts" not in parts:
            out[name] = t
            continue
        e = parts.index("experts")
        key = f"blk.{parts[2]}.{EXPERT_NAMES[parts[e + 2]]}.weight"
        stacks.setdefault(key, {})[int(parts[e + 1])] = t
    for key, by_expert in stacks.items():
        out[key] = np.stack([by_expert[e] for e in sorted(by_expert)])
    return out


def permute(w: np.ndarray, heads: int) -> np.ndarray:
    """llama.cpp's interleaving of each head's q/k rows (the inverse of what the loader undoes)."""
    return w.reshape(heads, 2, w.shape[0] // heads // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def llama3_rope_factors(cfg: dict) -> np.ndarray:
    rs, head_dim = cfg["rope_scaling"], cfg.get("head_dim") or cfg["hidden_size"] // cfg["num_attention_heads"]
    inv = 1.0 / (cfg["rope_theta"] ** (np.arange(0, head_dim, 2, dtype=np.float32) / head_dim))
    low_wl = rs["original_max_position_embeddings"] / rs["low_freq_factor"]
    high_wl = rs["original_max_position_embeddings"] / rs["high_freq_factor"]
    out = []
    for f in inv:
        wl = 2 * math.pi / f
        if wl < high_wl:
            out.append(1.0)
        elif wl > low_wl:
            out.append(rs["factor"])
        else:
            smooth = (rs["original_max_position_embeddings"] / wl - rs["low_freq_factor"]) / (
                rs["high_freq_factor"] - rs["low_freq_factor"])
            out.append(1 / ((1 - smooth) / rs["factor"] + smooth))
    return np.array(out, dtype=np.float32)


def write_gguf(model_dir: Path, out: Path, matrix_type: str = "F32", arch_override: str | None = None,
               skip: tuple[str, ...] = (), raw_tensors: dict[str, tuple[np.ndarray, str]] | None = None) -> Path:
    """matrix_type: the GGML type of every 2-D weight (norms and biases stay F32). skip: HF names left
    out; raw_tensors: GGUF name → (block bytes [rows, bytes per row], GGML type name) added as they are."""
    import gguf

    cfg = json.loads((model_dir / "config.json").read_text())
    arch = arch_override or GGUF_ARCH[cfg["architectures"][0]]
    heads, kv_heads = cfg["num_attention_heads"], cfg.get("num_key_value_heads") or cfg["num_attention_heads"]
    w = gguf.GGUFWriter(str(out), arch)
    w.add_block_count(cfg["num_hidden_layers"])
    w.add_context_length(cfg["max_position_embeddings"])
    w.add_embedding_length(cfg["hidden_size"])
    w.add_feed_forward_length(cfg["intermediate_size"])
    w.add_head_count(heads)
    w.add_head_count_kv(kv_heads)
    w.add_rope_freq_base(cfg["rope_theta"])
    w.add_layer_norm_rms_eps(cfg["rms_norm_eps"])
    w.add_vocab_size(cfg["vocab_size"])
    if cfg.get("head_dim"):
        w.add_key_length(cfg["head_dim"])
        w.add_value_length(cfg["head_dim"])
    if cfg.get("num_experts") or cfg.get("num_local_experts"):
        w.add_expert_count(cfg.get("num_experts") or cfg["num_local_experts"])
        w.add_expert_used_count(cfg["num_experts_per_tok"])
        if cfg.get("moe_intermediate_size"):
            w.add_expert_feed_forward_length(cfg["moe_intermediate_size"])
        if cfg.get("shared_expert_intermediate_size"):
            w.add_expert_shared_feed_forward_length(cfg["shared_expert_intermediate_size"])
    _add_tokenizer(w, model_dir)

    tensors = _stack_experts(load_file(str(model_dir / "model.safetensors")))
    qtype = gguf.GGMLQuantizationType[matrix_type]
    for name, t in tensors.items():
        if name in skip:
            continue
        t = t.astype(np.float32)
        if arch == "llama" and name.endswith("q_proj.weight"):
            t = permute(t, heads)
        elif arch == "llama" and name.endswith("k_proj.weight"):
            t = permute(t, kv_heads)
        if name.endswith("shared_expert_gate.weight"):
            t = t.reshape(-1)  # llama.cpp keeps it a vector
        out_name = name if name.startswith("blk.") else gguf_name(name)
        if t.ndim >= 2 and matrix_type != "F32":
            w.add_tensor(out_name, gguf.quants.quantize(t, qtype), raw_dtype=qtype)
        else:
            w.add_tensor(out_name, t)
    if arch == "llama" and (cfg.get("rope_scaling") or {}).get("rope_type") == "llama3":
        w.add_tensor("rope_freqs.weight", llama3_rope_factors(cfg))
    for name, (data, type_name) in (raw_tensors or {}).items():
        w.add_tensor(name, data, raw_dtype=gguf.GGMLQuantizationType[type_name])
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return out


def _add_tokenizer(w, model_dir: Path) -> None:
    """The directory's byte-level BPE tokenizer as llama.cpp's gpt2 tokenizer metadata."""
    tok = json.loads((model_dir / "tokenizer.json").read_text())
    tcfg = json.loads((model_dir / "tokenizer_config.json").read_text())
    vocab = dict(tok["model"]["vocab"])
    special = {a["content"]: a["id"] for a in tok.get("added_tokens", [])}
    vocab.update(special)
    tokens = [None] * (max(vocab.values()) + 1)
    for t, i in vocab.items():
        tokens[i] = t
    tokens = [t if t is not None else f"[PAD{i}]" for i, t in enumerate(tokens)]
    merges = [m if isinstance(m, str) else " ".join(m) for m in tok["model"].get("merges", [])]
    w.add_tokenizer_model("gpt2")
    w.add_tokenizer_pre("llama-bpe")
    w.add_token_list(tokens)
    w.add_token_types([3 if t in special else 1 for t in tokens])
    w.add_token_merges(merges)
    for key, setter in (("bos_token", w.add_bos_token_id), ("eos_token", w.add_eos_token_id)):
        content = tcfg.get(key)
        content = content.get("content") if isinstance(content, dict) else content
        if content in vocab:
            setter(vocab[content])
    if tcfg.get("chat_template"):
        w.add_chat_template(tcfg["chat_template"])
