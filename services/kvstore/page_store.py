"""The kvstore's host memory: one buffer per extent (see page_index.py), pinned when a GPU is present.

Buffers are numpy uint8 arrays (views of pinned torch tensors when pinned). Freeing drops the
store's reference only: a transfer still sending from or receiving into a buffer holds its own, so
memory is returned when the last user is done, never while UCX touches it.
"""

from __future__ import annotations

from typing import Sequence

import numpy as np

from services.kvstore.page_index import Page


def cuda_present() -> bool:
    try:
        import torch
    except ImportError:
        return False
    return torch.cuda.is_available()


class PageStore:
    def __init__(self, pinned: bool = False):
        self.pinned = pinned
        self._buffers: dict[int, np.ndarray] = {}

    def __len__(self) -> int:
        return len(self._buffers)

    @property
    def nbytes(self) -> int:
        return sum(b.nbytes for b in self._buffers.values())

    def allocate(self, extent_id: int, nbytes: int) -> np.ndarray:
        if self.pinned:
            import torch  # only where a GPU is, so CPU-only processes never pay for the import

            # The view's base is the tensor, so the pinned memory lives as long as any view of it.
            buf = torch.empty(nbytes, dtype=torch.uint8, pin_memory=True).numpy()
        else:
            buf = np.empty(nbytes, dtype=np.uint8)
        self._buffers[extent_id] = buf
        return buf

    def free(self, extent_id: int) -> None:
        self._buffers.pop(extent_id, None)

    def buffer(self, extent_id: int) -> np.ndarray:
        return self._buffers[extent_id]

    def gather(self, pages: Sequence[Page], page_bytes: int) -> np.ndarray:
        """The pages' bytes concatenated in order: a view when they are one run of one extent
        (a get of what one put stored), else one copy per run of consecutive slots."""
        runs: list[tuple[int, int, int]] = []  # (extent id, first slot, pages)
        for page in pages:
            eid = page.extent.id
            if runs and runs[-1][0] == eid and runs[-1][1] + runs[-1][2] == page.slot:
                runs[-1] = (eid, runs[-1][1], runs[-1][2] + 1)
            else:
                runs.append((eid, page.slot, 1))
        if len(runs) == 1:
            eid, first, n = runs[0]
            return self._buffers[eid][first * page_bytes:(first + n) * page_bytes]
        out = np.empty(len(pages) * page_bytes, dtype=np.uint8)
        at = 0
        for eid, first, n in runs:
            size = n * page_bytes
            out[at:at + size] = self._buffers[eid][first * page_bytes:first * page_bytes + size]
            at += size
        return out
