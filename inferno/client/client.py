"""AsyncInferno: an async client of Inferno's NATS API, shaped like openai.AsyncOpenAI.

Each request gets its own reply inbox and a random x-request-id; while any is in flight, one task
sends their ids as keep-alives, so the gateway cancels the requests of a client that vanished.
A stream that is closed, dropped (garbage-collected) or whose task is cancelled sends a cancel.
"""

from __future__ import annotations

import asyncio
import json
import uuid
from typing import Any, Generic, Mapping, TypeVar
from urllib.parse import urlsplit

import nats
import nats.errors
from nats.aio.client import Client
from nats.aio.msg import Msg
from nats.aio.subscription import Subscription

from inferno.client.errors import APIConnectionError, APIError, APITimeoutError, status_error
from inferno.client.types import ApiObject, ChatCompletion, ChatCompletionChunk, Completion, Model, ModelList
from shared.nats_api import (AUTHORIZATION, KEEPALIVE, KEEPALIVE_INTERVAL, REQUEST_ID, RETRY_AFTER, STATUS, TIMEOUT,
                             encode_ids)
from shared.nats_tls import tls_options
from shared.subjects import DEFAULT_PREFIX, Subjects

T = TypeVar("T", bound=ApiObject)

DEFAULT_TIMEOUT = 600.0  # seconds, as openai's client
GRACE = 5.0  # seconds past the request's deadline to wait for the gateway's own timeout answer


async def connect(servers: str | list[str] = "nats://127.0.0.1:4222", *, api_key: str | None = None,
                  prefix: str = DEFAULT_PREFIX, timeout: float = DEFAULT_TIMEOUT, tls_ca: str | None = None,
                  **nats_options: Any) -> AsyncInferno:
    """Connect to NATS and return a client that owns the connection (close() closes it). On a bus
    with users (`inferno up` makes them), give the API user's credentials in the URL
    (nats://user:password@host:port) or as user= and password=: its replies come to inboxes under
    _INBOX.<user>, the only ones it may read. On a bus with TLS, `tls_ca` is the CA file that signed
    its servers' certificate (`inferno up --nats-tls`: RUN_DIR/nats-tls/ca.crt); the client then
    starts TLS before the server's first line, as Inferno's servers expect (shared/nats_tls.py)."""
    user = nats_options.get("user") or urlsplit((servers if isinstance(servers, str) else servers[0])
                                                .split(",")[0].strip()).username
    if user and "inbox_prefix" not in nats_options:
        nats_options["inbox_prefix"] = f"_INBOX.{user}"
    if tls_ca:
        nats_options = {**tls_options(tls_ca), **nats_options}
    try:
        nc = await nats.connect(servers, **nats_options)
    except Exception as e:
        raise APIConnectionError(f"could not connect to NATS at {servers}: {e!r}") from e
    return AsyncInferno(nc, api_key=api_key, prefix=prefix, timeout=timeout, owns_connection=True)


