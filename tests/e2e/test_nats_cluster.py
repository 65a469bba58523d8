"""A stack on a three-server NATS cluster: every service is given all three, the scheduler's affinity
bucket is replicated on all of them, and when one server is killed the stack serves on."""

from __future__ import annotations

import asyncio
import json
import threading
import time

import pytest

from tests.e2e.conftest import MODEL_NAME, start_stack


@pytest.fixture(scope="module")
def cluster_stack(tiny_model, tmp_path_factory):
    s = start_stack(tmp_path_factory.mktemp("cluster"), tiny_model, nats_cluster=3, kvstore_capacity_gb=0)
    yield s
    s.stop()


def complete(stack, prompt: str) -> str:
    from openai import OpenAI

    client = OpenAI(base_url=stack.url + "/v1", api_key="unused", max_retries=0, timeout=20)
    return client.completions.create(model=MODEL_NAME, prompt=prompt, max_tokens=8, temperature=0).choices[0].text


def read_bucket(stack, read):
    """`await read(kv)` on the affinity bucket, tried again for 20 s: the scheduler creates it once
    JetStream has elected its leader, and a server killed a moment ago may have led it."""
    import nats

    async def ask():
        nc = await nats.connect(stack.admin_nats_url.split(","))
        try:
            deadline = time.monotonic() + 20
            while True:
                try:
                    return await read(await nc.jetstream().key_value("inferno_affinity"))
                except Exception:
                    if time.monotonic() > deadline:
                        raise
                    await asyncio.sleep(0.2)
        finally:
            await nc.close()

    return asyncio.run(ask())


def bucket_replicas(stack) -> int:
    async def replicas(kv) -> int:
        return (await kv.status()).stream_info.config.num_replicas
    return read_bucket(stack, replicas)


def affinity_keys(stack) -> set[str]:
    async def keys(kv) -> set[str]:
        return set(await kv.keys())
    return read_bucket(stack, keys)


def gateway_server(stack) -> str:
    """The name of the NATS server the gateway is connected to (nats-N, by its port)."""
    import json

    ports = [url.rsplit(":", 1)[1] for url in stack.nats_url.split(",")]
    for line in reversed(stack.child("gateway").log.read_text().splitlines()):
        try:
            event = json.loads(line)
        except ValueError:
            continue
        if event.get("event") in ("nats_connected", "nats_reconnected") and event.get("url"):
            return f"nats-{ports.index(event['url'].rsplit(':', 1)[1])}"
    raise AssertionError("the gateway's log names no NATS server")


def stream(stack, i: int, started: threading.Event, dropped_ok: bool = False,
           max_tokens: int = 160) -> tuple[str, float]:
    """A streamed completion: ('ok' | the clean error's type, when it ended). dropped_ok: a connection
    that drops mid-stream (its gateway died) is an end too."""
    from openai import APIConnectionError, APIError, OpenAI

    client = OpenAI(base_url=stack.url + "/v1", api_key="unused", max_retries=0, timeout=30)
    # The HTTP client's own transport errors (its module varies with openai's version) when dropped_ok.
    ends = Exception if dropped_ok else (APIError, APIConnectionError)
    try:
        for _ in client.completions.create(model=MODEL_NAME, prompt=f"story {i}", max_tokens=max_tokens, stream=True,
                                           temperature=0, extra_body={"ignore_eos": True}):
            started.set()
        return "ok", time.monotonic()
    except ends as e:
        return type(e).__name__, time.monotonic()


def first_answer(stack, killed: float) -> str:
    """The answer of the first request that succeeds after a kill, sent again until one does: within 2 s."""
    while True:
        try:
            return complete(stack, "Hello there")
        except Exception:
            assert time.monotonic() - killed < 2, "no request succeeded within 2 s of the kill"
            time.sleep(0.05)


