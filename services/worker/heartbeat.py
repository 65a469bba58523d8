"""A worker's heartbeat: what the schedulers route by and the gateways show (identity, readiness,
load, the engine's device and counters), and how often it goes out."""

from __future__ import annotations

import functools
import time

from shared.config import WorkerServiceConfig
from shared.messages import WorkerHeartbeat

PREFILL_BEAT_S = 0.1  # a prefill worker's heartbeat period at most


def heartbeat_period(cfg: WorkerServiceConfig) -> float:
    """Seconds between heartbeats. A prefill worker beats at least every 0.1 s: the scheduler sends a
    prompt to its decode worker instead once the prefill queue passes its bound, and counts what it
    routed since the last beat as queued. At 1 s, at 5 long prompts a second (two H200s, 2026-11-29),
    a second's prompts always looked queued, and 27 % of them were prefilled by the decode worker
    for nothing: its inter-token latency paid, and the first tokens came no sooner."""
    if cfg.role == "prefill":
        return min(cfg.heartbeat_interval, PREFILL_BEAT_S)
    return cfg.heartbeat_interval


def worker_heartbeat(service) -> WorkerHeartbeat:
    """A WorkerService's heartbeat now (its seq already counted)."""
    cfg, loop_thread = service.cfg, service.loop_thread
    ready = service.state == "ready" and loop_thread is not None and not service.draining
    hb = dict(worker_id=cfg.worker_id, role=cfg.role, model=service.model_name, state=service.state,
              ready=ready, draining=service.draining, generate_subject=service.generate_subject,
              abort_subject=service.abort_subject, timestamp=time.time(), seq=service.seq,
              block_size=service.block_size, max_model_len=service.max_model_len, host=service.host,
              model_dir=service.model_dir, memory_share=cfg.memory_share, num_waiting=len(service.parked))
    if loop_thread is not None:
        s = loop_thread.stats
        hb.update(num_running=s.num_running,
                  num_waiting=s.num_waiting + loop_thread.commands.qsize() + len(service.parked),
                  queued_prefill_tokens=s.queued_prefill_tokens, active_decode_tokens=s.active_decode_tokens,
                  kv_usage=min(1.0, max(0.0, s.kv_usage)), num_free_blocks=s.num_free_blocks,
                  num_total_blocks=s.num_total_blocks, prefix_cache_hits=s.prefix_cache_hits,
                  prefix_cache_queries=s.prefix_cache_queries, spec_by_method=s.draft_counts,
                  expert_tokens=s.expert_tokens, expert_ranks=expert_ranks(loop_thread.engine),
                  steps=loop_thread.steps_done, busy_seconds=loop_thread.busy_seconds,
                  computed_tokens=loop_thread.computed_tokens, output_tokens=loop_thread.output_tokens,
                  prefill_tokens_per_s=loop_thread.prefill_rate.rate,
                  **describe_engine(loop_thread.engine), **handoff_counts(service.sender, service.receiver))
    cache = service.cluster_cache
    hb["store_fetch_cost"] = -1.0 if cache is None else min(cache.fetch_cost_ratio, 10.0)
    return WorkerHeartbeat(**hb)


def handoff_counts(sender, receiver) -> dict:
    """A prefill worker's hand-offs sent, or a decode worker's received."""
    if sender is not None:
        stats = sender.stats
        recent = sorted(sender.recent_seconds)
        return {"kv_handoffs": stats["handoffs"], "kv_handoff_bytes": stats["bytes"],
                "kv_handoffs_direct": stats["direct"], "kv_handoffs_ipc": stats["ipc"],
                "kv_handoffs_pushed": stats["pushed"], "kv_handoffs_staged": stats["staged"],
                "kv_handoffs_recomputed": stats["recomputed"],
                "kv_handoff_p50_ms": 1e3 * recent[len(recent) // 2] if recent else 0.0}
    if receiver is not None:
        stats = receiver.stats
        return {"kv_handoffs": stats["imports"], "kv_handoff_bytes": stats["bytes"],
                "kv_handoffs_direct": stats["direct"], "kv_handoffs_ipc": stats["ipc"],
                "kv_handoffs_pushed": stats["pushed"], "kv_handoffs_staged": stats["staged"],
                "kv_handoffs_recomputed": stats["recomputed"]}
    return {}


def expert_ranks(engine) -> int:
    """The GPUs an MoE model's experts are spread over (1: every rank holds every expert)."""
    layout = getattr(engine, "layout", None)
    return layout.tp if layout is not None and layout.expert_parallel else 1


def describe_engine(engine) -> dict:
    """The heartbeat's device, dtype and graph count of an engine (the model-free emitter has none)."""
    device = getattr(engine, "device", None)
    if device is None:
        return {}
    name = str(device)
    if device.type == "cuda":
        name = f"{device} {_gpu_name(device.index or 0)}"
    layout = getattr(engine, "layout", None)
    if layout is not None and layout.world_size > 1:
        name += f" +{layout.world_size - 1}"
    runner = getattr(engine, "runner", None)
    graphs = getattr(runner, "graphs", None)
    dtype = getattr(engine, "dtype", None)
    return {"device": name, "dtype": str(dtype).removeprefix("torch.") if dtype is not None else "",
            "graphs": len(getattr(graphs, "graphs", ())) if graphs is not None else 0}


@functools.cache
def _gpu_name(index: int) -> str:
    import torch
    return torch.cuda.get_device_name(index)
