"""torch's profiler around a stretch of engine steps, written as two tables: kernels by GPU time
and ops by the host's own time, with the GPU's busy time per step beside the step's wall time (a
step is GPU-bound when its kernels fill it, host-bound when they leave gaps). `inferno bench-engine
--profile FILE` profiles the driver's decode steps; a parallel group's other ranks, told by
FOLLOWERS_ENV, profile every step they follow into FILE.rankN. With TRACE_ENV set (bench-engine's
--profile-trace) each also writes its timeline, FILE[.rankN].trace.json.gz (chrome://tracing,
Perfetto): the ranks' clocks are the host's, so their steps line up side by side."""

from __future__ import annotations

import gzip
import os
import shutil

import torch

FOLLOWERS_ENV = "INFERNO_PROFILE_FOLLOWERS"
TRACE_ENV = "INFERNO_PROFILE_TRACE"


def start_profile():
    from torch.profiler import ProfilerActivity, profile
    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if torch.cuda.is_available() else [])
    profiler = profile(activities=activities)
    profiler.__enter__()
    return profiler


def write_profile(profiler, path: str, steps: int, seconds: float) -> None:
    profiler.__exit__(None, None, None)
    events = profiler.key_averages()
    gpu_us = sum(e.self_device_time_total for e in events)
    with open(path, "w") as f:
        f.write(f"steps {steps}, wall {1e3 * seconds / max(steps, 1):.3f} ms a step, "
                f"GPU kernels {gpu_us / 1e3 / max(steps, 1):.3f} ms a step\n")
        f.write(events.table(sort_by="self_device_time_total", row_limit=30, max_name_column_width=60))
        f.write("\nby the host's own time:\n")
        f.write(events.table(sort_by="self_cpu_time_total", row_limit=30, max_name_column_width=60))
    if os.environ.get(TRACE_ENV):
        raw = f"{path}.trace.json"
        profiler.export_chrome_trace(raw)
        with open(raw, "rb") as src, gzip.open(f"{raw}.gz", "wb") as dst:
            shutil.copyfileobj(src, dst)
        os.remove(raw)
