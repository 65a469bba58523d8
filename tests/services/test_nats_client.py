"""NatsConnection against a real nats-server: typed pub/sub, request/reply, failures, reconnects, KV."""

from __future__ import annotations

import asyncio
import time

import pytest

from shared.config import NatsConfig
from shared.errors import ServiceUnavailable
from shared.messages import AbortRequest, RouteReply, TokenBatch, TokenDelta
from shared.nats_client import connect_nats
from shared.subjects import SCHEDULER_QUEUE, Subjects
from shared.wire import encode, pack_ids


async def wait_until(predicate, timeout: float = 10.0, what: str = "condition") -> None:
    deadline = time.monotonic() + timeout
    while not predicate():
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out waiting for {what}")
        await asyncio.sleep(0.01)


def batch(n: int = 2) -> TokenBatch:
    return TokenBatch.of("worker-1", [
        TokenDelta(request_id=f"r{i}", token_ids=pack_ids([100 + i, 200 + i]), logprobs=[-0.5, -1.0],
                   completion_tokens=2 * (i + 1)) for i in range(n)])


@pytest.fixture
async def other_conn(nats_config):
    conn = await connect_nats(nats_config, "test-other", wait=10.0)
    try:
        yield conn
    finally:
        await conn.close()


async def test_publish_subscribe_typed(nats_conn, other_conn, nats_config):
    subject = Subjects(nats_config.subject_prefix).gateway_inbox("gw-1")
    got: list[TokenBatch] = []
    await nats_conn.subscribe(subject, TokenBatch, got.append)  # a plain (sync) handler
    sent = [batch(1), batch(3)]
    for b in sent:
        await other_conn.publish(subject, b)
    await wait_until(lambda: len(got) == 2, what="two batches")
    assert got == sent
    assert nats_conn.bad_messages.total == 0


async def test_subscription_is_live_when_subscribe_returns(nats_conn, other_conn, nats_config):
    """No message published right after subscribe() may be lost (nats-py 2.16's flush() alone allows it)."""
    prefix = nats_config.subject_prefix
    got: list[int] = []
    for i in range(100):
        subject = f"{prefix}.live.{i}"
        await nats_conn.subscribe(subject, AbortRequest, lambda msg: got.append(int(msg.request_ids[0])))
        await other_conn.publish(subject, AbortRequest(request_ids=[str(i)]))
    await wait_until(lambda: len(got) == 100, timeout=5.0, what="all 100 messages")
    assert sorted(got) == list(range(100))


async def test_request_reply(nats_conn, other_conn, nats_config):
    subject = Subjects(nats_config.subject_prefix).generate

    async def route(req: AbortRequest) -> RouteReply:
        return RouteReply.accepted(f"worker-{len(req.request_ids)}")

    await nats_conn.subscribe(subject, AbortRequest, route, queue=SCHEDULER_QUEUE)
    reply = await other_conn.request(subject, AbortRequest(request_ids=["a", "b", "c"]), RouteReply, timeout=2.0)
    assert reply == RouteReply.accepted("worker-3")


async def test_queue_group_delivers_each_request_once(nats_conn, other_conn, nats_config):
    subject = Subjects(nats_config.subject_prefix).generate
    handled = {"a": 0, "b": 0}

    def replica(name):
        def handle(req: AbortRequest) -> RouteReply:
            handled[name] += 1
            return RouteReply.accepted(name)
        return handle

    third = await connect_nats(nats_config, "replica-b", wait=5.0)
    try:
        await nats_conn.subscribe(subject, AbortRequest, replica("a"), queue=SCHEDULER_QUEUE)
        await third.subscribe(subject, AbortRequest, replica("b"), queue=SCHEDULER_QUEUE)
        replies = await asyncio.gather(*(other_conn.request(subject, AbortRequest(request_ids=[str(i)]), RouteReply)
                                         for i in range(40)))
        assert sum(handled.values()) == 40
        assert {r.worker_id for r in replies} <= {"a", "b"}
    finally:
        await third.close()


async def test_no_responders_is_503(nats_conn, nats_config):
    subject = Subjects(nats_config.subject_prefix).generate
    started = time.monotonic()
    with pytest.raises(ServiceUnavailable, match="no service is listening") as info:
        await nats_conn.request(subject, AbortRequest(request_ids=["x"]), RouteReply, timeout=5.0)
    assert time.monotonic() - started < 2.0  # answered by the server at once, not by the timeout
    assert info.value.status == 503 and info.value.error_type == "service_unavailable"


