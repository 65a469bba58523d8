"""The kvstore's client for workers and tests: control over NATS, page data over UCXX, one error type.

A put is: reserve (NATS) → send the accepted pages in one UCXX frame → commit (NATS); a get is:
lease (NATS) → receive the leased pages in one UCXX frame → release (NATS, always). Every wait has a
deadline; any failure (store down, lease expired, refused) raises KvStoreError, except the cases a
caller should not have to handle: no room for a put (0 stored) and nothing to get (count 0).
"""

from __future__ import annotations

import asyncio
import time
from typing import Any, Callable

import numpy as np

from shared.errors import ServiceError
from shared.kv_transfer import Buffer, TransferClient, TransferError, as_buffer, import_ucxx, nbytes_of
from shared.kvstore_messages import (PROBE_PREFIX, KvCommitReply, KvCommitRequest, KvGetReply, KvGetRequest,
                                     KvLookupReply, KvLookupRequest, KvPutReply, KvPutRequest, KvReleaseReply,
                                     KvReleaseRequest, KvReply, KvStatsReply, KvStatsRequest, pack_hashes,
                                     unpack_hashes)
from shared.logging import get_logger
from shared.nats_client import NatsConnection
from shared.subjects import Subjects
from shared.wire import Message

log = get_logger(__name__)

PageAllocate = Callable[[int, int], Buffer]  # (pages, page_bytes) → a buffer of pages × page_bytes bytes


class KvStoreError(RuntimeError):
    """A kvstore call failed; `code` is the store's reply code, or "unavailable" / "transfer"."""

    def __init__(self, message: str, code: str = "unavailable"):
        super().__init__(message)
        self.code = code


def _host_pages(pages: int, page_bytes: int) -> np.ndarray:
    return np.empty(pages * page_bytes, dtype=np.uint8)


