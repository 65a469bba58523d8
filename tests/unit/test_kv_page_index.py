"""The kvstore's page index alone: LRU order, capacity, leases and their expiry, prefixes, namespaces, counters."""

from __future__ import annotations

import pytest

from services.kvstore.page_index import PageIndex, PageIndexError
from shared.kvstore_messages import PROBE_PREFIX

NS = "m=tiny|dt=float32|bs=4|L=2|H=2|D=8"
PAGE = 100


class Clock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


def h(i: int) -> bytes:
    return i.to_bytes(16, "big")


def hs(*ids: int) -> list[bytes]:
    return [h(i) for i in ids]


@pytest.fixture
def clock() -> Clock:
    return Clock()


def make(clock: Clock, pages: int = 10, freed: list | None = None) -> PageIndex:
    return PageIndex(pages * PAGE, clock, on_free=(freed.append if freed is not None else None), max_leases=8)


def store(ix: PageIndex, *ids: int, ns: str = NS) -> int:
    """Put and commit, one extent for all of them; returns how many were new."""
    lease = ix.reserve(ns, PAGE, hs(*ids), ttl=5.0)
    if lease is None:
        return 0
    ix.mark_filled(lease.id, ix.write_target(lease.id, len(lease.hashes) * PAGE))
    return ix.commit(lease.id)


def test_reserve_is_invisible_until_commit(clock):
    ix = make(clock)
    lease = ix.reserve(NS, PAGE, hs(1, 2, 3), ttl=5.0)
    assert lease.hashes == hs(1, 2, 3) and lease.extent.nbytes == 3 * PAGE
    assert ix.used_bytes == 3 * PAGE and ix.num_reserved_pages == 3 and ix.num_pages == 0
    assert ix.lookup(NS, hs(1, 2, 3)) == 0
    assert ix.acquire(NS, hs(1), ttl=5.0) is None
    # a second writer of the same pages is told to send nothing
    assert ix.reserve(NS, PAGE, hs(1, 2, 3), ttl=5.0) is None
    with pytest.raises(PageIndexError) as err:
        ix.commit(lease.id)
    assert err.value.code == "not_filled"
    ix.mark_filled(lease.id, ix.write_target(lease.id, 3 * PAGE))
    assert ix.commit(lease.id) == 3
    assert ix.lookup(NS, hs(1, 2, 3)) == 3
    assert ix.num_pages == 3 and ix.num_reserved_pages == 0 and ix.num_leases == 0
    assert ix.used_bytes == 3 * PAGE


def test_put_skips_stored_and_duplicate_hashes(clock):
    ix = make(clock)
    store(ix, 1, 2)
    lease = ix.reserve(NS, PAGE, hs(1, 2, 3, 3, 4), ttl=5.0)
    assert lease.hashes == hs(3, 4)
    assert ix.used_bytes == 4 * PAGE


def test_write_target_checks_lease_and_size(clock):
    ix = make(clock)
    lease = ix.reserve(NS, PAGE, hs(1, 2), ttl=5.0)
    with pytest.raises(PageIndexError):
        ix.write_target(lease.id, PAGE)
    with pytest.raises(PageIndexError) as err:
        ix.write_target("nope", 2 * PAGE)
    assert err.value.code == "unknown_lease"
    ix.mark_filled(lease.id, ix.write_target(lease.id, 2 * PAGE))
    with pytest.raises(PageIndexError):  # filled once only
        ix.write_target(lease.id, 2 * PAGE)


def test_longest_prefix_counts_leading_hits_only(clock):
    ix = make(clock)
    store(ix, 1, 2, 3, 5)
    assert ix.lookup(NS, hs(1, 2, 3, 4, 5), block_size=4) == 3
    assert ix.lookup(NS, hs(9, 1, 2), block_size=4) == 0
    assert ix.lookup(NS, [], block_size=4) == 0
    s = ix.stats
    assert (s.hit_pages, s.miss_pages, s.hit_tokens, s.miss_tokens) == (3, 5, 12, 20)


def test_namespaces_are_isolated(clock):
    ix = make(clock)
    store(ix, 1, 2)
    other = "m=other|dt=float32|bs=4|L=2|H=2|D=8"
    assert ix.lookup(other, hs(1, 2)) == 0
    assert ix.acquire(other, hs(1, 2), ttl=5.0) is None
    assert store(ix, 1, 2, ns=other) == 2  # the same hashes are new pages there
    with pytest.raises(PageIndexError) as err:  # one page size per namespace
        ix.reserve(NS, PAGE * 2, hs(7), ttl=5.0)
    assert err.value.code == "page_size"


