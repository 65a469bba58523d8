"""The decode side's hold on blocks for a request whose prompt KV another worker sends (engine.py's
reserve_import / complete_import / cancel_import), and the release of its receive slot."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch

from services.worker.engine.kv_export import PageExporter
from services.worker.engine.request import Request


@dataclass(slots=True)
class ImportReservation:
    """Blocks held for a request whose prompt KV another worker sends: the first `skip_blocks`
    pages are cached here already; `buffer` receives the others."""

    request: Request
    skip_blocks: int
    buffer: torch.Tensor
    # A CUDA event on the step stream after the buffer was allocated: another stream that writes
    # the buffer waits for it (kernels that used its memory before were queued ahead of it), not
    # for the steps queued since.
    allocated: object = None
    release: Callable[[], None] | None = None  # the receive slot's (a hand-off buffer run), or None
    # time.monotonic() until which a prefill worker may write the slot (it was told where it lies):
    # a dropped reservation's slot stays held that long (kv_export.PageExporter.retire).
    hold_until: float = 0.0

    def free_slot(self, exporter: PageExporter, hold_until: float) -> None:
        """Give the receive slot back, behind what the step stream queued last (the scatter of its
        pages, or whatever read it before)."""
        if self.release is None:
            return
        event = None
        if self.buffer.is_cuda:
            event = torch.cuda.Event()
            event.record(torch.cuda.current_stream(self.buffer.device))
        exporter.retire(self.release, event, hold_until)
