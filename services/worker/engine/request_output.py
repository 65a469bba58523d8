"""What one step produced for one request, as an object (the rare rows: ends, logprobs, hand-offs)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from services.worker.engine.kv_export import Handoff


@dataclass(slots=True)
class RequestOutput:
    """What one step produced for one request: new tokens (0 or 1), and the end if it came."""

    request_id: str
    new_token_ids: list[int]
    num_prompt_tokens: int
    num_cached_tokens: int
    num_output_tokens: int
    finish_reason: str | None = None  # stop | length | abort | error
    stop_token_id: int | None = None
    error: str | None = None
    logprobs: list[float] | None = None
    top_logprobs: list[list[tuple[int, float]]] | None = None
    handoff: Handoff | None = None  # the request stops here; its KV goes to a decode worker
    drafted_tokens: int = 0  # at its end: draft tokens checked over its life, and those confirmed
    accepted_tokens: int = 0

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None
