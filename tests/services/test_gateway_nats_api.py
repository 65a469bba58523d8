"""The NATS API of the gateway, spoken with plain nats-py (no client library), so these tests also
document the wire contract: {p}.api.v1.* subjects, headers in, chunk messages and one terminal
message with x-status out, cancel and keep-alive subjects. Same peer (scheduler + worker) as
test_gateway.py."""

from __future__ import annotations

import asyncio
import json
import time

import nats
import nats.errors
import pytest

from services.gateway.gateway import Gateway
from services.gateway.nats_api import NatsApi
from services.worker.engine.model_config import ModelConfig
from shared.config import GatewayConfig
from tests.services.test_gateway import (KEY, MAX_BODY, SCRIPT, make_stack, model_dir, stack,  # noqa: F401
                                         tokenizer, wait_for)

AUTH = {"Authorization": f"Bearer {KEY}"}
HI = [{"role": "user", "content": "Say hello."}]


@pytest.fixture
async def caller(nats_config):
    """A plain nats-py connection: an internal system calling the API."""
    nc = await nats.connect(nats_config.url)
    yield nc
    if not nc.is_closed:
        await nc.close()


def payload(body) -> bytes:
    return body if isinstance(body, bytes) else json.dumps(body).encode()


async def ask(nc, subject: str, body, headers: dict | None = None, timeout: float = 5.0):
    """A request that is not streamed: one reply, status in x-status."""
    msg = await nc.request(subject, payload(body), headers={**AUTH, **(headers or {})}, timeout=timeout)
    return int(msg.headers["x-status"]), json.loads(msg.data), msg.headers


async def eventually(attempt, seconds: float = 5.0):
    """attempt()'s result once it stops raising (timeouts, assertions), retrying for `seconds`."""
    deadline = asyncio.get_running_loop().time() + seconds
    while True:
        try:
            return await attempt()
        except (AssertionError, nats.errors.TimeoutError, nats.errors.NoRespondersError):
            if asyncio.get_running_loop().time() > deadline:
                raise
            await asyncio.sleep(0.1)


async def start_stream(nc, subject: str, body, headers: dict | None = None):
    """Subscribe a fresh inbox, then publish the request with it as the reply subject."""
    inbox = nc.new_inbox()
    sub = await nc.subscribe(inbox)
    await nc.publish(subject, payload(body), reply=inbox, headers={**AUTH, **(headers or {})})
    return sub


async def read_stream(sub, limit: int | None = None, timeout: float = 5.0):
    """Chunks until the terminal message (the one with x-status), or until `limit` chunks."""
    chunks = []
    while limit is None or len(chunks) < limit:
        msg = await sub.next_msg(timeout=timeout)
        if msg.headers and "x-status" in msg.headers:
            return chunks, msg
        chunks.append(json.loads(msg.data))
    return chunks, None


# ---------------------------------------------------------------------------------------------
# Answers