class AsyncInferno:
    """client.chat.completions.create(...), client.completions.create(...), client.models.list()."""

    def __init__(self, nc: Client, *, api_key: str | None = None, prefix: str = DEFAULT_PREFIX,
                 timeout: float = DEFAULT_TIMEOUT, owns_connection: bool = False):
        self.nc = nc
        self.api_key = api_key
        self.subjects = Subjects(prefix)
        self.timeout = timeout
        self._owns_connection = owns_connection
        self._auth = {AUTHORIZATION: f"Bearer {api_key}"} if api_key else {}
        self._live: set[str] = set()  # request ids in flight: kept alive
        self._keepalive: asyncio.Task | None = None
        self._tasks: set[asyncio.Task] = set()
        self.chat = Chat(self)
        self.completions = Completions(self)
        self.models = Models(self)

    async def close(self) -> None:
        """Cancel what is still in flight, then close the connection if this client opened it."""
        if self._keepalive is not None:
            self._keepalive.cancel()
        await asyncio.gather(*self._tasks, return_exceptions=True)
        if self._owns_connection and not self.nc.is_closed:
            await self.nc.drain()

    async def __aenter__(self) -> AsyncInferno:
        return self

    async def __aexit__(self, *exc: Any) -> None:
        await self.close()

    # -- requests -------------------------------------------------------------------------------

    async def _open(self, subject: str, body: dict | None, timeout: float | None,
                    extra_headers: Mapping[str, Any] | None) -> _Call:
        """Send one request; the returned call reads its answer."""
        timeout = self.timeout if timeout is None else timeout
        request_id = uuid.uuid4().hex
        headers = {REQUEST_ID: request_id, KEEPALIVE: "1", TIMEOUT: f"{timeout:g}", **self._auth}
        for key, value in (extra_headers or {}).items():
            if value is not None:
                headers[key] = str(value)
        inbox = self.nc.new_inbox()
        try:
            sub = await self.nc.subscribe(inbox)
        except nats.errors.Error as e:
            raise APIConnectionError(f"NATS: {e!r}", request_id=request_id) from e
        call = _Call(self, subject, request_id, sub, asyncio.get_running_loop().time() + timeout + GRACE)
        self._live.add(request_id)
        if self._keepalive is None:
            self._keepalive = asyncio.ensure_future(self._keep_alive())
        try:
            payload = b"" if body is None else json.dumps(body).encode()
            await self.nc.publish(subject, payload, reply=inbox, headers=headers)
        except nats.errors.Error as e:
            call.end()
            raise APIConnectionError(f"NATS: {e!r}", request_id=request_id) from e
        except BaseException:  # cancelled: the request may have left already
            call.abandon()
            raise
        return call

    async def _unary(self, subject: str, body: dict | None, cast: type[T], timeout: float | None,
                     extra_headers: Mapping[str, Any] | None) -> T:
        call = await self._open(subject, body, timeout, extra_headers)
        status, msg = await call.next()
        if status is None:  # a chunk: the body asked to stream, but this call does not
            call.abandon()
            raise APIError("the gateway streamed an answer to a request without stream=True",
                           request_id=call.request_id)
        return cast.from_dict(call.answer(status, msg))

    async def _stream(self, subject: str, body: dict, cast: type[T], timeout: float | None,
                      extra_headers: Mapping[str, Any] | None) -> AsyncStream[T]:
        call = await self._open(subject, body, timeout, extra_headers)
        status, msg = await call.next()  # like openai: a refused request raises here, not in the loop
        if status is not None and status != 200:
            call.answer(status, msg)
        return AsyncStream(call, cast, status, msg)

    async def _generate(self, subject: str, body: dict, cast: type[T], chunk: type[ApiObject], stream: bool,
                        timeout: float | None, extra_headers: Mapping[str, Any] | None,
                        extra_body: Mapping[str, Any] | None) -> Any:
        body = {k: v for k, v in body.items() if v is not None}
        body.update(extra_body or {})
        if stream:
            body["stream"] = True
            return await self._stream(subject, body, chunk, timeout, extra_headers)
        return await self._unary(subject, body, cast, timeout, extra_headers)

    # -- keep-alive and cancellation -------------------------------------------------------------

    async def _keep_alive(self) -> None:
        try:
            while self._live:
                await asyncio.sleep(KEEPALIVE_INTERVAL)
                if self._live and self.nc.is_connected:
                    try:
                        await self.nc.publish(self.subjects.api_keepalive, encode_ids(self._live), headers=self._auth)
                    except nats.errors.Error:
                        pass  # the gateway's own timeout follows
        finally:
            self._keepalive = None

    def _spawn(self, coro: Any) -> None:
        task = asyncio.ensure_future(coro)
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    async def _cancel(self, request_id: str) -> None:
        if not self.nc.is_closed:
            try:
                await self.nc.publish(self.subjects.api_cancel, encode_ids([request_id]), headers=self._auth)
            except nats.errors.Error:
                pass  # the missing keep-alives cancel it


class _Call:
    """One request in flight: its reply subscription, until its terminal message."""

    __slots__ = ("client", "subject", "request_id", "sub", "deadline", "done")

    def __init__(self, client: AsyncInferno, subject: str, request_id: str, sub: Subscription, deadline: float):
        self.client = client
        self.subject = subject
        self.request_id = request_id
        self.sub = sub
        self.deadline = deadline
        self.done = False

    async def next(self) -> tuple[int | None, Msg]:
        """The next message and its x-status (None for a chunk)."""
        remaining = self.deadline - asyncio.get_running_loop().time()
        try:
            msg = await self.sub.next_msg(timeout=max(remaining, 0.001))
        except nats.errors.TimeoutError:
            self.abandon()
            raise APITimeoutError("no answer from the gateway in time", request_id=self.request_id) from None
        except asyncio.CancelledError:
            self.abandon()
            raise
        except nats.errors.Error as e:
            self.end()
            raise APIConnectionError(f"NATS: {e!r}", request_id=self.request_id) from e
        task = asyncio.current_task()
        if task is not None and task.cancelling():
            # next_msg's asyncio.wait_for (Python 3.11) returns a message that raced the caller's
            # cancel and drops the cancel: honour it (seen once in five full test runs).
            self.abandon()
            raise asyncio.CancelledError
        headers = msg.headers or {}
        status = headers.get(STATUS)
        if status is not None:
            self.end()
            return int(status), msg
        if headers.get("Status") == "503":  # the server's own answer: nobody subscribes to the subject
            self.end()
            raise APIConnectionError(f"no gateway is listening on {self.subject}", request_id=self.request_id)
        return None, msg

    def answer(self, status: int, msg: Msg) -> dict:
        """The terminal message's JSON; raise the error it carries."""
        try:
            data = json.loads(msg.data) if msg.data else {}
        except ValueError:
            data = {}
        if status != 200:
            body = data.get("error") if isinstance(data, dict) else None
            retry = (msg.headers or {}).get(RETRY_AFTER)
            raise status_error(status, body if isinstance(body, dict) else None, self.request_id,
                               float(retry) if retry else None)
        return data

    def end(self) -> None:
        """The request is over: stop keeping it alive and drop its subscription."""
        if self.done:
            return
        self.done = True
        self.client._live.discard(self.request_id)
        self.client._spawn(_unsubscribe(self.sub))

    def abandon(self) -> None:
        """The caller gave up before the end: tell the gateway (synchronously safe, for __del__)."""
        if self.done:
            return
        self.end()
        self.client._spawn(self.client._cancel(self.request_id))


