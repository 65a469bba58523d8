"""The kvstore service: the page index and its host memory, served over NATS (control) and UCXX (data)."""

from __future__ import annotations

import asyncio
import contextlib
import time
from typing import Callable

from aiohttp import web
from nats.aio.subscription import Subscription

from services.kvstore.config import KvStoreConfig
from services.kvstore.control import Control
from services.kvstore.data_path import DataPath
from services.kvstore.http import start_http
from services.kvstore.metrics import KvStoreMetrics
from services.kvstore.page_index import PageIndex
from services.kvstore.page_store import PageStore, cuda_present
from shared.kv_transfer import TransferServer
from shared.logging import get_logger
from shared.messages import KvEvents
from shared.nats_client import NatsConnection
from shared.subjects import STORE_ID, Subjects

log = get_logger("kvstore")


EVENTS_BATCH_S = 0.005


class KvStore:
    """One kvstore per subject prefix: it alone owns its page index."""

    def __init__(self, cfg: KvStoreConfig, conn: NatsConnection, subjects: Subjects | None = None,
                 clock: Callable[[], float] = time.monotonic):
        self.cfg = cfg
        self.conn = conn
        self.subjects = subjects or Subjects(conn.cfg.subject_prefix)
        self.store = PageStore(pinned=cfg.pin_memory if cfg.pin_memory is not None else cuda_present())
        self.index = PageIndex(cfg.capacity_bytes, clock, on_free=self.store.free, max_leases=cfg.max_leases)
        self.metrics = KvStoreMetrics(self.index)
        self.data = DataPath(self.index, self.store, self.metrics)
        self.server = TransferServer(self.data.handle, self.data.allocate, host=cfg.ucx_host, port=cfg.ucx_port,
                                     on_error=self.data.on_error)
        self._events_due = asyncio.Event()
        self.control = Control(cfg, self.index, self.store, self.metrics, lambda: self.address,
                               on_commit=self._events_due.set)
        self._listening = False
        self._subs: list[Subscription] = []
        self._sweeper: asyncio.Task | None = None
        self._http: web.AppRunner | None = None
        self._events_seq = 0

    @property
    def address(self) -> str:
        """The UCXX data server's "host:port" that workers dial."""
        return self.server.address if self._listening else ""

    async def start(self) -> None:
        """Listen for data first, so every control reply can name the data server."""
        self.server.start()
        self._listening = True
        self._subs = await self.control.subscribe(self.conn, self.subjects)
        self._sweeper = asyncio.create_task(self._sweep_loop(), name="kvstore-sweep")
        if self.cfg.http_port:
            self._http = await start_http(self.cfg.http_host, self.cfg.http_port, self.metrics, self.health)
        log.info("kvstore_ready", address=self.address, capacity_bytes=self.cfg.capacity_bytes,
                 pinned=self.store.pinned, subjects=self.subjects.kvstore("put").rsplit(".", 1)[0] + ".*",
                 http_port=self.cfg.http_port or None)

    async def stop(self) -> None:
        """Stop taking requests (those delivered are answered), then close the data server."""
        for sub in self._subs:
            with contextlib.suppress(Exception):
                await sub.drain()
        self._subs.clear()
        if self._sweeper is not None:
            self._sweeper.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._sweeper
            self._sweeper = None
        await self.server.close()
        self._listening = False
        if self._http is not None:
            await self._http.cleanup()
            self._http = None
        ix = self.index
        log.info("kvstore_stopped", pages=ix.num_pages, leases=ix.num_leases, bytes_used=ix.used_bytes,
                 bad_messages=self.metrics.bad_total)

    def health(self) -> dict:
        ix = self.index
        return {"status": "ok", "nats_connected": self.conn.connected, "address": self.address,
                "pages": ix.num_pages, "bytes_used": ix.used_bytes, "capacity_bytes": ix.capacity,
                "leases": ix.num_leases}

    async def _sweep_loop(self) -> None:
        """Leases expire even when no request comes to sweep them; the pages stored and evicted
        since the last round go to the schedulers as KV events (they count a prefix the store
        holds as fetchable by every worker, and tell the worker so: it asks the store only then).
        A commit brings the round forward, so a prefix is known a few milliseconds after it is stored."""
        while True:
            asleep = time.monotonic()
            try:
                await asyncio.wait_for(self._events_due.wait(), self.cfg.sweep_interval)
                await asyncio.sleep(EVENTS_BATCH_S)  # the commits of one burst go in one report
            except asyncio.TimeoutError:
                self.metrics.loop_lag_seconds.observe(max(0.0, time.monotonic() - asleep - self.cfg.sweep_interval))
            self._events_due.clear()
            self.index.sweep()
            self.data.forget_stale()
            stored, removed = self.index.take_events()
            if stored or removed or self._events_seq == 0:
                self._events_seq += 1
                with contextlib.suppress(Exception):  # NATS down: the schedulers resync on the seq gap
                    await self.conn.publish(self.subjects.kv_events, KvEvents(
                        worker_id=STORE_ID, seq=self._events_seq, stored=stored, removed=removed,
                        cleared=self._events_seq == 1))
