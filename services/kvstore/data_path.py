"""The kvstore's UCXX side: a put's pages land in its reservation, a get's leased pages go out in one frame.

Frames (shared/kv_transfer.py) carry {"op": "put" | "get", "lease": lease id}:
- put: the payload is the accepted pages concatenated in order; it is received straight into the
  lease's extent (allocate), then the lease is marked filled; the client commits over NATS.
- get: no payload; the reply's payload is the leased pages concatenated (a view when they are
  one run of one extent), with {"pages": n, "page_bytes": b}.
Anything else is refused with an error reply on the same stream, which stays usable.
"""

from __future__ import annotations

import time

import numpy as np

from services.kvstore.metrics import KvStoreMetrics
from services.kvstore.page_index import Extent, PageIndex, PageIndexError
from services.kvstore.page_store import PageStore
from shared.logging import get_logger

log = get_logger("kvstore.data")


class DataPath:
    def __init__(self, index: PageIndex, store: PageStore, metrics: KvStoreMetrics):
        self.index, self.store, self.metrics = index, store, metrics
        self._receiving: dict[str, tuple[Extent, float]] = {}  # lease id → (its extent, first byte time)

    def allocate(self, header: dict) -> np.ndarray | None:
        """Where a put's payload goes: its reservation's buffer, or None (the payload is drained and refused)."""
        lease_id = header.get("lease")
        if header.get("op") != "put" or not isinstance(lease_id, str):
            return None
        try:
            extent = self.index.write_target(lease_id, header["nbytes"])
        except PageIndexError as e:
            self.metrics.transfer_errors.inc()
            log.info("put_refused", lease=lease_id, code=e.code, error=str(e))
            return None
        self._receiving[lease_id] = (extent, time.perf_counter())
        return self.store.buffer(extent.id)

    async def handle(self, header: dict, payload: np.ndarray | None) -> tuple[dict, np.ndarray | None]:
        op, lease_id = header.get("op"), header.get("lease")
        if not isinstance(lease_id, str):
            raise ValueError("the header needs a 'lease' id")
        if op == "put":
            return self._put(lease_id, payload)
        if op == "get":
            return self._get(lease_id)
        raise ValueError(f"unknown op {op!r} (expected 'put' or 'get')")

    def _put(self, lease_id: str, payload: np.ndarray | None) -> tuple[dict, None]:
        extent, started = self._receiving.pop(lease_id, (None, 0.0))
        if extent is None or payload is None:
            raise ValueError(f"put {lease_id!r} came without its pages")
        self.index.mark_filled(lease_id, extent)  # raises if the lease expired while the bytes flowed
        self.metrics.put_received(payload.nbytes, time.perf_counter() - started)
        return {"pages": extent.pages}, None

    def _get(self, lease_id: str) -> tuple[dict, np.ndarray]:
        lease = self.index.read_source(lease_id)
        data = self.store.gather(lease.pages, lease.page_bytes)
        self.metrics.get_sent(data.nbytes)
        return {"pages": len(lease.pages), "page_bytes": lease.page_bytes}, data

    def on_error(self, reason: str) -> None:
        self.metrics.transfer_errors.inc()
        log.warning("transfer_error", reason=reason)

    def forget_stale(self) -> None:
        """Drop receives whose lease is gone (the peer died mid-transfer and the lease expired)."""
        for lease_id in [k for k in self._receiving if not self.index.holds(k)]:
            del self._receiving[lease_id]
