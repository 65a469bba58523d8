"""Binds a thread to the engine's GPU: CUDA's current device is per thread, and it decides where
Triton launches, `torch.cuda.Event.record()` and UCX's device copies go."""

from __future__ import annotations

import threading


def bind_thread(device) -> None:
    """Make `device` current in the calling thread (nothing on the CPU or for a bare "cuda").

    Triton launches a kernel on the *current* device's stream, not on its tensors' device, so a
    worker on cuda:1 whose step thread was left on device 0 fails every launch; and a pipeline
    group's driver runs on its last stage's GPU, never device 0. Call it first in every thread
    that runs the model or moves its KV: the loading thread, the step thread, the event loop."""
    if device is None:
        return
    import torch

    device = torch.device(device)
    if device.type == "cuda" and device.index is not None:
        torch.cuda.set_device(device)


# One process may hold several models on one GPU (services/worker/model_host.py): while one thread
# captures a CUDA graph, no other thread may synchronise the device or free its memory (a device-wide
# sync or cudaFree waits on the capturing stream: the capture and the call both fail). Captures, and
# the loads and evictions that synchronise and free, take this lock; serving steps (stream events
# only) do not, so the other models serve on meanwhile.
DEVICE_LOCK = threading.RLock()


def holding_device(fn):
    """`fn` (a load, an eviction: they synchronise the device and free its memory) under DEVICE_LOCK."""
    import functools

    @functools.wraps(fn)
    def held(*args, **kwargs):
        with DEVICE_LOCK:
            return fn(*args, **kwargs)
    return held
