"""The worker's side of the cluster KV store: prompt blocks written back in the background, and a
prefix this worker lacks fetched from the store when that beats recomputing it.

Write-back never touches a step's critical path: the step thread only queues a copy of the new
full blocks (and skips it when the queue's byte bound is reached); a background task sends them.
On a GPU the copies take device memory beside a KV pool sized to nearly all of it, and a host
store over UCXX moves ~1-2 GB/s there, slower than an 8B model prefills on an H100: so workers
write back only with `--kvstore on` (write_back "on"); by default they only fetch ("off").
A fetch runs before a request is queued, and only when the scheduler's index of the store says
it holds more of the prompt than this worker does (or the index cannot say): the pages past the
worker's own prefix hit are fetched when that is estimated faster than their prefill (learnt: a
get's fixed cost, the store's GB/s, this engine's prefill tokens/s). A lookup or get waits no
longer than the prefill it could save. A store that fails, or answers late three times in a row,
is left alone for a moment; the worker just recomputes, and comes back to it later. The first
lookup, UCXX's import, the endpoint to the store and a first transfer are paid at start, not by a
request, and a probe page read back every few seconds keeps the get's cost current (issue 42: a
request's first get took 70 ms on the 2-core VM where the prefill it saved took 4).
"""

from __future__ import annotations

import asyncio
import os
import threading
import time
from collections import OrderedDict

import structlog

from services.worker.engine.engine import PromptSink
from shared.block_hash import prefix_block_hashes, request_block_key
from shared.kvstore_client import KvStoreClient, KvStoreError
from shared.kvstore_messages import HASH_BYTES

log = structlog.get_logger("worker.cluster_cache")

# Bytes of pages waiting for write-back at most; more are dropped. On a GPU the copies live in
# device memory beside a KV pool sized to nearly all of it, so the bound there is small.
QUEUE_BYTES_CPU = 1 << 30
QUEUE_BYTES_GPU = 256 << 20
KNOWN_HASHES = 1 << 16  # hashes remembered as stored (bounded LRU)
BACKOFF = 2.0  # seconds without the store after a failure, or while its lookups keep coming late
# A lookup waits at most the prefill time its blocks would save, and never less than this floor: a
# busy 2-core CI machine takes tens of milliseconds for a round trip an idle one answers in ~0.5 ms.
MIN_LOOKUP_S = 0.05
MIN_GET_S = 2 * MIN_LOOKUP_S  # a get is a lease round trip and then a transfer
# The get's cost is timed with a probe (one page, KvStoreClient.probe) at start and whenever no
# get timed it for this long: no request pays a first transfer's setup, or a store gone slow.
PROBE_S = 2.0
TYPICAL_PREFIX_BLOCKS = 16  # 256 tokens: a system prompt, or a dialogue's earlier turns
# Transfers at least this big measure bandwidth; smaller ones measure the fixed cost of a transfer
# (a 20 KiB get took 20 ms on the busy 2-core VM: latency, not bytes).
BANDWIDTH_BYTES = 1 << 20
# One late answer is noise (a GC pause, a busy core); this many in a row and the store is left alone.
LATE_IN_A_ROW = 3


class Estimate:
    """A learnt cost: the prior until the first sample, then a moving average."""

    def __init__(self, prior: float, alpha: float = 0.2):
        self.value, self.alpha, self.samples, self.at = prior, alpha, 0, 0.0

    def add(self, x: float) -> None:
        self.value = x if self.samples == 0 else self.value + self.alpha * (x - self.value)
        self.samples += 1
        self.at = time.monotonic()

    def older_than(self, seconds: float) -> bool:
        return time.monotonic() - self.at > seconds