def test_the_stack_serves_on_when_a_nats_server_dies(cluster_stack):
    """32 streams in flight when one server of three is killed: each ends with its tokens or a clean
    error within 5 s, new requests succeed within 2 s, and the affinity bucket (replicated on all
    three) keeps its entries."""
    from concurrent.futures import ThreadPoolExecutor

    from openai import OpenAI

    assert len(cluster_stack.nats_url.split(",")) == 3
    assert bucket_replicas(cluster_stack) == 3
    before = complete(cluster_stack, "Hello there")
    for i in range(4):  # sessions pinned to a worker: entries in the affinity bucket
        OpenAI(base_url=cluster_stack.url + "/v1", api_key="unused", max_retries=0, timeout=20,
               default_headers={"x-session-affinity": f"session-{i}"}).completions.create(
            model=MODEL_NAME, prompt="Hi", max_tokens=2)
    deadline = time.monotonic() + 10
    while len(keys := affinity_keys(cluster_stack)) < 4:
        assert time.monotonic() < deadline, keys
        time.sleep(0.2)
    victim = cluster_stack.child(gateway_server(cluster_stack))  # the gateway's own: it must reconnect
    started = [threading.Event() for _ in range(32)]
    with ThreadPoolExecutor(32) as pool:
        futures = [pool.submit(stream, cluster_stack, i, started[i]) for i in range(32)]
        for event in started:
            assert event.wait(30), "a stream never began"
        victim.proc.kill()
        killed = time.monotonic()
        victim.proc.wait()
        # Requests sent from now on: the first that succeeds does so within 2 s (the services on the
        # dead server move to the others: reconnect pause 0.5 s plus jitter).
        answer = first_answer(cluster_stack, killed)
        recovered = time.monotonic() - killed
        ends = [f.result(timeout=60) for f in futures]
    assert answer == before and recovered < 2, recovered
    late = [(outcome, round(t - killed, 2)) for outcome, t in ends if t - killed > 5]
    assert not late, f"streams that ended more than 5 s after the kill: {late}"
    print(f"new request answered {recovered:.2f} s after the kill; streams: "
          f"{sum(o == 'ok' for o, _ in ends)} ok, {[o for o, _ in ends if o != 'ok']}")
    assert all(complete(cluster_stack, f"prompt {i}") for i in range(5))
    assert bucket_replicas(cluster_stack) == 3  # the bucket is still there, on the two left
    assert keys <= affinity_keys(cluster_stack)  # and its entries


def test_a_restarted_server_rejoins_with_its_jetstream_directory_and_catches_up(cluster_stack):
    """A server down (the test above killed one; nats-0 is killed here if not), an affinity entry written
    meanwhile on the other two; restarted with the same argv, hence its JetStream directory, it rejoins the
    cluster, its replica of the bucket is current again (no lag: it holds the entry written while it was
    down), and clients of it read that entry."""
    import nats

    names = [f"nats-{i}" for i in range(3)]
    dead = [n for n in names if cluster_stack.child(n).proc.poll() is not None]  # the test above's
    victim = cluster_stack.child(dead[0] if dead else "nats-0")
    if victim.proc.poll() is None:
        victim.proc.kill()
        victim.proc.wait()
    index = names.index(victim.name)
    urls = cluster_stack.admin_nats_url.split(",")
    urls = [urls[index]] + urls[:index] + urls[index + 1:]  # the victim's first

    async def put_on_the_others() -> None:
        nc = await nats.connect(urls[1:])
        try:
            kv = await nc.jetstream().key_value("inferno_affinity")
            await kv.put("rejoin-probe", b"written while it was down")
        finally:
            await nc.close()

    async def replica_of_victim() -> tuple[bool, int, bytes]:
        """Through the restarted server alone: (its replica current, its lag, the probe entry as read there)."""
        nc = await nats.connect(urls[:1], max_reconnect_attempts=0)
        try:
            js = nc.jetstream()
            info = await js.stream_info("KV_inferno_affinity")
            peers = {p.name: p for p in info.cluster.replicas or []}
            if info.cluster.leader == victim.name:
                current, lag = True, 0
            else:
                peer = peers.get(victim.name)
                current, lag = (peer.current, peer.lag or 0) if peer else (False, -1)
            value = (await (await js.key_value("inferno_affinity")).get("rejoin-probe")).value
            return current, lag, value
        finally:
            await nc.close()

    asyncio.run(put_on_the_others())
    cluster_stack.restart(victim)
    deadline = time.monotonic() + 30
    last = None
    while True:
        try:
            last = current, lag, value = asyncio.run(replica_of_victim())
            if current and lag == 0 and value == b"written while it was down":
                break
        except Exception as e:  # not listening yet, or JetStream still syncing
            last = repr(e)
        assert time.monotonic() < deadline, (f"{victim.name} did not rejoin and catch up within 30 s: exit "
                                             f"{victim.proc.poll()}, last {last}")
        time.sleep(0.3)
    assert complete(cluster_stack, "Hello there")  # and the stack serves with all three


