"""The one request path behind every transport: body → model → spec → prompt tokens → routing → choices →
an answer (one JSON body, or chunks into the transport's sink). HTTP (app.py) and the NATS API
(nats_api.py) only read their requests into a Call and write what comes back."""

from __future__ import annotations

import asyncio
import math
import time
import uuid
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Callable

import structlog

from services.gateway.catalogue import ServedModel
from services.gateway.chat import ChatFormat
from services.gateway.completions import CompletionFormat
from services.gateway.errors import ApiError, invalid
from services.gateway.generation import Generation
from services.gateway.pump import Pump
from services.gateway.response_format import ResponseFormat
from services.gateway.schemas import (GenerationSpec, Limits, decode_body, is_unicode, parse_chat, parse_completion,
                                      resolve_max_tokens)
from services.gateway.streaming import ChunkFrame, ChunkSink, dumps
from services.gateway.tenants import Tenant
from services.gateway.token_router import StreamFailed
from shared.logging import get_logger

if TYPE_CHECKING:
    from services.gateway.gateway import Gateway

MAX_SESSION_ID_CHARS = 256

log = get_logger("gateway.serving")


@dataclass(frozen=True, slots=True)
class Endpoint:
    """A generation endpoint: how its body is read and how its answer is shaped."""

    parse: Callable[[Any, Limits], GenerationSpec]
    format: type[ResponseFormat]


CHAT = Endpoint(parse_chat, ChatFormat)
COMPLETIONS = Endpoint(parse_completion, CompletionFormat)


@dataclass(slots=True)
class Call:
    """One generation request as a transport received it; headers as given (checked here)."""

    body: bytes  # the JSON body, within the transport's size limit
    session: str | None = None  # x-session-affinity
    timeout: str | None = None  # x-timeout: the caller's deadline in seconds
    request_id: str | None = None  # x-request-id: the caller's own id, for the logs
    arrival: float = field(default_factory=time.monotonic)
    tenant: Tenant | None = None  # whose key authenticated it (None: the default tenant)
    # Set by generate(): the tenant's x-ratelimit-* as of this request's admission, for the answer.
    rate_headers: dict[str, str] = field(default_factory=dict)


async def generate(gw: Gateway, endpoint: Endpoint, call: Call,
                   open_stream: Callable[[], ChunkSink]) -> bytes | ChunkSink:
    """Serve one generation request: the JSON body of the answer, or (when the request streams)
    the sink that `open_stream` made, once the stream has ended. Errors before the answer begins
    raise ApiError; cancelling the task aborts the request on its workers."""
    tenant = call.tenant or gw.keys.default
    try:
        answer = await _generate(gw, endpoint, call, open_stream, tenant)
    except ApiError as e:
        gw.tenancy.count(tenant, e.status)
        raise
    return answer


async def _generate(gw: Gateway, endpoint: Endpoint, call: Call, open_stream: Callable[[], ChunkSink],
                    tenant: Tenant) -> bytes | ChunkSink:
    body = decode_body(call.body)
    model = gw.catalogue.of_body(body)  # the body is read against the limits of the model it names
    spec = endpoint.parse(body, model.limits)
    session = session_id(call.session)
    timeout = request_timeout(call.timeout, gw.cfg.request_timeout)
    prompt_ids = await gw.tokenize(spec, model)
    params = resolve_max_tokens(spec, len(prompt_ids), model.limits.max_model_len, gw.cfg.max_tokens_default)
    spec.cache_salt = gw.tenancy.cache_salt(tenant, spec.cache_salt)
    # Counted as OpenAI counts: the prompt plus the most every choice may generate.
    limiter = gw.tenancy.admit(tenant, len(prompt_ids) + spec.n * params.max_tokens)
    if limiter is not None:
        call.rate_headers = limiter.headers()
    try:
        return await _serve(gw, endpoint, call, open_stream, tenant, model, spec, session, timeout, prompt_ids)
    finally:
        if limiter is not None:
            limiter.release()


async def _serve(gw: Gateway, endpoint: Endpoint, call: Call, open_stream: Callable[[], ChunkSink],
                 tenant: Tenant, model: ServedModel, spec: GenerationSpec, session: str | None, timeout: float,
                 prompt_ids: list[int]) -> bytes | ChunkSink:
    fmt = endpoint.format(model.texts, spec.logprobs is not None)
    if spec.tool_spec.mode:
        fmt.tools = (spec.tool_spec, model.tool_parser)
        if not spec.params.grammar_kind:  # auto: the family's calls under a structural tag
            spec.params.grammar_kind, spec.params.grammar = spec.tool_spec.auto_grammar(model.tool_parser)
    response_id = f"{fmt.id_prefix}-{uuid.uuid4().hex}"
    context = {"request_id": response_id, "tenant": tenant.name}
    if call.request_id:
        context["client_request_id"] = call.request_id
    with structlog.contextvars.bound_contextvars(**context):
        gen = Generation(gw, response_id, spec, prompt_ids, session, call.arrival, timeout, model)
        gw.metrics.requests_in_flight.inc()
        try:
            await _start_by_deadline(gen, timeout)
            try:
                if spec.stream:
                    sink = open_stream()
                    await _stream(gw, gen, fmt, sink, tenant)
                    return sink
                return await _collect(gw, gen, fmt, tenant)
            except asyncio.CancelledError:  # the caller went away (HTTP disconnect, NATS cancel)
                gen.abort("client disconnected")
                log.info("client_disconnected", tokens=sum(c.num_tokens for c in gen.choices))
                raise
            finally:
                gen.close()
        finally:
            gw.metrics.requests_in_flight.dec()


