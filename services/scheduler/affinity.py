"""Session affinity: session id → worker id in a JetStream KV bucket shared by every scheduler replica.

The bucket is the source of truth; a small LRU cache in front of it saves a round trip for a
session this replica saw recently. A cached entry is trusted for `local_ttl` seconds and only
while its worker can take the request; otherwise the bucket is read again, so a mapping written
by another replica is seen. A new session is claimed with create-if-absent, and a move is an
update from the revision read, so two replicas that decide at once end up on the winner's worker.

Bucket trouble (JetStream down or slow) never fails a request: affinity degrades to this
replica's local cache and routing falls back to cost.
"""

from __future__ import annotations

import asyncio
import hashlib
import time
from collections import OrderedDict
from dataclasses import dataclass
from typing import Callable

import nats.errors
import nats.js.errors
from nats.js.kv import KeyValue

from shared.logging import get_logger

log = get_logger(__name__)

_KV_ERRORS = (nats.errors.Error, asyncio.TimeoutError, OSError)


@dataclass(slots=True, frozen=True)
class Mapping:
    worker_id: str
    revision: int  # the bucket entry's revision; 0 when known only locally
    at: float  # monotonic time this replica learned it


def session_key(session_id: str) -> str:
    """A valid NATS KV key for any session id (which may hold dots, spaces, anything)."""
    return hashlib.blake2b(session_id.encode(), digest_size=16).hexdigest()


class SessionAffinity:
    def __init__(self, kv: KeyValue | None = None, *, local_capacity: int = 65536, local_ttl: float = 10.0,
                 timeout: float = 0.5, clock: Callable[[], float] = time.monotonic):
        self.kv = kv  # None until the bucket is open: local cache only
        self.local_capacity = local_capacity
        self.local_ttl = local_ttl
        self.timeout = timeout  # per bucket operation, on the request path
        self.clock = clock
        self.errors = 0
        self._local: OrderedDict[str, Mapping] = OrderedDict()
        self._last_error_log = float("-inf")

    def cached(self, session_id: str) -> Mapping | None:
        """This replica's fresh mapping for the session, without touching the bucket."""
        key = session_key(session_id)
        m = self._local.get(key)
        if m is None:
            return None
        if self.clock() - m.at > self.local_ttl:
            return None
        self._local.move_to_end(key)
        return m

    async def lookup(self, session_id: str) -> Mapping | None:
        """The bucket's mapping (None when the session has none); the local cache if the bucket fails."""
        key = session_key(session_id)
        if self.kv is None:
            return self._local.get(key)
        try:
            entry = await asyncio.wait_for(self.kv.get(key), self.timeout)
        except nats.js.errors.KeyNotFoundError:  # also KeyDeletedError (expired or deleted)
            self._local.pop(key, None)
            return None
        except _KV_ERRORS as e:
            self._failed("lookup", e)
            return self._local.get(key)
        value = entry.value or b""
        try:
            worker_id = value.decode()
        except UnicodeDecodeError:
            worker_id = ""
        if not worker_id:
            return None
        return self._remember(key, worker_id, entry.revision or 0)

    async def assign(self, session_id: str, worker_id: str, revision: int | None) -> Mapping:
        """Map the session to worker_id unless another replica got there first.

        revision None: the session had no mapping (create-if-absent); else the revision that was read
        (update only from it). Returns the mapping now in force: ours, or the other replica's.
        """
        key = session_key(session_id)
        if self.kv is None:
            return self._remember(key, worker_id, 0)
        value = worker_id.encode()
        try:
            if revision is None or revision == 0:
                rev = await asyncio.wait_for(self.kv.create(key, value), self.timeout)
            else:
                rev = await asyncio.wait_for(self.kv.update(key, value, last=revision), self.timeout)
        except nats.js.errors.KeyWrongLastSequenceError:
            current = await self.lookup(session_id)
            if current is not None:
                return current
            return await self.force(session_id, worker_id)
        except _KV_ERRORS as e:
            self._failed("assign", e)
            return self._remember(key, worker_id, 0)
        return self._remember(key, worker_id, rev)

    async def force(self, session_id: str, worker_id: str) -> Mapping:
        """Overwrite the mapping whatever it is (the current one names a worker that cannot serve)."""
        key = session_key(session_id)
        rev = 0
        if self.kv is not None:
            try:
                rev = await asyncio.wait_for(self.kv.put(key, worker_id.encode()), self.timeout)
            except _KV_ERRORS as e:
                self._failed("put", e)
        return self._remember(key, worker_id, rev)

    def _remember(self, key: str, worker_id: str, revision: int) -> Mapping:
        m = Mapping(worker_id, revision, self.clock())
        self._local[key] = m
        self._local.move_to_end(key)
        while len(self._local) > self.local_capacity:
            self._local.popitem(last=False)
        return m

    def _failed(self, op: str, e: BaseException) -> None:
        self.errors += 1
        now = time.monotonic()
        if now - self._last_error_log >= 5.0:
            self._last_error_log = now
            log.warning("affinity_bucket_failed", op=op, error=repr(e), errors=self.errors)
