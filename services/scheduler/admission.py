"""Admission control: which live workers may take a request, or the HTTP error that refuses it."""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass

from services.scheduler.registry import WorkerState
from shared.messages import RouteReply

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

    503 when no worker is live or none of the model is serving (not ready, draining, or only
    prefill workers); 404 when no live worker serves the model at all; 400 when the prompt does not fit any
    serving worker's context; 429 when every one that fits has max_waiting requests queued.
    """
    live = list(live)
    if not live:
        return Rejection(503, "service_unavailable", "no worker is available", retry_after)
    of_model = [w for w in live if w.model == model]
    if not of_model:
        return Rejection(404, "model_not_found", f"The model `{model}` does not exist.")
    serving = [w for w in of_model if w.role in SERVING_ROLES and w.accepts_work]
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