async def _start_by_deadline(gen: Generation, timeout: float) -> None:
    """Route the request, within what is left of its deadline: routing retries (a scheduler that
    reconnects, workers that do not acknowledge) must not carry it past the time it was given; once
    routed, the generation's own timers hold it to the same deadline."""
    left = timeout - (time.monotonic() - gen.arrival)
    try:
        await asyncio.wait_for(gen.start(), max(left, 0.0))
    except TimeoutError:
        raise deadline_passed(timeout) from None


def deadline_passed(timeout: float) -> ApiError:
    return ApiError(504, f"the request did not finish within {timeout:g} s", type="timeout", code="timeout")


def session_id(value: str | None) -> str | None:
    if value is not None and len(value) > MAX_SESSION_ID_CHARS:
        raise invalid(f"x-session-affinity may hold at most {MAX_SESSION_ID_CHARS} characters",
                      param="x-session-affinity")
    if value is not None and not is_unicode(value):
        raise invalid("x-session-affinity is not valid UTF-8", param="x-session-affinity")
    return value or None


def request_timeout(value: str | None, server_timeout: float) -> float:
    """The request's deadline in seconds: the caller's own (x-timeout), capped by the server's."""
    if value is None:
        return server_timeout
    try:
        seconds = float(value)
    except ValueError:
        seconds = math.nan
    if not (math.isfinite(seconds) and seconds > 0):
        raise invalid("x-timeout must be a positive number of seconds", param="x-timeout")
    return min(seconds, server_timeout)


def usage(gen: Generation) -> dict:
    prompt = len(gen.prompt_ids)
    completion = sum(c.num_tokens for c in gen.choices)
    cached = min(prompt, max(c.cached_tokens for c in gen.choices))
    out = {"prompt_tokens": prompt, "completion_tokens": completion, "total_tokens": prompt + completion,
           "prompt_tokens_details": {"cached_tokens": cached}}
    drafted = sum(c.drafted_tokens for c in gen.choices)
    if drafted:  # speculation or jump-forward: OpenAI's predicted-output counts say what the drafts gave
        accepted = sum(c.accepted_tokens for c in gen.choices)
        out["completion_tokens_details"] = {"accepted_prediction_tokens": accepted,
                                            "rejected_prediction_tokens": drafted - accepted}
    return out


def _record_success(gw: Gateway, gen: Generation, tenant: Tenant) -> None:
    gw.tenancy.count(tenant, 200, len(gen.prompt_ids), sum(c.num_tokens for c in gen.choices))
    m = gw.metrics
    m.e2e_request_latency.observe(time.monotonic() - gen.arrival)
    m.prompt_tokens.inc(len(gen.prompt_ids))
    m.generation_tokens.inc(sum(c.num_tokens for c in gen.choices))
    for c in gen.choices:
        m.request_success.labels(finished_reason=c.finish_reason).inc()
    if gw.cfg.log_requests:
        log.info("request_finished", n=len(gen.choices), prompt_tokens=len(gen.prompt_ids),
                 completion_tokens=sum(c.num_tokens for c in gen.choices),
                 finish_reasons=[c.finish_reason for c in gen.choices],
                 seconds=round(time.monotonic() - gen.arrival, 4))


def _record_failure(gw: Gateway, gen: Generation, failure: StreamFailed, in_stream: bool, tenant: Tenant) -> None:
    gen.abort(failure.message)
    if in_stream:  # an error answer that is not a stream is counted by the transport (and by generate())
        gw.metrics.request_errors.labels(status=str(failure.status)).inc()
        gw.tenancy.count(tenant, failure.status)
    log.warning("request_failed", status=failure.status, error=failure.message)


async def _stream(gw: Gateway, gen: Generation, fmt: ResponseFormat, sink: ChunkSink, tenant: Tenant) -> None:
    await sink.open()
    frame = ChunkFrame(gen.response_id, fmt.chunk_object, int(time.time()), gen.spec.model)
    opening = fmt.begin(frame, gen.choices)
    if opening and not sink.send(opening):
        gen.abort("client disconnected")
        return
    pump = Pump(gw, gen, fmt, sink)
    await pump.run(gen.stream.inbox)
    if sink.closed:
        gen.abort("client disconnected")
        log.info("client_disconnected", tokens=sum(c.num_tokens for c in gen.choices))
        return
    failure = pump.failure
    if failure is not None:
        _record_failure(gw, gen, failure, in_stream=True, tenant=tenant)
        await sink.fail(pump.tail, failure)
        return
    _record_success(gw, gen, tenant)
    await sink.finish(pump.tail, frame.usage_chunk(usage(gen)) if gen.spec.include_usage else b"")


async def _collect(gw: Gateway, gen: Generation, fmt: ResponseFormat, tenant: Tenant) -> bytes:
    pump = Pump(gw, gen, fmt)
    await pump.run(gen.stream.inbox)
    failure = pump.failure
    if failure is not None:
        _record_failure(gw, gen, failure, in_stream=False, tenant=tenant)
        raise failure_error(failure)
    _record_success(gw, gen, tenant)
    body = {"id": gen.response_id, "object": fmt.object, "created": int(time.time()), "model": gen.spec.model,
            "choices": [fmt.final_choice(c) for c in gen.choices], "usage": usage(gen)}
    return dumps(body)


def failure_error(failure: StreamFailed) -> ApiError:
    """The error answer of a request that failed after it was routed."""
    return ApiError(failure.status, failure.message, type=failure.type,
                    retry_after=1.0 if failure.status == 503 else None)
