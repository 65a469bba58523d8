"""The gateway app on a random port, a real nats-server, the real openai client, and a small NATS peer
that plays scheduler and worker (routes every request to itself and emits tokens of the tiny model's
tokenizer to the gateway inbox, honouring AbortRequest)."""

from __future__ import annotations

import asyncio
import json
import os
import signal
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import aiohttp
import openai
import pytest

from services.gateway.app import bound_port, build_app, start_server
from services.gateway.gateway import Gateway
from services.gateway.nats_api import NatsApi
from services.launcher import free_port
from inferno.tools.make_model import write_model
from services.worker.engine.model_config import ModelConfig
from shared.config import GatewayConfig, NatsConfig
from shared.messages import (AbortRequest, GenerateRequest, RouteReply, TokenBatch, TokenDelta,
                             WorkerHeartbeat)
from shared.nats_client import NatsConnection, connect_nats
from shared.subjects import Subjects
from shared.tokenizer import Tokenizer
from shared.wire import pack_ids

KEY = "sk-test-key"
SCRIPT = "Hello world, this is a test."
WORKER = "peer-1"
MAX_BODY = 64 * 1024
LOAD = dict(num_running=3, num_waiting=1, kv_usage=0.25, num_total_blocks=100, num_free_blocks=75,
            prefix_cache_hits=10, prefix_cache_queries=40)


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return write_model(tmp_path_factory.mktemp("model") / "tiny", arch="LlamaForCausalLM", preset="tiny", seed=0,
                       dtype="float32")


@pytest.fixture(scope="module")
def tokenizer(model_dir) -> Tokenizer:
    return Tokenizer.from_dir(model_dir)


class Peer:
    """Scheduler and worker in one: accepts every GenerateRequest for itself and streams tokens.

    Token i of a request is script[i % len(script)]; after the script comes eos (finish "stop")
    unless ignore_eos; max_tokens ends it with "length". Cached tokens: half the prompt.
    """

    def __init__(self, nats_cfg: NatsConfig, tokenizer: Tokenizer):
        self.nats_cfg = nats_cfg
        self.subjects = Subjects(nats_cfg.subject_prefix)
        self.script = tokenizer.encode(SCRIPT, add_special_tokens=False)
        self.eos = tokenizer.eos_token_ids[0]
        self.mode = "ok"  # "ok" | "overload" (429) | "hang" (falls silent after hang_after tokens)
        self.hang_after = 2
        self.hung_at = 0.0
        self.step_delay = 0.002
        self.beating = True
        self.requests: list[GenerateRequest] = []
        self.aborts: list[tuple[float, AbortRequest]] = []
        self.tasks: dict[str, asyncio.Task] = {}
        self.conn: NatsConnection | None = None
        self._subs: list = []
        self._beat_task: asyncio.Task | None = None
        self.seq = 0

    async def start(self, beating: bool = True) -> Peer:
        self.beating = beating
        self.conn = await connect_nats(self.nats_cfg, "peer", wait=5.0)
        self._subs.append(await self.conn.subscribe(self.subjects.generate, GenerateRequest, self.on_generate))
        self._subs.append(await self.conn.subscribe(self.subjects.worker_abort(WORKER), AbortRequest, self.on_abort))
        self._beat_task = asyncio.create_task(self._beats())
        return self

    async def stop_routing(self) -> None:
        """Nobody listens on the generate subject any more (no responders)."""
        await self._subs[0].unsubscribe()
        await self.conn.flush()

    async def close(self) -> None:
        self._beat_task.cancel()
        for t in self.tasks.values():
            t.cancel()
        await self.conn.close()

    async def beat(self) -> None:
        self.seq += 1
        await self.conn.publish(self.subjects.heartbeat, WorkerHeartbeat(
            worker_id=WORKER, role="mixed", model="tiny", ready=True, draining=False,
            generate_subject=self.subjects.worker_generate(WORKER), abort_subject=self.subjects.worker_abort(WORKER),
            timestamp=time.time(), seq=self.seq, **LOAD))

    async def _beats(self) -> None:
        while True:
            if self.beating and self.mode != "hung":
                await self.beat()
            await asyncio.sleep(0.3)

    def on_generate(self, req: GenerateRequest) -> RouteReply:
        if self.mode == "overload":
            return RouteReply.rejected(429, "rate_limit_exceeded", "the peer is busy", retry_after=2.0)
        self.requests.append(req)
        self.tasks[req.request_id] = asyncio.create_task(self._emit(req))
        return RouteReply.accepted(WORKER)

    def on_abort(self, msg: AbortRequest) -> None:
        self.aborts.append((time.monotonic(), msg))
        for rid in msg.request_ids:
            task = self.tasks.pop(rid, None)
            if task is not None:
                task.cancel()

    def aborted(self, request_id: str) -> float | None:
        return next((t for t, m in self.aborts if request_id in m.request_ids), None)

    async def _emit(self, req: GenerateRequest) -> None:
        sp = req.sampling
        prompt = req.num_prompt_tokens
        for i in range(sp.max_tokens):
            await asyncio.sleep(self.step_delay)
            if self.mode == "hang" and i >= self.hang_after:
                self.mode = "hung"  # no more tokens, no more heartbeats: a dead worker
                self.hung_at = time.monotonic()
                return
            eos = i == len(self.script) and not sp.ignore_eos
            token = self.eos if eos else self.script[i % len(self.script)]
            finish = "stop" if eos else ("length" if i + 1 == sp.max_tokens else None)
            extra = {}
            if sp.logprobs is not None:
                alternatives = [token + j for j in range(sp.logprobs)]
                extra = dict(logprobs=[-0.5], top_ids=[pack_ids(alternatives)],
                             top_lps=[[-0.5 - j for j in range(sp.logprobs)]])
            delta = TokenDelta(request_id=req.request_id, token_ids=pack_ids([token]), finish_reason=finish,
                               prompt_tokens=prompt, cached_tokens=prompt // 2, completion_tokens=i + 1,
                               stop_token_id=self.eos if eos else None, **extra)
            await self.conn.publish(req.reply_to, TokenBatch.of(WORKER, [delta]))
            if finish:
                return


