"""The gateway's side of a lost worker: restart detection from heartbeats, and which requests are
sent again (no token shown yet, twice at most) and which fail."""

from __future__ import annotations

import asyncio
from pathlib import Path

import pytest

from services.gateway.gateway import Gateway
from services.gateway.generation import MAX_MIGRATIONS, Generation
from services.gateway.schemas import parse_completion
from services.gateway.token_router import StreamFailed
from services.gateway.worker_health import WorkerHealth
from inferno.tools import make_model as mm
from services.worker.engine.model_config import ModelConfig
from shared.config import GatewayConfig
from shared.messages import TokenBatch, TokenDelta, WorkerHeartbeat
from shared.tokenizer import Tokenizer
from shared.wire import pack_ids

PROMPT = [1, 2, 3, 4]


def hb(worker_id: str, seq: int, timestamp: float) -> WorkerHeartbeat:
    return WorkerHeartbeat(worker_id=worker_id, role="mixed", model="m", ready=True, draining=False,
                           generate_subject=f"g.{worker_id}", abort_subject=f"a.{worker_id}", timestamp=timestamp,
                           seq=seq)


def test_a_worker_whose_seq_starts_again_later_is_a_restart_and_an_old_seq_a_late_arrival():
    restarted = []
    health = WorkerHealth(ttl=3.0, clock=lambda: 0.0)
    health.on_restart = restarted.append
    health.on_heartbeat(hb("w", 5, 100.0))
    health.on_heartbeat(hb("w", 6, 101.0))
    health.on_heartbeat(hb("w", 4, 99.0))  # late: dropped
    assert restarted == [] and health.workers["w"].heartbeat.seq == 6
    health.on_heartbeat(hb("w", 1, 102.0))  # a new process under the same id
    assert restarted == ["w"] and health.workers["w"].heartbeat.seq == 1
    health.on_heartbeat(hb("w", 2, 103.0))
    assert restarted == ["w"]


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory) -> Path:
    return mm.write_model(tmp_path_factory.mktemp("migration") / "tiny", preset="tiny")


@pytest.fixture
async def gw(model_dir):
    mc = ModelConfig.from_dir(model_dir)
    gw = Gateway(GatewayConfig(model_name="tiny", model_dir=str(model_dir)), Tokenizer.from_dir(model_dir),
                 max_model_len=mc.max_model_len, vocab_size=mc.vocab_size)
    gw.health.on_restart = gw._worker_restarted  # as start() does, without the watch task
    yield gw
    await gw.close()


def routed(gw: Gateway, rid: str, worker: str) -> Generation:
    spec = parse_completion({"model": "tiny", "prompt": PROMPT, "max_tokens": 8, "stream": True}, gw.limits)
    gen = Generation(gw, rid, spec, PROMPT, None, 0.0)
    gen.stream = gw.router.open(gen.request_ids)
    gen.stream.migrate = gen._migrate  # as start() does
    gw.router.assign(gen.stream, gen.request_ids[0], worker)
    return gen


def token(rid: str) -> TokenBatch:
    return TokenBatch.of("w", [TokenDelta(request_id=rid, token_ids=pack_ids([7]), prompt_tokens=len(PROMPT),
                                          completion_tokens=1)])


async def test_a_request_without_tokens_is_sent_again_at_most_twice(gw):
    gen = routed(gw, "cmpl-a", "w")
    rid = gen.request_ids[0]
    for attempt in range(MAX_MIGRATIONS):
        assert gen.stream.migrate(rid, "w") is True
        assert rid not in gen.stream.workers  # the watch leaves it alone meanwhile
        gw.router.assign(gen.stream, rid, "w")  # as a successful re-route does
    assert gen.stream.migrate(rid, "w") is False
    assert gw.metrics.request_migrations._value.get() == MAX_MIGRATIONS


async def test_a_request_that_showed_a_token_is_not_sent_again(gw):
    gen = routed(gw, "cmpl-b", "w")
    items = []
    gen.stream.inbox.attach(items.extend)
    gw.router.on_batch(token(gen.request_ids[0]))
    await asyncio.sleep(0)
    gen.choices[0].apply(items[0])
    assert gen.stream.migrate(gen.request_ids[0], "w") is False


async def test_a_restarted_worker_fails_its_streams_with_tokens_and_resends_the_others(gw):
    started = routed(gw, "cmpl-c", "w")
    waiting = routed(gw, "cmpl-d", "w")
    elsewhere = routed(gw, "cmpl-e", "v")
    seen: list = []
    started.stream.inbox.attach(seen.extend)
    gw.router.on_batch(token(started.request_ids[0]))
    await asyncio.sleep(0)
    started.choices[0].apply(seen.pop())
    gw.health.on_heartbeat(hb("w", 9, 100.0))
    gw.health.on_heartbeat(hb("w", 1, 101.0))  # worker "w" came back as a new process
    assert seen == [StreamFailed(503, "worker w restarted; the request was not completed")]
    assert waiting.migrations == 1 and not waiting.stream.failed
    assert elsewhere.migrations == 0 and elsewhere.stream.workers == {elsewhere.request_ids[0]: "v"}
    await asyncio.sleep(0.05)  # no NATS here: the re-route itself fails, and says why
    assert waiting.stream.failed
