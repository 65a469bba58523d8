"""Which rank does what in a worker group of tensor_parallel × pipeline_parallel processes."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

from services.worker.engine.model_config import ModelConfig, MoEConfig


class ParallelConfigError(ValueError):
    """The model's shape cannot be split this way; the message says why."""


@dataclass(frozen=True, slots=True)
class ParallelLayout:
    """Rank r is tensor rank r % tp of pipeline stage r // tp. The driver (batcher, block manager,
    sampler, the service) is tensor rank 0 of the last stage: it holds the logits, so a step's
    tokens never travel back through the pipeline."""

    tp: int = 1
    pp: int = 1
    rank: int = 0
    # Mixture-of-experts layers: whole experts spread over the tensor-parallel ranks (vLLM's
    # --enable-expert-parallel) instead of every expert's intermediate dimension split over them.
    expert_parallel: bool = False

    def __post_init__(self) -> None:
        if self.tp < 1 or self.pp < 1:
            raise ParallelConfigError("tensor_parallel_size and pipeline_parallel_size must be ≥ 1")
        if not 0 <= self.rank < self.world_size:
            raise ParallelConfigError(f"rank {self.rank} is outside a group of {self.world_size}")

    @property
    def world_size(self) -> int:
        return self.tp * self.pp

    @property
    def tp_rank(self) -> int:
        return self.rank % self.tp

    @property
    def stage(self) -> int:
        return self.rank // self.tp

    @property
    def driver_rank(self) -> int:
        return (self.pp - 1) * self.tp

    @property
    def is_driver(self) -> bool:
        return self.rank == self.driver_rank

    @property
    def is_first_stage(self) -> bool:
        return self.stage == 0

    @property
    def is_last_stage(self) -> bool:
        return self.stage == self.pp - 1

    def stage_ranks(self, stage: int) -> list[int]:
        return list(range(stage * self.tp, (stage + 1) * self.tp))

    def peer(self, stage: int) -> int:
        """The rank of this tensor rank in another stage (activations go rank to rank)."""
        return stage * self.tp + self.tp_rank

    def with_rank(self, rank: int) -> "ParallelLayout":
        return dataclasses.replace(self, rank=rank)

    def layer_range(self, num_layers: int) -> tuple[int, int]:
        """This stage's layers [lo, hi): as even as possible, the earlier stages take the rest
        (the last stage also runs the final norm and the LM head)."""
        base, extra = divmod(num_layers, self.pp)
        lo = self.stage * base + min(self.stage, extra)
        return lo, lo + base + (1 if self.stage < extra else 0)

    def check(self, cfg: ModelConfig) -> None:
        tp = self.tp
        if cfg.num_attention_heads % tp:
            raise ParallelConfigError(
                f"{cfg.num_attention_heads} attention heads do not split over tensor_parallel_size {tp}")
        kv = cfg.num_key_value_heads
        if kv % tp and tp % kv:
            raise ParallelConfigError(
                f"{kv} KV heads neither split over nor replicate across tensor_parallel_size {tp}")
        if cfg.intermediate_size % tp and len(cfg.moe.sparse_layers if cfg.moe else ()) < cfg.num_hidden_layers:
            raise ParallelConfigError(
                f"intermediate_size {cfg.intermediate_size} does not split over tensor_parallel_size {tp}")
        if cfg.moe is not None:
            self._check_experts(cfg)
        if cfg.qk_norm_whole and tp > 1 and cfg.num_key_value_heads % tp:
            raise ParallelConfigError(f"{cfg.architecture}'s QK-norm spans all KV heads: its "
                                      f"{cfg.num_key_value_heads} KV heads must split over tensor_parallel_size {tp}")
        if cfg.num_hidden_layers < self.pp:
            raise ParallelConfigError(
                f"{cfg.num_hidden_layers} layers cannot fill pipeline_parallel_size {self.pp} stages")

    def _check_experts(self, cfg: ModelConfig) -> None:
        moe, tp = cfg.moe, self.tp
        if self.expert_parallel and moe.num_experts % tp:
            raise ParallelConfigError(f"{moe.num_experts} experts do not spread over {tp} expert-parallel ranks")
        if cfg.llama4 is not None and tp > 1 and not self.expert_parallel:
            raise ParallelConfigError("Llama 4's experts are stored stacked ([E, H, 2I]): they spread over the "
                                      "ranks whole (--enable-expert-parallel), not split by tensor parallelism")
        if not self.expert_parallel and moe.intermediate_size % tp:
            raise ParallelConfigError(f"the experts' intermediate size {moe.intermediate_size} does not split over "
                                      f"tensor_parallel_size {tp} (--enable-expert-parallel spreads whole experts)")
        if moe.shared_intermediate_size % tp:
            raise ParallelConfigError(f"the shared expert's intermediate size {moe.shared_intermediate_size} "
                                      f"does not split over tensor_parallel_size {tp}")

    def local_moe(self, cfg: ModelConfig, lo: int, hi: int) -> MoEConfig | None:
        """This rank's experts: every expert's slice of I (tensor parallelism), or whole experts of
        its own (expert parallelism); the shared expert split either way; stage-local layer ids."""
        moe = cfg.moe
        if moe is None:
            return None
        layers = _stage_layers(moe.sparse_layers, lo, hi)
        shared = moe.shared_intermediate_size // self.tp
        if self.expert_parallel:
            held = moe.num_experts // self.tp
            return dataclasses.replace(moe, sparse_layers=layers, shared_intermediate_size=shared,
                                       first_expert=self.tp_rank * held, local_experts=held)
        return dataclasses.replace(moe, sparse_layers=layers, shared_intermediate_size=shared,
                                   intermediate_size=moe.intermediate_size // self.tp)

    # -- this rank's share of the model --------------------------------------------------------
    def local_kv_heads(self, cfg: ModelConfig) -> int:
        return max(1, cfg.num_key_value_heads // self.tp)

    def kv_head_start(self, cfg: ModelConfig) -> int:
        """The first KV head this rank holds; with fewer KV heads than ranks, ranks share one."""
        kv = cfg.num_key_value_heads
        if kv >= self.tp:
            return self.tp_rank * (kv // self.tp)
        return self.tp_rank * kv // self.tp

    def vocab_rows(self, cfg: ModelConfig) -> int:
        return -(-cfg.vocab_size // self.tp)

    def local_config(self, cfg: ModelConfig) -> ModelConfig:
        """The shape this rank builds: its heads, its MLP columns, its vocabulary rows, its
        stage's layers. The model file is unchanged: it just sees a smaller model."""
        lo, hi = self.layer_range(cfg.num_hidden_layers)
        return dataclasses.replace(
            cfg,
            num_attention_heads=cfg.num_attention_heads // self.tp,
            num_key_value_heads=self.local_kv_heads(cfg),
            intermediate_size=cfg.intermediate_size // self.tp,
            vocab_size=self.vocab_rows(cfg),
            num_hidden_layers=hi - lo,
            moe=self.local_moe(cfg, lo, hi),
            llama4=None if cfg.llama4 is None else dataclasses.replace(
                cfg.llama4, nope_layers=_stage_layers(cfg.llama4.nope_layers, lo, hi),
                chunked_layers=_stage_layers(cfg.llama4.chunked_layers, lo, hi)),
        )


def _stage_layers(layers: tuple[int, ...], lo: int, hi: int) -> tuple[int, ...]:
    """The stage [lo, hi)'s layers among `layers`, renumbered from 0."""
    return tuple(i - lo for i in layers if lo <= i < hi)