def test_gateways_share_the_port_and_one_may_die(tiny_model, tmp_path):
    """`--api-server-count 2`: two gateway processes on one port (SO_REUSEPORT), each with its own
    NATS inbox. One killed under 16 streams: the other's streams finish, the dead one's end (their
    connections drop) within 5 s, new requests are answered by the other within 2 s, and the worker
    ends the dead one's requests once it misses its heartbeats (--gateway-ttl)."""
    from concurrent.futures import ThreadPoolExecutor

    stack = start_stack(tmp_path, tiny_model, api_server_count=2, kvstore_capacity_gb=0,
                        worker_args=("--gateway-ttl", "3"), gateway_args=("--heartbeat-interval", "0.2"))
    try:
        gateways = [stack.child("gateway-0"), stack.child("gateway-1")]
        assert all(g.proc.poll() is None for g in gateways)
        answers = {complete(stack, "Hello there") for _ in range(6)}  # new connections: both take some
        assert len(answers) == 1
        started = [threading.Event() for _ in range(16)]
        with ThreadPoolExecutor(16) as pool:
            futures = [pool.submit(stream, stack, i, started[i], dropped_ok=True, max_tokens=1000) for i in range(16)]
            for event in started:
                assert event.wait(30), "a stream never began"
            gateways[0].proc.kill()
            killed = time.monotonic()
            gateways[0].proc.wait()
            answer = first_answer(stack, killed)
            ended = orphans_ended(tmp_path / "worker-0.log", within=killed + 8)
            ends = [f.result(timeout=60) for f in futures]
        print(f"the worker ended {ended} of the dead gateway's requests; streams ended at "
              f"{sorted(round(t - killed, 2) for _, t in ends)} s after the kill")
        assert ended, "the worker went on generating the dead gateway's requests"
        assert {answer} == answers
        # The dead gateway's streams end at once; the other's run to their end, whenever that is.
        assert all(t - killed <= 5 for o, t in ends if o != "ok"), [(o, round(t - killed, 2)) for o, t in ends]
        outcomes = [o for o, _ in ends]
        assert "ok" in outcomes, outcomes  # the surviving gateway's streams went on
        assert any(o != "ok" for o in outcomes), outcomes  # SO_REUSEPORT gave the dead one some (1 - 2^-16)
        assert {complete(stack, "Hello there") for _ in range(4)} == answers
    finally:
        stack.stop()


def orphans_ended(log_path, within: float) -> int:
    """How many requests the worker ended for a silent gateway (its log), waiting until `within`."""
    while True:
        for line in log_path.read_text(errors="replace").splitlines():
            if "gateway silent, its requests ended" in line:
                return json.loads(line)["requests"]
        if time.monotonic() > within:
            return 0
        time.sleep(0.1)


def test_a_scheduler_killed_under_load_costs_at_most_clean_errors(tiny_model, tmp_path):
    """Two schedulers share the routing; one killed while 16 requests are being sent: each request
    is answered or ends with a clean 503 (a routing it held unanswered), none hangs, and the next
    ones are all answered by the other."""
    from concurrent.futures import ThreadPoolExecutor

    from openai import APIStatusError

    stack = start_stack(tmp_path, tiny_model, schedulers=2, kvstore_capacity_gb=0)
    try:
        def one(i: int):
            try:
                return complete(stack, f"request {i}")
            except APIStatusError as e:
                return e.status_code

        with ThreadPoolExecutor(8) as pool:
            futures = [pool.submit(one, i) for i in range(16)]
            stack.child("scheduler-0").proc.kill()
            results = [f.result(timeout=30) for f in futures]
        assert all(isinstance(r, str) or r == 503 for r in results), results
        assert all(isinstance(one(i), str) for i in range(6))
        # The worker's announced prefix cache reaches JetStream (every 5 s while it changes), and a
        # scheduler started now reads it whole instead of learning only what is stored from now on.
        deadline = time.monotonic() + 15
        while snapshot_seq(stack, "worker-0") < 1:
            assert time.monotonic() < deadline, "no snapshot of worker-0's cache in JetStream"
            time.sleep(0.5)
        late = stack.start_scheduler(2)
        deadline = time.monotonic() + 15
        while "kv_snapshots_loaded" not in late.log.read_text():
            assert time.monotonic() < deadline, "the late scheduler did not load the snapshots"
            time.sleep(0.2)
    finally:
        stack.stop()


def snapshot_seq(stack, worker_id: str) -> int:
    """The KV-events seq of the worker's newest snapshot in JetStream (0: none yet)."""
    import nats

    from shared.messages import KvSnapshot
    from shared.subjects import kv_snapshot_bucket
    from shared.wire import decode

    async def ask() -> int:
        nc = await nats.connect(stack.admin_nats_url.split(","))
        try:
            kv = await nc.jetstream().key_value(kv_snapshot_bucket("inferno"))
            return decode(KvSnapshot, (await kv.get(f"{worker_id}.0")).value).seq
        except Exception:
            return 0
        finally:
            await nc.close()

    return asyncio.run(ask())
