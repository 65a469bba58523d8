"""BlockManager: exact block ids, LRU eviction order, prefix hits and their counters, KV events."""

from __future__ import annotations

import random

import pytest

from services.worker.engine.block_manager import BlockManager
from services.worker.engine.request import Request
from shared.block_hash import prefix_block_hashes
from shared.sampling_params import SamplingParams


def make_request(request_id: str, tokens, salt: bytes = b"") -> Request:
    return Request(request_id, list(tokens), SamplingParams(max_tokens=16), cache_salt=salt)


def admit(bm: BlockManager, request: Request) -> tuple[list[int], int]:
    """Look up the prefix, allocate the rest of the prompt and compute it in one step."""
    hit_blocks, num_cached = bm.get_computed_blocks(request)
    assert bm.allocate_slots(request, request.num_tokens - num_cached, hit_blocks, num_cached)
    request.num_computed_tokens = request.num_tokens
    bm.cache_full_blocks(request)
    return hit_blocks, num_cached


def test_fresh_manager_hands_out_ids_in_order():
    bm = BlockManager(10, block_size=4)
    a = make_request("a", range(10))
    assert bm.allocate_slots(a, 10)
    assert a.block_ids == [0, 1, 2]
    assert bm.num_free_blocks == 7 and bm.num_total_blocks == 10
    assert bm.usage == pytest.approx(0.3)
    a.num_computed_tokens = 10
    assert bm.allocate_slots(a, 2)  # 12 tokens: still 3 blocks
    assert a.block_ids == [0, 1, 2]
    assert bm.allocate_slots(a, 3)  # 13 tokens: a 4th block
    assert a.block_ids == [0, 1, 2, 3]
    b = make_request("b", range(4))
    assert bm.allocate_slots(b, 4)
    assert b.block_ids == [4]
    assert [bm.ref_count(i) for i in range(6)] == [1, 1, 1, 1, 1, 0]


def test_allocation_that_does_not_fit_changes_nothing():
    bm = BlockManager(4, block_size=4)
    a = make_request("a", range(8))
    admit(bm, a)
    bm.free(a)  # free queue: 2, 3, 1, 0 with 0 and 1 still cached
    assert bm.num_free_blocks == 4
    # 17 tokens: hits blocks 0 and 1 and needs 3 more, but reviving the hits leaves only 2.
    b = make_request("b", list(range(8)) + [50] * 9)
    hits, num_cached = bm.get_computed_blocks(b)
    assert (hits, num_cached) == ([0, 1], 8)
    assert not bm.allocate_slots(b, 9, hits, num_cached)
    assert b.block_ids == [] and bm.num_free_blocks == 4
    assert [bm.ref_count(i) for i in range(4)] == [0, 0, 0, 0]
    assert bm.prefix_cache_queries == 8 and bm.prefix_cache_hits == 0  # a failed try counts nothing
    # 13 tokens fit exactly: the two hits plus blocks 2 and 3.
    c = make_request("c", list(range(8)) + [50] * 5)
    hits, num_cached = bm.get_computed_blocks(c)
    assert bm.allocate_slots(c, 5, hits, num_cached)
    assert c.block_ids == [0, 1, 2, 3] and bm.num_free_blocks == 0
    assert bm.prefix_cache_queries == 8 + 13 and bm.prefix_cache_hits == 8


def test_prefix_hit_gets_the_exact_blocks_and_counts_tokens():
    bm = BlockManager(16, block_size=16, extra_key=b"model")
    prompt = list(range(100, 140))
    a = make_request("a", prompt)
    assert admit(bm, a) == ([], 0)
    assert a.block_ids == [0, 1, 2]
    stored, removed = bm.take_events()
    assert stored == prefix_block_hashes(prompt[:32], 16, b"model") and removed == []
    assert a.block_hashes == stored  # the partial third block has no hash

    b = make_request("b", prompt[:32] + [7] * 8)
    assert admit(bm, b) == ([0, 1], 32)
    assert b.block_ids == [0, 1, 3]
    assert [bm.ref_count(i) for i in range(4)] == [2, 2, 1, 1]
    assert bm.prefix_cache_queries == 80 and bm.prefix_cache_hits == 32
    assert bm.take_events() == ([], [])  # hit blocks are not stored again

    bm.free(a)
    bm.free(b)
    assert bm.num_free_blocks == 16 and b.block_ids == []


def test_full_prompt_hit_leaves_one_token_to_compute():
    bm = BlockManager(8, block_size=16)
    admit(bm, make_request("a", range(32)))
    assert bm.get_computed_blocks(make_request("b", range(32))) == ([0], 16)
    assert bm.get_computed_blocks(make_request("c", range(33))) == ([0, 1], 32)
    assert bm.get_computed_blocks(make_request("d", range(31))) == ([0], 16)


