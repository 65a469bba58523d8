"""The live workers as the scheduler sees them: last heartbeat, load routed since, prefix-cache index."""

from __future__ import annotations

from dataclasses import dataclass, field

from services.scheduler.kv_index import KvIndex
from shared.logging import get_logger
from shared.messages import KvEvents, WorkerHeartbeat
from shared.subjects import STORE_ID

log = get_logger(__name__)


@dataclass(slots=True)
class WorkerState:
    """One worker: its latest heartbeat plus what this scheduler sent it since that heartbeat.

    The routed_* counters close the gap between heartbeats: without them, every request of a burst
    would see the same (stale) load and pile onto the same worker.
    """

    heartbeat: WorkerHeartbeat
    last_seen: float  # monotonic time the heartbeat arrived (never the worker's clock)
    kv: KvIndex
    routed_requests: int = 0
    routed_tokens: int = 0
    local_prefill_tokens: int = 0  # of routed_tokens: prompts a decode worker prefills itself

    @property
    def worker_id(self) -> str:
        return self.heartbeat.worker_id

    @property
    def model(self) -> str:
        return self.heartbeat.model

    @property
    def role(self) -> str:
        return self.heartbeat.role

    @property
    def block_size(self) -> int:
        return self.heartbeat.block_size

    @property
    def accepts_work(self) -> bool:
        return self.heartbeat.ready and not self.heartbeat.draining

    @property
    def num_waiting(self) -> int:
        """Requests queued at the worker, counting those routed since its heartbeat."""
        return self.heartbeat.num_waiting + self.routed_requests

    @property
    def num_running(self) -> int:
        return self.heartbeat.num_running + self.routed_requests

    @property
    def load_tokens(self) -> int:
        """Tokens the worker already has to work through: decode context, queued prefill, routed prompts."""
        hb = self.heartbeat
        return hb.active_decode_tokens + hb.queued_prefill_tokens + self.routed_tokens

    def note_routed(self, num_tokens: int) -> None:
        self.routed_requests += 1
        self.routed_tokens += num_tokens


@dataclass(slots=True)
class Registry:
    """Workers keyed by id, alive while their last heartbeat is younger than `heartbeat_ttl`."""

    heartbeat_ttl: float
    workers: dict[str, WorkerState] = field(default_factory=dict)
    # Indexes of workers not (or no longer) registered: KvEvents can arrive before a worker's first
    # heartbeat. They are adopted by that heartbeat, or dropped by the sweep after heartbeat_ttl.
    orphan_indexes: dict[str, KvIndex] = field(default_factory=dict)
    store_kv: KvIndex = field(default_factory=KvIndex)  # the cluster kvstore's pages: any worker can fetch them

    def on_heartbeat(self, hb: WorkerHeartbeat, now: float) -> WorkerState:
        state = self.workers.get(hb.worker_id)
        if state is None:
            kv = self.orphan_indexes.pop(hb.worker_id, None) or KvIndex(now)
            state = WorkerState(heartbeat=hb, last_seen=now, kv=kv)
            self.workers[hb.worker_id] = state
            log.info("worker_joined", worker_id=hb.worker_id, role=hb.role, model=hb.model,
                     ready=hb.ready, draining=hb.draining, state=hb.state)
            return state
        old = state.heartbeat
        if hb.seq <= old.seq:
            # seq only grows within one worker process: this is a new process under the same id.
            # Its prefix cache starts empty whatever our index says.
            state.kv.clear()
            state.kv.resets += 1
            log.info("worker_restarted", worker_id=hb.worker_id, seq=hb.seq, previous_seq=old.seq)
        elif (hb.ready, hb.draining, hb.state, hb.model) != (old.ready, old.draining, old.state, old.model):
            log.info("worker_state", worker_id=hb.worker_id, ready=hb.ready, draining=hb.draining, state=hb.state,
                     model=hb.model)
        state.heartbeat = hb
        state.last_seen = now
        state.routed_requests = 0
        state.routed_tokens = 0
        state.local_prefill_tokens = 0
        return state

    def on_kv_snapshot(self, worker_id: str, seq: int, blocks: set[bytes], now: float) -> bool:
        """A worker's whole prefix cache as of its report `seq` (read from JetStream at start)."""
        state = self.workers.get(worker_id)
        kv = state.kv if state is not None else self.orphan_indexes.setdefault(worker_id, KvIndex(now))
        return kv.load(seq, blocks, now)

    def on_kv_events(self, ev: KvEvents, now: float) -> None:
        if ev.worker_id == STORE_ID:
            if not self.store_kv.apply(ev, now):
                log.debug("kv_events_gap", worker_id=ev.worker_id, seq=ev.seq)
            return
        state = self.workers.get(ev.worker_id)
        if state is not None:
            kv = state.kv
        else:
            kv = self.orphan_indexes.get(ev.worker_id)
            if kv is None:
                kv = self.orphan_indexes[ev.worker_id] = KvIndex(now)
        if not kv.apply(ev, now):
            log.debug("kv_events_gap", worker_id=ev.worker_id, seq=ev.seq)

    def sweep(self, now: float) -> list[str]:
        """Drop workers whose heartbeats stopped (and their indexes); returns the ids dropped."""
        deadline = now - self.heartbeat_ttl
        gone = [wid for wid, w in self.workers.items() if w.last_seen <= deadline]
        for wid in gone:
            del self.workers[wid]
            log.info("worker_gone", worker_id=wid, ttl=self.heartbeat_ttl)
        for wid in [wid for wid, kv in self.orphan_indexes.items() if kv.updated <= deadline]:
            del self.orphan_indexes[wid]
        return gone

    def suspend(self, worker_id: str) -> None:
        """A worker that did not take a forwarded request leaves until its next heartbeat."""
        if self.workers.pop(worker_id, None) is not None:
            log.info("worker_suspended", worker_id=worker_id)

    def live(self, now: float) -> list[WorkerState]:
        """Every worker alive at `now` (sweeping first, so a silent worker never gets a request)."""
        deadline = now - self.heartbeat_ttl
        for w in self.workers.values():
            if w.last_seen <= deadline:
                self.sweep(now)
                break
        return list(self.workers.values())

    def get(self, worker_id: str, now: float) -> WorkerState | None:
        w = self.workers.get(worker_id)
        if w is None or w.last_seen <= now - self.heartbeat_ttl:
            return None
        return w
