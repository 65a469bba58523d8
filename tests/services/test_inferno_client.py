"""inferno.client against the real gateway over a real nats-server (the peer of test_gateway.py
plays scheduler and worker): typed answers, streams, errors as exceptions, and cancellation when
a stream is closed, dropped or its task cancelled."""

from __future__ import annotations

import asyncio
import gc
import time

import pytest

import inferno.client
from inferno.client import (APIConnectionError, AuthenticationError, BadRequestError, ChatCompletion,
                            ChatCompletionChunk, Completion, InternalServerError, NotFoundError, RateLimitError)
from tests.services.test_gateway import KEY, SCRIPT, make_stack, model_dir, stack, tokenizer, wait_for  # noqa: F401

HI = [{"role": "user", "content": "Say hello."}]


@pytest.fixture
async def client(stack, nats_config):  # noqa: F811
    c = await inferno.client.connect(nats_config.url, api_key=KEY, prefix=nats_config.subject_prefix)
    yield c
    await c.close()


async def test_chat_typed_answer(stack, client):
    r = await client.chat.completions.create(model="tiny", messages=HI, max_tokens=5,
                                             extra_headers={"x-session-affinity": "sess-c"})
    assert isinstance(r, ChatCompletion) and r.object == "chat.completion" and r.id.startswith("chatcmpl-")
    prompt = len(stack.tokenizer.encode_chat(HI))
    assert (r.choices[0].message.role, r.choices[0].message.content, r.choices[0].finish_reason) == \
        ("assistant", stack.text(5), "length")
    assert (r.usage.prompt_tokens, r.usage.completion_tokens, r.usage.total_tokens) == (prompt, 5, prompt + 5)
    assert r.usage.prompt_tokens_details.cached_tokens == prompt // 2
    assert stack.peer.requests[0].session_id == "sess-c"


async def test_chat_stream_with_usage(stack, client):
    stream = await client.chat.completions.create(model="tiny", messages=HI, max_tokens=6, stream=True,
                                                  stream_options={"include_usage": True})
    chunks = [c async for c in stream]
    assert all(isinstance(c, ChatCompletionChunk) for c in chunks)
    assert chunks[0].choices[0].delta.role == "assistant"
    assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices) == stack.text(6)
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == 6
    assert all(c.usage is None for c in chunks[:-1])
    assert not client._live  # nothing left to keep alive


async def test_completions_logprobs_and_models(stack, client):
    r = await client.completions.create(model="tiny", prompt="x", max_tokens=3, logprobs=1, extra_body={"n": 2})
    assert isinstance(r, Completion) and [c.index for c in r.choices] == [0, 1]
    assert r.choices[0].logprobs.token_logprobs == [-0.5] * 3 and r.choices[0].text == stack.text(3)
    stream = await client.completions.create(model="tiny", prompt=[5, 6], max_tokens=50, stream=True)
    assert "".join([c.choices[0].text async for c in stream]) == SCRIPT
    models = await client.models.list()
    assert [m.id for m in models] == ["tiny"] and models.data[0].max_model_len == stack.gw.limits.max_model_len
    assert (await client.models.retrieve("tiny")).id == "tiny"
    with pytest.raises(NotFoundError):
        await client.models.retrieve("other")


async def test_errors_are_exceptions_like_openai(stack, client, nats_config):
    with pytest.raises(BadRequestError) as info:
        await client.chat.completions.create(model="tiny", messages=HI, tool_choice="auto")
    e = info.value
    assert (e.status_code, e.param, e.type) == (400, "tool_choice", "invalid_request_error")
    assert "needs 'tools'" in e.message and e.request_id
    with pytest.raises(NotFoundError) as info:
        await client.completions.create(model="gpt-4o", prompt="x", stream=True)  # raised by create, as openai does
    assert info.value.body == {"message": "The model `gpt-4o` does not exist.", "type": "invalid_request_error",
                               "param": "model", "code": "model_not_found"}
    stack.peer.mode = "overload"
    with pytest.raises(RateLimitError) as info:
        await client.completions.create(model="tiny", prompt="x", max_tokens=2)
    assert (info.value.status_code, info.value.retry_after) == (429, 2.0)
    stranger = await inferno.client.connect(nats_config.url, api_key="sk-wrong", prefix=nats_config.subject_prefix)
    with pytest.raises(AuthenticationError) as info:
        await stranger.models.list()
    assert info.value.status_code == 401
    await stranger.close()
    nobody = await inferno.client.connect(nats_config.url, prefix="nobody-listens")
    with pytest.raises(APIConnectionError, match="no gateway is listening on nobody-listens.api.v1.models"):
        await nobody.models.list()
    await nobody.close()