def test_eviction_is_lru_with_each_request_tail_first():
    bm = BlockManager(6, block_size=4)
    a_tokens = list(range(12))
    a = make_request("a", a_tokens)
    admit(bm, a)
    a_hashes = list(a.block_hashes)
    bm.free(a)  # free queue: 3, 4, 5, then a's blocks tail first: 2, 1, 0
    bm.take_events()

    c = make_request("c", range(100, 116))
    assert bm.allocate_slots(c, 16)
    assert c.block_ids == [3, 4, 5, 2]
    assert bm.take_events() == ([], [a_hashes[2]])
    assert bm.get_computed_blocks(make_request("d", a_tokens + [9])) == ([0, 1], 8)

    e = make_request("e", range(200, 204))
    assert bm.allocate_slots(e, 4)
    assert e.block_ids == [1]
    assert bm.take_events() == ([], [a_hashes[1]])
    assert bm.get_computed_blocks(make_request("f", a_tokens + [9])) == ([0], 4)


def test_earlier_freed_request_is_evicted_first():
    bm = BlockManager(4, block_size=4)
    a, b = make_request("a", range(8)), make_request("b", range(50, 58))
    admit(bm, a)
    admit(bm, b)
    assert (a.block_ids, b.block_ids) == ([0, 1], [2, 3])
    bm.free(a)
    bm.free(b)  # free queue: 1, 0, 3, 2
    x = make_request("x", range(90, 102))
    assert bm.allocate_slots(x, 12)
    assert x.block_ids == [1, 0, 3]
    assert bm.get_computed_blocks(make_request("a2", range(9))) == ([], 0)
    assert bm.get_computed_blocks(make_request("b2", range(50, 59))) == ([2], 4)  # b's head survives
    bm.free(x)
    assert bm.num_free_blocks == 4


def test_tenant_salt_separates_caches():
    bm = BlockManager(8, block_size=4)
    admit(bm, make_request("a", range(9), salt=b"tenant-1"))
    assert bm.get_computed_blocks(make_request("b", range(9), salt=b"tenant-2")) == ([], 0)
    assert bm.get_computed_blocks(make_request("c", range(9))) == ([], 0)
    assert bm.get_computed_blocks(make_request("d", range(9), salt=b"tenant-1")) == ([0, 1], 8)


def test_model_key_separates_caches():
    a, b = make_request("a", range(8)), make_request("b", range(8))
    BlockManager(4, 4, extra_key=b"m1").get_computed_blocks(a)
    BlockManager(4, 4, extra_key=b"m2").get_computed_blocks(b)
    assert a.block_hashes != b.block_hashes


def test_duplicate_content_keeps_the_first_block():
    bm = BlockManager(8, block_size=4)
    a, b = make_request("a", range(9)), make_request("b", range(9))
    for r in (a, b):  # both admitted before either is computed: no hits
        assert bm.get_computed_blocks(r) == ([], 0)
        assert bm.allocate_slots(r, 9)
    assert (a.block_ids, b.block_ids) == ([0, 1, 2], [3, 4, 5])
    for r in (a, b):
        r.num_computed_tokens = 9
        bm.cache_full_blocks(r)
    stored, removed = bm.take_events()
    assert stored == a.block_hashes and removed == []
    assert bm.num_cached_blocks == 2
    assert bm.get_computed_blocks(make_request("c", range(9))) == ([0, 1], 8)
    bm.free(b)
    bm.free(a)
    assert bm.num_free_blocks == 8
    x = make_request("x", range(100, 124))  # takes 6 blocks: b's uncached ones go without events
    assert bm.allocate_slots(x, 24)
    assert x.block_ids == [6, 7, 5, 4, 3, 2]
    assert bm.take_events() == ([], [])


def test_decode_caches_each_block_once_it_fills():
    bm = BlockManager(8, block_size=4)
    a = make_request("a", range(6))
    admit(bm, a)
    assert bm.take_events()[0] == prefix_block_hashes(list(range(6)), 4)
    for token in (40, 41):  # decode: one sampled token per step
        a.all_token_ids.append(token)
        assert bm.allocate_slots(a, 1)
        a.num_computed_tokens += 1
        bm.cache_full_blocks(a)
    stored, _ = bm.take_events()
    assert stored == prefix_block_hashes(list(range(6)) + [40, 41], 4)[1:]
    assert a.block_ids == [0, 1]
    a.all_token_ids.append(42)  # known but not computed yet: its block is not cached
    assert bm.allocate_slots(a, 1)
    bm.cache_full_blocks(a)
    assert bm.take_events() == ([], []) and a.block_ids == [0, 1, 2]


