"""One generation request inside the engine: its tokens, progress, KV blocks and status."""

from __future__ import annotations

import enum
from dataclasses import dataclass, field
from typing import Any

from shared.sampling_params import SamplingParams


class RequestStatus(enum.Enum):
    WAITING = "waiting"
    RUNNING = "running"
    PREEMPTED = "preempted"
    FINISHED_STOPPED = "stop"
    FINISHED_LENGTH = "length"
    FINISHED_ABORTED = "abort"
    FINISHED_ERROR = "error"
    # Done here after its first token: a decode worker continues it (prefill/decode disaggregation).
    HANDED_OFF = "handoff"

    @property
    def finished(self) -> bool:
        return self in FINISHED


FINISHED = frozenset({RequestStatus.FINISHED_STOPPED, RequestStatus.FINISHED_LENGTH,
                      RequestStatus.FINISHED_ABORTED, RequestStatus.FINISHED_ERROR, RequestStatus.HANDED_OFF})


@dataclass(slots=True, eq=False)
class Request:
    """Every token the request knows (prompt + output) and how many of them have KV computed.

    The batcher's one rule: each step, num_computed_tokens catches up with len(all_token_ids)
    as far as the token budget allows. That covers prefill, chunked prefill, prefix hits,
    decode and recompute after preemption alike.

    With overlapped steps a step is scheduled before the one in flight has returned its
    tokens: `num_inflight_tokens` are scheduled but not yet done, and `num_pending_tokens` are
    being sampled on the device and not yet in all_token_ids. Both are 0 between steps when
    steps do not overlap.
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
    table_row: int = -1  # its row of the block manager's BlockTables while it holds blocks
    block_hashes: list[bytes] = field(default_factory=list)  # of full blocks, computed lazily
    status: RequestStatus = RequestStatus.WAITING
    num_preemptions: int = 0
    seed: int = 0  # resolved seed: the user's, or one drawn at admission
    error: str | None = None
    num_inflight_tokens: int = 0
    num_pending_tokens: int = 0
    # Penalties read the output tokens' values, so this request's next step cannot be
    # scheduled before the step in flight has returned its token.
    needs_token_history: bool = False
    stop_ids: frozenset[int] = frozenset()  # the ids that stop it (stop_token_ids, and eos unless ignored)
    handoff: bool = False  # a prefill worker's request: stops after its first token, its KV moves on
    # len(all_token_ids) at which max_tokens is reached: one comparison per step on the hot path
    token_limit: int = 0
    # The sampler's logits processors: bias and penalties apply on every step; min_tokens only
    # while outputs < min_tokens_masked, which is 0 when there are no stop ids to hide (a
    # benchmark's ignore_eos + min_tokens must not cost a pass over the logits per step).
    processes_logits: bool = False
    min_tokens_masked: int = 0
    # Greedy, no logprobs, no logits processors: a step of only such rows draws with one argmax.
    plain: bool = True
    # Structured output (services/worker/grammar.py): masks each draw to what the grammar allows.
    matcher: Any = None
    # Drafts (drafts.py): the last draft_len of all_token_ids are proposed tokens, not yet drawn
    # (the grammar's forced ones: jump_forward; speculation's: speculates); the next step computes
    # them and checks each against the model's own draw.
    jump_forward: bool = False
    speculates: bool = False
    draft_len: int = 0
    draft_method: str = ""  # the current draft's: "jump_forward", "ngram", "draft_model" or "eagle3"
    # A drafting model's KV of this request (model_drafter.py): positions it computed, the last
    # draft_kv_tail of them from its own drafted tokens (valid as far as the draws confirmed them).
    draft_kv_len: int = 0
    draft_kv_tail: list[int] = field(default_factory=list)
    draft_inputs: list = field(default_factory=list)  # an EAGLE-3 head's: (position, target states) kept
    drafted_tokens: int = 0  # over its life: draft tokens checked, and those the draws confirmed
    accepted_tokens: int = 0
    num_prompt_tokens: int = field(init=False, default=0)  # a field, not a property: read per row per step

    def __post_init__(self) -> None:
        if not self.all_token_ids:
            self.all_token_ids = list(self.prompt_token_ids)
        p = self.sampling_params
        self.num_prompt_tokens = len(self.prompt_token_ids)
        self.token_limit = len(self.prompt_token_ids) + p.max_tokens
        self.stop_ids = frozenset(p.stop_token_ids) | (frozenset() if p.ignore_eos else frozenset(self.eos_token_ids))
        self.needs_token_history = (p.repetition_penalty != 1.0 or bool(p.presence_penalty)
                                    or bool(p.frequency_penalty))
        self.processes_logits = bool(p.logit_bias) or self.needs_token_history
        self.min_tokens_masked = p.min_tokens if self.stop_ids else 0
        self.plain = (p.temperature == 0.0 and p.logprobs is None and not self.processes_logits
                      and not self.min_tokens_masked)

    @property
    def num_tokens(self) -> int:
        return len(self.all_token_ids)

    @property
    def num_output_tokens(self) -> int:
        return len(self.all_token_ids) - len(self.prompt_token_ids)

    @property
    def next_output_index(self) -> int:
        """Index among the outputs of the token the latest scheduled step samples (the seeded
        draw's counter, so a seed gives the same tokens whether steps overlap or not)."""
        return self.num_output_tokens + self.num_pending_tokens - 1

    @property
    def output_token_ids(self) -> list[int]:
        return self.all_token_ids[len(self.prompt_token_ids):]