@dataclass
class Stack:
    url: str
    client: openai.AsyncOpenAI
    peer: Peer
    gw: Gateway
    tokenizer: Tokenizer
    http: aiohttp.ClientSession
    nats_api: NatsApi

    def text(self, n: int) -> str:
        return self.tokenizer.decode(self.peer.script[:n])

    async def get(self, path: str, key: str | None = KEY) -> tuple[int, dict | str, dict]:
        headers = {"Authorization": f"Bearer {key}"} if key else {}
        async with self.http.get(self.url + path, headers=headers) as r:
            text = await r.text()
            body = json.loads(text) if r.content_type == "application/json" else text
            return r.status, body, dict(r.headers)

    async def post(self, path: str, data: bytes, key: str | None = KEY) -> tuple[int, dict, dict]:
        headers = {"Content-Type": "application/json", **({"Authorization": f"Bearer {key}"} if key else {})}
        async with self.http.post(self.url + path, data=data, headers=headers) as r:
            return r.status, json.loads(await r.text()), dict(r.headers)


@pytest.fixture
async def make_stack(nats_config, nats_conn, model_dir, tokenizer):
    made = []

    async def make(beating: bool = True, **cfg) -> Stack:
        peer = await Peer(nats_config, tokenizer).start(beating)
        gcfg = GatewayConfig(model_name="tiny", model_dir=str(model_dir), api_keys=(KEY, "sk-other"),
                             max_body_bytes=MAX_BODY, **cfg)
        mc = ModelConfig.from_dir(model_dir)
        gw = Gateway(gcfg, tokenizer, max_model_len=mc.max_model_len, vocab_size=mc.vocab_size,
                     subject_prefix=nats_config.subject_prefix)
        runner, _ = await start_server(build_app(gw, nats_conn), "127.0.0.1", 0)
        nats_api = NatsApi(gw)
        await nats_api.start(nats_conn)
        url = f"http://127.0.0.1:{bound_port(runner)}"
        client = openai.AsyncOpenAI(base_url=url + "/v1", api_key=KEY, max_retries=0, timeout=20)
        stack = Stack(url, client, peer, gw, tokenizer, aiohttp.ClientSession(), nats_api)
        made.append((stack, runner))
        if beating:
            await wait_for(lambda: stack.gw.health.ready())
        return stack

    yield make
    for stack, runner in made:
        await stack.client.close()
        await stack.http.close()
        await stack.nats_api.close()
        await runner.cleanup()
        await stack.peer.close()


