"""Per-request timestamps at each hop, for finding where a request waits (issue 42's trace).

`INFERNO_HOP_TRACE=DIR` makes each service append `{"rid", "hop", "t"}` JSON lines (wall clock, one
host's clock for the whole stack) to DIR/<service>-<pid>.jsonl: the gateway when the request came
(gw_in), when it sends it to the scheduler (gw_route), when the scheduler answered (gw_routed) and
when the first token came (gw_first); the scheduler when it takes the request (sc_in) and when its
worker acknowledged it (sc_out); the worker when the request came (wk_in), when it was queued for a
step after any fetch from the cluster store (wk_queued), when the step thread gave it to the engine
(wk_added) and when its first token went out (wk_out). `python bench/hop_trace_summary.py DIR` joins
them. Off by default; when on, a mark is a tuple appended (any thread) and a file write every few
hundred.
"""

from __future__ import annotations

import atexit
import json
import os
import threading
import time

FLUSH_EVERY = 256


class HopTrace:
    def __init__(self, path: str):
        self.path = path
        self._rows: list[tuple[str, str, float]] = []
        self._lock = threading.Lock()
        self._marked: set[tuple[str, str]] = set()  # mark_first's
        atexit.register(self.flush)

    def mark(self, rid: str, hop: str, ago: float = 0.0) -> None:
        """`ago`: the hop happened this many seconds before now."""
        self._rows.append((rid, hop, time.time() - ago))
        if len(self._rows) >= FLUSH_EVERY:
            self.flush()

    def mark_first(self, rid: str, hop: str) -> None:
        """Mark a hop a request passes many times (its tokens) the first time only."""
        if (rid, hop) not in self._marked:
            self._marked.add((rid, hop))
            self.mark(rid, hop)

    def flush(self) -> None:
        with self._lock:
            rows, self._rows = self._rows, []
            if rows:
                with open(self.path, "a") as f:
                    f.writelines(json.dumps({"rid": r, "hop": h, "t": t}) + "\n" for r, h, t in rows)


def from_env(service: str) -> HopTrace | None:
    directory = os.environ.get("INFERNO_HOP_TRACE", "")
    if not directory:
        return None
    os.makedirs(directory, exist_ok=True)
    return HopTrace(os.path.join(directory, f"{service}-{os.getpid()}.jsonl"))


# One per process: the services call TRACE.mark only `if TRACE is not None`.
TRACE: HopTrace | None = None


def enable(service: str) -> None:
    global TRACE
    TRACE = from_env(service)
