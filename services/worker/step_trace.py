"""Per-step timings for a benchmark's post-mortem: where a run's seconds went, step by step.

`INFERNO_STEP_TRACE=PATH` makes the step thread append one JSON line per engine step: the wall
clock when the step returned (comparable with a load generator's clock on the same host), the
seconds the call took, the tokens the finished step computed, its rows and the requests running,
and for structured outputs the seconds the step's grammar masks took to fill on the host and the
GPU sat idle waiting for them (grammar_mask.py). Off by default; the cost when on is a tuple per step and a file write every few hundred steps.
"""

from __future__ import annotations

import json
import os
import time

FLUSH_EVERY = 256


class StepTrace:
    def __init__(self, path: str):
        self.path = path
        self._rows: list[tuple] = []

    @classmethod
    def from_env(cls) -> StepTrace | None:
        path = os.environ.get("INFERNO_STEP_TRACE", "")
        return cls(path) if path else None

    def record(self, seconds: float, tokens: int, rows: int, running: int, mask_fill: float = 0.0,
               mask_wait: float = 0.0) -> None:
        self._rows.append((time.time(), seconds, tokens, rows, running, mask_fill, mask_wait))
        if len(self._rows) >= FLUSH_EVERY:
            self.flush()

    def flush(self) -> None:
        if not self._rows:
            return
        keys = ("t", "seconds", "tokens", "rows", "running", "mask_fill_s", "mask_wait_s")
        with open(self.path, "a") as f:
            f.writelines(json.dumps(dict(zip(keys, r))) + "\n" for r in self._rows)
        self._rows.clear()