@pytest.fixture
async def stack(make_stack) -> Stack:
    return await make_stack()


async def wait_for(predicate, timeout: float = 5.0, interval: float = 0.01):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        value = predicate()
        if value:
            return value
        await asyncio.sleep(interval)
    raise AssertionError("condition not met in time")


# ---------------------------------------------------------------------------------------------
# Answers

async def test_models_and_health(stack):
    models = await stack.client.models.list()
    assert [m.id for m in models.data] == ["tiny"]
    status, body, _ = await stack.get("/health", key=None)
    assert (status, body) == (200, {"status": "ok"})


async def test_chat_not_streamed(stack):
    messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Say hello."}]
    r = await stack.client.chat.completions.create(model="tiny", messages=messages, max_tokens=5, user="u1",
                                                   extra_headers={"x-session-affinity": "sess-1"},
                                                   extra_body={"cache_salt": "tenant-a"})
    prompt = len(stack.tokenizer.encode_chat(messages))
    assert r.object == "chat.completion" and r.id.startswith("chatcmpl-") and r.model == "tiny"
    assert len(r.choices) == 1
    c = r.choices[0]
    assert (c.index, c.message.role, c.message.content, c.finish_reason) == (0, "assistant", stack.text(5), "length")
    assert c.logprobs is None
    assert (r.usage.prompt_tokens, r.usage.completion_tokens, r.usage.total_tokens) == (prompt, 5, prompt + 5)
    assert r.usage.prompt_tokens_details.cached_tokens == prompt // 2
    req = stack.peer.requests[0]
    assert (req.request_id, req.session_id, req.cache_salt, req.model) == (f"{r.id}-0", "sess-1", "tenant-a", "tiny")
    assert req.prompt_token_ids == stack.tokenizer.encode_chat(messages)
    assert req.reply_to == stack.gw.inbox and req.gateway_id == stack.gw.cfg.gateway_id
    assert req.sampling.max_tokens == 5


async def test_chat_streamed_with_usage(stack):
    messages = [{"role": "user", "content": [{"type": "text", "text": "Say"}, {"type": "text", "text": "hello"}]}]
    stream = await stack.client.chat.completions.create(model="tiny", messages=messages, max_tokens=6, stream=True,
                                                        stream_options={"include_usage": True})
    chunks = [c async for c in stream]
    assert chunks[0].choices[0].delta.role == "assistant"
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text == stack.text(6)
    finishes = [c.choices[0].finish_reason for c in chunks if c.choices and c.choices[0].finish_reason]
    assert finishes == ["length"]
    last = chunks[-1]
    prompt = len(stack.tokenizer.encode_chat([{"role": "user", "content": "Say\nhello"}]))
    assert last.choices == [] and last.object == "chat.completion.chunk"
    assert (last.usage.prompt_tokens, last.usage.completion_tokens) == (prompt, 6)
    assert last.usage.prompt_tokens_details.cached_tokens == prompt // 2
    assert all(c.usage is None for c in chunks[:-1])


async def test_completion_ends_on_eos(stack):
    n_script = len(stack.peer.script)
    r = await stack.client.completions.create(model="tiny", prompt="Once upon a time", max_tokens=50)
    prompt = len(stack.tokenizer.encode("Once upon a time"))
    assert r.object == "text_completion" and r.id.startswith("cmpl-")
    assert (r.choices[0].text, r.choices[0].finish_reason) == (SCRIPT, "stop")
    assert (r.usage.prompt_tokens, r.usage.completion_tokens) == (prompt, n_script + 1)  # eos counted, not shown


