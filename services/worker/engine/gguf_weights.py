"""A GGUF's tensors into the model's parameters: llama.cpp names mapped to ours, q/k rows put back
in Hugging Face order, every quant type dequantized (on the target device) to the serving dtype."""

from __future__ import annotations

import re
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor

import torch

from services.worker.engine.gguf_dequant import SUPPORTED_TYPES, dequantize
from services.worker.engine.model_config import ModelConfig
from shared.gguf_file import GGUFError, GGUFFile, GGUFTensor

_GLOBAL_NAMES = {
    "token_embd.weight": "model.embed_tokens.weight",
    "output_norm.weight": "model.norm.weight",
    "output.weight": "lm_head.weight",
}
_LAYER_NAMES = {
    "attn_norm.weight": "input_layernorm.weight",
    "attn_q.weight": "self_attn.q_proj.weight",
    "attn_k.weight": "self_attn.k_proj.weight",
    "attn_v.weight": "self_attn.v_proj.weight",
    "attn_q.bias": "self_attn.q_proj.bias",
    "attn_k.bias": "self_attn.k_proj.bias",
    "attn_v.bias": "self_attn.v_proj.bias",
    "attn_q_norm.weight": "self_attn.q_norm.weight",
    "attn_k_norm.weight": "self_attn.k_norm.weight",
    "attn_output.weight": "self_attn.o_proj.weight",
    "ffn_norm.weight": "post_attention_layernorm.weight",
    "ffn_gate.weight": "mlp.gate_proj.weight",
    "ffn_up.weight": "mlp.up_proj.weight",
    "ffn_down.weight": "mlp.down_proj.weight",
}
_LAYER = re.compile(r"^blk\.(\d+)\.(.+)$")
# Tensors a GGUF may carry that are not weights of ours: rope_freqs is read into the config.
_NOT_WEIGHTS = {"rope_freqs.weight"}


def hf_name(gguf_name: str) -> str | None:
    """The Hugging Face checkpoint name of a GGUF tensor, or None if it is not one we know."""
    if gguf_name in _GLOBAL_NAMES:
        return _GLOBAL_NAMES[gguf_name]
    m = _LAYER.match(gguf_name)
    if m and m.group(2) in _LAYER_NAMES:
        return f"model.layers.{m.group(1)}.{_LAYER_NAMES[m.group(2)]}"
    return None


def unpermute_rows(w: torch.Tensor, num_heads: int) -> torch.Tensor:
    """llama.cpp stores each Llama q/k head's rows interleaved (pairs (i, i + d/2) side by side, for
    its GPT-J-style rope); put them back in the halves the neox-style rope of HF models expects."""
    rows = w.shape[0]
    return w.reshape(num_heads, rows // num_heads // 2, 2, *w.shape[1:]).transpose(1, 2).reshape(w.shape)


def gguf_plan(gf: GGUFFile, cfg: ModelConfig, expected: dict) -> list[tuple[GGUFTensor, str]]:
    """(tensor, HF name) for every expected parameter; all problems are reported before loading."""
    by_hf = {}
    for t in gf.tensors.values():
        name = hf_name(t.name)
        if name is None:
            if t.name not in _NOT_WEIGHTS:
                raise GGUFError(f"{gf.path}: unexpected tensor {t.name!r} for architecture {gf.architecture!r}")
            continue
        by_hf[name] = t
    plan = []
    for name, place in expected.items():
        t = by_hf.get(name)
        if t is None:
            raise GGUFError(f"{gf.path}: missing tensor for {name!r} (required by {cfg.architecture})")
        if t.type_name not in SUPPORTED_TYPES:
            raise GGUFError(f"{gf.path}: tensor {t.name!r} has quant type {t.type_name}, which is not "
                            f"supported; supported: {', '.join(SUPPORTED_TYPES)}")
        if t.shape != place.shape:
            raise GGUFError(f"{gf.path}: tensor {t.name!r} has shape {list(t.shape)}, "
                            f"but the metadata implies {list(place.shape)}")
        plan.append((t, name))
    return plan


def load_gguf_weights(gf: GGUFFile, cfg: ModelConfig, expected: dict, target: Callable[[str], torch.Tensor],
                      device: torch.device, dtype: torch.dtype, num_threads: int = 4) -> None:
    """Fill every parameter: target(hf_name) is the flat destination of that tensor's elements."""
    plan = gguf_plan(gf, cfg, expected)
    permute_heads = {}
    if cfg.architecture == "LlamaForCausalLM":
        permute_heads = {"q_proj": cfg.num_attention_heads, "k_proj": cfg.num_key_value_heads}

    def load_one(item: tuple[GGUFTensor, str]) -> None:
        t, name = item
        raw = torch.empty(t.nbytes, dtype=torch.uint8)
        with open(gf.path, "rb", buffering=0) as f:
            f.seek(t.offset)
            if f.readinto(memoryview(raw.numpy())) != t.nbytes:
                raise GGUFError(f"{gf.path}: tensor {t.name!r} is truncated")
        # Quantized bytes are 2-8x smaller than the result: move them, then expand on the device.
        w = dequantize(raw.to(device), t.type_name, t.shape, dtype)
        proj = name.rsplit(".", 2)[-2]
        if proj in permute_heads and name.endswith(".weight"):
            w = unpermute_rows(w, permute_heads[proj])
        target(name).copy_(w.reshape(-1))

    # Big tensors first so the threads finish together; torch releases the GIL while it works.
    jobs = sorted(plan, key=lambda item: -item[0].nbytes)
    with ThreadPoolExecutor(max(1, num_threads)) as pool:
        for future in [pool.submit(load_one, job) for job in jobs]:
            future.result()
    if device.type == "cuda":
        torch.cuda.synchronize(device)
