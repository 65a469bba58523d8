"""Admission control: which live workers may take a request, or the HTTP error that refuses it."""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass

from services.scheduler.registry import WorkerState
from shared.logging import get_logger
from shared.messages import RouteReply, WorkerHeartbeat

log = get_logger(__name__)

# Roles that serve a request to its end: a decode worker also prefills the prompts too short to be
# worth a remote prefill. Prefill workers are chosen beside one of these (services/scheduler/disagg.py).
SERVING_ROLES = ("mixed", "decode")


@dataclass(slots=True, frozen=True)
class Rejection:
    """A refused request: the HTTP status and OpenAI error type the gateway answers with."""

    status: int
    error_type: str
    message: str
    retry_after: float = 0.0

    def to_reply(self) -> RouteReply:
        return RouteReply.rejected(self.status, self.error_type, self.message, self.retry_after)


def admit(live: Iterable[WorkerState], model: str, num_prompt_tokens: int, max_waiting: int,
          retry_after: float) -> list[WorkerState] | Rejection:
    """The workers that may take this request now, or why none may.

    503 when no worker is live or none of the model is serving (loading it, unloading it, draining,
    or only prefill workers) or in standby (services/worker/model_host.py: the request waits there
    while the model is brought back to the GPU); 404 when no live worker serves the model at all; 400 when the prompt
    does not fit any serving worker's context; 429 when every one that fits has max_waiting requests
    queued. A worker with no model (waiting to be told which to load) counts as none at all.
    """
    live = [w for w in live if w.heartbeat.state != "no_model"]
    if not live:
        return Rejection(503, "service_unavailable", "no worker is available", retry_after)
    of_model = [w for w in live if w.model == model]
    if not of_model:
        return Rejection(404, "model_not_found", f"The model `{model}` does not exist.")
    serving = [w for w in of_model if w.role in SERVING_ROLES and w.accepts_work]
    if not serving:  # a model in standby takes the request, which waits there while the model loads
        serving = [w for w in of_model if w.role in SERVING_ROLES and w.heartbeat.state == "standby"
                   and not w.heartbeat.draining]
    if not serving:
        return Rejection(503, "service_unavailable", "no worker is available", retry_after)
    # Both sides count a prompt that leaves no room for one new token as too long.
    fits = [w for w in serving if not w.heartbeat.max_model_len or num_prompt_tokens < w.heartbeat.max_model_len]
    if not fits:
        limit = max(w.heartbeat.max_model_len for w in serving)
        return Rejection(400, "invalid_request_error",
                         f"The prompt has {num_prompt_tokens} tokens, more than this model's context of "
                         f"{limit} tokens allows.")
    open_ = [w for w in fits if w.num_waiting < max_waiting]
    if not open_:
        return Rejection(429, "rate_limit_exceeded",
                         f"Every worker has {max_waiting} or more requests waiting; retry later.", retry_after)
    return open_