async def test_completion_streamed_from_token_ids(stack):
    stream = await stack.client.completions.create(model="tiny", prompt=[5, 6, 7], max_tokens=4, stream=True)
    chunks = [c async for c in stream]
    assert "".join(c.choices[0].text for c in chunks) == stack.text(4)
    assert chunks[-1].choices[0].finish_reason == "length"
    assert stack.peer.requests[0].prompt_token_ids == [5, 6, 7]


async def test_n2_choices_and_seeds(stack):
    r = await stack.client.completions.create(model="tiny", prompt="x", max_tokens=3, n=2, seed=42)
    assert sorted(c.index for c in r.choices) == [0, 1]
    assert [c.text for c in r.choices] == [stack.text(3)] * 2
    assert r.usage.completion_tokens == 6
    by_id = {q.request_id: q.sampling.seed for q in stack.peer.requests}
    assert by_id == {f"{r.id}-0": 42, f"{r.id}-1": 43}


async def test_n2_streamed_interleaves_choices(stack):
    stack.peer.step_delay = 0.01
    stream = await stack.client.chat.completions.create(model="tiny", messages=[{"role": "user", "content": "hi"}],
                                                        max_tokens=5, n=2, stream=True)
    texts = {0: "", 1: ""}
    order = []
    async for chunk in stream:
        for c in chunk.choices:
            texts[c.index] += c.delta.content or ""
            order.append(c.index)
    assert texts == {0: stack.text(5), 1: stack.text(5)}
    assert order[:2] == [0, 1]  # the role chunks
    first_of_1 = order.index(1, 2)
    assert 0 in order[first_of_1:]  # tokens of the two choices alternate, not one choice after the other


async def test_stop_string_across_two_tokens_aborts_the_worker(stack):
    # "Hello" and " wor" are separate tokens; "lo wor" spans both.
    stack.peer.step_delay = 0.02
    r = await stack.client.completions.create(model="tiny", prompt="x", max_tokens=50, stop=["lo wor", "zzz"])
    assert (r.choices[0].text, r.choices[0].finish_reason) == ("Hel", "stop")
    assert await wait_for(lambda: stack.peer.aborted(f"{r.id}-0"), timeout=1.0)
    stream = await stack.client.chat.completions.create(model="tiny", messages=[{"role": "user", "content": "hi"}],
                                                        max_tokens=50, stop="lo wor", stream=True)
    chunks = [c async for c in stream]
    assert "".join(c.choices[0].delta.content or "" for c in chunks) == "Hel"
    assert chunks[-1].choices[0].finish_reason == "stop"


async def test_chat_logprobs_shape(stack):
    r = await stack.client.chat.completions.create(model="tiny", messages=[{"role": "user", "content": "hi"}],
                                                   max_tokens=3, logprobs=True, top_logprobs=2)
    content = r.choices[0].logprobs.content
    tok = stack.tokenizer
    ids = stack.peer.script[:3]
    assert [e.token for e in content] == [tok.token_text(i) for i in ids]
    assert [e.logprob for e in content] == [-0.5] * 3
    assert [e.bytes for e in content] == [list(tok.token_bytes(i)) for i in ids]
    assert [[t.token for t in e.top_logprobs] for e in content] == [[tok.token_text(i), tok.token_text(i + 1)]
                                                                    for i in ids]
    assert [[t.logprob for t in e.top_logprobs] for e in content] == [[-0.5, -1.5]] * 3
    assert stack.peer.requests[0].sampling.logprobs == 2


async def test_completion_logprobs_shape(stack):
    r = await stack.client.completions.create(model="tiny", prompt="x", max_tokens=3, logprobs=1)
    lp = r.choices[0].logprobs
    tok = stack.tokenizer
    texts = [tok.token_text(i) for i in stack.peer.script[:3]]
    assert lp.tokens == texts
    assert lp.token_logprobs == [-0.5] * 3
    assert lp.top_logprobs == [{t: -0.5} for t in texts]
    assert lp.text_offset == [0, len(texts[0]), len(texts[0]) + len(texts[1])]


# ---------------------------------------------------------------------------------------------
# Errors