async def test_timeout_is_503_with_its_own_message(nats_conn, other_conn, nats_config):
    subject = Subjects(nats_config.subject_prefix).generate
    await nats_conn.subscribe(subject, AbortRequest, lambda req: None)  # listens, never answers
    with pytest.raises(ServiceUnavailable, match="no reply .* within 0.3s") as info:
        await other_conn.request(subject, AbortRequest(request_ids=["x"]), RouteReply, timeout=0.3)
    assert info.value.status == 503


async def test_malformed_reply_is_counted_and_503(nats_conn, other_conn, nats_config):
    subject = Subjects(nats_config.subject_prefix).generate

    async def wrong(req: AbortRequest):
        return AbortRequest(request_ids=[])  # a reply of the wrong type

    await nats_conn.subscribe(subject, AbortRequest, wrong)
    with pytest.raises(ServiceUnavailable, match="malformed RouteReply"):
        await other_conn.request(subject, AbortRequest(request_ids=["x"]), RouteReply)
    assert other_conn.bad_messages.count(type_tag="route_reply", reason="type") == 1


async def test_garbage_is_counted_and_the_subscriber_keeps_working(nats_conn, other_conn, nats_config):
    subject = Subjects(nats_config.subject_prefix).worker_abort("worker-1")
    got: list[AbortRequest] = []

    async def handle(msg: AbortRequest) -> None:
        got.append(msg)

    await nats_conn.subscribe(subject, AbortRequest, handle)
    await other_conn.client.publish(subject, b"\xc1 not msgpack")
    await other_conn.client.publish(subject, encode(RouteReply.accepted("w")))  # another subject's message
    await other_conn.client.publish(subject, encode(batch()))
    await other_conn.publish(subject, AbortRequest(request_ids=["r1"], reason="client disconnected"))
    await wait_until(lambda: len(got) == 1, what="the good message")
    assert got == [AbortRequest(request_ids=["r1"], reason="client disconnected")]
    assert nats_conn.bad_messages.total == 3
    assert nats_conn.bad_messages.count(reason="malformed") == 1
    assert nats_conn.bad_messages.count(reason="type") == 2


async def test_a_failing_handler_does_not_stop_the_subscription(nats_conn, other_conn, nats_config):
    subject = Subjects(nats_config.subject_prefix).worker_abort("worker-1")
    got: list[list[str]] = []

    async def handle(msg: AbortRequest) -> None:
        if msg.reason == "explode":
            raise RuntimeError("handler bug")
        got.append(msg.request_ids)

    await nats_conn.subscribe(subject, AbortRequest, handle)
    await other_conn.publish(subject, AbortRequest(request_ids=["a"], reason="explode"))
    await other_conn.publish(subject, AbortRequest(request_ids=["b"]))
    await wait_until(lambda: got == [["b"]], what="the message after the failure")


async def test_reconnect_after_server_restart(nats_server, nats_config):
    states: list[bool] = []
    sub_conn = await connect_nats(nats_config, "sub", on_state=states.append, wait=5.0)
    pub_conn = await connect_nats(nats_config, "pub", wait=5.0)
    try:
        assert sub_conn.connected and states == [True]
        subject = Subjects(nats_config.subject_prefix).heartbeat
        got: list[AbortRequest] = []
        await sub_conn.subscribe(subject, AbortRequest, got.append)
        await pub_conn.publish(subject, AbortRequest(request_ids=["before"]))
        await wait_until(lambda: len(got) == 1, what="the message before the restart")

        nats_server.stop()
        await wait_until(lambda: not sub_conn.connected and not pub_conn.connected, what="disconnect")
        assert states == [True, False]
        with pytest.raises(ServiceUnavailable, match="connection is down"):
            await pub_conn.request(subject, AbortRequest(request_ids=["x"]), RouteReply)
        await asyncio.sleep(0.5)  # a few failed reconnect attempts
        assert not sub_conn.connected

        nats_server.start()
        await wait_until(lambda: sub_conn.connected and pub_conn.connected, timeout=15.0, what="reconnect")
        assert states == [True, False, True]
        await pub_conn.flush()
        await sub_conn.flush()  # the subscription has been replayed to the new server
        await pub_conn.publish(subject, AbortRequest(request_ids=["after"]))
        await wait_until(lambda: len(got) == 2, what="the message after the restart")
        assert got[1] == AbortRequest(request_ids=["after"])
    finally:
        await sub_conn.close()
        await pub_conn.close()
    assert states[-1] is False


