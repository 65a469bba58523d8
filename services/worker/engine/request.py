"""One generation request inside the engine: its tokens, progress, KV blocks and status."""

from __future__ import annotations

import enum
from dataclasses import dataclass, field

from shared.sampling_params import SamplingParams


class RequestStatus(enum.Enum):
    WAITING = "waiting"
    RUNNING = "running"
    PREEMPTED = "preempted"
    FINISHED_STOPPED = "stop"
    FINISHED_LENGTH = "length"
    FINISHED_ABORTED = "abort"
    FINISHED_ERROR = "error"

    @property
    def finished(self) -> bool:
        return self.value in ("stop", "length", "abort", "error")


@dataclass(slots=True, eq=False)
class Request:
    """Every token the request knows (prompt + output) and how many of them have KV computed.

    The batcher's one rule: each step, num_computed_tokens catches up with len(all_token_ids)
    as far as the token budget allows. That covers prefill, chunked prefill, prefix hits,
    decode and recompute after preemption alike.
    """

    request_id: str
    prompt_token_ids: list[int]
    sampling_params: SamplingParams
    eos_token_ids: tuple[int, ...] = ()
    arrival_time: float = 0.0
    cache_salt: bytes = b""  # tenant salt, folded into the block hashes
    all_token_ids: list[int] = field(default_factory=list)
    num_computed_tokens: int = 0
    num_cached_tokens: int = 0  # prompt tokens served from the prefix cache at first admission
    block_ids: list[int] = field(default_factory=list)
    block_hashes: list[bytes] = field(default_factory=list)  # of full blocks, computed lazily
    status: RequestStatus = RequestStatus.WAITING
    num_preemptions: int = 0
    seed: int = 0  # resolved seed: the user's, or one drawn at admission
    error: str | None = None

    def __post_init__(self) -> None:
        if not self.all_token_ids:
            self.all_token_ids = list(self.prompt_token_ids)

    @property
    def num_prompt_tokens(self) -> int:
        return len(self.prompt_token_ids)

    @property
    def num_tokens(self) -> int:
        return len(self.all_token_ids)

    @property
    def num_output_tokens(self) -> int:
        return len(self.all_token_ids) - len(self.prompt_token_ids)

    @property
    def output_token_ids(self) -> list[int]:
        return self.all_token_ids[len(self.prompt_token_ids):]