def test_lru_eviction_order_exact(clock):
    freed = []
    ix = make(clock, pages=4, freed=freed)
    for i in (1, 2, 3, 4):
        store(ix, i)  # one extent per page
    assert ix.lru_order(NS) == hs(1, 2, 3, 4)
    lease = ix.acquire(NS, hs(1), ttl=5.0)  # a get touches
    ix.release(lease.id)
    assert ix.lru_order(NS) == hs(2, 3, 4, 1)
    assert ix.reserve(NS, PAGE, hs(3), ttl=5.0) is None  # a put of a stored page touches it too
    assert ix.lru_order(NS) == hs(2, 4, 1, 3)
    ix.lookup(NS, hs(2))  # a lookup does not
    assert ix.lru_order(NS) == hs(2, 4, 1, 3)
    store(ix, 5)
    assert ix.lru_order(NS) == hs(4, 1, 3, 5) and ix.stats.evictions == 1
    store(ix, 6, 7)
    assert ix.lru_order(NS) == hs(3, 5, 6, 7) and ix.stats.evictions == 3
    assert ix.used_bytes == 4 * PAGE == ix.capacity
    assert len(freed) == 3


def test_eviction_skips_leased_pages(clock):
    ix = make(clock, pages=3)
    for i in (1, 2, 3):
        store(ix, i)
    pinned = ix.acquire(NS, hs(1, 2), ttl=5.0)
    assert ix.lru_order(NS) == hs(3, 1, 2)
    store(ix, 4)
    assert ix.lru_order(NS) == hs(1, 2, 4)  # 3 was the least recently used once the get touched 1 and 2
    store(ix, 5)  # 1 and 2 are pinned: 4 goes
    assert ix.lru_order(NS) == hs(1, 2, 5)
    with pytest.raises(PageIndexError) as err:  # nothing unpinned is left big enough
        ix.reserve(NS, PAGE, hs(6, 7), ttl=5.0)
    assert err.value.code == "no_space" and ix.stats.no_space == 1
    assert ix.lru_order(NS) == hs(1, 2, 5)  # a refused put evicts nothing
    ix.release(pinned.id)
    assert store(ix, 6, 7) == 2
    assert ix.lru_order(NS) == hs(5, 6, 7)


def test_extent_bytes_return_with_its_last_page(clock):
    freed = []
    ix = make(clock, pages=4, freed=freed)
    store(ix, 1, 2, 3)  # one extent of three pages
    store(ix, 4)
    pinned = ix.acquire(NS, hs(1), ttl=5.0)
    # evicting 2 and 3 would free nothing while 1 pins their extent: 4 goes instead
    store(ix, 5)
    assert ix.lru_order(NS) == hs(2, 3, 1, 5) and len(freed) == 1
    ix.release(pinned.id)
    store(ix, 6)  # now 2, 3 and 1 must all go before their 3 pages of bytes come back
    assert ix.lru_order(NS) == hs(5, 6)
    assert ix.used_bytes == 2 * PAGE and len(freed) == 2


def test_too_big_for_capacity(clock):
    ix = make(clock, pages=2)
    with pytest.raises(PageIndexError) as err:
        ix.reserve(NS, PAGE, hs(1, 2, 3), ttl=5.0)
    assert err.value.code == "no_space" and ix.used_bytes == 0


def test_dead_writer_reservation_expires(clock):
    freed = []
    ix = make(clock, pages=2, freed=freed)
    lease = ix.reserve(NS, PAGE, hs(1, 2), ttl=5.0)
    extent = ix.write_target(lease.id, 2 * PAGE)
    clock.now += 4.9
    assert ix.sweep() == 0 and ix.used_bytes == 2 * PAGE
    clock.now += 0.2
    assert ix.sweep() == 1
    assert ix.used_bytes == 0 and ix.num_leases == 0 and ix.num_reserved_pages == 0 and freed == [extent.id]
    assert ix.stats.lease_expiries == 1
    with pytest.raises(PageIndexError) as err:  # bytes that arrive after the deadline are refused
        ix.mark_filled(lease.id, extent)
    assert err.value.code == "unknown_lease"
    assert store(ix, 1, 2) == 2  # the hashes are free to be written by someone else


