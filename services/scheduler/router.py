"""Token-aware routing: the worker with the least prefill-plus-load cost for a request's prompt.

cost(w) = (prompt tokens − tokens of the prompt's prefix cached on w, or in the cluster kvstore, from
which any worker fetches it) + load(w), where load(w) is
w's decode context plus queued prefill from its last heartbeat, plus the prompts routed to it since.
Least cost wins; ties go to fewer running requests, then the smaller worker id (deterministic, so
replicas with the same view agree). This is the KV-aware routing idea of Dynamo's router.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from services.scheduler.admission import QueueWait, Rejection, admit, within_wait
from services.scheduler.kv_index import KvIndex, match_prefixes
from services.scheduler.registry import Registry, WorkerState
from shared.block_hash import request_block_key
from shared.config import RouterConfig
from shared.messages import GenerateRequest


@dataclass(slots=True, frozen=True)
class Choice:
    worker: WorkerState
    cached_tokens: int
    cost: int
    sticky: bool = False  # chosen by session affinity rather than by cost
    store_tokens: int = -1  # of the prompt's prefix in the cluster kvstore, for the worker (-1: unknown)


def request_cost(num_prompt_tokens: int, cached_tokens: int, load_tokens: int) -> int:
    return max(num_prompt_tokens - cached_tokens, 0) + load_tokens


def prefix_hits(workers: Sequence[WorkerState], req: GenerateRequest,
                store: KvIndex | None = None) -> tuple[list[int], list[int]]:
    """Tokens of the request's prompt each worker holds as a cached prefix (whole blocks), and
    tokens of it the cluster kvstore (`store`) holds in that worker's block size by the index
    (what the index lacks may still be there when it is not `complete`)."""
    own = [0] * len(workers)
    in_store = [0] * len(workers)
    extra_key = request_block_key(req.model, req.cache_salt)
    # Workers of different block sizes hash different chains; usually there is one group.
    by_size: dict[int, list[int]] = {}
    for i, w in enumerate(workers):
        by_size.setdefault(w.block_size, []).append(i)
    for block_size, members in by_size.items():
        depths = match_prefixes(req.prompt_ids, block_size, extra_key,
                                [workers[i].kv for i in members] + [store])
        shared = depths.pop()
        for i, depth in zip(members, depths):
            own[i], in_store[i] = depth * block_size, shared * block_size
    return own, in_store


def usable(workers: Sequence[WorkerState], own: list[int], in_store: list[int]) -> list[int]:
    """Cached tokens each worker can start from: its own prefix, or the store's in proportion to
    the prefill a fetch saves there (a worker's heartbeat says what a fetch costs it against a
    prefill: a store token fetched at half a prefill's cost counts half)."""
    out = []
    for w, o, s in zip(workers, own, in_store):
        ratio = w.heartbeat.store_fetch_cost
        saved = 1.0 - ratio if 0.0 <= ratio < 1.0 else 0.0
        out.append(o + int(max(0, s - o) * saved))
    return out


def store_hint(tokens: int, store: KvIndex | None) -> int:
    """What a worker is told the store holds: -1 (ask it) unless the index is the store's whole content."""
    return tokens if store is not None and store.complete else -1


def cached_tokens(workers: Sequence[WorkerState], req: GenerateRequest, store: KvIndex | None = None) -> list[int]:
    """Tokens of the request's prompt each worker holds as a cached prefix, or fetches from the
    cluster kvstore (`store`), whichever is longer."""
    return usable(workers, *prefix_hits(workers, req, store))


class Router:
    """Admission plus the choice of one worker; owns no I/O (session affinity sits on top of it)."""

    __slots__ = ("cfg", "registry", "wait")

    def __init__(self, cfg: RouterConfig, registry: Registry):
        self.cfg = cfg
        self.registry = registry
        self.wait = QueueWait(cfg.admission_tokens_per_second)

    def admit(self, req: GenerateRequest, now: float) -> list[WorkerState] | Rejection:
        open_ = admit(self.registry.live(now), req.model, req.num_prompt_tokens, self.cfg.max_waiting,
                      self.cfg.retry_after)
        if isinstance(open_, Rejection):
            return open_
        return within_wait(open_, self.wait, self.cfg.max_queue_seconds, self.cfg.retry_after,
                           req.num_prompt_tokens)

    def overloaded(self, w: WorkerState) -> bool:
        return w.heartbeat.kv_usage >= self.cfg.overload_kv_usage

    def best(self, open_: Sequence[WorkerState], req: GenerateRequest) -> Choice:
        """The least-cost worker among admitted ones (those below the KV-usage threshold first)."""
        # A worker with its KV pool nearly full would queue or preempt; it is still better than a
        # 429 when every worker is that full, so it is only passed over, never excluded.
        pool = [w for w in open_ if not self.overloaded(w)] or list(open_)
        own, in_store = prefix_hits(pool, req, self.registry.store_kv)
        cached = usable(pool, own, in_store)
        n = req.num_prompt_tokens
        best_key: tuple[int, int, str] | None = None
        best_i = 0
        for i, w in enumerate(pool):
            key = (request_cost(n, cached[i], w.load_tokens), w.num_running, w.worker_id)
            if best_key is None or key < best_key:
                best_key, best_i = key, i
        assert best_key is not None, "best() needs at least one admitted worker"
        return Choice(pool[best_i], cached[best_i], best_key[0],
                      store_tokens=store_hint(in_store[best_i], self.registry.store_kv))

    def sticky(self, worker_id: str, open_: Sequence[WorkerState], req: GenerateRequest) -> Choice | None:
        """The session's worker, if it is admitted and not overloaded; else None (route by cost)."""
        for w in open_:
            if w.worker_id == worker_id:
                if self.overloaded(w):
                    return None
                own, in_store = prefix_hits([w], req, self.registry.store_kv)
                cached, in_store = usable([w], own, in_store)[0], in_store[0]
                return Choice(w, cached, request_cost(req.num_prompt_tokens, cached, w.load_tokens), sticky=True,
                              store_tokens=store_hint(in_store, self.registry.store_kv))
        return None

    def commit(self, choice: Choice, req: GenerateRequest) -> None:
        """Count the request against its worker until that worker's next heartbeat reports it."""
        choice.worker.note_routed(req.num_prompt_tokens)

    def route(self, req: GenerateRequest, now: float) -> Choice | Rejection:
        """Admission and the least-cost choice, committed (no session affinity)."""
        open_ = self.admit(req, now)
        if isinstance(open_, Rejection):
            return open_
        choice = self.best(open_, req)
        self.commit(choice, req)
        return choice
