"""A worker's prompt tokens a second, learnt from its own steps (the heartbeat's prefill_tokens_per_s).

The scheduler weighs a prompt's remote prefill (the prefill worker's queue and rate, then the
hand-off) against its decode worker's own (that worker's queue and its rate in chunks beside its
decodes): services/scheduler/disagg.py. A step's prompt tokens are its computed tokens less one per
row (a decode's), over the seconds since the step before it ended (StepLoop): with overlapped steps
a step call's own seconds are only what was left of the GPU's work. Rates from those looked optimistic
for the decode worker: a 2,986-token prompt kept local took 279 ms against 172 remote (two H200s,
2026-11-29); the step-to-step rate is not yet measured on a GPU.
"""

from __future__ import annotations

MIN_TOKENS = 128  # a step with fewer prompt tokens (decodes, a prompt's short tail) says little of the rate
WEIGHT = 0.2  # of the newest step in the running mean


class PrefillRate:
    """Written by the step thread, read by the heartbeat (one float)."""

    __slots__ = ("rate",)

    def __init__(self) -> None:
        self.rate = 0.0  # 0: no prompt computed yet

    def add(self, prompt_tokens: int, seconds: float) -> None:
        if prompt_tokens < MIN_TOKENS or seconds <= 0:
            return
        sample = prompt_tokens / seconds
        self.rate = sample if self.rate == 0.0 else self.rate + WEIGHT * (sample - self.rate)