async def test_401(stack):
    bad = openai.AsyncOpenAI(base_url=stack.url + "/v1", api_key="sk-wrong", max_retries=0)
    with pytest.raises(openai.AuthenticationError) as info:
        await bad.models.list()
    await bad.close()
    assert info.value.status_code == 401
    assert info.value.body == {"message": "Incorrect API key provided.", "type": "invalid_request_error",
                               "param": None, "code": "invalid_api_key"}
    status, body, _ = await stack.get("/v1/models", key=None)
    assert status == 401 and body["error"]["code"] == "invalid_api_key"
    status, _, _ = await stack.get("/v1/models", key="sk-other")  # every configured key is accepted
    assert status == 200


async def test_404_model(stack):
    with pytest.raises(openai.NotFoundError) as info:
        await stack.client.chat.completions.create(model="gpt-4o", messages=[{"role": "user", "content": "hi"}])
    assert info.value.body == {"message": "The model `gpt-4o` does not exist.", "type": "invalid_request_error",
                               "param": "model", "code": "model_not_found"}


async def test_unknown_route_is_an_openai_shaped_404(stack):
    status, body, _ = await stack.get("/v1/nothing")
    assert (status, body) == (404, {"error": {"message": "Not Found: GET /v1/nothing",
                                              "type": "invalid_request_error", "param": None, "code": "not_found"}})


async def test_413_body_too_large(stack):
    body = json.dumps({"model": "tiny", "prompt": "x" * (MAX_BODY + 10)}).encode()
    status, payload, _ = await stack.post("/v1/completions", body)
    assert status == 413
    assert payload == {"error": {"message": f"The request body exceeds the limit of {MAX_BODY} bytes.",
                                 "type": "invalid_request_error", "param": None, "code": "request_too_large"}}


async def test_400_bad_json_and_bounds(stack):
    status, payload, _ = await stack.post("/v1/completions", b'{"prompt": "x",')
    assert (status, payload["error"]["type"], payload["error"]["message"]) == \
        (400, "invalid_request_error", "the request body is not valid JSON")
    with pytest.raises(openai.BadRequestError) as info:
        await stack.client.completions.create(model="tiny", prompt="x", n=17)
    assert (info.value.body["param"], info.value.body["type"]) == ("n", "invalid_request_error")
    with pytest.raises(openai.BadRequestError) as info:
        await stack.client.completions.create(model="tiny", prompt="x", logit_bias={"5000": 1})
    assert info.value.body["param"] == "logit_bias"
    assert stack.peer.requests == []  # nothing bad reached the cluster
    r = await stack.client.completions.create(model="tiny", prompt="x", max_tokens=2)  # and it keeps serving
    assert r.choices[0].text == stack.text(2)


async def test_context_length_exceeded(stack):
    with pytest.raises(openai.BadRequestError) as info:
        await stack.client.completions.create(model="tiny", prompt=[7] * 2000, max_tokens=100)
    assert (info.value.body["code"], info.value.body["param"]) == ("context_length_exceeded", "prompt")
    assert info.value.body["message"].startswith("This model's maximum context length is 2048 tokens.")


async def test_429_with_retry_after(stack):
    stack.peer.mode = "overload"
    with pytest.raises(openai.RateLimitError) as info:
        await stack.client.completions.create(model="tiny", prompt="x", max_tokens=2, stream=True)
    assert info.value.response.headers["retry-after"] == "2"
    assert info.value.body == {"message": "the peer is busy", "type": "rate_limit_exceeded", "param": None,
                               "code": "rate_limit_exceeded"}


async def test_503_no_responders(stack):
    await stack.peer.stop_routing()
    with pytest.raises(openai.InternalServerError) as info:
        await stack.client.completions.create(model="tiny", prompt="x", max_tokens=2)
    assert info.value.status_code == 503
    assert info.value.body["type"] == "service_unavailable"
    assert "no service is listening" in info.value.body["message"]


# ---------------------------------------------------------------------------------------------
# Disconnects, dead workers, timeouts

