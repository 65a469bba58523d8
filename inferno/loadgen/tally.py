"""A run's live counts for its progress line: requests ended, in flight and failed, output tokens and
their rate, kept as requests start and end (never per token), summed over the client processes."""

from __future__ import annotations

import asyncio
import contextlib
import time
from array import array
from collections import deque
from collections.abc import Awaitable, Iterator
from multiprocessing import shared_memory

from inferno.loadgen.stats import RequestRecord
from shared.progress import Progress

PROGRESS_REFRESH_S = 0.5  # how often a run's progress is refreshed and a client process publishes its counts
PROGRESS_WINDOW_S = 5.0  # the live output tok/s is over this many recent seconds


class Tally:
    """A run's counts for its progress, kept by stream_one as a request starts and ends, never per token:
    the tokens of the requests still streaming are counted only when the progress is refreshed."""

    FIELDS = 4  # ended, in flight, failed, output tokens: as counts() returns them and a child publishes them

    def __init__(self, every: float = PROGRESS_REFRESH_S):
        self.every = every  # seconds between refreshes of the progress, and between a child's publications
        self.ended = 0
        self.failed = 0
        self.tokens = 0  # output tokens of the requests that ended
        self.open: dict[int, RequestRecord] = {}  # the requests in flight, by id()
        self.others: memoryview | None = None  # FIELDS counts per other client process, in shared memory

    def start(self, record: RequestRecord) -> None:
        self.open[id(record)] = record

    def end(self, record: RequestRecord) -> None:
        """The request ended, or was given up unsent (a session's turns after a failed one)."""
        self.open.pop(id(record), None)
        self.ended += 1
        if record.error is not None:
            self.failed += 1
        self.tokens += record.output_tokens

    def counts(self) -> list[int]:
        """[ended, in flight, failed, output tokens so far], the other client processes' included."""
        counts = [self.ended, len(self.open), self.failed,
                  self.tokens + sum(len(r.chunk_times) for r in self.open.values())]
        for i, n in enumerate(self.others or ()):
            counts[i % self.FIELDS] += n
        return counts

    @contextlib.contextmanager
    def sharing(self, processes: int) -> Iterator[str]:
        """Shared memory for the counts of `processes` other client processes (each publishes into its
        slot); yields its name."""
        memory = shared_memory.SharedMemory(create=True, size=8 * self.FIELDS * processes)
        self.others = memory.buf.cast("q")
        try:
            yield memory.name
        finally:
            self.others.release()
            self.others = None
            memory.close()
            memory.unlink()


async def publish(tally: Tally, name: str, slot: int) -> None:
    """A child process's counts into its slot of the parent's shared memory, every tally.every until cancelled."""
    memory = shared_memory.SharedMemory(name=name)
    counts = memory.buf.cast("q")
    mine = slice(slot * Tally.FIELDS, (slot + 1) * Tally.FIELDS)
    try:
        while True:
            counts[mine] = array("q", tally.counts())
            await asyncio.sleep(tally.every)
    finally:
        counts[mine] = array("q", tally.counts())  # as the shard ends
        counts.release()
        memory.close()


async def refreshing(run: Awaitable[float | None], tally: Tally | None,
                      shown: Progress | None) -> float | None:
    """Await the run, refreshing its progress from the tally meanwhile."""
    if shown is None:
        return await run
    refresh = asyncio.create_task(_refresh(tally, shown))
    try:
        return await run
    finally:
        refresh.cancel()


async def _refresh(tally: Tally, shown: Progress) -> None:
    """Until cancelled: the requests ended, those in flight, the output tok/s of the last few seconds, errors."""
    past = deque([(time.perf_counter(), 0)])  # (time, output tokens so far) over PROGRESS_WINDOW_S
    while True:
        await asyncio.sleep(tally.every)
        ended, in_flight, failed, tokens = tally.counts()
        now = time.perf_counter()
        past.append((now, tokens))
        while len(past) > 2 and now - past[0][0] > PROGRESS_WINDOW_S:
            past.popleft()
        then, before = past[0]
        rate = (tokens - before) / (now - then)
        shown.update(ended, note=f"in flight {in_flight:,}, output tok/s {rate:,.0f}, errors {failed:,}")
