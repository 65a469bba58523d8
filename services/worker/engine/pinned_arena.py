"""Pinned host memory made once, before any model serves, and lent to evicted models' host copies.

Pinning takes the driver's lock for as long as it pins (cudaHostAlloc: ~1.1 GB/s on the H200 host),
and every other thread's CUDA calls wait for it: the launches of the models serving beside the one
being evicted. A 1B's ITL p99 was 526 ms against 2.0 quiet while an 8B went to the host, 17.5 ms with
threaded pinning (H200, 2026-11-29). With the arena, an eviction pins nothing: its tensors are views
of memory pinned at start (`--host-memory-gb`), carved first-fit and given back when the model returns
to the GPU or its copy is dropped.
"""

from __future__ import annotations

import threading

import torch

ALIGN = 512  # bytes: every view starts on a boundary any dtype and DMA engine is happy with


def _aligned(n: int) -> int:
    return -(-n // ALIGN) * ALIGN


class PinnedArena:
    def __init__(self, nbytes: int, pin: bool = True):
        self.nbytes = _aligned(nbytes) if nbytes > 0 else 0
        self.buffer = torch.empty(self.nbytes, dtype=torch.uint8, pin_memory=pin)
        self._free: list[tuple[int, int]] = [(0, self.nbytes)] if self.nbytes else []  # (offset, size), sorted
        self._lock = threading.Lock()  # evictions run on threads; the host's lock orders them anyway

    @property
    def free_bytes(self) -> int:
        return sum(size for _, size in self._free)

    @staticmethod
    def bytes_for(tensors) -> int:
        """The span that holds `tensors` (shape and dtype of each), each view aligned."""
        return sum(_aligned(t.numel() * t.element_size()) for t in tensors)

    def take(self, nbytes: int) -> tuple[int, int] | None:
        """A span of at least `nbytes` (first fit), or None when no free run is that long."""
        need = _aligned(nbytes)
        with self._lock:
            for i, (offset, size) in enumerate(self._free):
                if size >= need:
                    if size == need:
                        del self._free[i]
                    else:
                        self._free[i] = (offset + need, size - need)
                    return offset, need
        return None

    def give(self, span: tuple[int, int]) -> None:
        """A span back, merged with its free neighbours."""
        offset, size = span
        with self._lock:
            free = self._free
            i = 0
            while i < len(free) and free[i][0] < offset:
                i += 1
            free.insert(i, (offset, size))
            if i + 1 < len(free) and offset + size == free[i + 1][0]:
                free[i] = (offset, size + free[i + 1][1])
                del free[i + 1]
            if i > 0 and free[i - 1][0] + free[i - 1][1] == free[i][0]:
                free[i - 1] = (free[i - 1][0], free[i - 1][1] + free[i][1])
                del free[i]

    def views(self, span: tuple[int, int]):
        """allocate(shape, dtype) → the span's next view of that shape, in order, each aligned."""
        at = [span[0]]
        end = span[0] + span[1]

        def allocate(shape, dtype) -> torch.Tensor:
            n = torch.Size(shape).numel() * torch.empty(0, dtype=dtype).element_size()
            start = at[0]
            if start + n > end:
                raise ValueError("the span is smaller than the tensors put in it")
            at[0] = start + _aligned(n)
            return self.buffer[start:start + n].view(dtype).view(shape)

        return allocate