async def test_chat_not_streamed_is_the_http_body(stack, caller):
    s = stack.gw.subjects
    body = {"model": "tiny", "messages": HI, "max_tokens": 5}
    status, r, headers = await ask(caller, s.api_chat_completions, body, {"x-request-id": "my-req-1"})
    assert status == 200 and headers["x-request-id"] == "my-req-1"
    prompt = len(stack.tokenizer.encode_chat(HI))
    assert r["object"] == "chat.completion" and r["id"].startswith("chatcmpl-") and r["model"] == "tiny"
    assert r["choices"] == [{"index": 0, "message": {"role": "assistant", "content": stack.text(5)},
                             "logprobs": None, "finish_reason": "length"}]
    assert r["usage"] == {"prompt_tokens": prompt, "completion_tokens": 5, "total_tokens": prompt + 5,
                          "prompt_tokens_details": {"cached_tokens": prompt // 2}}
    status, http, _ = await stack.post("/v1/chat/completions", payload(body))
    assert status == 200 and (http["choices"], http["usage"]) == (r["choices"], r["usage"])


async def test_completion_not_streamed(stack, caller):
    status, r, _ = await ask(caller, stack.gw.subjects.api_completions, {"model": "tiny", "prompt": "x",
                                                                        "max_tokens": 50})
    assert status == 200 and r["object"] == "text_completion"
    assert (r["choices"][0]["text"], r["choices"][0]["finish_reason"]) == (SCRIPT, "stop")


async def test_chat_streamed_with_usage_matches_sse(stack, caller):
    body = {"model": "tiny", "messages": HI, "max_tokens": 6, "stream": True, "stream_options": {"include_usage": True}}
    sub = await start_stream(caller, stack.gw.subjects.api_chat_completions, body, {"x-request-id": "s-1"})
    chunks, end = await read_stream(sub)
    assert end.headers["x-status"] == "200" and end.headers["x-request-id"] == "s-1"
    assert chunks[0]["choices"][0]["delta"] == {"role": "assistant", "content": ""}
    assert "".join(c["choices"][0]["delta"].get("content", "") for c in chunks) == stack.text(6)
    assert [c["choices"][0]["finish_reason"] for c in chunks][-1] == "length"
    assert all(c["object"] == "chat.completion.chunk" and c["id"] == chunks[0]["id"] for c in chunks)
    usage = json.loads(end.data)  # the terminal message carries the usage chunk
    prompt = len(stack.tokenizer.encode_chat(HI))
    assert usage["choices"] == [] and usage["id"] == chunks[0]["id"]
    assert usage["usage"]["prompt_tokens"] == prompt and usage["usage"]["completion_tokens"] == 6
    # The same request over HTTP: the same events (ids and timestamps aside).
    async with stack.http.post(stack.url + "/v1/chat/completions", data=payload(body), headers=AUTH) as r:
        events = [json.loads(line[6:]) for line in (await r.text()).split("\n\n") if line.startswith("data: {")]
    strip = [{k: v for k, v in c.items() if k not in ("id", "created")} for c in chunks + [usage]]
    assert [{k: v for k, v in c.items() if k not in ("id", "created")} for c in events] == strip


async def test_stream_without_usage_ends_with_an_empty_terminal(stack, caller):
    body = {"model": "tiny", "prompt": [5, 6, 7], "max_tokens": 4, "stream": True}
    chunks, end = await read_stream(await start_stream(caller, stack.gw.subjects.api_completions, body))
    assert (end.headers["x-status"], end.data) == ("200", b"")
    assert "".join(c["choices"][0]["text"] for c in chunks) == stack.text(4)


async def test_models(stack, caller):
    status, r, _ = await ask(caller, stack.gw.subjects.api_models, b"")
    assert status == 200 and [m["id"] for m in r["data"]] == ["tiny"] and r["object"] == "list"


async def test_affinity_and_salt_reach_the_scheduler(stack, caller):
    body = {"model": "tiny", "prompt": "x", "max_tokens": 2, "cache_salt": "tenant-b"}
    status, _, _ = await ask(caller, stack.gw.subjects.api_completions, body, {"x-session-affinity": "sess-9"})
    assert status == 200
    req = stack.peer.requests[0]
    assert (req.session_id, req.cache_salt) == ("sess-9", "tenant-b")


# ---------------------------------------------------------------------------------------------
# Errors: the OpenAI body, the status in x-status

ERRORS = [
    ("completions", b'{"prompt": "x",', {}, 400, "the request body is not valid JSON", None),
    ("completions", {"prompt": "x", "n": 99}, {}, 400, None, "n"),
    ("chat", {"messages": HI, "response_format": {"type": "xml"}}, {}, 400, None, "response_format.type"),
    ("chat", {"messages": HI, "tools": [{"type": "function", "function": {"name": "f g"}}]}, {}, 400, None,
     "tools[0].function.name"),
    ("chat", rb'{"messages": [{"role": "user", "content": "\ud800"}]}', {}, 400, None, "messages[0].content"),
    ("chat", {"model": "gpt-4o", "messages": HI}, {}, 404, "The model `gpt-4o` does not exist.", "model"),
    ("chat", {"messages": HI}, {"Authorization": "Bearer sk-wrong"}, 401, "Incorrect API key provided.", None),
    ("models", b"", {"Authorization": ""}, 401, None, None),
    ("completions", {"prompt": "x" * (MAX_BODY + 1)}, {}, 413,
     f"The request body exceeds the limit of {MAX_BODY} bytes.", None),
    ("completions", {"prompt": "x"}, {"x-timeout": "soon"}, 400, None, "x-timeout"),
    ("completions", {"prompt": "x"}, {"x-session-affinity": "s" * 300}, 400, None, "x-session-affinity"),
]


@pytest.mark.parametrize("endpoint, body, headers, status, message, param", ERRORS)
async def test_errors(stack, caller, endpoint, body, headers, status, message, param):
    subject = {"chat": stack.gw.subjects.api_chat_completions, "completions": stack.gw.subjects.api_completions,
               "models": stack.gw.subjects.api_models}[endpoint]
    got, r, h = await ask(caller, subject, body, headers)
    assert got == status, r
    err = r["error"]
    assert set(err) == {"message", "type", "param", "code"} and err["param"] == param
    if message is not None:
        assert err["message"] == message
    assert stack.peer.requests == []  # nothing bad reached the cluster
    assert f'inferno:request_errors_total{{status="{status}"}} 1.0' in (await stack.get("/metrics"))[1]


async def test_streamed_request_refused_before_it_starts_gets_only_the_terminal(stack, caller):
    stack.peer.mode = "overload"
    body = {"model": "tiny", "prompt": "x", "max_tokens": 2, "stream": True}
    chunks, end = await read_stream(await start_stream(caller, stack.gw.subjects.api_completions, body))
    assert chunks == [] and end.headers["x-status"] == "429" and end.headers["Retry-After"] == "2"
    assert json.loads(end.data) == {"error": {"message": "the peer is busy", "type": "rate_limit_exceeded",
                                              "param": None, "code": "rate_limit_exceeded"}}


async def test_dead_worker_mid_stream_ends_with_an_error_terminal(stack, caller):
    stack.peer.mode = "hang"
    stack.peer.step_delay = 0.05
    body = {"model": "tiny", "messages": HI, "max_tokens": 100, "stream": True}
    chunks, end = await read_stream(await start_stream(caller, stack.gw.subjects.api_chat_completions, body))
    assert end.headers["x-status"] == "503" and "stopped responding" in json.loads(end.data)["error"]["message"]
    assert "".join(c["choices"][0]["delta"].get("content", "") for c in chunks) == stack.text(2)


async def test_duplicate_request_id_in_flight_is_refused(stack, caller):
    stack.peer.step_delay = 0.05
    body = {"model": "tiny", "prompt": "x", "max_tokens": 100, "stream": True, "ignore_eos": True}
    first = await start_stream(caller, stack.gw.subjects.api_completions, body, {"x-request-id": "dup"})
    await read_stream(first, limit=1)
    status, r, _ = await ask(caller, stack.gw.subjects.api_completions, body, {"x-request-id": "dup"})
    assert status == 400 and r["error"]["param"] == "x-request-id"
    await caller.publish(stack.gw.subjects.api_cancel, b'["dup"]', headers=AUTH)
    _, end = await read_stream(first)
    assert end.headers["x-status"] == "499"


# ---------------------------------------------------------------------------------------------
# Cancellation, vanished callers, deadlines

async def test_cancel_subject_aborts_the_request(stack, caller):
    stack.peer.step_delay = 0.05
    s = stack.gw.subjects
    body = {"model": "tiny", "prompt": "x", "max_tokens": 1000, "stream": True, "ignore_eos": True}
    sub = await start_stream(caller, s.api_completions, body, {"x-request-id": "to-cancel"})
    chunks, _ = await read_stream(sub, limit=2)
    await caller.publish(s.api_cancel, b'["to-cancel"]', headers={"Authorization": "Bearer sk-wrong"})
    await caller.publish(s.api_cancel, b'["to-cancel"]')  # no key: refused too
    more, _ = await read_stream(sub, limit=3)  # still running
    assert await wait_for(lambda: stack.nats_api.refused_control == 2)
    sent = time.monotonic()
    await caller.publish(s.api_cancel, b'["someone-else", "to-cancel"]', headers=AUTH)
    rest, end = await read_stream(sub)
    assert end.headers["x-status"] == "499"
    assert json.loads(end.data)["error"] == {"message": "the request was cancelled", "type": "cancelled",
                                             "param": None, "code": "cancelled"}
    rid = stack.peer.requests[0].request_id
    assert await wait_for(lambda: stack.peer.aborted(rid), timeout=2.0) - sent < 1.0
    assert await wait_for(lambda: stack.gw.router.in_flight == 0 and not stack.nats_api.calls)
    assert stack.gw.metrics.requests_in_flight._value.get() == 0


async def test_a_cancel_that_overtakes_its_request_still_cancels_it(stack, caller):
    s = stack.gw.subjects
    await caller.publish(s.api_cancel, b'["early"]', headers=AUTH)  # the request comes after it
    await caller.flush()
    await wait_for(lambda: "early" in stack.nats_api._early_cancels)
    status, r, _ = await ask(caller, s.api_completions, {"prompt": "x", "max_tokens": 5}, {"x-request-id": "early"})
    assert (status, r["error"]["code"]) == (499, "cancelled")
    assert stack.peer.requests == []  # it never ran
    status, _, _ = await ask(caller, s.api_completions, {"prompt": "x", "max_tokens": 5}, {"x-request-id": "early"})
    assert status == 200  # the cancel was used up


async def test_vanished_caller_is_noticed_within_1s(stack, nats_config):
    stack.peer.step_delay = 0.05
    s = stack.gw.subjects
    nc = await nats.connect(nats_config.url)

    async def keep_alive():
        while True:
            await nc.publish(s.api_keepalive, b'["gone-soon"]', headers=AUTH)
            await asyncio.sleep(0.25)

    pinger = asyncio.create_task(keep_alive())
    body = {"model": "tiny", "prompt": "x", "max_tokens": 1000, "stream": True, "ignore_eos": True}
    sub = await start_stream(nc, s.api_completions, body, {"x-request-id": "gone-soon", "x-keepalive": "1"})
    started = time.monotonic()
    chunks = 0
    while time.monotonic() - started < 1.5:  # past the keep-alive timeout: the keep-alives hold it
        got, end = await read_stream(sub, limit=1)
        assert end is None
        chunks += len(got)
    assert chunks > 10
    pinger.cancel()
    await nc.close()  # the caller vanishes without a word
    vanished = time.monotonic()
    rid = stack.peer.requests[0].request_id
    assert await wait_for(lambda: stack.peer.aborted(rid), timeout=3.0) - vanished < 1.0
    assert await wait_for(lambda: stack.gw.router.in_flight == 0 and not stack.nats_api.calls)


async def test_requests_without_keepalive_header_are_not_watched(stack, caller):
    stack.peer.step_delay = 0.05
    body = {"model": "tiny", "prompt": "x", "max_tokens": 25, "ignore_eos": True}  # about 1.3 s
    status, r, _ = await ask(caller, stack.gw.subjects.api_completions, body)
    assert status == 200 and r["usage"]["completion_tokens"] == 25


async def test_deadline_from_the_header_ends_with_a_504_terminal(stack, caller):
    stack.peer.step_delay = 0.2
    s = stack.gw.subjects
    body = {"model": "tiny", "prompt": "x", "max_tokens": 100, "stream": True, "ignore_eos": True}
    started = time.monotonic()
    chunks, end = await read_stream(await start_stream(caller, s.api_completions, body, {"x-timeout": "0.5"}))
    assert 0.4 < time.monotonic() - started < 1.5
    assert end.headers["x-status"] == "504" and json.loads(end.data)["error"]["type"] == "timeout"
    assert 1 <= len(chunks) <= 3
    rid = stack.peer.requests[0].request_id
    assert await wait_for(lambda: stack.peer.aborted(rid), timeout=1.0)
    status, r, _ = await ask(caller, s.api_completions, {**body, "stream": False}, {"x-timeout": "0.3"})
    assert status == 504 and "did not finish within 0.3 s" in r["error"]["message"]


# ---------------------------------------------------------------------------------------------
# Replicas

async def test_replicas_share_requests_and_drain(stack, caller, nats_conn, model_dir, tokenizer):  # noqa: F811
    mc = ModelConfig.from_dir(model_dir)
    other = Gateway(GatewayConfig(model_name="tiny", model_dir=str(model_dir), api_keys=(KEY,)), tokenizer,
                    max_model_len=mc.max_model_len, vocab_size=mc.vocab_size, subject_prefix=stack.gw.subjects.prefix)
    second = NatsApi(other)
    await second.start(nats_conn)
    try:
        inbox = caller.new_inbox()
        sub = await caller.subscribe(inbox)
        for i in range(20):
            await caller.publish(stack.gw.subjects.api_models, b"", reply=inbox, headers=AUTH)
        replies = [await sub.next_msg(timeout=5) for _ in range(20)]
        assert all(r.headers["x-status"] == "200" for r in replies)
        with pytest.raises(nats.errors.TimeoutError):
            await sub.next_msg(timeout=0.3)  # one reply per request, never two
        await stack.nats_api.stop_accepting()  # draining: the other replica takes everything
        # The UNSUB travels on the gateway's own connection: a request on the caller's may still
        # reach the leaving replica for a moment (no order across connections), so poll briefly.
        status = await eventually(lambda: ask(caller, stack.gw.subjects.api_models, b"", timeout=0.5))
        assert status[0] == 200
        await second.stop_accepting()

        async def no_responders():
            try:
                await ask(caller, stack.gw.subjects.api_models, b"", timeout=0.5)
            except nats.errors.NoRespondersError:
                return True
            raise AssertionError("a replica still answers")

        assert await eventually(no_responders)
    finally:
        await second.close()
        await other.close()
