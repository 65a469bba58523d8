"""The NATS API through the whole stack (gateway → scheduler → worker), with inferno.client and with
plain nats-py: the same greedy tokens as over HTTP, and cancellation that frees the worker's KV."""

from __future__ import annotations

import asyncio
import json
import time

import nats
import openai
import pytest

import inferno.client
from tests.e2e.conftest import MODEL_NAME, metrics

GREEDY = dict(temperature=0, max_tokens=12, extra_body={"ignore_eos": True})
MESSAGES = [{"role": "user", "content": "Tell me about NATS"}]


@pytest.fixture
async def client(stack):
    c = await inferno.client.connect(stack.nats_url_of("api"))  # (its inbox prefix follows from the user)
    yield c
    await c.close()


@pytest.fixture
async def http(stack):
    c = openai.AsyncOpenAI(base_url=stack.url + "/v1", api_key="unused", max_retries=0, timeout=60)
    yield c
    await c.close()


async def wait_idle(stack, timeout: float = 5.0) -> dict:
    """Until the workers report no running request and no KV block in use (their heartbeats)."""
    deadline = time.monotonic() + timeout
    while True:
        m = await asyncio.to_thread(metrics, stack)
        if (m["inferno:num_requests_running"], m["inferno:kv_cache_usage_perc"]) == (0, 0) or \
                time.monotonic() > deadline:
            return m
        await asyncio.sleep(0.1)


async def wait_running(stack, timeout: float = 10.0) -> None:
    deadline = time.monotonic() + timeout
    while (await asyncio.to_thread(metrics, stack)).get("inferno:num_requests_running", 0) < 1:
        assert time.monotonic() < deadline, "the request never ran"
        await asyncio.sleep(0.1)


async def test_models(client):
    assert [m.id for m in await client.models.list()] == [MODEL_NAME]


async def test_greedy_chat_is_identical_over_http_and_nats(client, http):
    over_http = await http.chat.completions.create(model=MODEL_NAME, messages=MESSAGES, **GREEDY)
    over_nats = await client.chat.completions.create(model=MODEL_NAME, messages=MESSAGES, **GREEDY)
    assert over_nats.choices[0].message.content == over_http.choices[0].message.content
    assert over_nats.choices[0].finish_reason == over_http.choices[0].finish_reason == "length"
    u, v = over_nats.usage, over_http.usage
    assert (u.prompt_tokens, u.completion_tokens, u.total_tokens) == (v.prompt_tokens, v.completion_tokens,
                                                                      v.total_tokens)
    assert u.prompt_tokens_details.cached_tokens > 0  # the same prompt again: the worker's prefix cache
    stream = await client.chat.completions.create(model=MODEL_NAME, messages=MESSAGES, stream=True,
                                                  stream_options={"include_usage": True}, **GREEDY)
    chunks = [c async for c in stream]
    assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices) == \
        over_http.choices[0].message.content
    assert chunks[-1].usage.completion_tokens == 12


async def test_greedy_completion_tokens_identical_with_logprobs(client, http):
    kwargs = dict(model=MODEL_NAME, prompt="The quick brown fox", logprobs=2, **GREEDY)
    over_http = await http.completions.create(**kwargs)
    over_nats = await client.completions.create(**kwargs)
    assert over_nats.choices[0].text == over_http.choices[0].text
    assert over_nats.choices[0].logprobs.tokens == over_http.choices[0].logprobs.tokens  # the same tokens
    assert over_nats.choices[0].logprobs.token_logprobs == pytest.approx(over_http.choices[0].logprobs.token_logprobs)


