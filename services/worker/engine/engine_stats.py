"""What a worker's heartbeat says of its engine's load: requests, queued tokens, KV, caches, drafts, experts."""

from __future__ import annotations

from dataclasses import dataclass, field
from operator import attrgetter

import numpy as np

_TOKENS = attrgetter("all_token_ids")
_COMPUTED = attrgetter("num_computed_tokens")


@dataclass(slots=True)
class EngineStats:
    num_running: int
    num_waiting: int
    queued_prefill_tokens: int
    active_decode_tokens: int
    kv_usage: float
    num_free_blocks: int
    num_total_blocks: int
    prefix_cache_hits: int
    prefix_cache_queries: int
    steps: int = 0
    draft_counts: dict = field(default_factory=dict)  # LLMEngine.draft_counts
    expert_tokens: list = field(default_factory=list)  # an MoE model's tokens routed per expert (ExpertLoad)
    extra: dict = field(default_factory=dict)


def engine_stats(engine) -> EngineStats:
    """An LLMEngine's load now (the step thread refreshes it a few times a second)."""
    running = engine.batcher.running_requests()
    waiting = engine.batcher.waiting_requests()
    bm = engine.block_manager
    # C-level maps: a step that finishes requests refreshes this (a thousand running on a GPU).
    known = np.fromiter(map(len, map(_TOKENS, running)), dtype=np.int64, count=len(running))
    left = known - np.fromiter(map(_COMPUTED, running), dtype=np.int64, count=len(running)) - 1
    return EngineStats(
        num_running=len(running),
        num_waiting=len(waiting),
        queued_prefill_tokens=sum(map(len, map(_TOKENS, waiting))) - sum(map(_COMPUTED, waiting))
        + int(np.maximum(left, 0).sum()),
        active_decode_tokens=int(known.sum()),
        kv_usage=bm.usage,
        num_free_blocks=bm.num_free_blocks,
        num_total_blocks=bm.num_total_blocks,
        prefix_cache_hits=bm.prefix_cache_hits,
        prefix_cache_queries=bm.prefix_cache_queries,
        steps=engine.steps,
        draft_counts={m: list(c) for m, c in engine.draft_counts.items()},
        expert_tokens=engine.expert_load.snapshot(),
    )
