"""The kvstore's control over NATS: one request/reply subject per verb, each answered from the page index.

Every request gets a reply: a message that does not decode (not MessagePack, wrong type or
version, a bad field, over the size limit) is counted and answered with code "bad_request"; a
refusal of the index carries its code; an unexpected failure is logged and answered "internal".
Handlers are synchronous and short (index operations on one event loop), so nothing interleaves
between a decision and its reply.
"""

from __future__ import annotations

import contextlib
import time
from typing import Any, Callable

import nats.errors
from nats.aio.msg import Msg
from nats.aio.subscription import Subscription

from services.kvstore.config import KvStoreConfig
from services.kvstore.metrics import KvStoreMetrics
from services.kvstore.page_index import PageIndex, PageIndexError
from services.kvstore.page_store import PageStore
from shared.errors import MessageError
from shared.kvstore_messages import (KvCommitReply, KvCommitRequest, KvGetReply, KvGetRequest, KvLookupReply,
                                     KvLookupRequest, KvPutReply, KvPutRequest, KvReleaseReply, KvReleaseRequest,
                                     KvReply, KvStatsReply, KvStatsRequest, pack_hashes, unpack_hashes)
from shared.logging import get_logger
from shared.nats_client import NatsConnection
from shared.subjects import Subjects
from shared.wire import Message, decode, encode

log = get_logger("kvstore.control")


class Control:
    def __init__(self, cfg: KvStoreConfig, index: PageIndex, store: PageStore, metrics: KvStoreMetrics,
                 address: Callable[[], str], on_commit: Callable[[], None] = lambda: None):
        self.cfg, self.index, self.store, self.metrics = cfg, index, store, metrics
        self.address = address  # the data server's "host:port", known once it listens
        self.on_commit = on_commit  # new pages: the schedulers should hear of them soon
        self.verbs: dict[str, tuple[type[Message], type[KvReply], Callable[[Any], KvReply]]] = {
            "lookup": (KvLookupRequest, KvLookupReply, self.lookup),
            "put": (KvPutRequest, KvPutReply, self.put),
            "commit": (KvCommitRequest, KvCommitReply, self.commit),
            "get": (KvGetRequest, KvGetReply, self.get),
            "release": (KvReleaseRequest, KvReleaseReply, self.release),
            "stats": (KvStatsRequest, KvStatsReply, self.stats),
        }

    # -- verbs --------------------------------------------------------------------------------------

    def lookup(self, req: KvLookupRequest) -> KvLookupReply:
        hits = self.index.lookup(req.namespace, unpack_hashes(req.hashes), req.block_size)
        return KvLookupReply(hits=hits, address=self.address())

    def put(self, req: KvPutRequest) -> KvPutReply:
        lease = self.index.reserve(req.namespace, req.page_bytes, unpack_hashes(req.hashes), self.cfg.ttl(req.ttl))
        if lease is None:  # everything is stored already (or on its way from another writer)
            return KvPutReply(address=self.address(), reuse=self.index.reuse)
        try:
            self.store.allocate(lease.extent.id, lease.extent.nbytes)
        except (MemoryError, RuntimeError) as e:  # numpy: MemoryError; torch's pinned allocator: RuntimeError
            self.index.release(lease.id)
            raise PageIndexError("no_space", f"host memory for {lease.extent.nbytes} bytes: {e}") from None
        return KvPutReply(lease_id=lease.id, accepted=pack_hashes(lease.hashes), address=self.address(),
                          reuse=self.index.reuse)

    def commit(self, req: KvCommitRequest) -> KvCommitReply:
        pages = self.index.commit(req.lease_id)
        self.on_commit()
        return KvCommitReply(pages=pages)

    def get(self, req: KvGetRequest) -> KvGetReply:
        lease = self.index.acquire(req.namespace, unpack_hashes(req.hashes), self.cfg.ttl(req.ttl))
        if lease is None:
            return KvGetReply(address=self.address())
        return KvGetReply(lease_id=lease.id, count=len(lease.pages), page_bytes=lease.page_bytes,
                          address=self.address())

    def release(self, req: KvReleaseRequest) -> KvReleaseReply:
        if not self.index.release(req.lease_id):
            raise PageIndexError("unknown_lease", f"no lease {req.lease_id!r} (expired or released?)")
        return KvReleaseReply()

    def stats(self, req: KvStatsRequest | None = None) -> KvStatsReply:
        ix, s, m = self.index, self.index.stats, self.metrics
        return KvStatsReply(
            pages=ix.num_pages, reserved_pages=ix.num_reserved_pages, bytes_used=ix.used_bytes,
            capacity_bytes=ix.capacity, leases=ix.num_leases, hit_pages=s.hit_pages, miss_pages=s.miss_pages,
            hit_tokens=s.hit_tokens, miss_tokens=s.miss_tokens, leased_pages=s.leased_pages,
            stored_pages=s.stored_pages, evictions=s.evictions, lease_expiries=s.lease_expiries,
            no_space=s.no_space, bad_messages=m.bad_total, transfer_bytes_in=m.bytes_in,
            transfer_bytes_out=m.bytes_out, address=self.address())

    # -- NATS -----------------------------------------------------------------------------------------

    def answer(self, verb: str, data: bytes, subject: str, bad: Callable[[MessageError, str], None]) -> KvReply:
        """The reply to one raw request (never raises)."""
        req_cls, reply_cls, handler = self.verbs[verb]
        try:
            req = decode(req_cls, data)
        except MessageError as e:
            bad(e, subject)
            self.metrics.bad_message(verb, e.reason)
            reply = reply_cls(code="bad_request", error=str(e))
        else:
            try:
                reply = handler(req)
            except (PageIndexError, MessageError) as e:
                reply = reply_cls(code=getattr(e, "code", "bad_request"), error=str(e))
            except Exception as e:
                log.exception("kvstore_handler_failed", verb=verb)
                reply = reply_cls(code="internal", error=f"internal error: {type(e).__name__}")
        self.metrics.request(verb, reply.code)
        return reply

    async def subscribe(self, conn: NatsConnection, subjects: Subjects) -> list[Subscription]:
        """One plain subscription per verb (no queue group: the index lives in this one process)."""
        nc = conn.client
        subs = []
        for verb in self.verbs:
            async def callback(msg: Msg, verb: str = verb) -> None:
                started = time.perf_counter()
                reply = self.answer(verb, msg.data, msg.subject, conn.bad_messages.record)
                if msg.reply:
                    with contextlib.suppress(nats.errors.Error):  # the asker is gone or NATS is down
                        await nc.publish(msg.reply, encode(reply))
                self.metrics.answered(verb, time.perf_counter() - started)
            subs.append(await nc.subscribe(subjects.kvstore(verb), cb=callback))
        await conn.flush()
        return subs