class QueueWait:
    """How long a request would wait in a worker's queue before its prefill starts: the prompt tokens
    queued ahead of it (the worker's last report plus what was routed to it since) over the rate at
    which that worker drains its queue.

    The rate starts at the configured tokens/s and is learnt from heartbeats: over a window in which
    the queue never emptied (tokens queued at every report), the worker was busy the whole time, so
    the tokens that left the queue over the seconds that passed is its drain rate (decode load
    included: a full batch drains the queue only as fast as requests finish). Windows in which the
    queue emptied say nothing about capacity and teach nothing. The rate admission counts on is the
    running mean less the running mean deviation of the samples (as TCP's retransmit timer counts on
    the mean round trip plus its deviation): a worker whose drain is lumpy (few long requests per
    batch, or a CPU shared with others) is given a margin. Seconds are the worker's own
    timestamps, and a window spans at least MIN_WINDOW: heartbeats can arrive bunched, and a few
    milliseconds between two receipts would make a wild sample.
    """

    LEARNING_WEIGHT = 0.3  # of the newest sample in the running average
    MIN_WINDOW = 0.5  # seconds of the worker's clock per sample

    def __init__(self, tokens_per_second: float):
        self.default_rate = tokens_per_second
        self.rates: dict[str, float] = {}  # learnt mean, by worker id
        self.deviations: dict[str, float] = {}  # learnt mean deviation from it, by worker id
        # worker id → the window being measured: (tokens queued at its start, its start on the
        # worker's clock, tokens routed since, the last heartbeat's seq)
        self._window: dict[str, tuple[int, float, int, int]] = {}

    def observe(self, before: WorkerState | None, hb: WorkerHeartbeat, now: float) -> None:
        """A heartbeat arrived (`before`: the worker's state until now, with the tokens routed since)."""
        window = self._window.get(hb.worker_id)
        fresh = (hb.queued_prefill_tokens, hb.timestamp, 0, hb.seq)
        if window is None or before is None or hb.seq <= window[3] or hb.queued_prefill_tokens <= 0:
            self._window[hb.worker_id] = fresh  # a new worker, a restarted one, or an emptied queue
            return
        queued, start, routed, _ = window
        routed += before.routed_tokens
        dt = hb.timestamp - start
        if queued <= 0 or dt < self.MIN_WINDOW:
            self._window[hb.worker_id] = (queued, start, routed, hb.seq) if queued > 0 else fresh
            return
        self._window[hb.worker_id] = fresh
        drained = queued + routed - hb.queued_prefill_tokens
        if drained <= 0:
            return
        sample = drained / dt
        old = self.rates.get(hb.worker_id)
        w = self.LEARNING_WEIGHT
        if old is None:
            self.rates[hb.worker_id], self.deviations[hb.worker_id] = sample, sample / 2
        else:
            dev = self.deviations[hb.worker_id]
            self.deviations[hb.worker_id] = dev + w * (abs(sample - old) - dev)
            self.rates[hb.worker_id] = old + w * (sample - old)
        log.debug("drain_rate_learnt", worker_id=hb.worker_id, sample=round(sample),
                  rate=round(self.rates[hb.worker_id]), deviation=round(self.deviations[hb.worker_id]),
                  queued=hb.queued_prefill_tokens, seconds=round(dt, 3))

    def forget(self, worker_id: str) -> None:
        self.rates.pop(worker_id, None)
        self.deviations.pop(worker_id, None)
        self._window.pop(worker_id, None)

    def rate(self, worker_id: str) -> float:
        """Tokens per second admission counts on: the learnt mean less its deviation (at least a quarter
        of the mean), or the configured rate until something is learnt."""
        mean = self.rates.get(worker_id)
        if mean is None:
            return self.default_rate
        return max(mean - self.deviations[worker_id], mean / 4)

    def seconds(self, w: WorkerState, num_prompt_tokens: int = 0) -> float:
        """Until the first token of a request of `num_prompt_tokens`: the queue ahead, then its own prompt."""
        return (w.heartbeat.queued_prefill_tokens + w.routed_tokens + num_prompt_tokens) / self.rate(w.worker_id)


def within_wait(open_: list[WorkerState], wait: QueueWait, max_seconds: float, retry_after: float,
                num_prompt_tokens: int = 0) -> list[WorkerState] | Rejection:
    """The admitted workers on which the request's estimated time to its first token (the queue ahead
    and its own prompt) is within `max_seconds` (0: no bound), or a 429 when none is: shedding now, in
    the scheduler, is cheaper than a request that waits past its deadline (or its caller's patience)
    in a worker's queue."""
    if max_seconds <= 0:
        return open_
    waits = [wait.seconds(w, num_prompt_tokens) for w in open_]
    fits = [w for w, s in zip(open_, waits) if s <= max_seconds]
    if fits:
        return fits
    least = min(waits)
    return Rejection(429, "rate_limit_exceeded",
                     f"The estimated queueing time ({least:.1f} s) exceeds the server's bound of {max_seconds:g} s; "
                     "retry later.", max(retry_after, least - max_seconds))
