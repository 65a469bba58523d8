"""The typed messages on NATS, one class per subject (the codec and its rules are in shared/wire.py)."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from itertools import accumulate

from shared.admin_messages import MODEL_STATES
from shared.config import WORKER_ROLES
from shared.errors import MessageError, service_error
from shared.sampling_params import SamplingParams
from shared.wire import BlockHash, Message, PackedIds, pack_ids, register, unpack_ids

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
    grammar_kind: str = ""
    grammar: str = ""
    speculative: bool = True

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
    # Set by the scheduler when worker_id is a prefill worker: it hands the request to this one.
    decode_worker_id: str = ""
    # Tokens of the prompt's prefix the cluster kvstore holds, by the scheduler's index of it; the
    # worker asks the store only when this passes its own prefix hit. -1: unknown (ask).
    store_cached_tokens: int = -1

    @property
    def prompt_token_ids(self) -> list[int]:
        return unpack_ids(self.prompt_ids)

    @property
    def num_prompt_tokens(self) -> int:
        return len(self.prompt_ids) // 4

    def forwarded_to(self, worker_id: str, decode_worker_id: str = "", store_cached_tokens: int = -1) -> GenerateRequest:
        return dataclasses.replace(self, worker_id=worker_id, decode_worker_id=decode_worker_id,
                                   store_cached_tokens=store_cached_tokens)

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
    error_param: str | None = None  # an "error" the request's own input caused: the field at fault (a 400)
    drafted_tokens: int = 0  # with the finish: its drafts' tokens over its life (Finish's)
    accepted_tokens: int = 0

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


class Delta:
    """One request's part of a TokenBatch, as the gateway reads it: TokenDelta's fields on a
    plain slotted object (a frozen dataclass costs several times more to build per token)."""

    __slots__ = ("request_id", "token_ids", "logprobs", "top_ids", "top_lps", "finish_reason", "error",
                 "prompt_tokens", "cached_tokens", "completion_tokens", "stop_token_id", "error_param",
                 "drafted_tokens", "accepted_tokens")

    def __init__(self, request_id, token_ids, prompt_tokens, cached_tokens, completion_tokens):
        self.request_id = request_id
        self.token_ids = token_ids
        self.prompt_tokens = prompt_tokens
        self.cached_tokens = cached_tokens
        self.completion_tokens = completion_tokens
        self.logprobs = self.top_ids = self.top_lps = None
        self.finish_reason = self.error = self.stop_token_id = self.error_param = None
        self.drafted_tokens = self.accepted_tokens = 0

    @property
    def token_id_list(self) -> list[int]:
        return unpack_ids(self.token_ids)

    @property
    def num_tokens(self) -> int:
        return len(self.token_ids) // 4

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None


@register
@dataclass(slots=True, frozen=True, kw_only=True)
class Finish(Message):
    """The end of one request inside a TokenBatch (index into its columns)."""

    TYPE = "finish"
    VERSION = 1

    index: int
    reason: str  # "stop" | "length" | "abort" | "error"
    error: str | None = None
    stop_token_id: int | None = None
    param: str | None = None  # the request's own input failed: a 400 naming this field
    # Its drafts (speculation, jump-forward) over its life: tokens checked, and those confirmed.
    drafted_tokens: int = 0
    accepted_tokens: int = 0

    def _check(self) -> None:
        _require(self.reason in FINISH_REASONS, f"reason must be one of {FINISH_REASONS}")


@register
@dataclass(slots=True, frozen=True, kw_only=True)
class TokenLogprobs(Message):
    """Logprobs of one request's new tokens inside a TokenBatch (top_* as in TokenDelta)."""

    TYPE = "token_logprobs"
    VERSION = 1

    index: int
    logprobs: list[float]
    top_ids: list[PackedIds] | None = None
    top_lps: list[list[float]] | None = None


