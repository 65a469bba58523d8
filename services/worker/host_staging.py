"""Hand-off pages through host memory, where UCX would move GPU memory over TCP.

Without a CUDA IPC or RDMA path, UCX sends GPU memory over TCP by its own staging pipeline, which
moved a hand-off's pages at 0.1-0.2 GB/s between two H200s of one host (UCX_TLS=tcp,cuda_copy,self:
4.2 s for a 2,900-token prompt's 364 MiB; 26 of 100 long prompts timed out; 2026-11-29), against
2.0 GB/s for pinned host memory over the same loopback (bench/ucx_tcp_probe.py). So the prefill
worker copies the pages into a host buffer and sends that; the decode worker receives into one and
copies it onto its GPU. The frame's header says "staged", so the decode side needs no setting of its own.

The buffers are pageable, not pinned: the copies then run at ~10 GB/s rather than 25-50, still
several times the link, and no buffer is pinned while the worker serves (pinning takes ~1 s a GB
on the event loop that receives the frame, and the driver's lock held meanwhile stalls the steps'
launches: the ITL lesson of several models on one GPU, engine/pinned_arena.py).

`--handoff-staging auto` (the default) stages when UCX has no GPU-capable path to the peer: UCX_TLS
names transports and none of them moves GPU memory directly (cuda_ipc, RDMA), or the peer is on
another host and this one has no RDMA device. `host` always stages (tests use it on the CPU, where
it copies host to host); `off` never.
"""

from __future__ import annotations

import os
import threading

import torch

STAGING_MODES = ("auto", "host", "off")
# UCX transports that move GPU memory without a host copy: CUDA IPC on one host, RDMA (GPUDirect) between hosts.
GPU_CAPABLE_TLS = ("cuda_ipc", "rc", "dc", "ud", "ib", "gdr", "all")
ROUND = 32 << 20  # buffers are made in multiples of this, so prompts of nearby lengths reuse one


def rdma_present() -> bool:
    try:
        return any(os.scandir("/sys/class/infiniband"))
    except OSError:
        return False


def should_stage(mode: str, own_host: str, peer_host: str, ucx_tls: str | None = None,
                 rdma: bool | None = None) -> bool:
    """Whether pages for a peer on `peer_host` go through host memory (see the module's text)."""
    if mode != "auto":
        return mode == "host"
    tls = os.environ.get("UCX_TLS", "") if ucx_tls is None else ucx_tls
    names = [t.strip().lstrip("^") for t in tls.split(",") if t.strip()]
    gpu_capable = any(n == "cuda" or n.startswith(GPU_CAPABLE_TLS) for n in names)
    if names and not tls.lstrip().startswith("^") and not gpu_capable:
        return True  # e.g. tcp,cuda_copy,self: UCX's own staging over TCP
    if peer_host and own_host and peer_host != own_host:
        return not (rdma_present() if rdma is None else rdma)
    return False


class HostStaging:
    """Reusable host buffers: take() one of at least n bytes, give() it back. Kept, up to `keep_bytes`
    of them, so their pages are faulted in once."""

    def __init__(self, keep_bytes: int = 4 << 30):
        self.keep_bytes = keep_bytes
        self._free: list[torch.Tensor] = []
        self._lock = threading.Lock()  # takes on the event loop, gives from copy threads too
        self.made = 0  # buffers allocated (a test and the logs read it)

    def take(self, nbytes: int) -> torch.Tensor:
        """A flat uint8 buffer of exactly nbytes (a view of a kept buffer when one is large enough)."""
        with self._lock:
            fits = [i for i, b in enumerate(self._free) if b.numel() >= nbytes]
            if fits:
                buf = self._free.pop(min(fits, key=lambda i: self._free[i].numel()))
                return buf[:nbytes]
        size = -(-max(nbytes, 1) // ROUND) * ROUND
        self.made += 1
        return torch.empty(size, dtype=torch.uint8)[:nbytes]

    def give(self, view: torch.Tensor) -> None:
        base = view._base if view._base is not None else view
        with self._lock:
            self._free.append(base)
            self._free.sort(key=torch.Tensor.numel, reverse=True)
            while sum(b.numel() for b in self._free) > self.keep_bytes and self._free:
                self._free.pop()  # the smallest go first: the large ones cost most to make again


def flat_bytes(x: torch.Tensor) -> torch.Tensor:
    """A contiguous tensor's bytes as a flat uint8 view (never a copy: a copy would take the pages
    written into it away with it; view raises on a tensor that is not contiguous)."""
    return x.view(-1).view(torch.uint8)


def copy_pages(dst: torch.Tensor, src: torch.Tensor, after=None) -> None:
    """dst ← src, both flat bytes, synchronous (run it off the event loop): a GPU side waits for
    `after` (a CUDA event: what last wrote or used the GPU buffer) first."""
    if after is not None and hasattr(after, "synchronize"):
        after.synchronize()
    dst.copy_(src)
    if dst.is_cuda or src.is_cuda:
        torch.cuda.current_stream(dst.device if dst.is_cuda else src.device).synchronize()