class KvStoreClient:
    def __init__(self, conn: NatsConnection, transfer: TransferClient, prefix: str | None = None,
                 timeout: float = 2.0, transfer_timeout: float = 30.0):
        self.conn = conn
        self.transfer = transfer
        self.subjects = Subjects(prefix if prefix is not None else conn.cfg.subject_prefix)
        self.timeout = timeout  # each control request
        self.transfer_timeout = transfer_timeout  # each UCXX call
        self.last_put: tuple[int, float] = (0, 0.0)  # (bytes, seconds) of the last UCXX put
        self.last_get: tuple[int, float] = (0, 0.0)
        self.reuse = 1.0  # the store's pages read per page stored, as its last put reply said
        self._pending: set[asyncio.Task] = set()  # releases in flight (a task needs a reference)

    def _later(self, coro) -> None:
        task = asyncio.ensure_future(coro)
        self._pending.add(task)
        task.add_done_callback(self._pending.discard)

    async def _call(self, verb: str, msg: Message, reply_cls: type[KvReply]) -> Any:
        try:
            reply = await self.conn.request(self.subjects.kvstore(verb), msg, reply_cls, timeout=self.timeout)
        except ServiceError as e:
            raise KvStoreError(f"kvstore {verb}: {e}", "unavailable") from None
        if not reply.ok:
            raise KvStoreError(f"kvstore {verb}: {reply.error}", reply.code)
        return reply

    async def lookup(self, namespace: str, block_size: int, hashes: list[bytes]) -> int:
        """How many leading `hashes` the store holds."""
        if not hashes:
            return 0
        reply: KvLookupReply = await self._call(
            "lookup", KvLookupRequest(namespace=namespace, block_size=block_size, hashes=pack_hashes(hashes)),
            KvLookupReply)
        return reply.hits

    async def warm_up(self, namespace: str, block_size: int) -> None:
        """Pay now what a first call would: NATS's reply inbox, UCXX's import (off the event loop,
        ~0.5 s) and start, and the endpoint to the store's data server."""
        await asyncio.to_thread(import_ucxx)
        reply: KvLookupReply = await self._call(
            "lookup", KvLookupRequest(namespace=namespace, block_size=block_size, hashes=b""), KvLookupReply)
        if reply.address:
            try:
                await self.transfer.connect(reply.address, self.transfer_timeout)
            except TransferError as e:
                raise KvStoreError(f"kvstore data server {reply.address}: {e}", "transfer") from None

    async def probe(self, namespace: str, key: bytes, page_bytes: int) -> tuple[float, float]:
        """Time a round trip of one page: its put (only the first time: then the store holds it)
        and its get, under PROBE_PREFIX + namespace. (put seconds or 0.0, get seconds). Also pays a
        first data transfer's setup (~70 ms on a 2-core VM), which a request's fetch paid before."""
        probe_ns = PROBE_PREFIX + namespace
        put_s = 0.0
        started = time.perf_counter()
        count, _ = await self.get(probe_ns, [key])
        get_s = time.perf_counter() - started
        if not count:  # the first probe, or the page was evicted: store it, and time the get again
            started = time.perf_counter()
            await self.put(probe_ns, [key], np.zeros(page_bytes, np.uint8), page_bytes)
            put_s = time.perf_counter() - started
            started = time.perf_counter()
            count, _ = await self.get(probe_ns, [key])
            get_s = time.perf_counter() - started
            if not count:
                raise KvStoreError("kvstore probe: the page just stored could not be read back", "unavailable")
        return put_s, get_s

    async def put(self, namespace: str, hashes: list[bytes], pages: Buffer, page_bytes: int,
                  ttl: float = 0.0) -> int:
        """Store the pages of `hashes` (`pages`: their bytes concatenated, page_bytes each; numpy,
        CPU or CUDA tensor); returns how many were new and are now stored (0 when the store is full)."""
        flat = as_buffer(pages)
        if nbytes_of(flat) != len(hashes) * page_bytes:
            raise ValueError(f"{len(hashes)} pages of {page_bytes} bytes need {len(hashes) * page_bytes} bytes, "
                             f"got {nbytes_of(flat)}")
        if not hashes:
            return 0
        try:
            reply: KvPutReply = await self._call(
                "put", KvPutRequest(namespace=namespace, page_bytes=page_bytes, hashes=pack_hashes(hashes), ttl=ttl),
                KvPutReply)
        except KvStoreError as e:
            if e.code == "no_space":
                return 0
            raise
        self.reuse = reply.reuse
        if not reply.lease_id:
            return 0
        accepted = unpack_hashes(reply.accepted)
        try:
            payload = _select(flat, hashes, accepted, page_bytes)
            started = time.perf_counter()
            await self.transfer.call(reply.address, {"op": "put", "lease": reply.lease_id}, payload,
                                     timeout=self.transfer_timeout)
            self.last_put = (nbytes_of(payload), time.perf_counter() - started)
            commit: KvCommitReply = await self._call("commit", KvCommitRequest(lease_id=reply.lease_id),
                                                     KvCommitReply)
        except TransferError as e:
            await self._release(reply.lease_id)
            raise KvStoreError(f"kvstore put: {e}", "transfer") from None
        except BaseException:
            await self._release(reply.lease_id)  # also when cancelled: the reservation is freed at once
            raise
        return commit.pages

    async def get(self, namespace: str, hashes: list[bytes], allocate: PageAllocate | None = None,
                  ttl: float = 0.0, release_later: bool = False) -> tuple[int, Buffer | None]:
        """The pages of the longest prefix of `hashes` the store holds: (count, their bytes concatenated
        in a buffer from allocate(count, page_bytes), numpy by default); (0, None) when none is held.
        release_later: return with the pages, releasing their lease in the background (a request
        waiting on them need not wait another round trip)."""
        if not hashes:
            return 0, None
        reply: KvGetReply = await self._call(
            "get", KvGetRequest(namespace=namespace, hashes=pack_hashes(hashes), ttl=ttl), KvGetReply)
        if not reply.count:
            return 0, None
        make = allocate or _host_pages
        try:
            started = time.perf_counter()
            header, data = await self.transfer.call(reply.address, {"op": "get", "lease": reply.lease_id},
                                                    allocate=lambda h: make(reply.count, reply.page_bytes),
                                                    timeout=self.transfer_timeout)
            self.last_get = (nbytes_of(data), time.perf_counter() - started)
        except TransferError as e:
            raise KvStoreError(f"kvstore get: {e}", "transfer") from None
        finally:
            if release_later:
                self._later(self._release(reply.lease_id))
            else:
                await self._release(reply.lease_id)
        if header.get("_discarded") or nbytes_of(data) != reply.count * reply.page_bytes:
            raise KvStoreError(f"kvstore get: expected {reply.count} pages of {reply.page_bytes} bytes, got "
                               f"{nbytes_of(data)} bytes (does allocate() return pages × page_bytes?)", "transfer")
        return reply.count, data

    async def stats(self) -> KvStatsReply:
        return await self._call("stats", KvStatsRequest(), KvStatsReply)

    async def release(self, lease_id: str) -> None:
        await self._call("release", KvReleaseRequest(lease_id=lease_id), KvReleaseReply)

    async def _release(self, lease_id: str) -> None:
        """Best effort: a lease the store cannot hear about ends at its TTL anyway."""
        try:
            await self.release(lease_id)
        except KvStoreError as e:
            log.debug("kvstore_release_failed", lease=lease_id, code=e.code, error=str(e))


def _select(flat: Buffer, hashes: list[bytes], accepted: list[bytes], page_bytes: int) -> Buffer:
    """The accepted pages, in order: a slice when they are one run (the usual case), else one gather."""
    where = {}
    for i, h in enumerate(hashes):
        where.setdefault(h, i)
    try:
        rows = [where[h] for h in accepted]
    except KeyError:
        raise KvStoreError("kvstore put: the store accepted a hash that was not offered", "internal") from None
    first = rows[0]
    if rows == list(range(first, first + len(rows))):
        return flat[first * page_bytes:(first + len(rows)) * page_bytes]
    return flat.reshape(len(hashes), page_bytes)[rows].reshape(-1)
