"""The kvstore's page index: which pages exist, where their bytes live, who holds them, what to evict.

Pure Python (no NATS, UCX or torch), called from one event loop, with an injectable clock.

A page is keyed by (namespace, block hash) and is opaque bytes of a size fixed per namespace. A put
reserves one *extent* (one contiguous buffer, owned by the page store) for all the pages it will
send, so the transfer lands in place; once committed, each page is indexed, touched and evicted on
its own, and the extent's bytes return to the free pool when its last page is gone. Memory is
therefore counted by extents, which is what the host really holds: capacity is never exceeded.

Leases bound what a client can hold: a write lease is a reservation, invisible to lookups until
commit; a read lease pins pages against eviction. Each has a deadline, and an expired lease is
swept (its reservation freed, its pins dropped), so a dead client never holds memory for long.
LRU: a get touches the pages it leases, a put touches the pages it did not need to send (someone
computed them again, so they are in demand); lookups do not touch. Eviction takes the least
recently used committed pages whose extent holds no pins.
"""

from __future__ import annotations

import heapq
import itertools
import secrets
import time
from collections import OrderedDict
from dataclasses import dataclass
from typing import Callable

from shared.kvstore_messages import PROBE_PREFIX


class PageIndexError(Exception):
    """A request the index refuses; `code` is a short label for the reply and for metrics."""

    def __init__(self, code: str, message: str):
        super().__init__(message)
        self.code = code


@dataclass(slots=True, eq=False)
class Extent:
    id: int
    nbytes: int
    pages: int  # pages still reserved or indexed in it; at 0 its bytes are freed
    committed: bool = False
    pins: int = 0  # read pins on its pages: while > 0 evicting its pages would free nothing


@dataclass(slots=True, eq=False)
class Page:
    extent: Extent
    slot: int  # index of the page inside its extent
    pins: int = 0


@dataclass(slots=True, eq=False)
class WriteLease:
    id: str
    deadline: float
    namespace: str
    page_bytes: int
    hashes: list[bytes]  # the accepted hashes, in the order their pages fill the extent
    extent: Extent
    filled: bool = False  # the data arrived; commit makes the pages visible


@dataclass(slots=True, eq=False)
class ReadLease:
    id: str
    deadline: float
    namespace: str
    page_bytes: int
    pages: list[Page]


REUSE_PRIOR_PAGES = 64


@dataclass(slots=True)
class IndexStats:
    hit_pages: int = 0  # lookups: leading pages found
    miss_pages: int = 0  # lookups: pages asked for after the first miss
    hit_tokens: int = 0
    miss_tokens: int = 0
    leased_pages: int = 0  # gets: pages leased to readers
    stored_pages: int = 0  # commits
    evictions: int = 0  # pages
    lease_expiries: int = 0
    no_space: int = 0  # puts refused for want of space


