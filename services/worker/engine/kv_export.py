"""Copies of a request's KV blocks out of the pool as pages: a hand-off's (cut from the hand-off
buffer where one is set aside) and the cluster store's, on a side stream the next step need not wait for."""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass

import torch

from services.worker.engine.kv_cache import KVCache
from services.worker.engine.kv_pages import gather_pages
from services.worker.engine.page_arena import PageArena


@dataclass(slots=True)
class Handoff:
    """A prefill worker's request after its first token: its prompt's KV as pages, ready to send
    once `ready()` returns (a GPU copy may still be running when the step returns)."""

    pages: torch.Tensor  # [n, L, 2, block_size, H, D], one page per block of the prompt
    seed: int
    num_cached_tokens: int
    event: object = None  # a CUDA event recorded after the copy
    release: Callable[[], None] | None = None  # frees the pages' hand-off slot (page_arena.py)

    @property
    def in_buffer(self) -> bool:
        """The pages lie in the hand-off buffer, which lives as long as the worker: another process
        may map it once and copy from it (cuda_ipc.py)."""
        return self.release is not None

    def ready(self) -> None:
        if self.event is not None:
            self.event.synchronize()

    def copied(self) -> bool:
        """The copy out of the pool has ended (ready() would not wait)."""
        return self.event is None or self.event.query()

    def done(self) -> None:
        """The pages have been sent (or never will be): their slot may hold the next hand-off."""
        if self.release is not None:
            self.release, release = None, self.release
            release()


def handoff_buffer_blocks(config) -> int:
    """Pages of memory a prefill or decode worker keeps out of its KV pool for hand-offs."""
    return -(-config.handoff_buffer_tokens // config.block_size)


class PageExporter:
    """The engine's copies out of its KV pool; owns the side stream and the hand-off buffer (a prefill
    worker's pages on their way out, a decode worker's receive slots)."""

    def __init__(self, kv_cache: KVCache, device: torch.device, buffer_blocks: int = 0):
        self.kv_cache, self.device = kv_cache, device
        self.buffer_blocks = buffer_blocks
        self.arena: PageArena | None = None  # made at the first hand-off
        self._stream = None
        self._retired: list[tuple[Callable[[], None], object, float]] = []  # (release, CUDA event, hold until)

    def copy_out(self, block_ids: list[int], after=None, out: torch.Tensor | None = None) -> tuple[torch.Tensor, object]:
        """These blocks' pages in a new tensor (or in `out`), and (on a GPU) an event for when they
        are there. The copy runs on a side stream behind `after` (the step that wrote them): with
        overlap the main stream holds the next step already, which the copy need not wait for.
        Later steps wait for the copy, since the blocks may be handed to other requests from now on."""
        kv = self.kv_cache
        if not kv.pool.is_cuda:
            return gather_pages(kv, block_ids, out), None
        if self._stream is None:
            # High priority: behind a long prefill step's GEMMs on the main stream, a copy at normal
            # priority waited for SMs for 5-12 ms in the hand-off's tail (four H100s, 2026-11-27).
            self._stream = torch.cuda.Stream(self.device, priority=-1)
        stream, main = self._stream, torch.cuda.current_stream(self.device)
        if after is not None:
            stream.wait_event(after)
        else:
            stream.wait_stream(main)
        with torch.cuda.stream(stream):
            pages = gather_pages(kv, block_ids, out)
            event = torch.cuda.Event()
            event.record(stream)
        main.wait_event(event)
        return pages, event

    def export(self, block_ids: list[int], seed: int, num_cached_tokens: int, after=None,
               shared: bool = False) -> Handoff:
        """A hand-off of these blocks. `shared`: the cluster store takes the pages too and keeps them
        longer than a send, so they get an allocation of their own."""
        slot = None if shared else self._slot(len(block_ids))
        if slot is None:
            pages, event = self.copy_out(block_ids, after)
            return Handoff(pages, seed, num_cached_tokens, event)
        out, release = slot
        try:
            pages, event = self.copy_out(block_ids, after, out)
        except BaseException:
            release()
            raise
        return Handoff(pages, seed, num_cached_tokens, event, release)

    def receive_slot(self, n: int):
        """A decode worker's receive buffer for n pages cut from the hand-off buffer, and its release
        (give it to retire()); None where there is none free (the caller allocates instead)."""
        self.reap()
        return self._slot(n)

    def retire(self, release: Callable[[], None], event=None, hold_until: float = 0.0) -> None:
        """Free a receive slot once the kernels queued before `event` (the import's scatter) have
        read it and time.monotonic() has passed `hold_until` (a prefill worker may still write a
        slot it was told of until then): before that the next reservation must not get it."""
        self._retired.append((release, event, hold_until))

    def reap(self) -> None:
        if not self._retired:
            return
        now, kept = time.monotonic(), []
        for release, event, hold_until in self._retired:
            if hold_until <= now and (event is None or event.query()):
                release()
            else:
                kept.append((release, event, hold_until))
        self._retired = kept

    def _slot(self, n: int):
        """A run of the hand-off buffer and its release; None without a buffer (a mixed worker; a CPU
        worker, whose pool is not sized from memory) or with every slot taken (then a fresh
        allocation, as without a buffer)."""
        if not self.buffer_blocks:
            return None
        if self.arena is None:
            self.arena = PageArena(self.kv_cache.pool, self.buffer_blocks)
        return self.arena.take(n)