async def test_plain_nats_request_without_the_client(stack, http):
    """What any language does: one request with a reply subject, the JSON body, the headers (as the
    API user, whose replies come under its own inbox prefix)."""
    nc = await nats.connect(stack.nats_url_of("api"), inbox_prefix="_INBOX.api")
    try:
        body = {"model": MODEL_NAME, "prompt": "Once upon a time", "max_tokens": 8, "temperature": 0,
                "ignore_eos": True}
        msg = await nc.request("inferno.api.v1.completions", json.dumps(body).encode(),
                               headers={"x-request-id": "plain-1"}, timeout=30)
        assert (msg.headers["x-status"], msg.headers["x-request-id"]) == ("200", "plain-1")
        answer = json.loads(msg.data)
        expected = await http.completions.create(model=MODEL_NAME, prompt="Once upon a time", **{**GREEDY,
                                                                                              "max_tokens": 8})
        assert answer["choices"][0]["text"] == expected.choices[0].text
        assert answer["usage"]["completion_tokens"] == 8
    finally:
        await nc.close()


async def test_cancel_subject_frees_the_request(stack):
    nc = await nats.connect(stack.nats_url_of("api"), inbox_prefix="_INBOX.api")
    try:
        inbox = nc.new_inbox()
        sub = await nc.subscribe(inbox)
        body = {"model": MODEL_NAME, "prompt": "a long story", "max_tokens": 1500, "stream": True, "ignore_eos": True}
        await nc.publish("inferno.api.v1.completions", json.dumps(body).encode(), reply=inbox,
                         headers={"x-request-id": "e2e-cancel"})
        first = await sub.next_msg(timeout=30)
        assert "x-status" not in (first.headers or {})  # a chunk: the request runs on the worker
        await wait_running(stack)
        await nc.publish("inferno.api.v1.cancel", b'["e2e-cancel"]')
        while "x-status" not in ((msg := await sub.next_msg(timeout=10)).headers or {}):
            pass
        assert msg.headers["x-status"] == "499"
        m = await wait_idle(stack)
        assert (m["inferno:num_requests_running"], m["inferno:kv_cache_usage_perc"]) == (0, 0)
        assert m["inferno:gateway_requests_in_flight"] == 0
    finally:
        await nc.close()


async def test_closed_client_stream_frees_the_request(stack, client):
    stream = await client.completions.create(model=MODEL_NAME, prompt="another long story", max_tokens=1500,
                                             stream=True, extra_body={"ignore_eos": True})
    await stream.__anext__()
    await wait_running(stack)
    await stream.close()
    m = await wait_idle(stack)
    assert (m["inferno:num_requests_running"], m["inferno:kv_cache_usage_perc"]) == (0, 0)


async def test_refused_features_and_bad_unicode_are_400_over_both(stack, client, http):
    with pytest.raises(openai.BadRequestError) as info:
        await http.chat.completions.create(model=MODEL_NAME, messages=MESSAGES,
                                           response_format={"type": "json_schema", "json_schema": {
                                               "name": "x", "schema": {"type": "objekt"}}})
    assert info.value.body["param"] == "response_format.json_schema.schema"
    assert "not a valid JSON Schema" in info.value.body["message"]
    with pytest.raises(inferno.client.BadRequestError) as info:
        await client.chat.completions.create(model=MODEL_NAME, messages=MESSAGES, tool_choice="auto")
    assert info.value.param == "tool_choice"
    raw = rb'{"model": "%s", "messages": [{"role": "user", "content": "\ud800"}]}' % MODEL_NAME.encode()
    async with __import__("aiohttp").ClientSession() as s:
        async with s.post(stack.url + "/v1/chat/completions", data=raw,
                          headers={"Content-Type": "application/json"}) as r:
            assert r.status == 400 and (await r.json())["error"]["param"] == "messages[0].content"
    assert (await client.completions.create(model=MODEL_NAME, prompt="still up", max_tokens=2)).choices