async def test_client_disconnect_mid_stream_aborts_within_1s(stack):
    stack.peer.step_delay = 0.05
    stream = await stack.client.completions.create(model="tiny", prompt="x", max_tokens=1000, stream=True,
                                                   extra_body={"ignore_eos": True})
    seen = 0
    async for _ in stream:
        seen += 1
        if seen == 2:
            break
    await stream.close()
    closed = time.monotonic()
    rid = stack.peer.requests[0].request_id
    aborted_at = await wait_for(lambda: stack.peer.aborted(rid), timeout=2.0)
    assert aborted_at - closed < 1.0
    assert await wait_for(lambda: stack.gw.router.in_flight == 0)


async def test_client_disconnect_without_stream_aborts(stack):
    stack.peer.step_delay = 0.05
    body = json.dumps({"model": "tiny", "prompt": "x", "max_tokens": 1000, "ignore_eos": True}).encode()
    with pytest.raises(asyncio.TimeoutError):
        await asyncio.wait_for(stack.post("/v1/completions", body), 0.5)
    closed = time.monotonic()
    rid = stack.peer.requests[0].request_id
    assert await wait_for(lambda: stack.peer.aborted(rid), timeout=2.0) - closed < 1.0


async def test_dead_worker_ends_the_stream_with_an_error(stack):
    stack.peer.mode = "hang"
    stack.peer.step_delay = 0.05
    stream = await stack.client.chat.completions.create(model="tiny", messages=[{"role": "user", "content": "hi"}],
                                                        max_tokens=100, stream=True)
    received = []
    with pytest.raises(openai.APIError) as info:
        async for chunk in stream:
            received.append(chunk)
    assert time.monotonic() - stack.peer.hung_at < 5.0
    assert "stopped responding" in info.value.message
    assert info.value.body["type"] == "service_unavailable" and info.value.body["code"] == 503
    assert "".join(c.choices[0].delta.content or "" for c in received) == stack.text(2)


async def test_dead_worker_non_streamed_is_503_within_5s(stack):
    stack.peer.mode = "hang"
    started = time.monotonic()
    with pytest.raises(openai.InternalServerError) as info:
        await stack.client.completions.create(model="tiny", prompt="x", max_tokens=100)
    assert time.monotonic() - started < 5.0
    assert info.value.status_code == 503 and "stopped responding" in info.value.body["message"]


async def test_request_timeout(make_stack):
    stack = await make_stack(request_timeout=0.5)
    stack.peer.step_delay = 0.2
    with pytest.raises(openai.APIStatusError) as info:
        await stack.client.completions.create(model="tiny", prompt="x", max_tokens=100)
    assert info.value.status_code == 504 and info.value.body["type"] == "timeout"
    rid = stack.peer.requests[0].request_id
    assert await wait_for(lambda: stack.peer.aborted(rid), timeout=1.0)


async def test_request_timeout_from_the_header(stack):
    stack.peer.step_delay = 0.2
    with pytest.raises(openai.APIStatusError) as info:
        await stack.client.completions.create(model="tiny", prompt="x", max_tokens=100,
                                              extra_headers={"x-timeout": "0.5"})
    assert info.value.status_code == 504 and "did not finish within 0.5 s" in info.value.body["message"]
    for value in ("0", "-1", "nan", "soon"):
        async with stack.http.post(stack.url + "/v1/completions", data=b'{"prompt": "x"}',
                                   headers={"Authorization": f"Bearer {KEY}", "x-timeout": value}) as r:
            assert r.status == 400 and (await r.json())["error"]["param"] == "x-timeout"


# ---------------------------------------------------------------------------------------------
# Readiness and metrics

async def test_ready_follows_heartbeats(make_stack):
    stack = await make_stack(beating=False)
    status, body, headers = await stack.get("/ready")
    assert status == 503
    assert body == {"error": {"message": "no worker is ready", "type": "service_unavailable", "param": None,
                              "code": "service_unavailable"}}
    assert (await stack.get("/ready", key=None))[0] == 503  # open, as /health: probes hold no key
    stack.peer.beating = True
    await wait_for(lambda: stack.gw.health.ready())
    status, body, _ = await stack.get("/ready")
    assert (status, body) == (200, {"status": "ready", "workers": 1})


