"""A layout's plan (every rank of one replica, the KV tokens the group gets) and --compare's list of them."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

from services.worker.engine.engine_config import EngineConfig
from services.worker.engine.model_config import ModelConfig
from services.worker.engine.parallel.layout import ParallelConfigError, ParallelLayout
from services.worker.plan.gpus import Gpus
from services.worker.plan.rank_memory import RankMemory, rank_memory


@dataclass(frozen=True, slots=True)
class LayoutPlan:
    tp: int
    pp: int
    expert_parallel: bool
    replicas: int  # groups of tp × pp GPUs the --gpus hold
    ranks: tuple[RankMemory, ...]
    error: str = ""  # the layout cannot be made (too few GPUs, a shape that does not split)

    @property
    def name(self) -> str:
        return f"TP={self.tp} PP={self.pp}" + (" EP" if self.expert_parallel else "")

    @property
    def kv_blocks(self) -> int:
        """The group's pool: every rank takes the least over the ranks (LLMEngine: min_over_ranks)."""
        return min((r.kv_blocks for r in self.ranks), default=0)

    @property
    def kv_tokens(self) -> int:
        """KV tokens of one replica."""
        return self.kv_blocks * self.ranks[0].block_size if self.ranks else 0

    @property
    def fits(self) -> bool:
        return not self.error and self.kv_blocks >= 1

    @property
    def reason(self) -> str:
        """Why it does not fit ('' when it does): the layout's error, else the first short rank's."""
        return self.error or next((r.shortfall() for r in self.ranks if not r.fits), "")

    def as_dict(self) -> dict:
        return {"tp": self.tp, "pp": self.pp, "expert_parallel": self.expert_parallel, "replicas": self.replicas,
                "kv_blocks_per_replica": self.kv_blocks, "kv_tokens_per_replica": self.kv_tokens,
                "kv_tokens_total": self.kv_tokens * self.replicas, "fits": self.fits, "reason": self.reason,
                "ranks": [r.as_dict() for r in self.ranks]}


def plan_layout(model_config: ModelConfig, config: EngineConfig, gpus: Gpus) -> LayoutPlan:
    """The layout of config's tensor_parallel_size, pipeline_parallel_size and enable_expert_parallel."""
    tp, pp, ep = config.tensor_parallel_size, config.pipeline_parallel_size, config.enable_expert_parallel
    world = tp * pp
    if world > gpus.count:
        return LayoutPlan(tp, pp, ep, 0, (), f"TP × PP = {world} GPUs, --gpus gives {gpus.count}")
    layout = ParallelLayout(tp, pp, expert_parallel=ep)
    try:
        layout.check(model_config)
    except ParallelConfigError as e:
        return LayoutPlan(tp, pp, ep, 0, (), str(e))
    ranks = tuple(rank_memory(model_config, layout.with_rank(r), config, gpus.total_bytes) for r in range(world))
    return LayoutPlan(tp, pp, ep, gpus.count // world, ranks)


def compare_layouts(model_config: ModelConfig, config: EngineConfig, gpus: Gpus,
                    max_group: int | None = None) -> list[LayoutPlan]:
    """Every TP × PP whose group (of at most max_group GPUs) divides the GPUs (the rest serve as more
    replicas), with and without expert parallelism for an MoE model, that ParallelLayout accepts; most KV
    tokens per replica first."""
    plans = []
    for world in (n for n in range(1, (max_group or gpus.count) + 1) if gpus.count % n == 0):
        for tp in (n for n in range(1, world + 1) if world % n == 0):
            for ep in (False, True) if model_config.moe is not None and tp > 1 else (False,):
                layout = dataclasses.replace(config, tensor_parallel_size=tp, pipeline_parallel_size=world // tp,
                                             enable_expert_parallel=ep)
                plan = plan_layout(model_config, layout, gpus)
                if not plan.error:
                    plans.append(plan)
    return sorted(plans, key=lambda p: (-p.kv_tokens, p.tp * p.pp, p.pp, p.expert_parallel))
