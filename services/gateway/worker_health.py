"""The gateway's view of the workers: their latest heartbeats, who is live, who went silent."""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Callable

from shared.messages import WorkerHeartbeat

HEARTBEAT_TTL = 3.0  # a worker is gone after 3 missed 1 s heartbeats (as the scheduler sees it)
FORGET_AFTER = 60.0  # entries of long-gone workers are dropped, so the table stays bounded


@dataclass(slots=True)
class WorkerEntry:
    heartbeat: WorkerHeartbeat
    received: float  # monotonic seconds at this gateway (worker clocks are not trusted)


class WorkerHealth:
    """Heartbeat table keyed by worker id; fed by the heartbeat subscription."""

    def __init__(self, ttl: float = HEARTBEAT_TTL, clock: Callable[[], float] = time.monotonic):
        self.ttl = ttl
        self.clock = clock
        self.workers: dict[str, WorkerEntry] = {}
        # Told the id of a worker whose process was replaced: a supervisor restarts a worker under
        # the same id, often within the TTL, and the new process knows nothing of the old requests.
        self.on_restart: Callable[[str], None] | None = None

    def on_heartbeat(self, hb: WorkerHeartbeat) -> None:
        entry = self.workers.get(hb.worker_id)
        # A restarted worker starts its seq again; an older seq of the same process is a late arrival.
        if entry is not None and hb.seq <= entry.heartbeat.seq:
            if hb.timestamp <= entry.heartbeat.timestamp:
                return
            if self.on_restart is not None:
                self.on_restart(hb.worker_id)
        self.workers[hb.worker_id] = WorkerEntry(hb, self.clock())

    def live(self) -> list[WorkerHeartbeat]:
        """Workers heard from within the TTL (ready or not)."""
        now = self.clock()
        self._forget(now)
        return [e.heartbeat for e in self.workers.values() if now - e.received < self.ttl]

    def ready(self) -> list[WorkerHeartbeat]:
        """Live workers that take new requests."""
        return [hb for hb in self.live() if hb.ready and not hb.draining]

    def serving(self) -> list[WorkerHeartbeat]:
        """Live workers that serve requests now or after a load: ready, or holding a model in
        standby (its requests wait in that worker's queue while the worker loads it)."""
        return [hb for hb in self.live() if (hb.ready or hb.state == "standby") and not hb.draining]

    def resident_models(self) -> set[str]:
        """The models some live worker holds on its GPU now."""
        return {hb.model for hb in self.live() if hb.state == "ready" and hb.model}

    def heard_within_ttl(self) -> set[str]:
        """Ids of the workers heard from within the TTL: none of them is silent, whatever `since`."""
        now = self.clock()
        return {w for w, e in self.workers.items() if now - e.received < self.ttl}

    def is_silent(self, worker_id: str, since: float) -> bool:
        """True when `worker_id` has not been heard from for the TTL; a worker never heard from
        counts from `since` (when the caller started depending on it)."""
        now = self.clock()
        entry = self.workers.get(worker_id)
        last = entry.received if entry is not None else since
        return now - last >= self.ttl

    def _forget(self, now: float) -> None:
        gone = [w for w, e in self.workers.items() if now - e.received > FORGET_AFTER]
        for w in gone:
            del self.workers[w]
