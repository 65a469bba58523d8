"""The typed messages on NATS, one class per subject (the codec and its rules are in shared/wire.py)."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field

from shared.config import WORKER_ROLES
from shared.errors import MessageError, service_error
from shared.sampling_params import SamplingParams
from shared.wire import BlockHash, Message, PackedIds, register, unpack_ids

FINISH_REASONS = ("stop", "length", "abort", "error")
MAX_ID_CHARS = 256


def _require(ok: bool, message: str) -> None:
    if not ok:
        raise MessageError(message)


@register
@dataclass(slots=True, frozen=True, kw_only=True)
class WireSamplingParams(Message):
    """SamplingParams as carried inside a GenerateRequest (every field is required)."""

    TYPE = "sampling_params"
    VERSION = 1

    temperature: float
    top_k: int
    top_p: float
    min_p: float
    repetition_penalty: float
    presence_penalty: float
    frequency_penalty: float
    logit_bias: dict[int, float]
    seed: int | None
    max_tokens: int
    min_tokens: int
    stop_token_ids: list[int]
    ignore_eos: bool
    logprobs: int | None

    @classmethod
    def from_params(cls, p: SamplingParams) -> WireSamplingParams:
        return cls(**{f.name: getattr(p, f.name) for f in dataclasses.fields(cls)})

    def to_params(self) -> SamplingParams:
        """A fresh SamplingParams (not validated: the receiver calls .validate(vocab_size))."""
        kwargs = {f.name: getattr(self, f.name) for f in dataclasses.fields(self)}
        kwargs["logit_bias"] = dict(self.logit_bias)
        kwargs["stop_token_ids"] = list(self.stop_token_ids)
        return SamplingParams(**kwargs)


@register
@dataclass(slots=True, frozen=True, kw_only=True)
class GenerateRequest(Message):
    """gateway → scheduler (request/reply on generate_subject), then scheduler → worker."""

    TYPE = "generate_request"
    VERSION = 1

    request_id: str
    model: str
    prompt_ids: PackedIds  # pack_ids(prompt token ids)
    sampling: WireSamplingParams
    reply_to: str  # the gateway's token inbox subject
    session_id: str | None = None  # x-session-affinity
    cache_salt: str = ""  # tenant salt, folded into the block hashes
    arrival_time: float = 0.0  # wall-clock seconds at the gateway
    gateway_id: str = ""
    worker_id: str = ""  # set by the scheduler when forwarding; "" from the gateway

    @property
    def prompt_token_ids(self) -> list[int]:
        return unpack_ids(self.prompt_ids)

    @property
    def num_prompt_tokens(self) -> int:
        return len(self.prompt_ids) // 4

    def forwarded_to(self, worker_id: str) -> GenerateRequest:
        return dataclasses.replace(self, worker_id=worker_id)

    def _check(self) -> None:
        _require(0 < len(self.request_id) <= MAX_ID_CHARS, "request_id must be 1..256 characters")
        _require(len(self.prompt_ids) >= 4, "prompt_ids must hold at least one token")
        _require(bool(self.reply_to), "reply_to must not be empty")


@register
@dataclass(slots=True, frozen=True, kw_only=True)
class RouteReply(Message):
    """scheduler → gateway: the reply to a GenerateRequest on the generate subject."""

    TYPE = "route_reply"
    VERSION = 1

    ok: bool
    worker_id: str = ""
    error_status: int = 0  # 0 when ok; else the HTTP status for the client (429, 503, 400)
    error_type: str = ""
    error_message: str = ""
    retry_after: float = 0.0  # seconds, for 429/503

    @classmethod
    def accepted(cls, worker_id: str) -> RouteReply:
        return cls(ok=True, worker_id=worker_id)

    @classmethod
    def rejected(cls, status: int, error_type: str, message: str, retry_after: float = 0.0) -> RouteReply:
        return cls(ok=False, error_status=status, error_type=error_type, error_message=message,
                   retry_after=retry_after)

    def raise_for_error(self) -> None:
        """Raise the ServiceError (ServiceUnavailable, Overloaded, BadRequest, ...) this reply reports."""
        if not self.ok:
            raise service_error(self.error_status, self.error_type, self.error_message,
                                self.retry_after or None)

    def _check(self) -> None:
        if self.ok:
            _require(self.error_status == 0 and bool(self.worker_id),
                     "an ok reply names its worker and has error_status 0")
        else:
            _require(400 <= self.error_status <= 599, "a refusal carries an HTTP error status")
        _require(self.retry_after >= 0.0, "retry_after must not be negative")


@register
@dataclass(slots=True, frozen=True, kw_only=True)
class AbortRequest(Message):
    """gateway → worker (worker_abort subject): stop these requests and free their blocks."""

    TYPE = "abort_request"
    VERSION = 1

    request_ids: list[str]
    reason: str = ""


@register
@dataclass(slots=True, frozen=True, kw_only=True)
class TokenDelta(Message):
    """New tokens of one request since the last step; the last delta has a finish_reason.

    Top logprobs are two parallel arrays per new token: top_ids[i] = pack_ids(alternative ids),
    top_lps[i] = their logprobs, in the same order.
    """

    TYPE = "token_delta"
    VERSION = 1

    request_id: str
    token_ids: PackedIds = b""
    logprobs: list[float] | None = None  # one per new token
    top_ids: list[PackedIds] | None = None
    top_lps: list[list[float]] | None = None
    finish_reason: str | None = None  # "stop" | "length" | "abort" | "error"
    error: str | None = None
    prompt_tokens: int = 0
    cached_tokens: int = 0
    completion_tokens: int = 0  # total so far, including these
    stop_token_id: int | None = None  # the eos/stop token that finished the request, if one did

    @property
    def token_id_list(self) -> list[int]:
        return unpack_ids(self.token_ids)

    @property
    def num_tokens(self) -> int:
        return len(self.token_ids) // 4

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None

    def _check(self) -> None:
        if self.finish_reason is not None and self.finish_reason not in FINISH_REASONS:
            raise MessageError(f"finish_reason must be one of {FINISH_REASONS}")
        if self.logprobs is not None or self.top_ids is not None or self.top_lps is not None:
            self._check_logprobs()
        if self.prompt_tokens < 0 or self.cached_tokens < 0 or self.completion_tokens < 0:
            raise MessageError("token counts must not be negative")

    def _check_logprobs(self) -> None:
        n = len(self.token_ids) // 4
        _require(self.logprobs is None or len(self.logprobs) == n, "logprobs needs one entry per token")
        _require((self.top_ids is None) == (self.top_lps is None), "top_ids and top_lps come together")
        if self.top_ids is not None and self.top_lps is not None:
            _require(len(self.top_ids) == n and len(self.top_lps) == n, "top logprobs need one entry per token")
            for ids, lps in zip(self.top_ids, self.top_lps):
                _require(len(ids) // 4 == len(lps), "top_ids and top_lps entries must have equal lengths")


@register
@dataclass(slots=True, frozen=True, kw_only=True)
class TokenBatch(Message):
    """worker → gateway inbox: every delta for that gateway's requests from one step."""

    TYPE = "token_batch"
    VERSION = 1

    worker_id: str
    items: list[TokenDelta]


