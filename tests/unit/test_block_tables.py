"""BlockTables: the block manager's rows of block ids match every request's list through
allocation, prefix hits, growth, frees and reuse, and a step's packed table read from them equals
the one read from the lists."""

from __future__ import annotations

import random

import numpy as np

from services.worker.engine.batcher import ScheduledRequest
from services.worker.engine.block_manager import BlockManager
from services.worker.engine.request import Request
from services.worker.engine.step_inputs import pack_step_inputs
from shared.sampling_params import SamplingParams


def make_request(request_id: str, tokens) -> Request:
    return Request(request_id, list(tokens), SamplingParams(max_tokens=16))


def check_mirror(bm: BlockManager, held: list[Request]) -> None:
    ids = bm.tables.ids
    rows = set()
    for r in held:
        assert r.table_row >= 0 and r.table_row not in rows
        rows.add(r.table_row)
        n = len(r.block_ids)
        assert ids[r.table_row, :n].tolist() == r.block_ids
        assert not ids[r.table_row, n:].any()  # zero after its blocks
    for row in set(range(ids.shape[0])) - rows:
        assert not ids[row].any()  # a row nobody holds is all zero


def test_rows_follow_allocation_growth_and_frees():
    rng = random.Random(0)
    bm = BlockManager(4096, block_size=4)
    held: list[Request] = []
    for step in range(400):
        if held and rng.random() < 0.3:
            r = held.pop(rng.randrange(len(held)))
            bm.free(r)
            assert r.table_row == -1 and r.block_ids == []
        elif rng.random() < 0.5 or not held:
            r = make_request(f"r{step}", [rng.randrange(50) for _ in range(rng.randrange(1, 40))])
            hit, cached = bm.get_computed_blocks(r)  # prefix hits come first in the row
            assert bm.allocate_slots(r, r.num_tokens - cached, hit, cached)
            r.num_computed_tokens = r.num_tokens
            bm.cache_full_blocks(r)
            held.append(r)
        else:  # a running request grows, past the array's first 64 columns for some
            r = rng.choice(held)
            assert bm.allocate_slots(r, rng.randrange(1, 120))
            r.num_computed_tokens = len(r.block_ids) * 4
        check_mirror(bm, held)
    assert bm.tables.ids.shape[0] >= 64 and bm.tables.ids.shape[1] > 64  # both grew


def test_more_requests_than_rows_grow_the_array():
    bm = BlockManager(1000, block_size=4)
    held = [make_request(f"r{i}", range(5)) for i in range(150)]
    for r in held:
        assert bm.allocate_slots(r, 5)
    check_mirror(bm, held)
    assert bm.tables.ids.shape[0] == 256


def test_packed_table_from_rows_equals_the_lists():
    rng = random.Random(1)
    bm = BlockManager(2048, block_size=4)
    reqs = []
    for i in range(40):
        r = make_request(f"r{i}", [rng.randrange(100) for _ in range(rng.randrange(1, 60))])
        assert bm.allocate_slots(r, r.num_tokens)
        reqs.append(r)
    bm.free(reqs.pop(7))  # a freed row between the others
    reqs.append(make_request("late", range(30)))
    assert bm.allocate_slots(reqs[-1], 30)
    scheduled = [ScheduledRequest(r, r.num_tokens, 0, True, False) if i % 3 else
                 ScheduledRequest(r, 1, r.num_tokens - 1, True, False) for i, r in enumerate(reqs)]
    with_rows = pack_step_inputs(scheduled, 4, block_tables=bm.tables)
    from_lists = pack_step_inputs(scheduled, 4)
    assert with_rows.lens == from_lists.lens
    assert np.array_equal(with_rows.flat, from_lists.flat)
