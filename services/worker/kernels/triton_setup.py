"""A process's first Triton launch, made early on a thread of its own.

The first launch of any Triton kernel in a process pays ~0.5 s of setup that later kernels do not
(Triton's driver helpers and launcher, loaded once): on the H100 with a warm cache, 525-540 ms for
the first kernel, then 2-5 ms for each further one (bench/triton_first_launch_probe.py at 937136b,
2026-11-27). A worker's start paid it in the KV sizing's dry run, after the weights had loaded;
warm_device now starts it on a thread beside the load, and the engine waits for it (`wait`) once
its weights are in, before its first kernel."""

from __future__ import annotations

import threading

import structlog
import torch
import triton
import triton.language as tl

from services.worker.engine.cuda_device import bind_thread

log = structlog.get_logger("worker.triton")

_thread: threading.Thread | None = None


@triton.jit
def _touch(x_ptr):
    tl.store(x_ptr, 1)


def start(device) -> None:
    """Launch one trivial kernel on `device` from a daemon thread (once per process)."""
    global _thread
    if _thread is None:
        _thread = threading.Thread(target=_first_launch, args=(device,), name="triton-setup", daemon=True)
        _thread.start()


def wait() -> None:
    """Return once the thread `start` began has finished (at once if none was started)."""
    if _thread is not None:
        _thread.join()


def _first_launch(device) -> None:
    try:
        bind_thread(device)
        x = torch.zeros(1, dtype=torch.int32, device=device)
        _touch[(1,)](x)
        if x.is_cuda:
            torch.cuda.synchronize(x.device)
    except Exception:  # only a head start: the first real launch pays the setup instead
        log.warning("triton setup launch failed", exc_info=True)