@register
@dataclass(slots=True, frozen=True, kw_only=True)
class WorkerHeartbeat(Message):
    """worker → heartbeat subject, about once a second: identity, readiness and load."""

    TYPE = "worker_heartbeat"
    VERSION = 1

    worker_id: str
    role: str  # "mixed" | "prefill" | "decode"
    model: str
    ready: bool
    draining: bool
    generate_subject: str
    abort_subject: str
    timestamp: float  # wall-clock seconds at the worker
    seq: int  # increases by one per heartbeat of this worker process
    num_running: int = 0
    num_waiting: int = 0
    queued_prefill_tokens: int = 0
    active_decode_tokens: int = 0
    kv_usage: float = 0.0  # fraction of KV blocks in use, 0..1
    num_free_blocks: int = 0
    num_total_blocks: int = 0
    block_size: int = 16
    prefix_cache_hits: int = 0  # tokens, cumulative
    prefix_cache_queries: int = 0  # tokens, cumulative
    max_model_len: int = 0

    def _check(self) -> None:
        _require(bool(self.worker_id), "worker_id must not be empty")
        _require(self.role in WORKER_ROLES, f"role must be one of {WORKER_ROLES}")
        _require(0.0 <= self.kv_usage <= 1.0, "kv_usage must be in [0, 1]")
        _require(self.block_size > 0, "block_size must be positive")


@register
@dataclass(slots=True, frozen=True, kw_only=True)
class KvEvents(Message):
    """worker → kv_events subject: prefix-cache blocks stored and evicted since the last report."""

    TYPE = "kv_events"
    VERSION = 1

    worker_id: str
    seq: int  # increases by one per report, so a reader can detect a gap and resync
    stored: list[BlockHash] = field(default_factory=list)
    removed: list[BlockHash] = field(default_factory=list)
    cleared: bool = False  # the worker dropped its whole prefix cache (applied before stored/removed)
