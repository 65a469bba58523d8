"""Several client processes for one run: a load generator in one Python process tops out near one
core (at W2 on four H100 workers it used 89 % of one while the gateway used 88 %, 2026-11-27), so a
run whose server outpaces it measures the client. Process i of n sends requests i, i + n, ... on
the parent's clock (time.perf_counter is the system's monotonic clock, one for every process),
and hands back its records and CPU time; the parent merges them as if it had sent them all.
This module splits and merges the run and starts the pool; each child runs client.run_shard."""

from __future__ import annotations

import concurrent.futures
import dataclasses
import multiprocessing
import time

from inferno.loadgen.stats import RequestRecord


@dataclasses.dataclass(slots=True, frozen=True)
class Shard:
    """What one client process sends: every n-th request of the run (shards.split), on the run's clock."""

    url: str
    headers: dict[str, str]
    bodies: list[bytes]
    offsets: list[float]
    records: list[RequestRecord]
    concurrency: int | None
    timeout: float
    max_duration: float
    t0: float  # the run's clock origin (time.perf_counter of the parent)


def split(values: list, n: int) -> list[list]:
    """values[i::n] for i in 0..n-1: shard i's share, in its original order."""
    return [values[i::n] for i in range(n)]


def merge(records: list[RequestRecord], shards: list[list[RequestRecord]]) -> None:
    """Write the shards' records back over `records` (shard i holds records i, i + n, ...)."""
    n = len(shards)
    for i, shard in enumerate(shards):
        records[i::n] = shard


def pool(n: int) -> concurrent.futures.ProcessPoolExecutor:
    """n - 1 child processes, started (spawn: no forked event loop) before the run's clock starts."""
    executor = concurrent.futures.ProcessPoolExecutor(n - 1, mp_context=multiprocessing.get_context("spawn"))
    for f in [executor.submit(time.sleep, 0) for _ in range(n - 1)]:  # each child up and importing
        f.result()
    return executor
