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
# A mixture of experts (llama.cpp stacks each projection of all experts in one 3-D tensor [E, N, K]);
# the names under the MoE block, whose prefix is the family's (MoE_BLOCK).
_MOE_NAMES = {
    "ffn_gate_inp.weight": "gate.weight",
    "ffn_gate_shexp.weight": "shared_expert.gate_proj.weight",
    "ffn_up_shexp.weight": "shared_expert.up_proj.weight",
    "ffn_down_shexp.weight": "shared_expert.down_proj.weight",
    "ffn_gate_inp_shexp.weight": "shared_expert_gate.weight",  # a vector [H] in the file, [1, H] in ours
}
_EXPERT_NAMES = {"ffn_gate_exps.weight": 0, "ffn_up_exps.weight": 1, "ffn_down_exps.weight": 2}
_EXPERT_PROJ = {"MixtralForCausalLM": ("w1", "w3", "w2")}
_MOE_BLOCK = {"MixtralForCausalLM": "block_sparse_moe."}
_LAYER = re.compile(r"^blk\.(\d+)\.(.+)$")
# Tensors a GGUF may carry that are not weights of ours: rope_freqs is read into the config.
_NOT_WEIGHTS = {"rope_freqs.weight"}


def hf_names(gguf_name: str, cfg: ModelConfig) -> list[str]:
    """The Hugging Face checkpoint names a GGUF tensor holds: one, or each expert's of a stacked
    expert tensor (in expert order); none if it is not one we know."""
    if gguf_name in _GLOBAL_NAMES:
        return [_GLOBAL_NAMES[gguf_name]]
    m = _LAYER.match(gguf_name)
    if not m:
        return []
    layer, rest = f"model.layers.{m.group(1)}.", m.group(2)
    if rest in _LAYER_NAMES:
        return [layer + _LAYER_NAMES[rest]]
    block = layer + _MOE_BLOCK.get(cfg.architecture, "mlp.")
    if rest in _MOE_NAMES and cfg.moe is not None:
        return [block + _MOE_NAMES[rest]]
    if rest in _EXPERT_NAMES and cfg.moe is not None:
        proj = _EXPERT_PROJ.get(cfg.architecture, ("gate_proj", "up_proj", "down_proj"))[_EXPERT_NAMES[rest]]
        return [f"{block}experts.{e}.{proj}.weight" for e in range(cfg.moe.num_experts)]
    return []


def unpermute_rows(w: torch.Tensor, num_heads: int) -> torch.Tensor:
    """llama.cpp stores each Llama q/k head's rows interleaved (pairs (i, i + d/2) side by side, for
    its GPT-J-style rope); put them back in the halves the neox-style rope of HF models expects."""
    rows = w.shape[0]
    return w.reshape(num_heads, rows // num_heads // 2, 2, *w.shape[1:]).transpose(1, 2).reshape(w.shape)


def gguf_plan(gf: GGUFFile, cfg: ModelConfig, expected: dict) -> list[tuple[GGUFTensor, list[str]]]:
    """(tensor, the HF names it fills) for every expected parameter; all problems are reported
    before loading."""
    by_hf = {}
    for t in gf.tensors.values():
        names = hf_names(t.name, cfg)
        if not names and t.name not in _NOT_WEIGHTS:
            raise GGUFError(f"{gf.path}: unexpected tensor {t.name!r} for architecture {gf.architecture!r}")
        for name in names:
            by_hf[name] = (t, names)
    plan, planned = [], set()
    for name, place in expected.items():
        t, names = by_hf.get(name, (None, None))
        if t is None:
            raise GGUFError(f"{gf.path}: missing tensor for {name!r} (required by {cfg.architecture})")
        if t.type_name not in SUPPORTED_TYPES:
            raise GGUFError(f"{gf.path}: tensor {t.name!r} has quant type {t.type_name}, which is not "
                            f"supported; supported: {', '.join(SUPPORTED_TYPES)}")
        want = (len(names), *place.shape) if len(names) > 1 else place.shape
        if t.shape != want and (1, *t.shape) != want:  # (Qwen2-MoE's shared expert gate is a vector there)
            raise GGUFError(f"{gf.path}: tensor {t.name!r} has shape {list(t.shape)}, "
                            f"but the metadata implies {list(want)}")
        if t.name not in planned:
            planned.add(t.name)
            plan.append((t, names))
    return plan


def load_gguf_weights(gf: GGUFFile, cfg: ModelConfig, expected: dict, target: Callable[[str], torch.Tensor],
                      device: torch.device, dtype: torch.dtype, num_threads: int = 4) -> None:
    """Fill every parameter: target(hf_name) is the flat destination of that tensor's elements."""
    plan = gguf_plan(gf, cfg, expected)
    permute_heads = {}
    if cfg.architecture in ("LlamaForCausalLM", "MixtralForCausalLM"):
        permute_heads = {"q_proj": cfg.num_attention_heads, "k_proj": cfg.num_key_value_heads}

    def load_one(item: tuple[GGUFTensor, list[str]]) -> None:
        t, names = item
        raw = torch.empty(t.nbytes, dtype=torch.uint8)
        with open(gf.path, "rb", buffering=0) as f:
            f.seek(t.offset)
            if f.readinto(memoryview(raw.numpy())) != t.nbytes:
                raise GGUFError(f"{gf.path}: tensor {t.name!r} is truncated")
        # Quantized bytes are 2-8x smaller than the result: move them, then expand on the device.
        w = dequantize(raw.to(device), t.type_name, t.shape, dtype)
        proj = names[0].rsplit(".", 2)[-2]
        if proj in permute_heads and names[0].endswith(".weight"):
            w = unpermute_rows(w, permute_heads[proj])
        for name, part in zip(names, w.reshape(len(names), -1)):  # a stacked expert tensor: each expert's
            target(name).copy_(part)

    # Big tensors first so the threads finish together; torch releases the GIL while it works.
    jobs = sorted(plan, key=lambda item: -item[0].nbytes)
    with ThreadPoolExecutor(max(1, num_threads)) as pool:
        for future in [pool.submit(load_one, job) for job in jobs]:
            future.result()
    if device.type == "cuda":
        torch.cuda.synchronize(device)