def test_reset_prefix_cache_refused_while_blocks_are_in_use():
    bm = BlockManager(4, block_size=4)
    a = make_request("a", range(9))
    admit(bm, a)
    stored, _ = bm.take_events()
    assert not bm.reset_prefix_cache()
    bm.free(a)
    assert bm.reset_prefix_cache()
    assert bm.take_events() == ([], stored)
    assert bm.num_cached_blocks == 0
    assert bm.get_computed_blocks(make_request("b", range(9))) == ([], 0)


def test_events_report_only_the_last_change_of_a_hash():
    bm = BlockManager(2, block_size=4)
    a = make_request("a", range(4))
    admit(bm, a)
    bm.free(a)  # free queue: 1, 0 (0 cached)
    b = make_request("b", range(50, 58))
    assert bm.allocate_slots(b, 8)  # evicts a's block 0 within the same window
    assert bm.take_events() == ([], a.block_hashes)
    assert bm.take_events() == ([], [])


def test_disabled_prefix_caching_never_hits():
    bm = BlockManager(4, block_size=4, enable_prefix_caching=False)
    admit(bm, make_request("a", range(9)))
    assert bm.get_computed_blocks(make_request("b", range(9))) == ([], 0)
    assert bm.take_events() == ([], []) and bm.prefix_cache_queries == 0


def test_invalid_sizes_are_rejected():
    with pytest.raises(ValueError, match="num_blocks"):
        BlockManager(0)
    with pytest.raises(ValueError, match="block_size"):
        BlockManager(4, block_size=0)


def test_random_operations_keep_counts_and_content_consistent():
    """Random admissions, chunked steps, decodes, finishes and resets. A fake KV store records
    which prefix each block holds, so every prefix hit is checked against the real content."""
    rng = random.Random(1234)
    block_size, num_blocks = 4, 24
    bm = BlockManager(num_blocks, block_size)
    bases = [[rng.randrange(1000) for _ in range(20)] for _ in range(3)]
    content: dict[int, tuple] = {}  # block id -> (salt, the full prefix through that block)
    router_index: set[bytes] = set()  # what a router learns from the KV events
    active: list[Request] = []
    next_id = 0

    def compute(r: Request, n: int) -> None:
        start = r.num_computed_tokens
        r.num_computed_tokens += n
        for index in range(start // block_size, r.num_computed_tokens // block_size):
            prefix = tuple(r.all_token_ids[:(index + 1) * block_size])
            content[r.block_ids[index]] = (r.cache_salt, prefix)
        bm.cache_full_blocks(r)

    for _ in range(3000):
        op = rng.random()
        if op < 0.3:
            base = rng.choice(bases)
            tokens = base[:rng.randrange(1, 21)] + [rng.randrange(1000) for _ in range(rng.randrange(4))]
            r = make_request(f"r{next_id}", tokens, salt=rng.choice([b"", b"s"]))
            next_id += 1
            hits, num_cached = bm.get_computed_blocks(r)
            assert num_cached < r.num_tokens
            for index, block_id in enumerate(hits):
                assert content[block_id] == (r.cache_salt, tuple(tokens[:(index + 1) * block_size]))
            chunk = rng.randrange(1, r.num_tokens - num_cached + 1)
            if bm.allocate_slots(r, chunk, hits, num_cached):
                r.num_computed_tokens = num_cached
                compute(r, chunk)
                active.append(r)
        elif op < 0.7 and active:
            r = rng.choice(active)
            if r.num_computed_tokens == r.num_tokens:
                r.all_token_ids.append(rng.randrange(1000))  # a sampled token
            n = rng.randrange(1, r.num_tokens - r.num_computed_tokens + 1)
            if bm.allocate_slots(r, n):
                compute(r, n)
        elif op < 0.98 and active:
            r = active.pop(rng.randrange(len(active)))  # finish or abort, at any point
            bm.free(r)
            assert r.block_ids == []
        elif not active:
            assert bm.reset_prefix_cache()

        stored, removed = bm.take_events()
        assert not set(stored) & set(removed)
        router_index.difference_update(removed)
        router_index.update(stored)
        assert len(router_index) == bm.num_cached_blocks

        holders = [0] * num_blocks
        for r in active:
            assert len(r.block_ids) == -(-r.num_computed_tokens // block_size)
            for block_id in r.block_ids:
                holders[block_id] += 1
        assert holders == [bm.ref_count(i) for i in range(num_blocks)]
        assert bm.num_free_blocks == holders.count(0)

    assert bm.prefix_cache_hits > 0
    for r in active:
        bm.free(r)
    assert bm.num_free_blocks == num_blocks
    assert all(bm.ref_count(i) == 0 for i in range(num_blocks))
