"""Which GPUs each child of the stack sees: a worker only its own (its group's), renumbered from
cuda:0; the scheduler, the gateway and nats-server none; the kvstore all (UCX moves the workers' GPU
pages only where CUDA is; it makes no context: kvstore/main.py).

Why: a process that can see GPU 0 makes a CUDA context there (518 MiB on an H200) as soon as
anything in it picks "device 0", and UCXX's progress thread does as it starts (ucxx's
_create_context: Device(0).set_current()). On two H200s (2026-11-28) a decode worker on cuda:1 held
a second context on GPU 0 from it, as reported; given CUDA_VISIBLE_DEVICES of its own GPU, its
"device 0" is that GPU and it holds one context. CUDA IPC between such workers still works (pull
and push, checked the same day): a mapping is opened on the caller's own device
(worker/engine/cuda_ipc.py), and the driver maps a peer's memory whether or not the peer's GPU is
visible to the caller."""

from __future__ import annotations

import os
import subprocess

NO_GPU = {"CUDA_VISIBLE_DEVICES": ""}


def visible_gpus() -> list[str]:
    """The GPUs the launcher hands out: CUDA_VISIBLE_DEVICES's entries if it is set, else those
    nvidia-smi lists, by index (none found: one, "0")."""
    env = os.environ.get("CUDA_VISIBLE_DEVICES")
    if env is not None:
        return [d.strip() for d in env.split(",") if d.strip()]
    try:
        out = subprocess.run(["nvidia-smi", "-L"], capture_output=True, text=True, timeout=10).stdout
    except (OSError, subprocess.TimeoutExpired):
        return ["0"]
    return [str(i) for i in range(max(1, sum(1 for line in out.splitlines() if line.startswith("GPU "))))]


def worker_placement(device: str, index: int, ranks: int, gpus: list[str]) -> tuple[str, dict[str, str]]:
    """The --device and the environment of the index-th worker started, a group of `ranks`
    processes with a GPU each. `cuda`: the workers take the GPUs in turn, each as many as its
    group has ranks; `cuda:N`: all of them the GPUs from N on; anything else (the CPU): no GPU."""
    if device == "cuda":
        first = (index % max(1, len(gpus) // ranks)) * ranks
    elif device.startswith("cuda:") and device[5:].isdigit():
        first = int(device[5:])
    else:
        return device, dict(NO_GPU)
    if first + ranks > len(gpus):  # more GPUs than were found (no nvidia-smi?): the launcher's view, as asked
        return f"cuda:{first}", {}
    return "cuda:0", {"CUDA_VISIBLE_DEVICES": ",".join(gpus[first:first + ranks])}