class ClusterCache(PromptSink):
    def __init__(self, client: KvStoreClient, namespace: str, page_bytes: int, block_size: int, model: str,
                 write_back: str = "off", on_gpu: bool = False):
        self.client, self.namespace, self.page_bytes = client, namespace, page_bytes
        self.block_size, self.model = block_size, model
        self.write_back = write_back  # "on": every new prompt block; "off": none
        self.max_queue_bytes = QUEUE_BYTES_GPU if on_gpu else QUEUE_BYTES_CPU
        self.known: OrderedDict[bytes, None] = OrderedDict()  # stored in the store (by us or seen there)
        self.queue: asyncio.Queue = asyncio.Queue()
        self.queued_bytes = 0
        self._queued_lock = threading.Lock()  # the step thread adds, the event loop subtracts
        self.down_until = 0.0
        self.prefill_tps = Estimate(5e3)  # prefill tokens/s of this engine, from its steps
        # A fetch costs lookup_s (when the scheduler did not say what the store holds), then get_s,
        # then its bytes at fetch_bps.
        self.lookup_s = Estimate(1e-3)
        self.get_s = Estimate(2e-3)
        self.fetch_bps = Estimate(1e9)
        self.late = 0  # answers past their deadline in a row
        self.stats = {"put_pages": 0, "dropped_pages": 0, "fetched_pages": 0, "fetches": 0, "errors": 0,
                      "slow_lookups": 0}
        self._loop: asyncio.AbstractEventLoop | None = None
        self._tasks: list[asyncio.Task] = []
        self.warming: asyncio.Task | None = None
        self._probe_key = os.urandom(HASH_BYTES)  # this worker's probe page

    def start(self) -> None:
        self._loop = asyncio.get_running_loop()
        self.warming = asyncio.create_task(self._warm_up())
        self._tasks = [asyncio.create_task(self._write_back()), self.warming, asyncio.create_task(self._probe_loop())]

    async def close(self) -> None:
        for task in self._tasks:
            task.cancel()

    async def _warm_up(self) -> None:
        """What a first lookup and a first transfer set up (NATS's reply inbox, UCXX's import,
        start and endpoint) is done now, before a request waits on it."""
        started = time.perf_counter()
        try:
            await self.client.warm_up(self.namespace, self.block_size)
            await self._probe()
            log.info("kvstore_warm", seconds=round(time.perf_counter() - started, 3),
                     get_ms=round(1e3 * self.get_s.value, 2))
        except KvStoreError as e:
            self._failed(e)
        except Exception as e:  # e.g. no UCXX here: the store's transfers will fail and say so then
            log.warning("kvstore_warm_up_failed", error=repr(e))

    async def _probe(self) -> None:
        """Time one page's get into the cost model: its fixed part, the round trips. (A put's cost
        is learnt per block from the puts themselves: one page's would overstate it many times.)"""
        _, get_s = await self.client.probe(self.namespace, self._probe_key, self.page_bytes)
        self.get_s.add(get_s)
        self.late = 0

    async def _probe_loop(self) -> None:
        await asyncio.wait([self.warming])
        while True:
            await asyncio.sleep(PROBE_S)
            if self.available and self.get_s.older_than(PROBE_S):
                try:
                    await asyncio.wait_for(self._probe(), max(MIN_GET_S, 10 * self.get_s.value))
                except (KvStoreError, asyncio.TimeoutError) as e:
                    self._failed(e)
                except Exception as e:  # a bug or a transport fault must not end the probes
                    log.warning("kvstore_probe_failed", error=repr(e))
                    self._failed(e)

    @property
    def available(self) -> bool:
        return time.monotonic() >= self.down_until

    def _failed(self, e: Exception) -> None:
        self.stats["errors"] += 1
        self.down_until = time.monotonic() + BACKOFF
        log.debug("kvstore_unavailable", error=str(e))

    # -- write-back (PromptSink: called on the step thread) ---------------------------------------
    def skip(self, hashes: list[bytes]) -> int:
        if self.write_back == "off" or not self.available:
            return len(hashes)
        n = 0
        for h in hashes:  # reads only: the event loop owns `known`
            if h not in self.known:
                break
            n += 1
        if self.queued_bytes + (len(hashes) - n) * self.page_bytes > self.max_queue_bytes:
            self.stats["dropped_pages"] += len(hashes) - n
            return len(hashes)
        return n

    def take(self, hashes: list[bytes], pages, event) -> None:
        with self._queued_lock:
            self.queued_bytes += len(hashes) * self.page_bytes
        self._loop.call_soon_threadsafe(self.queue.put_nowait, (hashes, pages, event))

    async def _write_back(self) -> None:
        while True:
            hashes, pages, event = await self.queue.get()
            try:
                await self._put(hashes, pages, event)
            finally:
                with self._queued_lock:
                    self.queued_bytes -= len(hashes) * self.page_bytes
                del pages  # a GPU copy: give its memory back at once

    async def _put(self, hashes: list[bytes], pages, event) -> None:
        if not self.available:
            self.stats["dropped_pages"] += len(hashes)
            return
        try:
            if event is not None:
                await asyncio.to_thread(event.synchronize)
            await self.client.put(self.namespace, hashes, pages, self.page_bytes)
            self._remember(hashes)
            self.stats["put_pages"] += len(hashes)
        except KvStoreError as e:
            self._failed(e)
        except Exception as e:  # a bug or a transport fault must not end the write-back task
            log.warning("kvstore_put_failed", error=repr(e))
            self._failed(e)

    def _remember(self, hashes: list[bytes]) -> None:
        for h in hashes:
            self.known[h] = None
            self.known.move_to_end(h)
        while len(self.known) > KNOWN_HASHES:
            self.known.popitem(last=False)

    # -- fetch ------------------------------------------------------------------------------------
    def note_step(self, tokens: int, seconds: float) -> None:
        """A step's computed tokens and time: prefill speed, for the fetch-or-recompute choice."""
        if tokens >= 64 and seconds > 0:
            self.prefill_tps.add(tokens / seconds)

    def prompt_hashes(self, prompt: list[int], cache_salt: str) -> list[bytes]:
        """The engine's block hashes of the prompt's full blocks (model and tenant in the key)."""
        return prefix_block_hashes(prompt, self.block_size, request_block_key(self.model, cache_salt))

    def _prefill_s(self, blocks: int) -> float:
        return blocks * self.block_size / self.prefill_tps.value

    def fetch_s(self, blocks: int, ask: bool = False) -> float:
        """What fetching `blocks` is expected to cost (`ask`: a lookup first)."""
        return ((self.lookup_s.value if ask else 0.0) + self.get_s.value
                + blocks * self.page_bytes / self.fetch_bps.value)

    def pays(self, blocks: int, ask: bool = False) -> bool:
        """Fetching `blocks` is faster than prefilling them."""
        return self.available and self.fetch_s(blocks, ask) < self._prefill_s(blocks)

    @property
    def worth_asking(self) -> bool:
        """The store answers, and a block comes from it faster than it is prefilled here (both
        linear in the blocks, so one block decides; when it does not, no request pays a lookup)."""
        return self.available and self.page_bytes / self.fetch_bps.value < self._prefill_s(1)

    @property
    def fetch_cost_ratio(self) -> float:
        """Fetching a typical shared prefix (TYPICAL_PREFIX_BLOCKS) against prefilling it here, as
        learnt (no estimate forgotten): what the heartbeat tells the scheduler, which counts the
        store's pages as cached here only by the fraction of the prefill a fetch saves."""
        n = TYPICAL_PREFIX_BLOCKS
        return (self.get_s.value + n * self.page_bytes / self.fetch_bps.value) / self._prefill_s(n)

    async def _in_time(self, coro, blocks: int, floor: float = MIN_LOOKUP_S):
        """`coro`'s result, or None when it takes longer than prefilling `blocks` would (`floor` at
        least): the request is then recomputed at once (a saturated store must never hold a
        request back), and a store that keeps answering late is left alone like a dead one."""
        deadline = max(floor, self._prefill_s(blocks))
        try:
            return await asyncio.wait_for(coro, deadline)
        except asyncio.TimeoutError:
            self.stats["slow_lookups"] += 1
            self.late += 1
            if self.late >= LATE_IN_A_ROW:
                self.late = 0
                self._failed(KvStoreError(f"{LATE_IN_A_ROW} answers in a row later than {deadline * 1e3:.0f} ms",
                                          "slow"))
            return None

    async def _lookup(self, want: list[bytes]) -> int | None:
        """How many of `want` the store holds (None: no answer in time)."""
        t0 = time.perf_counter()
        hits = await self._in_time(self.client.lookup(self.namespace, self.block_size, want), len(want))
        if hits is not None:
            self.late = 0
            self.lookup_s.add(time.perf_counter() - t0)
        return hits

    async def fetch(self, hashes: list[bytes], local: int, held: int | None = None):
        """(hashes, pages) of the prefix past `local` blocks that the store holds; None when it
        holds none or fetching does not pay. `held`: the blocks the store holds by the scheduler's
        index of it (None: unknown, the store is asked first). Leaves at least one token to compute."""
        want = hashes[local:] if held is None else hashes[local:held]
        if not want or not self.pays(len(want), ask=held is None):
            return None
        try:
            if held is None:
                hits = await self._lookup(want)
                if not hits:  # none held, or no answer in time
                    return None
                want = want[:hits]
            t0 = time.perf_counter()
            got = await self._in_time(self.client.get(self.namespace, want, release_later=True), len(want),
                                      MIN_GET_S)
            if got is None or got[0] == 0 or got[1] is None:
                return None
            count, pages = got
            self._learn_get(time.perf_counter() - t0)
            self._remember(want[:count])
        except KvStoreError as e:
            self._failed(e)
            return None
        self.stats["fetches"] += 1
        self.stats["fetched_pages"] += count
        return want[:count], pages

    def _learn_get(self, seconds: float) -> None:
        """A get is a lease round trip and a transfer: a big transfer measures the bandwidth, and
        what the bytes do not explain is the get's fixed cost."""
        nbytes, transfer_s = self.client.last_get
        self.late = 0
        if nbytes >= BANDWIDTH_BYTES and 0 < transfer_s <= seconds:
            self.fetch_bps.add(nbytes / transfer_s)
        self.get_s.add(max(0.0, seconds - nbytes / self.fetch_bps.value))
