"""Answering one generation request: an SSE stream or one JSON body, built from the same events."""

from __future__ import annotations

import asyncio
import json
import time
import uuid
from typing import TYPE_CHECKING

import structlog
from aiohttp import web

from services.gateway.choice import ChoiceState, ChoiceUpdate
from services.gateway.errors import ApiError, invalid, stream_error_event
from services.gateway.generation import Generation
from services.gateway.pump import Pump
from services.gateway.schemas import GenerationSpec
from services.gateway.streaming import ChunkFrame, SseWriter, dumps, event
from services.gateway.token_router import StreamFailed
from shared.logging import get_logger

if TYPE_CHECKING:
    from services.gateway.app import Gateway
    from services.gateway.logprobs import TokenTexts

GATEWAY = web.AppKey("gateway", object)  # the Gateway of an app (typed loosely: no import cycle)
MAX_SESSION_ID_CHARS = 256

log = get_logger("gateway.serving")


class ResponseFormat:
    """What differs between the endpoints: the shapes of choices, chunks and bodies."""

    object = ""
    chunk_object = ""
    id_prefix = ""

    def __init__(self, texts: TokenTexts, want_logprobs: bool):
        self.texts = texts
        self.want_logprobs = want_logprobs
        self.frame: ChunkFrame | None = None
        self.heads: list[bytes] = []  # per choice: the per-token chunk up to the text's JSON string

    def begin(self, frame: ChunkFrame, choices: list[ChoiceState]) -> bytes:
        """Start a stream (a format object serves one request): keep its frame, build the per-choice
        byte templates of the per-token chunk, and return the events sent before any token."""
        raise NotImplementedError

    def chunk(self, choice: ChoiceState, update: ChoiceUpdate) -> bytes | None:
        """The SSE event for one update of a stream, or None when there is nothing to send yet."""
        raise NotImplementedError

    def collect(self, choice: ChoiceState, update: ChoiceUpdate) -> None:
        raise NotImplementedError

    def final_choice(self, choice: ChoiceState) -> dict:
        raise NotImplementedError


async def read_json(request: web.Request):
    """The body as JSON; 413 (from aiohttp, converted by the error middleware) past the size limit."""
    raw = await request.read()
    try:
        return json.loads(raw)
    except (ValueError, RecursionError):  # UnicodeDecodeError is a ValueError
        raise invalid("the request body is not valid JSON") from None


def session_id(request: web.Request) -> str | None:
    value = request.headers.get("x-session-affinity")
    if value is not None and len(value) > MAX_SESSION_ID_CHARS:
        raise invalid(f"x-session-affinity may hold at most {MAX_SESSION_ID_CHARS} characters",
                      param="x-session-affinity")
    return value or None


def usage(gen: Generation) -> dict:
    prompt = len(gen.prompt_ids)
    completion = sum(c.num_tokens for c in gen.choices)
    cached = min(prompt, max(c.cached_tokens for c in gen.choices))
    return {"prompt_tokens": prompt, "completion_tokens": completion, "total_tokens": prompt + completion,
            "prompt_tokens_details": {"cached_tokens": cached}}


async def generate(gw: Gateway, request: web.Request, spec: GenerationSpec, prompt_ids: list[int],
                   fmt: ResponseFormat, arrival: float) -> web.StreamResponse:
    """Route the request, then answer it; the request id is in every log line meanwhile."""
    response_id = f"{fmt.id_prefix}-{uuid.uuid4().hex}"
    with structlog.contextvars.bound_contextvars(request_id=response_id):
        gen = Generation(gw, response_id, spec, prompt_ids, session_id(request), arrival)
        gw.metrics.requests_in_flight.inc()
        try:
            await gen.start()
            try:
                if spec.stream:
                    return await _stream(gw, request, gen, fmt)
                return await _collect(gw, gen, fmt)
            except asyncio.CancelledError:  # aiohttp cancels the handler when the client goes away
                gen.abort("client disconnected")
                log.info("client_disconnected", tokens=sum(c.num_tokens for c in gen.choices))
                raise
            finally:
                gen.close()
        finally:
            gw.metrics.requests_in_flight.dec()


def _record_success(gw: Gateway, gen: Generation) -> None:
    m = gw.metrics
    m.e2e_request_latency.observe(time.monotonic() - gen.arrival)
    m.prompt_tokens.inc(len(gen.prompt_ids))
    m.generation_tokens.inc(sum(c.num_tokens for c in gen.choices))
    for c in gen.choices:
        m.request_success.labels(finished_reason=c.finish_reason).inc()
    log.info("request_finished", n=len(gen.choices), prompt_tokens=len(gen.prompt_ids),
             completion_tokens=sum(c.num_tokens for c in gen.choices),
             finish_reasons=[c.finish_reason for c in gen.choices],
             seconds=round(time.monotonic() - gen.arrival, 4))


def _record_failure(gw: Gateway, gen: Generation, failure: StreamFailed, in_stream: bool) -> None:
    gen.abort(failure.message)
    if in_stream:  # an error answer that is not a stream is counted by the error middleware
        gw.metrics.request_errors.labels(status=str(failure.status)).inc()
    log.warning("request_failed", status=failure.status, error=failure.message)


async def _stream(gw: Gateway, request: web.Request, gen: Generation, fmt: ResponseFormat) -> web.StreamResponse:
    writer = SseWriter()
    await writer.start(request)
    frame = ChunkFrame(gen.response_id, fmt.chunk_object, int(time.time()), gen.spec.model)
    opening = fmt.begin(frame, gen.choices)
    if opening and not writer.send(opening):
        gen.abort("client disconnected")
        return writer.response
    pump = Pump(gw, gen, fmt, writer)
    await pump.run(gen.stream.inbox)
    if writer.closed:
        gen.abort("client disconnected")
        log.info("client_disconnected", tokens=sum(c.num_tokens for c in gen.choices))
        return writer.response
    failure = pump.failure
    if failure is not None:
        _record_failure(gw, gen, failure, in_stream=True)
        await writer.finish(pump.tail + event(stream_error_event(failure.status, failure.message, failure.type)))
        return writer.response
    _record_success(gw, gen)
    tail = pump.tail + frame.usage_chunk(usage(gen)) if gen.spec.include_usage else pump.tail
    await writer.finish(tail)
    return writer.response


async def _collect(gw: Gateway, gen: Generation, fmt: ResponseFormat) -> web.Response:
    pump = Pump(gw, gen, fmt)
    await pump.run(gen.stream.inbox)
    failure = pump.failure
    if failure is not None:
        _record_failure(gw, gen, failure, in_stream=False)
        raise ApiError(failure.status, failure.message, type=failure.type,
                       retry_after=1.0 if failure.status == 503 else None)
    _record_success(gw, gen)
    body = {"id": gen.response_id, "object": fmt.object, "created": int(time.time()), "model": gen.spec.model,
            "choices": [fmt.final_choice(c) for c in gen.choices], "usage": usage(gen)}
    return web.Response(body=dumps(body), content_type="application/json")