class PageIndex:
    def __init__(self, capacity_bytes: int, clock: Callable[[], float] = time.monotonic,
                 on_free: Callable[[int], None] | None = None, max_leases: int = 65536):
        self.capacity = capacity_bytes
        self.clock = clock
        self.on_free = on_free or (lambda extent_id: None)  # the page store drops the extent's buffer
        self.max_leases = max_leases
        self.used_bytes = 0  # live extents, committed or reserved
        self.stats = IndexStats()
        self._pages: OrderedDict[tuple[str, bytes], Page] = OrderedDict()  # least recently used first
        self._pending: dict[tuple[str, bytes], str] = {}  # reserved, not yet committed → write lease id
        self._extents: dict[int, Extent] = {}
        self._layouts: dict[str, list[int]] = {}  # namespace → [page_bytes, pages reserved or indexed]
        self._leases: dict[str, WriteLease | ReadLease] = {}
        self._deadlines: list[tuple[float, str]] = []  # heap; released leases are skipped when popped
        self._extent_ids = itertools.count(1)
        self._lease_ids = itertools.count(1)
        self._epoch = secrets.token_hex(4)  # lease ids of a restarted store never match old ones
        self._events: dict[bytes, bool] = {}  # hash → stored (True) / evicted (False) since take_events

    # -- queries ------------------------------------------------------------------------------------

    @property
    def num_pages(self) -> int:
        return len(self._pages)

    @property
    def num_reserved_pages(self) -> int:
        return len(self._pending)

    @property
    def num_leases(self) -> int:
        return len(self._leases)

    def holds(self, lease_id: str) -> bool:
        return lease_id in self._leases

    def lru_order(self, namespace: str) -> list[bytes]:
        """The namespace's committed hashes, least recently used first (tests, debugging)."""
        return [h for (ns, h) in self._pages if ns == namespace]

    def lookup(self, namespace: str, hashes: list[bytes], block_size: int = 0) -> int:
        """How many leading `hashes` are committed (the longest cached prefix)."""
        hits = 0
        for h in hashes:
            if (namespace, h) not in self._pages:
                break
            hits += 1
        s = self.stats
        s.hit_pages += hits
        s.miss_pages += len(hashes) - hits
        s.hit_tokens += hits * block_size
        s.miss_tokens += (len(hashes) - hits) * block_size
        return hits

    # -- writers --------------------------------------------------------------------------------------

    def reserve(self, namespace: str, page_bytes: int, hashes: list[bytes], ttl: float) -> WriteLease | None:
        """Reserve room for the pages of `hashes` not stored or being stored; None if there are none.

        Evicts LRU pages if it must; raises PageIndexError("no_space") when even that cannot make room.
        """
        self.sweep()
        layout = self._layouts.get(namespace)
        if layout is not None and layout[0] != page_bytes:
            raise PageIndexError("page_size", f"namespace {namespace!r} holds pages of {layout[0]} bytes, "
                                              f"not {page_bytes}")
        accepted: list[bytes] = []
        seen: set[bytes] = set()
        for h in hashes:
            key = (namespace, h)
            if key in self._pages:
                self._pages.move_to_end(key)
            elif key not in self._pending and h not in seen:
                seen.add(h)
                accepted.append(h)
        if not accepted:
            return None
        self._check_lease_room()
        nbytes = len(accepted) * page_bytes
        self._make_room(nbytes)
        extent = Extent(next(self._extent_ids), nbytes, len(accepted))
        self._extents[extent.id] = extent
        self.used_bytes += nbytes
        lease = WriteLease(self._new_lease_id(), self.clock() + ttl, namespace, page_bytes, accepted, extent)
        for h in accepted:
            self._pending[(namespace, h)] = lease.id
        self._layouts.setdefault(namespace, [page_bytes, 0])[1] += len(accepted)
        self._add_lease(lease)
        return lease

    def write_target(self, lease_id: str, nbytes: int) -> Extent:
        """The extent a put's data lands in; refuses a lease that is unknown, filled or of another size."""
        lease = self._leases.get(lease_id)
        if not isinstance(lease, WriteLease):
            raise PageIndexError("unknown_lease", f"no write lease {lease_id!r} (expired or released?)")
        if lease.filled:
            raise PageIndexError("bad_request", f"lease {lease_id!r} was already filled")
        if nbytes != lease.extent.nbytes:
            raise PageIndexError("bad_request", f"lease {lease_id!r} takes {lease.extent.nbytes} bytes, "
                                                f"not {nbytes}")
        return lease.extent

    def mark_filled(self, lease_id: str, extent: Extent) -> None:
        """The data for `extent` arrived; refused if the lease expired meanwhile."""
        lease = self._leases.get(lease_id)
        if not isinstance(lease, WriteLease) or lease.extent is not extent:
            raise PageIndexError("unknown_lease", f"write lease {lease_id!r} expired during the transfer")
        lease.filled = True

    def commit(self, lease_id: str) -> int:
        """Make a filled reservation's pages visible (most recently used); returns their number."""
        self.sweep()
        lease = self._leases.get(lease_id)
        if not isinstance(lease, WriteLease):
            raise PageIndexError("unknown_lease", f"no write lease {lease_id!r} (expired or released?)")
        if not lease.filled:
            raise PageIndexError("not_filled", f"lease {lease_id!r}: its pages have not arrived")
        del self._leases[lease_id]
        for slot, h in enumerate(lease.hashes):
            key = (lease.namespace, h)
            del self._pending[key]
            self._pages[key] = Page(lease.extent, slot)
        lease.extent.committed = True
        if not lease.namespace.startswith(PROBE_PREFIX):
            self.stats.stored_pages += len(lease.hashes)
            for h in lease.hashes:
                self._events[h] = True
        return len(lease.hashes)

    def take_events(self) -> tuple[list[bytes], list[bytes]]:
        """(stored, removed) page hashes since the last call, for the schedulers' prefix index
        (each hash's last change only, as a worker's block manager reports them)."""
        stored = [h for h, present in self._events.items() if present]
        removed = [h for h, present in self._events.items() if not present]
        self._events.clear()
        return stored, removed

    # -- readers --------------------------------------------------------------------------------------

    @property
    def reuse(self) -> float:
        """Pages leased to readers per page stored; the first REUSE_PRIOR_PAGES count as read once."""
        s = self.stats
        return (s.leased_pages + REUSE_PRIOR_PAGES) / (s.stored_pages + REUSE_PRIOR_PAGES)

    def acquire(self, namespace: str, hashes: list[bytes], ttl: float) -> ReadLease | None:
        """Pin the committed pages of the leading `hashes` found; None when the first is missing."""
        self.sweep()
        pages: list[Page] = []
        for h in hashes:
            page = self._pages.get((namespace, h))
            if page is None:
                break
            pages.append(page)
        if not pages:
            return None
        self._check_lease_room()
        for h, page in zip(hashes, pages):
            self._pages.move_to_end((namespace, h))
            page.pins += 1
            page.extent.pins += 1
        lease = ReadLease(self._new_lease_id(), self.clock() + ttl, namespace, self._layouts[namespace][0], pages)
        self._add_lease(lease)
        if not namespace.startswith(PROBE_PREFIX):
            self.stats.leased_pages += len(pages)
        return lease

    def read_source(self, lease_id: str) -> ReadLease:
        lease = self._leases.get(lease_id)
        if not isinstance(lease, ReadLease):
            raise PageIndexError("unknown_lease", f"no read lease {lease_id!r} (expired or released?)")
        return lease

    # -- both -----------------------------------------------------------------------------------------

    def release(self, lease_id: str) -> bool:
        """End a lease: a reservation is abandoned, pins are dropped. False if it is not (or no longer) held."""
        lease = self._leases.pop(lease_id, None)
        if lease is None:
            return False
        self._end(lease)
        return True

    def sweep(self) -> int:
        """Expire every lease past its deadline; returns how many."""
        now = self.clock()
        expired = 0
        heap = self._deadlines
        while heap and heap[0][0] <= now:
            _, lease_id = heapq.heappop(heap)
            lease = self._leases.pop(lease_id, None)
            if lease is not None:
                self._end(lease)
                expired += 1
        self.stats.lease_expiries += expired
        return expired

    # -- internals ------------------------------------------------------------------------------------

    def _new_lease_id(self) -> str:
        return f"{self._epoch}-{next(self._lease_ids)}"

    def _check_lease_room(self) -> None:
        if len(self._leases) >= self.max_leases:
            raise PageIndexError("too_many_leases", f"{len(self._leases)} leases are held")

    def _add_lease(self, lease: WriteLease | ReadLease) -> None:
        self._leases[lease.id] = lease
        heapq.heappush(self._deadlines, (lease.deadline, lease.id))

    def _end(self, lease: WriteLease | ReadLease) -> None:
        if isinstance(lease, ReadLease):
            for page in lease.pages:
                page.pins -= 1
                page.extent.pins -= 1
            return
        for h in lease.hashes:
            del self._pending[(lease.namespace, h)]
        self._forget_pages(lease.namespace, len(lease.hashes))
        self._free(lease.extent)

    def _make_room(self, nbytes: int) -> None:
        """Evict LRU pages until `nbytes` fit, choosing every victim before evicting any, so a
        refused put costs the cache nothing."""
        need = self.used_bytes + nbytes - self.capacity
        if need <= 0:
            return
        victims: list[tuple[tuple[str, bytes], Page]] = []
        left: dict[int, int] = {}  # extent id → its pages not yet chosen
        freed = 0
        if nbytes <= self.capacity:
            for key, page in self._pages.items():
                extent = page.extent
                if extent.pins:
                    continue
                victims.append((key, page))
                n = left[extent.id] = left.get(extent.id, extent.pages) - 1
                if n == 0:
                    freed += extent.nbytes
                    if freed >= need:
                        break
        if freed < need:
            self.stats.no_space += 1
            raise PageIndexError("no_space", f"{nbytes} bytes do not fit: {self.used_bytes} of "
                                             f"{self.capacity} used, {freed} could be freed")
        for key, page in victims:
            del self._pages[key]
            if not key[0].startswith(PROBE_PREFIX):
                self._events[key[1]] = False
            self.stats.evictions += 1
            self._forget_pages(key[0], 1)
            page.extent.pages -= 1
            if page.extent.pages == 0:
                self._free(page.extent)

    def _free(self, extent: Extent) -> None:
        del self._extents[extent.id]
        self.used_bytes -= extent.nbytes
        self.on_free(extent.id)

    def _forget_pages(self, namespace: str, n: int) -> None:
        layout = self._layouts[namespace]
        layout[1] -= n
        if layout[1] == 0:  # a namespace with nothing in it may come back with another page size
            del self._layouts[namespace]

