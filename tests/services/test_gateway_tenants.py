"""Tenants at the gateway: per-tenant limits answered with 429 and x-ratelimit-* on HTTP and on the NATS
API (one budget for both), the tenant folded into the prefix-cache salt, per-tenant metrics. Same peer
(scheduler + worker) as test_gateway.py, on a real nats-server."""

from __future__ import annotations

import asyncio
import json

import aiohttp
import nats
import openai
import pytest

from services.gateway.app import bound_port, build_app, start_server
from services.gateway.gateway import Gateway
from services.gateway.nats_api import NatsApi
from services.gateway.tenants import TenantsFile
from services.worker.engine.model_config import ModelConfig
from shared.config import GatewayConfig
from tests.services.test_gateway import KEY, MAX_BODY, Peer, Stack, model_dir, tokenizer, wait_for  # noqa: F401

TENANTS = {
    "tenants": {
        "acme": {"requests_per_minute": 3, "tokens_per_minute": 100_000},
        "slow": {"max_concurrent": 1},
        "small": {"tokens_per_minute": 100},
        "lab": {"share_prefix_cache": True},
    },
    "keys": {"sk-acme": "acme", "sk-acme-2": "acme", "sk-slow": "slow", "sk-small": "small", "sk-lab": "lab"},
}
HI = [{"role": "user", "content": "Say hello."}]
RATE_HEADERS = ("x-ratelimit-limit-requests", "x-ratelimit-remaining-requests", "x-ratelimit-reset-requests",
                "x-ratelimit-limit-tokens", "x-ratelimit-remaining-tokens", "x-ratelimit-reset-tokens")


@pytest.fixture
async def tenant_stack(nats_config, nats_conn, model_dir, tokenizer):  # noqa: F811
    made = []

    async def make(share: bool = False) -> Stack:
        peer = await Peer(nats_config, tokenizer).start()
        gcfg = GatewayConfig(model_name="tiny", model_dir=str(model_dir), api_keys=(KEY,), max_body_bytes=MAX_BODY,
                             share_prefix_cache=share)
        mc = ModelConfig.from_dir(model_dir)
        gw = Gateway(gcfg, tokenizer, max_model_len=mc.max_model_len, vocab_size=mc.vocab_size,
                     subject_prefix=nats_config.subject_prefix, tenants=TenantsFile.parse(TENANTS))
        runner, _ = await start_server(build_app(gw, nats_conn), "127.0.0.1", 0)
        nats_api = NatsApi(gw)
        await nats_api.start(nats_conn)
        url = f"http://127.0.0.1:{bound_port(runner)}"
        client = openai.AsyncOpenAI(base_url=url + "/v1", api_key=KEY, max_retries=0, timeout=20)
        stack = Stack(url, client, peer, gw, tokenizer, aiohttp.ClientSession(), nats_api)
        made.append((stack, runner))
        await wait_for(lambda: stack.gw.health.ready())
        return stack

    yield make
    for stack, runner in made:
        await stack.client.close()
        await stack.http.close()
        await stack.nats_api.close()
        await runner.cleanup()
        await stack.peer.close()


def chat(max_tokens: int = 3, **extra) -> bytes:
    return json.dumps({"model": "tiny", "messages": HI, "max_tokens": max_tokens, **extra}).encode()


async def nats_ask(nc, subject: str, body: bytes, key: str):
    msg = await nc.request(subject, body, headers={"Authorization": f"Bearer {key}"}, timeout=5)
    return int(msg.headers["x-status"]), json.loads(msg.data), msg.headers


async def test_requests_per_minute_429_with_headers_on_http_and_nats(tenant_stack, nats_config):
    stack = await tenant_stack()
    nc = await nats.connect(nats_config.url)
    try:
        status, body, headers = await stack.post("/v1/chat/completions", chat(), key="sk-acme")
        assert status == 200 and headers["x-ratelimit-remaining-requests"] == "2"  # on answers too
        assert headers["x-ratelimit-limit-tokens"] == "100000"
        # One budget per tenant, whichever key and transport.
        status, _, headers = await nats_ask(nc, stack.gw.subjects.api_chat_completions, chat(), "sk-acme-2")
        assert status == 200 and headers["x-ratelimit-remaining-requests"] == "1"
        status, _, headers = await stack.post("/v1/chat/completions", chat(), key="sk-acme")
        assert status == 200
        status, body, headers = await stack.post("/v1/chat/completions", chat(), key="sk-acme")
        assert status == 429
        assert body["error"]["code"] == "rate_limit_exceeded"
        assert "requests per minute (limit 3)" in body["error"]["message"]
        assert all(h in headers for h in RATE_HEADERS)
        assert (headers["x-ratelimit-limit-requests"], headers["x-ratelimit-remaining-requests"]) == ("3", "0")
        assert headers["x-ratelimit-limit-tokens"] == "100000" and headers["Retry-After"] == "20"
        status, body, headers = await nats_ask(nc, stack.gw.subjects.api_chat_completions, chat(), "sk-acme")
        assert status == 429 and body["error"]["code"] == "rate_limit_exceeded"
        assert headers["x-ratelimit-remaining-requests"] == "0" and headers["Retry-After"] == "20"
        # Another tenant, and the default one, are untouched.
        assert (await stack.post("/v1/chat/completions", chat(), key="sk-lab"))[0] == 200
        assert (await stack.post("/v1/chat/completions", chat(), key=KEY))[0] == 200
        metrics = (await stack.get("/metrics"))[1]
        assert 'inferno:tenant_requests_total{status="200",tenant="acme"} 3.0' in metrics
        assert 'inferno:tenant_requests_total{status="429",tenant="acme"} 2.0' in metrics
        assert 'inferno:tenant_requests_total{status="200",tenant="lab"} 1.0' in metrics
        assert 'inferno:tenant_tokens_total{kind="completion",tenant="acme"} 9.0' in metrics
    finally:
        await nc.close()