async def test_deadline_and_mid_stream_failure_raise(stack, client):
    stack.peer.step_delay = 0.2
    with pytest.raises(InternalServerError) as info:
        await client.completions.create(model="tiny", prompt="x", max_tokens=100, timeout=0.4)
    assert (info.value.status_code, info.value.type) == (504, "timeout")
    stack.peer.step_delay = 0.05
    stack.peer.mode = "hang"
    stream = await client.chat.completions.create(model="tiny", messages=HI, max_tokens=100, stream=True)
    text = ""
    with pytest.raises(InternalServerError) as info:
        async for chunk in stream:
            text += chunk.choices[0].delta.content or ""
    assert info.value.status_code == 503 and "stopped responding" in info.value.message
    assert text == stack.text(2)


# ---------------------------------------------------------------------------------------------
# Cancellation: every way of leaving a stream early aborts the request on its worker

async def long_stream(client):
    return await client.completions.create(model="tiny", prompt="x", max_tokens=1000, stream=True,
                                           extra_body={"ignore_eos": True})


async def assert_aborted_soon(stack, since: float) -> None:
    rid = stack.peer.requests[-1].request_id
    assert await wait_for(lambda: stack.peer.aborted(rid), timeout=2.0) - since < 1.0
    assert await wait_for(lambda: stack.gw.router.in_flight == 0 and not stack.nats_api.calls)


async def test_closing_a_stream_cancels_it(stack, client):
    stack.peer.step_delay = 0.05
    async with await long_stream(client) as stream:
        async for _ in stream:
            break
    await assert_aborted_soon(stack, time.monotonic())


async def test_dropping_a_stream_cancels_it(stack, client):
    stack.peer.step_delay = 0.05
    stream = await long_stream(client)
    await stream.__anext__()
    del stream
    gc.collect()
    await assert_aborted_soon(stack, time.monotonic())


async def test_cancelling_the_reading_task_cancels_the_request(stack, client):
    stack.peer.step_delay = 0.05

    async def read_all():
        async for _ in await long_stream(client):
            pass

    task = asyncio.create_task(read_all())
    await wait_for(lambda: stack.peer.requests)
    await asyncio.sleep(0.2)
    task.cancel()
    with pytest.raises(asyncio.CancelledError):
        await task
    await assert_aborted_soon(stack, time.monotonic())
    # A request that is not streamed, given up by its caller while it runs.
    task = asyncio.create_task(client.completions.create(model="tiny", prompt="x", max_tokens=1000,
                                                         extra_body={"ignore_eos": True}))
    await wait_for(lambda: len(stack.peer.requests) == 2)
    task.cancel()
    with pytest.raises(asyncio.CancelledError):
        await task
    await assert_aborted_soon(stack, time.monotonic())


async def test_a_client_that_vanishes_is_noticed_by_its_missing_keepalives(stack, client):
    stack.peer.step_delay = 0.05
    stream = await long_stream(client)
    await stream.__anext__()
    await asyncio.sleep(1.2)  # longer than the keep-alive timeout: the client keeps it alive
    assert stack.peer.aborted(stack.peer.requests[-1].request_id) is None
    client._keepalive.cancel()  # as if the process froze or died: no cancel, no more keep-alives
    await asyncio.sleep(0)
    await client.nc.close()
    await assert_aborted_soon(stack, time.monotonic())
