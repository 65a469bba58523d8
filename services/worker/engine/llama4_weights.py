"""Where a Llama 4 layer's feed-forward checkpoint tensors land (transformers' names), whole or as one rank's part."""

from __future__ import annotations

from services.worker.engine.model_config import ModelConfig
from services.worker.engine.placement import Placement, ShardedTensor, Slice


def llama4_feed_forward(cfg: ModelConfig, local: ModelConfig, layer: int, local_layer: int,
                        tp_rank: int = 0) -> dict[str, ShardedTensor]:
    """Checkpoint name → what a rank built with `local` (ParallelLayout.local_config) loads of layer
    `layer`'s feed_forward, its layer `local_layer`: a dense MLP (intermediate_size_mlp wide), or the
    router, the experts and the shared expert. The experts come stacked, gate_up_proj [E, H, 2I]
    (gate | up along the last dimension) and down_proj [E, I, H]: each expert's matrix is the
    transpose of its w13 [2I, H] and w2 [H, I] (Placement.transpose). Tensor parallelism splits the
    dense MLP and the shared expert as Llama's MLP; the experts go to ranks whole (expert
    parallelism: a run of rows of the stacked tensors; ParallelLayout.check asks for it)."""
    h = cfg.hidden_size
    src, dst = f"model.layers.{layer}.feed_forward.", f"layers.{local_layer}.mlp."
    if not cfg.is_sparse(layer):
        return _mlp(src, dst, h, cfg.intermediate_size, local.intermediate_size, tp_rank)
    moe, mine = cfg.moe, local.moe
    experts, inter, held = moe.num_experts, moe.intermediate_size, mine.held_experts
    mine_rows = Slice(0, mine.first_expert, held) if held < experts else None
    out = {
        src + "router.weight": ShardedTensor((experts, h), Placement(dst + "gate.weight", 0, (experts, h))),
        src + "experts.gate_up_proj": ShardedTensor(
            (experts, h, 2 * inter), Placement(dst + "w13", 0, (held, 2 * inter, h), transpose=True), mine_rows),
        src + "experts.down_proj": ShardedTensor(
            (experts, inter, h), Placement(dst + "w2", 0, (held, h, inter), transpose=True), mine_rows),
    }
    out.update(_mlp(src + "shared_expert.", dst + "shared_expert.", h, moe.shared_intermediate_size,
                    mine.shared_intermediate_size, tp_rank))
    return out


def _mlp(src: str, dst: str, h: int, full: int, inter: int, tp_rank: int) -> dict[str, ShardedTensor]:
    """A SiLU-gated MLP's gate, up and down projections into gate_up_proj and down_proj: a rank's
    `inter` of the `full` intermediate rows (of gate and up) and columns (of down)."""
    i0 = tp_rank * inter
    rows, cols = (None, None) if inter == full else (Slice(0, i0, inter), Slice(1, i0, inter))
    gate_up = dst + "gate_up_proj.weight"
    return {
        src + "gate_proj.weight": ShardedTensor((full, h), Placement(gate_up, 0, (inter, h)), rows),
        src + "up_proj.weight": ShardedTensor((full, h), Placement(gate_up, inter, (inter, h)), rows),
        src + "down_proj.weight": ShardedTensor((h, full), Placement(dst + "down_proj.weight", 0, (h, inter)), cols),
    }
