"""This rank's part of the model: the group joined, the shard loaded, the collectives hooked on,
and the layers wrapped as a pipeline stage when there are several."""

from __future__ import annotations

from torch import nn

from services.worker.engine.loader import load_model
from services.worker.engine.model_config import ModelConfig
from services.worker.engine.parallel.group import RankGroup, join_group, rank_device, start_group
from services.worker.engine.parallel.layout import ParallelLayout
from services.worker.engine.parallel.pipeline import PipelineStage
from services.worker.engine.parallel.tensor_parallel import apply_tensor_parallel, sharded_tensors


def join_or_start_group(config, layout: ParallelLayout, rank: int | None, init_method: str) -> RankGroup:
    """rank None: this is the driver, which starts the others; otherwise a rank it started."""
    if rank is None:
        return start_group(config, layout.with_rank(layout.driver_rank))
    layout = layout.with_rank(rank)
    return join_group(layout, init_method, rank_device(config.device, rank), config.custom_all_reduce,
                      config.fused_all_reduce_norm)


def load_rank_model(config, cfg: ModelConfig, group: RankGroup, device, dtype, ops) -> nn.Module:
    layout = group.layout
    model = load_model(config.model_dir, device, dtype, ops, config.load_threads, config.load_format,
                       config.seed * 1009 + layout.rank, build_cfg=layout.local_config(cfg),
                       shards=sharded_tensors(cfg, layout), max_positions=config.max_model_len)
    apply_tensor_parallel(model, cfg, layout, group.tp)
    return PipelineStage(model, layout) if layout.pp > 1 else model