async def test_tokens_per_minute_counts_the_prompt_and_max_tokens(tenant_stack):
    stack = await tenant_stack()
    status, body, headers = await stack.post("/v1/chat/completions", chat(max_tokens=200), key="sk-small")
    assert status == 429 and "more than the limit of 100" in body["error"]["message"]
    assert headers["x-ratelimit-remaining-tokens"] == "100" and "x-ratelimit-limit-requests" not in headers
    assert (await stack.post("/v1/chat/completions", chat(max_tokens=5), key="sk-small"))[0] == 200
    status, _, headers = await stack.post("/v1/chat/completions", chat(max_tokens=90), key="sk-small")
    assert status == 429 and int(headers["x-ratelimit-remaining-tokens"]) < 100


async def test_concurrent_requests_are_limited_and_released(tenant_stack):
    stack = await tenant_stack()
    stack.peer.step_delay = 0.02
    first = asyncio.ensure_future(stack.post("/v1/chat/completions", chat(max_tokens=15), key="sk-slow"))
    await wait_for(lambda: stack.peer.requests)
    status, body, _ = await stack.post("/v1/chat/completions", chat(), key="sk-slow")
    assert status == 429 and "concurrent requests (limit 1)" in body["error"]["message"]
    assert (await first)[0] == 200
    assert (await stack.post("/v1/chat/completions", chat(), key="sk-slow"))[0] == 200


async def test_the_tenant_enters_the_prefix_cache_salt(tenant_stack):
    stack = await tenant_stack()
    for key in ("sk-acme", "sk-lab", KEY):
        assert (await stack.post("/v1/chat/completions", chat(cache_salt="x"), key=key))[0] == 200
    assert (await stack.post("/v1/chat/completions", chat(), key="sk-acme"))[0] == 200
    assert [r.cache_salt for r in stack.peer.requests] == ["t4:acmex", "sx", "t7:defaultx", "t4:acme"]


async def test_sharing_by_flag(tenant_stack):
    stack = await tenant_stack(share=True)
    for key in ("sk-acme", "sk-slow"):
        assert (await stack.post("/v1/chat/completions", chat(), key=key))[0] == 200
    assert [r.cache_salt for r in stack.peer.requests] == ["s", "s"]


async def test_a_request_stalled_in_routing_ends_by_its_deadline(tenant_stack, nats_config):
    """Deadlines (part 8): no scheduler answers (no responders are retried for 1.55 s), yet a request
    with x-timeout 0.3 s gets its 504 by then, on HTTP and on the NATS API."""
    stack = await tenant_stack()
    await stack.peer.stop_routing()
    t0 = asyncio.get_running_loop().time()
    async with stack.http.post(stack.url + "/v1/chat/completions", data=chat(),
                               headers={"Authorization": f"Bearer {KEY}", "x-timeout": "0.3"}) as r:
        status, body = r.status, json.loads(await r.text())
    took = asyncio.get_running_loop().time() - t0
    # The failure is waiting for the 1.55 s no-responder end; a loaded 2-core CI runner took 0.455 s.
    assert status == 504 and body["error"]["code"] == "timeout" and 0.3 <= took < 1.2, took
    nc = await nats.connect(nats_config.url)
    try:
        t0 = asyncio.get_running_loop().time()
        msg = await nc.request(stack.gw.subjects.api_chat_completions, chat(),
                               headers={"Authorization": f"Bearer {KEY}", "x-timeout": "0.3"}, timeout=5)
        took = asyncio.get_running_loop().time() - t0
        assert msg.headers["x-status"] == "504" and 0.3 <= took < 1.2, took
    finally:
        await nc.close()
    # Their routing attempts end by themselves (no responders, 1.55 s) and leave nothing behind.
    await wait_for(lambda: stack.gw.router.in_flight == 0, timeout=5)
