"""The pinned arena evicted models' host copies live in (services/worker/engine/pinned_arena.py):
first-fit spans, aligned views, spans given back and merged. On the CPU, unpinned: the same logic."""

from __future__ import annotations

import pytest
import torch

from services.worker.engine.pinned_arena import ALIGN, PinnedArena


def test_spans_are_carved_first_fit_and_merge_when_given_back():
    arena = PinnedArena(10 * ALIGN, pin=False)
    a, b, c = arena.take(3 * ALIGN), arena.take(1), arena.take(4 * ALIGN)
    assert (a, b, c) == ((0, 3 * ALIGN), (3 * ALIGN, ALIGN), (4 * ALIGN, 4 * ALIGN))
    assert arena.take(3 * ALIGN) is None and arena.free_bytes == 2 * ALIGN
    arena.give(a)
    arena.give(c)  # merged with the free tail; b still splits the arena in two runs (3 and 6 pages)
    assert arena.take(7 * ALIGN) is None
    arena.give(b)  # now one run again
    assert arena.free_bytes == 10 * ALIGN and arena.take(10 * ALIGN) == (0, 10 * ALIGN)


def test_views_hold_a_models_tensors_in_order_each_aligned():
    tensors = [torch.randn(3, 5), torch.arange(7, dtype=torch.int8), torch.randn(2, 2).to(torch.bfloat16)]
    arena = PinnedArena(4096, pin=False)
    span = arena.take(arena.bytes_for(tensors))
    assert span == (0, 3 * ALIGN)
    allocate = arena.views(span)
    outs = [allocate(t.shape, t.dtype) for t in tensors]
    for t, out in zip(tensors, outs):
        out.copy_(t)
        assert (out.data_ptr() - arena.buffer.data_ptr()) % ALIGN == 0 and out.dtype == t.dtype and torch.equal(out, t)
    with pytest.raises(ValueError):
        allocate((1,), torch.float32)  # past the span