async def test_metrics(stack):
    await stack.client.completions.create(model="tiny", prompt="x", max_tokens=3)
    stream = await stack.client.completions.create(model="tiny", prompt="x", max_tokens=2, stream=True)
    async for _ in stream:
        pass
    status, text, headers = await stack.get("/metrics")
    assert status == 200 and headers["Content-Type"].startswith("text/plain")
    lines = set(text.splitlines())
    for name in ("time_to_first_token_seconds", "e2e_request_latency_seconds", "request_queue_time_seconds"):
        assert f"inferno:{name}_count 2.0" in lines, name
    assert "inferno:inter_token_latency_seconds_count 3.0" in lines  # 2 gaps + 1 gap
    prompt = len(stack.tokenizer.encode("x"))
    for line in ("inferno:num_requests_running 3.0", "inferno:num_requests_waiting 1.0",
                 "inferno:kv_cache_usage_perc 0.25", "inferno:prefix_cache_hits_total 10.0",
                 "inferno:prefix_cache_queries_total 40.0", 'inferno:request_success_total{finished_reason="length"} 2.0',
                 f"inferno:prompt_tokens_total {2.0 * prompt}", "inferno:generation_tokens_total 5.0"):
        assert line in lines, line
    assert (await stack.get("/metrics", key=None))[0] == 401


async def test_metrics_take_their_own_token(make_stack):
    """--metrics-token: a scrape with it needs no tenant key, and a tenant's key no longer reads them."""
    stack = await make_stack(metrics_token="scrape-me")
    assert (await stack.get("/metrics", key="scrape-me"))[0] == 200
    assert [(await stack.get("/metrics", key=key))[0] for key in (KEY, None)] == [401, 401]  # the API key, none
    assert (await stack.get("/v1/models", key="scrape-me"))[0] == 401  # the token is no API key
    assert (await stack.get("/ready", key=None))[0] == 200


# ---------------------------------------------------------------------------------------------
# The entry point

async def test_entry_point_serves_at_once_and_drains_on_sigterm(nats_config, model_dir, tokenizer):
    port = free_port()
    env = {**os.environ, "INFERNO_API_KEYS": "k1, k2", "INFERNO_NATS_URL": nats_config.url}
    proc = subprocess.Popen([sys.executable, "-m", "services.gateway", "--subject-prefix", nats_config.subject_prefix,
                             "--port", str(port), "--model-dir", str(model_dir), "--model-name", "tiny",
                             "--log-format", "json"], cwd=Path(__file__).resolve().parents[2], env=env,
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    peer = None
    try:
        url = f"http://127.0.0.1:{port}"
        async with aiohttp.ClientSession(headers={"Authorization": "Bearer k2"}) as http:
            async def status(path: str) -> int:
                try:
                    async with http.get(url + path) as r:
                        return r.status
                except aiohttp.ClientConnectionError:
                    return 0
            deadline = time.monotonic() + 30
            while await status("/health") != 200:
                assert time.monotonic() < deadline and proc.poll() is None
                await asyncio.sleep(0.1)
            assert await status("/ready") == 503  # no worker yet
            peer = await Peer(nats_config, tokenizer).start()
            deadline = time.monotonic() + 10
            while await status("/ready") != 200:
                assert time.monotonic() < deadline
                await asyncio.sleep(0.05)
            peer.step_delay = 0.05
            client = openai.AsyncOpenAI(base_url=url + "/v1", api_key="k1", max_retries=0)
            stream = await client.completions.create(model="tiny", prompt="x", max_tokens=20, stream=True,
                                                     extra_body={"ignore_eos": True})
            text = ""
            async for chunk in stream:
                if not text:
                    proc.send_signal(signal.SIGTERM)  # in-flight streams still finish
                text += chunk.choices[0].text
            await client.close()
            assert text == tokenizer.decode([peer.script[i % len(peer.script)] for i in range(20)])
        assert await asyncio.to_thread(proc.wait, 15) == 0
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
        if peer is not None:
            await peer.close()
