"""Binds a thread to the engine's GPU: CUDA's current device is per thread, and it decides where
Triton launches, `torch.cuda.Event.record()` and UCX's device copies go."""

from __future__ import annotations


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