async def test_first_connect_waits_for_the_server(nats_server, nats_config):
    nats_server.stop()
    states: list[bool] = []
    connecting = asyncio.create_task(connect_nats(nats_config, "early", on_state=states.append, wait=20.0))
    await asyncio.sleep(0.5)
    assert not connecting.done()
    nats_server.start()
    conn = await asyncio.wait_for(connecting, 15.0)
    try:
        assert conn.connected and states == [True]
        await conn.flush()
    finally:
        await conn.close()


async def test_first_connect_gives_up_at_the_deadline(nats_server, nats_config):
    nats_server.stop()
    started = time.monotonic()
    with pytest.raises(ServiceUnavailable, match="could not connect to NATS"):
        await connect_nats(nats_config, "late", wait=0.6)
    assert 0.5 < time.monotonic() - started < 3.0


async def test_first_connect_reports_the_cause(nats_server_factory):
    locked = nats_server_factory(extra_args=("--user", "svc", "--pass", "secret"))
    with pytest.raises(ServiceUnavailable, match="Authorization Violation"):
        await connect_nats(NatsConfig(url=locked.url, connect_timeout=0.5), "no-creds", wait=1.5)
    conn = await connect_nats(NatsConfig(url=f"nats://svc:secret@127.0.0.1:{locked.port}"), "creds", wait=5.0)
    try:
        assert conn.connected
    finally:
        await conn.close()


async def test_kv_bucket(nats_conn, other_conn, nats_server):
    kv = await nats_conn.kv_bucket("test_affinity", ttl=60.0)
    await kv.put("session-1", b"worker-3")
    assert (await kv.get("session-1")).value == b"worker-3"
    again = await other_conn.kv_bucket("test_affinity", ttl=60.0)  # opens the existing bucket
    assert (await again.get("session-1")).value == b"worker-3"
    status = await kv.status()
    assert status.bucket == "test_affinity" and status.ttl == 60.0
    # Several replicas creating the same new bucket at once all end up with it.
    a, b = await asyncio.gather(nats_conn.kv_bucket("test_race", ttl=5.0), other_conn.kv_bucket("test_race", ttl=5.0))
    await a.put("k", b"v")
    assert (await b.get("k")).value == b"v"


async def test_kv_bucket_without_jetstream_is_503(nats_server_factory, nats_config):
    plain = nats_server_factory(jetstream=False)
    conn = await connect_nats(NatsConfig(url=plain.url, request_timeout=2.0), "no-js", wait=5.0)
    try:
        with pytest.raises(ServiceUnavailable, match="JetStream is not enabled") as info:
            await conn.kv_bucket("test_affinity", ttl=60.0)
        assert info.value.status == 503
    finally:
        await conn.close()


async def test_drain_closes(nats_conn):
    assert nats_conn.connected
    await nats_conn.drain()
    assert not nats_conn.connected and nats_conn.client.is_closed
    await nats_conn.drain()  # idempotent
    await nats_conn.close()


def test_the_first_reconnect_of_an_outage_goes_at_once_to_another_server_of_the_cluster():
    """A cluster's other servers are up when one dies: no pause, and never the lost one first. Later
    attempts (and a lone server's) wait the pause plus jitter, so a fleet does not hammer it in step."""
    from types import SimpleNamespace
    from urllib.parse import urlparse

    from shared.nats_client import FAILOVER_JITTER, NatsConnection

    cfg = NatsConfig(url="nats://a:1,nats://b:2,nats://c:3")
    conn = NatsConnection(cfg, "t")
    pool = [SimpleNamespace(uri=urlparse(u)) for u in cfg.servers]
    conn._server = "a:1"  # connected to a until it died
    for _ in range(20):
        server, delay = conn._next_server(pool, {})
        assert server.uri.netloc != "a:1" and 0 <= delay <= FAILOVER_JITTER
    conn._errors_while_down = 1  # that try failed too: the pause and any server
    server, delay = conn._next_server(pool, {})
    assert cfg.reconnect_time_wait <= delay <= cfg.reconnect_time_wait + cfg.reconnect_jitter
    lone = NatsConnection(NatsConfig(url="nats://a:1"), "t")
    lone._server = "a:1"
    assert lone._next_server(pool[:1], {})[1] >= cfg.reconnect_time_wait