async def test_a_schema_over_nats_as_over_http(client):
    """Structured outputs go through the NATS API like any other field: the answer fits the schema."""
    schema = {"type": "object", "properties": {"n": {"type": "integer", "minimum": 0, "maximum": 9},
                                               "ok": {"type": "boolean"}}, "required": ["n", "ok"]}
    r = await client.chat.completions.create(
        model=MODEL_NAME, messages=MESSAGES, max_tokens=32, temperature=0,
        response_format={"type": "json_schema", "json_schema": {"name": "s", "schema": schema}})
    answer = json.loads(r.choices[0].message.content)
    assert set(answer) == {"n", "ok"} and 0 <= answer["n"] <= 9 and isinstance(answer["ok"], bool)


async def test_parse_over_nats_gives_the_typed_answer(client):
    """inferno.client's chat.completions.parse, as the openai package's: a Pydantic model in, its instance out."""
    from pydantic import BaseModel, Field

    class Reading(BaseModel):
        sensor: str = Field(pattern="^[a-z]{3}$")
        value: int = Field(ge=0, le=99)

    r = await client.chat.completions.parse(model=MODEL_NAME, messages=MESSAGES, max_tokens=48, temperature=0,
                                            response_format=Reading)
    parsed = r.choices[0].message.parsed
    assert isinstance(parsed, Reading) and 0 <= parsed.value <= 99 and r.choices[0].finish_reason == "stop"
    tool = {"type": "function", "function": {"name": "read", "parameters": Reading.model_json_schema()}}
    r = await client.chat.completions.create(model=MODEL_NAME, messages=MESSAGES, max_tokens=48, tools=[tool],
                                             tool_choice={"type": "function", "function": {"name": "read"}})
    (call,) = r.choices[0].message.tool_calls
    assert call.function.name == "read" and Reading.model_validate_json(call.function.arguments)
    assert r.choices[0].finish_reason == "tool_calls"


async def test_an_api_user_reaches_the_api_only(stack):
    """The bus's users (shared/nats_auth.py): an API user may not publish to a worker's or an admin
    subject, nor read another API user's replies; the admin may; without a password nobody connects."""
    errors: list[str] = []

    async def on_error(e):
        errors.append(str(e))

    api = await nats.connect(stack.nats_url_of("api"), inbox_prefix="_INBOX.api", error_cb=on_error)
    other = await nats.connect(stack.nats_url_of("other"), inbox_prefix="_INBOX.other")
    admin = await nats.connect(stack.admin_nats_url)
    try:
        await api.publish("inferno.worker.worker-0.generate", b"not from a scheduler")
        with pytest.raises((nats.errors.TimeoutError, nats.errors.NoRespondersError)):
            await api.request("inferno.worker.worker-0.admin.status", b"", timeout=1)
        await api.subscribe("_INBOX.other.>")  # another user's replies
        await api.flush()
        await asyncio.sleep(0.3)
        errors = [e.lower() for e in errors]
        assert 'violation for publish to "inferno.worker.worker-0.generate"' in " ".join(errors), errors
        assert 'violation for publish to "inferno.worker.worker-0.admin.status"' in " ".join(errors), errors
        assert 'violation for subscription to "_inbox.other.>"' in " ".join(errors), errors
        # The other user's request is answered, to it alone.
        body = {"model": MODEL_NAME, "prompt": "hi", "max_tokens": 2, "temperature": 0, "ignore_eos": True}
        msg = await other.request("inferno.api.v1.completions", json.dumps(body).encode(), timeout=30)
        assert msg.subject.startswith("_INBOX.other.") and msg.headers["x-status"] == "200"
        # The admin reaches a worker's admin subject.
        from shared.admin_messages import WorkerAdminReply, WorkerStatusRequest
        from shared.wire import decode, encode
        reply = await admin.request("inferno.worker.worker-0.admin.status", encode(WorkerStatusRequest()), timeout=10)
        assert decode(WorkerAdminReply, reply.data).ok
    finally:
        for nc in (api, other, admin):
            await nc.close()
    with pytest.raises(Exception):
        await nats.connect(stack.nats_url, max_reconnect_attempts=0, allow_reconnect=False, connect_timeout=2)
