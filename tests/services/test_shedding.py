"""Load shedding on a real nats-server: the real gateway and scheduler in front of a peer worker whose
heartbeats report a long queue; a request whose estimated wait passes --max-queue-seconds gets 429
within 50 ms (measured at the HTTP and NATS clients), and is admitted again once the queue drains."""

from __future__ import annotations

import json
import time

import aiohttp
import nats
import pytest

from services.gateway.app import bound_port, build_app, start_server
from services.gateway.gateway import Gateway
from services.gateway.nats_api import NatsApi
from services.worker.engine.model_config import ModelConfig
from shared.config import GatewayConfig
from shared.subjects import Subjects
from tests.services.test_gateway import model_dir, tokenizer  # noqa: F401
from tests.services.test_scheduler import MODEL, cluster, gen_request, tokens  # noqa: F401

SHED_LATENCY_BOUND = 0.050  # seconds


@pytest.fixture
async def gateway_url(nats_config, nats_conn, model_dir, tokenizer):  # noqa: F811
    mc = ModelConfig.from_dir(model_dir)
    gw = Gateway(GatewayConfig(model_name=MODEL, model_dir=str(model_dir)), tokenizer, max_model_len=mc.max_model_len,
                 vocab_size=mc.vocab_size, subject_prefix=nats_config.subject_prefix)
    runner, _ = await start_server(build_app(gw, nats_conn), "127.0.0.1", 0)
    nats_api = NatsApi(gw)
    await nats_api.start(nats_conn)
    yield f"http://127.0.0.1:{bound_port(runner)}"
    await nats_api.close()
    await runner.cleanup()


async def test_overload_is_shed_with_429_within_50ms(cluster, gateway_url, nats_config):  # noqa: F811
    sched = await cluster.scheduler(max_queue_seconds=2.0, admission_tokens_per_second=1000.0)
    worker = await cluster.worker("w1", interval=None, queued_prefill_tokens=2500, max_model_len=4096)
    await cluster.known("w1")
    body = json.dumps({"model": MODEL, "prompt": "Hello there, how are you today?", "max_tokens": 4}).encode()
    latencies = []
    async with aiohttp.ClientSession() as http:
        async def post() -> tuple[int, dict, dict]:
            async with http.post(gateway_url + "/v1/completions", data=body,
                                 headers={"Content-Type": "application/json"}) as r:
                return r.status, json.loads(await r.text()), dict(r.headers)

        await post()  # warm: connection, tokenizer
        for _ in range(30):
            t0 = time.perf_counter()
            status, answer, headers = await post()
            latencies.append(time.perf_counter() - t0)
            assert status == 429, answer
        assert answer["error"]["code"] == "rate_limit_exceeded"
        assert "estimated queueing time (2.5 s) exceeds the server's bound of 2 s" in answer["error"]["message"]
        assert headers["Retry-After"] == "1"
        assert max(latencies) < SHED_LATENCY_BOUND, latencies
        assert sched.stats.rejected[429] == 31 and worker.received == []

    # The NATS API sheds the same way (its 429 carries Retry-After in the terminal message's headers).
    nc = await nats.connect(nats_config.url)
    try:
        subject = Subjects(nats_config.subject_prefix).api_completions
        for _ in range(10):
            t0 = time.perf_counter()
            msg = await nc.request(subject, body, timeout=5)
            assert time.perf_counter() - t0 < SHED_LATENCY_BOUND
            assert (msg.headers["x-status"], msg.headers["Retry-After"]) == ("429", "1")
    finally:
        await nc.close()

    await worker.beat(queued_prefill_tokens=500)  # drained: 0.5 s of queue
    await cluster.known("w1")
    reply = await cluster.send(gen_request(tokens(20)))  # the peer takes it but emits nothing: asked directly
    assert reply.ok and reply.worker_id == "w1" and len(worker.received) == 1
