"""Where an MoE layer's checkpoint tensors land (each family's names), whole or as one rank's part."""

from __future__ import annotations

from services.worker.engine.model_config import ModelConfig
from services.worker.engine.placement import Placement, ShardedTensor, Slice

# Each family's names under model.layers.{i}.: the MoE block, the router, and an expert's gate, up
# and down projections.
_NAMES = {
    "MixtralForCausalLM": ("block_sparse_moe.", "gate", ("w1", "w3", "w2")),
}
_QWEN_STYLE = ("mlp.", "gate", ("gate_proj", "up_proj", "down_proj"))


def expert_tensors(cfg: ModelConfig, local: ModelConfig, layer: int, local_layer: int,
                   tp_rank: int = 0) -> dict[str, ShardedTensor]:
    """Checkpoint name → what a rank built with `local` (ParallelLayout.local_config) loads of layer
    `layer`'s MoE block, which is its layer `local_layer`. Tensor parallelism (local's expert size
    below cfg's) takes rank tp_rank's rows of gate and up and columns of down from every expert;
    expert parallelism (local_experts set) takes whole experts, its own only."""
    moe, mine = cfg.moe, local.moe
    h, inter, held = cfg.hidden_size, mine.intermediate_size, mine.held_experts
    block, router, (gate, up, down) = _NAMES.get(cfg.architecture, _QWEN_STYLE)
    src, dst = f"model.layers.{layer}.{block}", f"layers.{local_layer}.mlp."
    split = inter < moe.intermediate_size
    i0 = tp_rank * inter

    def rows(start, length):
        return Slice(0, start, length) if split else None

    def cols(start, length):
        return Slice(1, start, length) if split else None

    out = {src + f"{router}.weight": ShardedTensor((moe.num_experts, h), Placement(dst + "gate.weight", 0,
                                                                                     (moe.num_experts, h)))}
    for e in range(held):
        name = f"{src}experts.{mine.first_expert + e}."
        full = (moe.intermediate_size, h)
        out[name + f"{gate}.weight"] = ShardedTensor(full, Placement(dst + "w13", e * 2 * inter, (inter, h)),
                                                     rows(i0, inter))
        out[name + f"{up}.weight"] = ShardedTensor(full, Placement(dst + "w13", e * 2 * inter + inter, (inter, h)),
                                                   rows(i0, inter))
        out[name + f"{down}.weight"] = ShardedTensor((h, moe.intermediate_size),
                                                     Placement(dst + "w2", e * h, (h, inter)), cols(i0, inter))
    if moe.score_bias:
        out[src + f"{router}.e_score_correction_bias"] = ShardedTensor(
            (moe.num_experts,), Placement(dst + "score_bias", 0, (moe.num_experts,)))
    if moe.shared_intermediate_size:
        # The shared expert is a dense MLP seen by every token: split by tensor parallelism either way.
        # (DeepSeek's n_shared_experts are one MLP of their summed width, named in the plural.)
        shared = src + ("shared_expert." if moe.shared_gate else "shared_experts.")
        s_inter = mine.shared_intermediate_size
        s_full, s0 = moe.shared_intermediate_size, tp_rank * s_inter
        whole = s_inter == s_full
        s_rows = None if whole else Slice(0, s0, s_inter)
        s_cols = None if whole else Slice(1, s0, s_inter)
        gate_up = dst + "shared_expert.gate_up_proj.weight"
        out[shared + "gate_proj.weight"] = ShardedTensor((s_full, h), Placement(gate_up, 0, (s_inter, h)), s_rows)
        out[shared + "up_proj.weight"] = ShardedTensor((s_full, h), Placement(gate_up, s_inter, (s_inter, h)), s_rows)
        out[shared + "down_proj.weight"] = ShardedTensor(
            (h, s_full), Placement(dst + "shared_expert.down_proj.weight", 0, (h, s_inter)), s_cols)
        if moe.shared_gate:
            out[src + "shared_expert_gate.weight"] = ShardedTensor(
                (1, h), Placement(dst + "shared_expert_gate.weight", 0, (1, h)))
    return out