def test_dead_reader_pin_expires(clock):
    ix = make(clock, pages=2)
    store(ix, 1, 2)
    ix.acquire(NS, hs(1, 2), ttl=3.0)
    with pytest.raises(PageIndexError):
        ix.reserve(NS, PAGE, hs(3), ttl=5.0)
    clock.now += 3.0
    assert ix.reserve(NS, PAGE, hs(3), ttl=5.0) is not None  # the request itself swept the lease
    assert ix.stats.lease_expiries == 1 and ix.stats.evictions == 2


def test_release_abandons_a_reservation_and_is_idempotent(clock):
    ix = make(clock)
    lease = ix.reserve(NS, PAGE, hs(1), ttl=5.0)
    assert ix.release(lease.id) is True
    assert ix.release(lease.id) is False
    assert ix.used_bytes == 0 and ix.num_leases == 0
    with pytest.raises(PageIndexError):
        ix.commit(lease.id)
    clock.now += 10
    assert ix.sweep() == 0 and ix.stats.lease_expiries == 0  # released leases are not counted as expired


def test_acquire_pins_the_leading_prefix(clock):
    ix = make(clock)
    store(ix, 1, 2, 4)
    lease = ix.acquire(NS, hs(1, 2, 3, 4), ttl=5.0)
    assert [p.slot for p in lease.pages] == [0, 1] and lease.page_bytes == PAGE
    assert ix.read_source(lease.id) is lease
    assert ix.stats.leased_pages == 2
    ix.release(lease.id)
    assert all(p.pins == 0 for p in lease.pages) and lease.pages[0].extent.pins == 0


def test_lease_count_is_bounded(clock):
    ix = make(clock)
    store(ix, 1)
    leases = [ix.acquire(NS, hs(1), ttl=5.0) for _ in range(8)]
    with pytest.raises(PageIndexError) as err:
        ix.acquire(NS, hs(1), ttl=5.0)
    assert err.value.code == "too_many_leases"
    for lease in leases:
        ix.release(lease.id)
    assert ix.num_leases == 0


def test_counters(clock):
    ix = make(clock, pages=3)
    store(ix, 1, 2)
    store(ix, 3)
    ix.lookup(NS, hs(1, 2, 9), block_size=16)
    lease = ix.acquire(NS, hs(1, 2), ttl=1.0)
    clock.now += 2
    store(ix, 4)
    s = ix.stats
    assert (s.stored_pages, s.hit_pages, s.miss_pages, s.hit_tokens, s.miss_tokens) == (4, 2, 1, 32, 16)
    assert (s.leased_pages, s.lease_expiries, s.evictions, s.no_space) == (2, 1, 1, 0)
    assert ix.num_pages == 3 and ix.used_bytes == 3 * PAGE and ix.num_leases == 0
    assert not ix.holds(lease.id)


def test_stored_and_evicted_pages_are_reported_as_kv_events():
    from services.kvstore.page_index import PageIndex

    index = PageIndex(capacity_bytes=4 * 8)
    a, b, c = b"a" * 16, b"b" * 16, b"c" * 16
    lease = index.reserve("ns", 8, [a, b, c, b"d" * 16], ttl=10)
    index.mark_filled(lease.id, index.write_target(lease.id, 4 * 8))
    index.commit(lease.id)
    stored, removed = index.take_events()
    assert set(stored) == {a, b, c, b"d" * 16} and removed == []
    assert index.take_events() == ([], [])
    lease = index.reserve("ns", 8, [b"e" * 16], ttl=10)  # room comes from evicting the oldest extent
    stored, removed = index.take_events()
    assert stored == [] and len(removed) == 4


def test_a_probe_page_counts_in_no_figure_and_no_event(clock):
    """A worker's cost probe (shared/kvstore_client.py: probe) is stored and read like any page, but
    the store's reuse figure (what decides write-back) and the schedulers' index never see it."""
    ix = make(clock)
    store(ix, 1)
    ix.take_events()
    reuse = ix.reuse
    assert store(ix, 9, ns=PROBE_PREFIX + NS) == 1
    lease = ix.acquire(PROBE_PREFIX + NS, hs(9), ttl=5.0)
    assert lease is not None and len(lease.pages) == 1
    assert ix.reuse == reuse and ix.stats.stored_pages == 1 and ix.stats.leased_pages == 0
    assert ix.take_events() == ([], [])