async def _unsubscribe(sub: Subscription) -> None:
    try:
        await sub.unsubscribe()
    except nats.errors.Error:
        pass


class AsyncStream(Generic[T]):
    """The chunks of a streamed answer: `async for chunk in stream`. Closing it early (close(),
    leaving `async with`, dropping it, cancelling the task reading it) cancels the request."""

    def __init__(self, call: _Call, cast: type[T], status: int | None, first: Msg):
        self._call = call
        self._cast = cast
        self._pending: tuple[int | None, Msg] | None = (status, first)
        self._finished = False

    @property
    def request_id(self) -> str:
        return self._call.request_id

    def __aiter__(self) -> AsyncStream[T]:
        return self

    async def __anext__(self) -> T:
        while True:
            if self._pending is not None:
                (status, msg), self._pending = self._pending, None
            elif self._finished:
                raise StopAsyncIteration
            else:
                status, msg = await self._call.next()
            if status is None:
                return self._cast.from_dict(json.loads(msg.data))
            self._finished = True
            data = self._call.answer(status, msg)
            if data:  # the usage chunk
                return self._cast.from_dict(data)

    async def close(self) -> None:
        if not self._finished:
            self._finished = True
            self._call.abandon()

    aclose = close

    async def __aenter__(self) -> AsyncStream[T]:
        return self

    async def __aexit__(self, *exc: Any) -> None:
        await self.close()

    def __del__(self) -> None:
        if not self._finished and not self._call.done:
            try:
                self._call.abandon()
            except RuntimeError:  # no running loop any more: the missing keep-alives cancel it
                self._call.client._live.discard(self._call.request_id)


# -- resources, as openai names them -------------------------------------------------------------

class ChatCompletions:
    def __init__(self, client: AsyncInferno):
        self._client = client

    async def create(self, *, model: str, messages: list[dict], stream: bool = False,
                     extra_headers: Mapping[str, Any] | None = None, extra_body: Mapping[str, Any] | None = None,
                     timeout: float | None = None, **params: Any) -> ChatCompletion | AsyncStream[ChatCompletionChunk]:
        """OpenAI's chat.completions.create: any of its parameters (and vLLM's) as keywords."""
        c = self._client
        return await c._generate(c.subjects.api_chat_completions, {"model": model, "messages": messages, **params},
                                 ChatCompletion, ChatCompletionChunk, stream, timeout, extra_headers, extra_body)

    async def parse(self, *, model: str, messages: list[dict], response_format: type, **params: Any) -> ChatCompletion:
        """openai's chat.completions.parse: `response_format` is a Pydantic model; its JSON Schema
        constrains the answer, and each choice that ends ("stop") carries `message.parsed`, the
        answer as an instance of it (None when max_tokens cut it)."""
        schema = response_format.model_json_schema()
        answer = await self.create(model=model, messages=messages, response_format={
            "type": "json_schema", "json_schema": {"name": response_format.__name__, "schema": schema, "strict": True}},
            **params)
        for choice in answer.choices:
            if choice.finish_reason == "stop" and choice.message.content is not None:
                choice.message.parsed = response_format.model_validate_json(choice.message.content)
        return answer


class Chat:
    def __init__(self, client: AsyncInferno):
        self.completions = ChatCompletions(client)


class Completions:
    def __init__(self, client: AsyncInferno):
        self._client = client

    async def create(self, *, model: str, prompt: str | list[int], stream: bool = False,
                     extra_headers: Mapping[str, Any] | None = None, extra_body: Mapping[str, Any] | None = None,
                     timeout: float | None = None, **params: Any) -> Completion | AsyncStream[Completion]:
        """OpenAI's completions.create: any of its parameters (and vLLM's) as keywords."""
        c = self._client
        return await c._generate(c.subjects.api_completions, {"model": model, "prompt": prompt, **params},
                                 Completion, Completion, stream, timeout, extra_headers, extra_body)


class Models:
    def __init__(self, client: AsyncInferno):
        self._client = client

    async def list(self, *, timeout: float | None = None) -> ModelList:
        c = self._client
        return await c._unary(c.subjects.api_models, None, ModelList, timeout, None)

    async def retrieve(self, model: str, *, timeout: float | None = None) -> Model:
        for m in await self.list(timeout=timeout):
            if m.id == model:
                return m
        raise status_error(404, {"message": f"The model `{model}` does not exist.", "type": "invalid_request_error",
                                 "param": "model", "code": "model_not_found"}, None, None)