@register
@dataclass(slots=True, frozen=True, kw_only=True)
class TokenBatch(Message):
    """worker → gateway inbox: every new token for that gateway's requests from one step.

    Columnar: request i has token_counts[i] new tokens, which follow request i-1's in token_ids;
    the per-request counters are packed int32 columns; ends and logprobs are sparse lists. One
    map per step instead of one per token keeps both ends cheap (a few µs per token matter here).
    """

    TYPE = "token_batch"
    VERSION = 2

    worker_id: str
    request_ids: list[str]
    token_counts: PackedIds
    token_ids: PackedIds
    prompt_tokens: PackedIds
    cached_tokens: PackedIds
    completion_tokens: PackedIds
    finishes: list[Finish] = field(default_factory=list)
    logprobs: list[TokenLogprobs] = field(default_factory=list)

    @classmethod
    def of(cls, worker_id: str, items: list[TokenDelta]) -> TokenBatch:
        """A batch from per-request deltas (tests, peers, rare paths; the worker builds columns)."""
        finishes = [Finish(index=i, reason=d.finish_reason, error=d.error, stop_token_id=d.stop_token_id,
                           drafted_tokens=d.drafted_tokens, accepted_tokens=d.accepted_tokens)
                    for i, d in enumerate(items) if d.finish_reason is not None]
        logprobs = [TokenLogprobs(index=i, logprobs=d.logprobs, top_ids=d.top_ids, top_lps=d.top_lps)
                    for i, d in enumerate(items) if d.logprobs is not None]
        return cls(worker_id=worker_id, request_ids=[d.request_id for d in items],
                   token_counts=pack_ids([len(d.token_ids) // 4 for d in items]),
                   token_ids=b"".join(d.token_ids for d in items),
                   prompt_tokens=pack_ids([d.prompt_tokens for d in items]),
                   cached_tokens=pack_ids([d.cached_tokens for d in items]),
                   completion_tokens=pack_ids([d.completion_tokens for d in items]),
                   finishes=finishes, logprobs=logprobs)

    def special_rows(self) -> set[int]:
        """Rows that end their request or carry logprobs (the few that need more than a token)."""
        if not self.finishes and not self.logprobs:
            return set()
        return {f.index for f in self.finishes} | {lp.index for lp in self.logprobs}

    def deltas(self, rows) -> list[Delta]:
        """The Deltas of these rows (ascending indices), ends and logprobs attached."""
        counts = unpack_ids(self.token_counts)
        starts = list(accumulate(counts, initial=0))
        prompt, cached, done = (unpack_ids(self.prompt_tokens), unpack_ids(self.cached_tokens),
                                unpack_ids(self.completion_tokens))
        ids, rids = self.token_ids, self.request_ids
        out = {i: Delta(rids[i], ids[4 * starts[i]:4 * starts[i + 1]], prompt[i], cached[i], done[i]) for i in rows}
        for f in self.finishes:
            d = out.get(f.index)
            if d is not None:
                d.finish_reason, d.error, d.stop_token_id, d.error_param = f.reason, f.error, f.stop_token_id, f.param
                d.drafted_tokens, d.accepted_tokens = f.drafted_tokens, f.accepted_tokens
        for lp in self.logprobs:
            d = out.get(lp.index)
            if d is not None:
                d.logprobs, d.top_ids, d.top_lps = lp.logprobs, lp.top_ids, lp.top_lps
        return list(out.values())

    @property
    def items(self) -> list[Delta]:
        return self.deltas(range(len(self.request_ids)))

    def _check(self) -> None:
        n = len(self.request_ids)
        for name in ("token_counts", "prompt_tokens", "cached_tokens", "completion_tokens"):
            _require(len(getattr(self, name)) == 4 * n, f"{name} needs one entry per request")
        counts = unpack_ids(self.token_counts)
        _require(min(counts, default=0) >= 0, "token_counts must not be negative")
        _require(4 * sum(counts) == len(self.token_ids), "token_ids must hold sum(token_counts) ids")
        for f in self.finishes:
            _require(0 <= f.index < n, "a finish index is outside the batch")
        for lp in self.logprobs:
            _require(0 <= lp.index < n, "a logprobs index is outside the batch")
            k = counts[lp.index]
            _require(len(lp.logprobs) == k, "logprobs needs one entry per token")
            _require((lp.top_ids is None) == (lp.top_lps is None), "top_ids and top_lps come together")
            if lp.top_ids is not None:
                _require(len(lp.top_ids) == k and len(lp.top_lps) == k, "top logprobs need one entry per token")


@register
@dataclass(slots=True, frozen=True, kw_only=True)
class GatewayHeartbeat(Message):
    """gateway → gateway_heartbeat subject, every second: the inbox its requests' tokens go to. A
    worker that stops hearing one ends those requests (no one reads their tokens any more)."""

    TYPE = "gateway_heartbeat"
    VERSION = 1

    gateway_id: str
    inbox: str
    in_flight: int = 0


@register
@dataclass(slots=True, frozen=True, kw_only=True)
class WorkerHeartbeat(Message):
    """worker → heartbeat subject, about once a second and at once when its state changes:
    identity, readiness, the model it serves and its load."""

    TYPE = "worker_heartbeat"
    VERSION = 1

    worker_id: str
    role: str  # "mixed" | "prefill" | "decode"
    model: str  # the served id; "" with no model
    ready: bool  # takes new requests: state "ready" and not draining
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
    kv_handoffs: int = 0  # cumulative: requests handed on (prefill role) or taken over (decode role)
    kv_handoff_bytes: int = 0  # cumulative page bytes of those hand-offs
    kv_handoffs_direct: int = 0  # of kv_handoffs: pushed to blocks reserved at prepare, no offer round trip
    kv_handoffs_ipc: int = 0  # of kv_handoffs: copied over CUDA IPC (one host), not sent over UCXX
    kv_handoffs_pushed: int = 0  # of kv_handoffs_ipc: written into the decode worker's slot by the prefill worker
    kv_handoffs_staged: int = 0  # of kv_handoffs: sent through host buffers (services/worker/host_staging.py)
    # Failed hand-offs whose requests the decode worker computed from the prompt and first token instead
    # (services/worker/handoff.py): asked for and taken (prefill role), taken (decode role). Not in kv_handoffs.
    kv_handoffs_recomputed: int = 0
    kv_handoff_p50_ms: float = 0.0  # a prefill worker's latest hand-offs (up to 256): their median time
    state: str = "ready"  # MODEL_STATES: no_model | loading | ready | unloading | standby
    # A worker process holding several models answers for each as a worker of its own (a model slot,
    # services/worker/model_host.py): `host` is that process's worker id ("" = this one alone), and
    # `model_dir` where its model came from (a gateway reads the tokenizer of a model added later there).
    host: str = ""
    model_dir: str = ""
    memory_share: float = 0.0  # the GPU's fraction this model holds when on it (0: the whole budget)
    # Seconds to fetch a prefix from the cluster kvstore per second to prefill it on this worker (a
    # typical one, 256 tokens): the scheduler counts the store's pages as cached here in proportion
    # to what a fetch saves (none at 1 or more). -1: this worker does not use a store.
    store_fetch_cost: float = -1.0
    # Drafts, cumulative (the worker's --speculative-config, --jump-forward), by method ("jump_forward",
    # "ngram"): [drafts checked (a request's in a step), drafted tokens, those the draws confirmed].
    spec_by_method: dict[str, list[int]] = field(default_factory=dict)
    # A mixture-of-experts model: tokens its routers sent to each expert, cumulative, summed over the
    # layers; expert_ranks > 1 under expert parallelism, where expert e lives on GPU e * ranks // experts.
    expert_tokens: list[int] = field(default_factory=list)
    expert_ranks: int = 1
    # What it runs on (`inferno top`, `inferno up`'s table): "cpu", or "cuda:0 NVIDIA H200" (tp ranks
    # beyond the first: "+N"), the weights' dtype, the decode graphs captured.
    device: str = ""
    dtype: str = ""
    graphs: int = 0
    # Cumulative, for rates: steps, their seconds on the step thread, tokens computed and produced.
    steps: int = 0
    busy_seconds: float = 0.0
    computed_tokens: int = 0
    output_tokens: int = 0
    # Prompt tokens a second over the recent steps that computed prompts (0: none yet), decodes beside
    # them included: the scheduler weighs a remote prefill against a decode worker's own with it.
    prefill_tokens_per_s: float = 0.0

    def _check(self) -> None:
        _require(bool(self.worker_id), "worker_id must not be empty")
        _require(self.role in WORKER_ROLES, f"role must be one of {WORKER_ROLES}")
        _require(self.state in MODEL_STATES, f"state must be one of {MODEL_STATES}")
        _require(not self.ready or self.state == "ready", "only a worker in state ready can be ready")
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


@register
@dataclass(slots=True, frozen=True, kw_only=True)
class KvSnapshot(Message):
    """worker → its keys of the KV snapshots bucket (JetStream): every prefix-cache block its KvEvents
    announced up to `seq`, in `parts` values (a NATS message holds 1 MB), so a scheduler that starts
    late (a replica, a restart) learns the whole cache instead of only what changes after it."""

    TYPE = "kv_snapshot"
    VERSION = 1

    worker_id: str
    seq: int  # the KvEvents seq this snapshot is current to
    part: int
    parts: int
    blocks: bytes  # 16-byte block hashes, concatenated
