"""The scheduler against a real nats-server, with small real worker peers and a gateway-side requester."""

from __future__ import annotations

import asyncio
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import msgpack
import pytest

from services.scheduler.affinity import session_key
from services.scheduler.service import Scheduler
from shared.block_hash import prefix_block_hashes, request_block_key
from shared.config import NatsConfig, RouterConfig
from shared.messages import GenerateRequest, KvEvents, RouteReply, WireSamplingParams, WorkerHeartbeat
from shared.nats_client import NatsConnection, connect_nats
from shared.sampling_params import SamplingParams
from shared.subjects import Subjects
from shared.wire import pack_ids

MODEL = "tiny"
ROOT = Path(__file__).resolve().parents[2]


class PeerWorker:
    """A stand-in worker process: its own NATS connection, heartbeats, KV events, a generate inbox."""

    def __init__(self, nats_cfg: NatsConfig, worker_id: str, interval: float | None = 0.5, **load):
        self.nats_cfg = nats_cfg
        self.subjects = Subjects(nats_cfg.subject_prefix)
        self.worker_id = worker_id
        self.interval = interval  # None: heartbeats only when the test calls beat()
        self.load = dict(load)
        self.seq = 0
        self.kv_seq = 0
        self.received: list[GenerateRequest] = []
        self.conn: NatsConnection | None = None
        self._task: asyncio.Task | None = None
        self._sub = None

    async def start(self) -> PeerWorker:
        self.conn = await connect_nats(self.nats_cfg, self.worker_id, wait=5.0)
        self._sub = await self.conn.subscribe(self.subjects.worker_generate(self.worker_id), GenerateRequest,
                                              self.take)
        await self.beat()
        if self.interval is not None:
            self._task = asyncio.create_task(self._beats())
        return self

    def take(self, req: GenerateRequest) -> RouteReply:
        """A worker acknowledges each forwarded request."""
        self.received.append(req)
        return RouteReply.accepted(self.worker_id)

    def heartbeat(self) -> WorkerHeartbeat:
        fields = dict(role="mixed", model=MODEL, ready=True, draining=False, block_size=16)
        fields.update(self.load)
        return WorkerHeartbeat(worker_id=self.worker_id, generate_subject=self.subjects.worker_generate(self.worker_id),
                               abort_subject=self.subjects.worker_abort(self.worker_id), timestamp=time.time(),
                               seq=self.seq, **fields)

    async def beat(self, **load) -> None:
        self.load.update(load)
        self.seq += 1
        await self.conn.publish(self.subjects.heartbeat, self.heartbeat())
        await self.conn.flush()

    async def _beats(self) -> None:
        while True:
            await asyncio.sleep(self.interval)
            await self.beat()

    async def store_blocks(self, hashes: list[bytes]) -> None:
        self.kv_seq += 1
        await self.conn.publish(self.subjects.kv_events, KvEvents(worker_id=self.worker_id, seq=self.kv_seq,
                                                                  stored=hashes))
        await self.conn.flush()

    async def silence(self) -> None:
        """Stop heartbeating, as a crashed or partitioned worker does."""
        if self._task is not None:
            self._task.cancel()
            self._task = None

    async def close(self) -> None:
        await self.silence()
        if self.conn is not None:
            await self.conn.close()

    async def wait_received(self, n: int, timeout: float = 2.0) -> list[GenerateRequest]:
        deadline = time.monotonic() + timeout
        while len(self.received) < n:
            assert time.monotonic() < deadline, f"{self.worker_id} got {len(self.received)} of {n} requests"
            await asyncio.sleep(0.01)
        return self.received


def gen_request(prompt: list[int], rid: str = "r", model: str = MODEL, session_id: str | None = None,
                cache_salt: str = "") -> GenerateRequest:
    return GenerateRequest(request_id=rid, model=model, prompt_ids=pack_ids(prompt),
                           sampling=WireSamplingParams.from_params(SamplingParams(max_tokens=4)),
                           reply_to="t.gateway.gw.tokens", session_id=session_id, cache_salt=cache_salt,
                           gateway_id="gw")


def tokens(n: int, start: int = 1000) -> list[int]:
    return list(range(start, start + n))


async def wait_for(predicate, timeout: float = 3.0, what: str = "condition") -> None:
    deadline = time.monotonic() + timeout
    while not predicate():
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        await asyncio.sleep(0.01)


class Cluster:
    """Scheduler replicas and peer workers of one test, torn down in reverse."""

    def __init__(self, nats_cfg: NatsConfig, requester: NatsConnection):
        self.nats_cfg = nats_cfg
        self.requester = requester
        self.subjects = Subjects(nats_cfg.subject_prefix)
        self.schedulers: list[Scheduler] = []
        self.workers: dict[str, PeerWorker] = {}

    async def scheduler(self, **cfg) -> Scheduler:
        conn = await connect_nats(self.nats_cfg, f"sched-{len(self.schedulers)}", wait=5.0)
        sched = Scheduler(RouterConfig(**cfg), conn)
        await sched.start()
        self.schedulers.append(sched)
        return sched

    async def worker(self, worker_id: str, interval: float | None = 0.5, **load) -> PeerWorker:
        w = await PeerWorker(self.nats_cfg, worker_id, interval, **load).start()
        self.workers[worker_id] = w
        return w

    async def known(self, *worker_ids: str) -> None:
        """Wait until every scheduler has the workers' latest heartbeats."""
        def ready() -> bool:
            return all(s.registry.workers.get(wid) is not None
                       and s.registry.workers[wid].heartbeat.seq == self.workers[wid].seq
                       for s in self.schedulers for wid in worker_ids)
        await wait_for(ready, what=f"schedulers to see {worker_ids}")

    async def send(self, req: GenerateRequest) -> RouteReply:
        return await self.requester.request(self.subjects.generate, req, RouteReply, timeout=2.0)

    async def close(self) -> None:
        for w in self.workers.values():
            await w.close()
        for s in self.schedulers:
            await s.stop()
            await s.conn.close()


@pytest.fixture
async def cluster(nats_config, nats_conn):
    c = Cluster(nats_config, nats_conn)
    try:
        yield c
    finally:
        await c.close()


def counts(cluster: Cluster) -> dict[str, int]:
    return {wid: len(w.received) for wid, w in cluster.workers.items()}


# ---------------------------------------------------------------------------------------------


async def test_long_shared_prompt_goes_to_the_worker_with_the_most_cached_prefix(cluster):
    sched = await cluster.scheduler()
    system = tokens(2000)  # 125 blocks
    hashes = prefix_block_hashes(system, 16, request_block_key(MODEL, "acme"))
    some = await cluster.worker("w-some", active_decode_tokens=0)
    most = await cluster.worker("w-most", active_decode_tokens=800)
    await cluster.worker("w-none", active_decode_tokens=0)
    await some.store_blocks(hashes[:40])
    await most.store_blocks(hashes)
    await cluster.known("w-some", "w-most", "w-none")
    await wait_for(lambda: len(sched.registry.workers["w-most"].kv) == 125, what="KV events")

    req = gen_request(system + tokens(37, start=5), rid="req-1", cache_salt="acme")
    reply = await cluster.send(req)
    assert reply == RouteReply.accepted("w-most")
    (got,) = await most.wait_received(1)
    assert got == req.forwarded_to("w-most")
    assert sched.stats.cached_tokens == 2000 and sched.stats.prompt_tokens == 2037

    # Another tenant's salt shares no blocks: w-most's load (800) now loses to the idle ones.
    reply = await cluster.send(gen_request(system, rid="req-2", cache_salt="other"))
    assert reply.worker_id == "w-none"


async def test_without_cache_the_least_loaded_worker_wins(cluster):
    await cluster.scheduler()
    await cluster.worker("w-a", active_decode_tokens=3000, num_running=10)
    await cluster.worker("w-b", active_decode_tokens=500, queued_prefill_tokens=100, num_running=2)
    await cluster.worker("w-c", active_decode_tokens=1200, num_running=4)
    await cluster.known("w-a", "w-b", "w-c")
    reply = await cluster.send(gen_request(tokens(300), rid="one"))
    assert reply == RouteReply.accepted("w-b")
    await cluster.workers["w-b"].wait_received(1)


async def test_a_burst_spreads_over_two_idle_workers(cluster):
    sched = await cluster.scheduler()
    await cluster.worker("w-a", interval=None)
    await cluster.worker("w-b", interval=None)
    await cluster.known("w-a", "w-b")
    replies = await asyncio.gather(*(cluster.send(gen_request(tokens(200), rid=f"b{i}")) for i in range(20)))
    assert all(r.ok for r in replies)
    assert sorted(r.worker_id for r in replies).count("w-a") == 10
    await cluster.workers["w-a"].wait_received(10)
    await cluster.workers["w-b"].wait_received(10)
    assert counts(cluster) == {"w-a": 10, "w-b": 10}
    assert sched.stats.routed == 20


async def test_a_silent_worker_is_gone_within_the_heartbeat_ttl(cluster):
    sched = await cluster.scheduler(heartbeat_ttl=3.0)
    system = tokens(640)
    favourite = await cluster.worker("w-fav")
    await cluster.worker("w-other", active_decode_tokens=1_000_000)
    await favourite.store_blocks(prefix_block_hashes(system, 16, request_block_key(MODEL, "")))
    await cluster.known("w-fav", "w-other")
    await wait_for(lambda: len(sched.registry.workers["w-fav"].kv) == 40, what="KV events")
    assert (await cluster.send(gen_request(system, rid="before"))).worker_id == "w-fav"

    await favourite.beat()
    last_beat = time.monotonic()
    await favourite.silence()  # still subscribed: only the heartbeats stop
    n = 0
    while True:
        n += 1
        reply = await cluster.send(gen_request(system, rid=f"after-{n}"))
        if reply.worker_id == "w-other":
            break
        # 3 missed heartbeats (TTL 3 s), plus the heartbeat's own delivery on a busy machine.
        assert time.monotonic() - last_beat < 4.0
        await asyncio.sleep(0.05)
    elapsed = time.monotonic() - last_beat
    assert 2.7 < elapsed < 4.0, elapsed
    assert "w-fav" not in sched.registry.workers  # with its KV index
    reply = await cluster.send(gen_request(system, rid="later"))
    assert reply.worker_id == "w-other"


async def test_the_sweep_drops_a_silent_worker_without_traffic(cluster):
    sched = await cluster.scheduler(heartbeat_ttl=1.0)
    w = await cluster.worker("w-a", interval=0.2)
    await cluster.known("w-a")
    await w.silence()
    await wait_for(lambda: "w-a" not in sched.registry.workers, timeout=2.0, what="the sweep")


async def test_not_ready_and_draining_workers_get_nothing(cluster):
    await cluster.scheduler()
    await cluster.worker("w-loading", ready=False)
    await cluster.worker("w-draining", draining=True)
    await cluster.worker("w-prefill", role="prefill")
    await cluster.worker("w-ok", active_decode_tokens=100000)
    await cluster.known("w-loading", "w-draining", "w-prefill", "w-ok")
    for i in range(8):
        assert (await cluster.send(gen_request(tokens(64), rid=f"r{i}"))).worker_id == "w-ok"
    await cluster.workers["w-ok"].wait_received(8)
    await cluster.workers["w-ok"].beat(draining=True)
    await cluster.known("w-ok")
    reply = await cluster.send(gen_request(tokens(64), rid="late"))
    assert (reply.ok, reply.error_status, reply.error_type) == (False, 503, "service_unavailable")
    await asyncio.sleep(0.1)
    assert counts(cluster) == {"w-loading": 0, "w-draining": 0, "w-prefill": 0, "w-ok": 8}


async def test_429_when_every_worker_queue_is_full(cluster):
    await cluster.scheduler(max_waiting=3)
    a = await cluster.worker("w-a", interval=None, num_waiting=3)
    b = await cluster.worker("w-b", interval=None, num_waiting=1)
    await cluster.known("w-a", "w-b")
    # w-b has room for two more (1 waiting + routed since its heartbeat < 3).
    assert [(await cluster.send(gen_request(tokens(20), rid=f"r{i}"))).worker_id for i in range(2)] == ["w-b", "w-b"]
    reply = await cluster.send(gen_request(tokens(20), rid="r-full"))
    assert reply == RouteReply.rejected(429, "rate_limit_exceeded",
                                        "Every worker has 3 or more requests waiting; retry later.", retry_after=1.0)
    # A heartbeat that reports the queue drained opens it again.
    await a.beat(num_waiting=0)
    await cluster.known("w-a")
    assert (await cluster.send(gen_request(tokens(20), rid="r-again"))).worker_id == "w-a"
    await b.wait_received(2)


async def test_503_when_no_worker_is_live(cluster):
    sched = await cluster.scheduler()
    reply = await cluster.send(gen_request(tokens(10)))
    assert reply == RouteReply.rejected(503, "service_unavailable", "no worker is available", retry_after=1.0)
    assert sched.stats.rejected == {503: 1}


async def test_404_for_an_unknown_model(cluster):
    await cluster.scheduler()
    await cluster.worker("w-a")
    await cluster.known("w-a")
    reply = await cluster.send(gen_request(tokens(10), model="no-such-model"))
    assert (reply.ok, reply.error_status, reply.error_type) == (False, 404, "model_not_found")
    assert reply.error_message == "The model `no-such-model` does not exist."


async def test_session_affinity_across_two_replicas_and_after_the_worker_dies(cluster, nats_conn):
    s1 = await cluster.scheduler(heartbeat_ttl=1.0)
    s2 = await cluster.scheduler(heartbeat_ttl=1.0)
    for wid in ("w-a", "w-b", "w-c"):
        await cluster.worker(wid, interval=0.25)
    await cluster.known("w-a", "w-b", "w-c")

    replies = [await cluster.send(gen_request(tokens(100, start=i), rid=f"s{i}", session_id="chat-1"))
               for i in range(20)]
    homes = {r.worker_id for r in replies}
    assert len(homes) == 1, homes
    (home,) = homes
    assert s1.stats.routed > 0 and s2.stats.routed > 0, "the queue group should share the requests"
    assert s1.stats.sticky + s2.stats.sticky == 19
    await cluster.workers[home].wait_received(20)

    bucket = await nats_conn.kv_bucket("inferno_affinity")
    assert (await bucket.get(session_key("chat-1"))).value == home.encode()

    # Without a session, cost routing spreads the same traffic.
    spread = {(await cluster.send(gen_request(tokens(100), rid=f"n{i}"))).worker_id for i in range(6)}
    assert len(spread) > 1

    # The session's worker dies: the session moves, once, to one worker both replicas agree on.
    await cluster.workers[home].close()
    await wait_for(lambda: all(home not in s.registry.workers for s in (s1, s2)), timeout=2.0,
                   what="the dead worker to leave both registries")
    moved = [await cluster.send(gen_request(tokens(100, start=i), rid=f"m{i}", session_id="chat-1"))
             for i in range(12)]
    new_homes = {r.worker_id for r in moved}
    assert len(new_homes) == 1 and home not in new_homes, new_homes
    (new_home,) = new_homes
    assert (await bucket.get(session_key("chat-1"))).value == new_home.encode()


async def test_concurrent_first_requests_of_a_session_agree_across_replicas(cluster):
    await cluster.scheduler()
    await cluster.scheduler()
    for wid in ("w-a", "w-b", "w-c", "w-d"):
        await cluster.worker(wid, interval=None)
    await cluster.known("w-a", "w-b", "w-c", "w-d")
    replies = await asyncio.gather(*(cluster.send(gen_request(tokens(50), rid=f"c{i}", session_id=f"sess-{i % 3}"))
                                     for i in range(30)))
    for k in range(3):
        assert len({r.worker_id for i, r in enumerate(replies) if i % 3 == k}) == 1


async def test_garbage_on_the_generate_subject_is_counted_and_serving_goes_on(cluster, nats_conn):
    sched = await cluster.scheduler()
    await cluster.worker("w-a")
    await cluster.known("w-a")
    nc = nats_conn.client
    await nc.publish(cluster.subjects.generate, b"garbage")
    await nc.publish(cluster.subjects.generate, msgpack.packb({"t": "token_batch", "v": 1}))
    await nc.publish(cluster.subjects.generate, msgpack.packb({"t": "generate_request", "v": 1, "model": MODEL}))
    await nc.flush()
    await wait_for(lambda: sched.conn.bad_messages.total == 3, what="bad messages to be counted")
    assert sched.conn.bad_messages.count(reason="malformed") == 1
    assert sched.conn.bad_messages.count(reason="type") == 1
    assert sched.conn.bad_messages.count(reason="field") == 1
    assert (await cluster.send(gen_request(tokens(10), rid="fine"))).worker_id == "w-a"


async def test_a_failure_while_routing_becomes_a_500_reply(cluster):
    sched = await cluster.scheduler()
    broken = await cluster.worker("w-broken", interval=None)
    # A heartbeat naming an invalid subject: forwarding to it fails inside the handler.
    await broken.conn.publish(cluster.subjects.heartbeat, WorkerHeartbeat(
        worker_id="w-broken", role="mixed", model=MODEL, ready=True, draining=False, generate_subject="bad subject",
        abort_subject="", timestamp=time.time(), seq=2))
    await wait_for(lambda: "w-broken" in sched.registry.workers
                   and sched.registry.workers["w-broken"].heartbeat.seq == 2)
    reply = await cluster.send(gen_request(tokens(10), rid="x"))
    assert (reply.ok, reply.error_status, reply.error_type) == (False, 500, "internal_error")
    assert sched.stats.errors == 1
    await cluster.worker("w-good", interval=None)
    await cluster.known("w-good")
    await broken.beat(draining=True)
    await cluster.known("w-broken")
    assert (await cluster.send(gen_request(tokens(10), rid="y"))).worker_id == "w-good"


async def test_the_scheduler_runs_as_a_process_and_exits_cleanly_on_sigterm(nats_config, nats_conn):
    env = {**os.environ, "PYTHONUNBUFFERED": "1"}
    proc = subprocess.Popen([sys.executable, "-m", "services.scheduler", "--nats-url", nats_config.url,
                             "--subject-prefix", nats_config.subject_prefix, "--log-format", "json",
                             "--max-waiting", "8"],
                            cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT)
    worker = await PeerWorker(nats_config, "w-proc", interval=0.2).start()
    try:
        subjects = Subjects(nats_config.subject_prefix)
        deadline = time.monotonic() + 20.0
        while True:  # until the process is up and has heard the worker
            try:
                reply = await nats_conn.request(subjects.generate, gen_request(tokens(10)), RouteReply, timeout=0.5)
                if reply.ok:
                    break
            except Exception:
                pass
            assert proc.poll() is None, proc.stdout.read().decode()
            assert time.monotonic() < deadline, "the scheduler process did not start serving"
            await asyncio.sleep(0.1)
        assert reply.worker_id == "w-proc"
        await worker.wait_received(1)
        proc.send_signal(signal.SIGTERM)
        rc = await asyncio.to_thread(proc.wait, 10)
        out = proc.stdout.read().decode()
        assert rc == 0, out
        assert '"event": "scheduler_ready"' in out and '"event": "scheduler_stopped"' in out
    finally:
        await worker.close()
        if proc.poll() is None:
            proc.kill()
            proc.wait()


async def test_a_scheduler_started_late_reads_the_workers_caches_from_jetstream(cluster, nats_conn):
    """A worker put its announced blocks into JetStream (KvSnapshot, in parts); a scheduler started
    after that knows them whole and routes by them, and the worker's next report applies on top."""
    from services.worker import kv_snapshot
    from shared.subjects import kv_snapshot_bucket

    system = tokens(2000)  # 125 blocks
    hashes = prefix_block_hashes(system, 16, request_block_key(MODEL, "acme"))
    most = await cluster.worker("w-most", active_decode_tokens=800)
    await cluster.worker("w-none", active_decode_tokens=0)
    mirror = kv_snapshot.KvMirror()
    mirror.apply(7, hashes[:-1], [], cleared=True)
    old_part_size, kv_snapshot.PART_BLOCKS = kv_snapshot.PART_BLOCKS, 50  # three parts
    try:
        await mirror.put(await nats_conn.kv_bucket(kv_snapshot_bucket(cluster.nats_cfg.subject_prefix)), "w-most", 0.0)
    finally:
        kv_snapshot.PART_BLOCKS = old_part_size
    most.kv_seq = 7
    sched = await cluster.scheduler()
    index = sched.registry.orphan_indexes.get("w-most") or sched.registry.workers["w-most"].kv
    assert (len(index), index.seq, index.complete) == (124, 7, True)
    await most.store_blocks(hashes[-1:])  # report 8: in order after the snapshot
    await cluster.known("w-most", "w-none")
    await wait_for(lambda: len(sched.registry.workers["w-most"].kv) == 125, what="the next report")
    reply = await cluster.send(gen_request(system + tokens(37, start=5), rid="late", cache_salt="acme"))
    assert reply == RouteReply.accepted("w-most")


async def test_a_request_not_acknowledged_in_time_is_withdrawn_from_that_worker(cluster):
    """A slow worker that takes a request after the scheduler gave up on it would run it beside the
    next worker: the scheduler aborts it there before routing on."""
    from shared.messages import AbortRequest

    await cluster.scheduler(forward_timeout=0.2)
    slow = await cluster.worker("w-slow")
    other = await cluster.worker("w-other", active_decode_tokens=1_000_000)  # the slow one wins on load
    aborts: list[AbortRequest] = []
    await slow.conn.subscribe(slow.subjects.worker_abort("w-slow"), AbortRequest, aborts.append)
    await slow._sub.unsubscribe()  # it answers nothing in time: replaced by a subscriber that never replies
    await slow.conn.subscribe(slow.subjects.worker_generate("w-slow"), GenerateRequest, slow.received.append)
    await cluster.known("w-slow", "w-other")
    reply = await cluster.send(gen_request(tokens(40), rid="late"))
    assert reply.worker_id == "w-other" and [r.request_id for r in other.received] == ["late"]
    await wait_for(lambda: aborts, what="the withdrawal")
    assert aborts[0].request_ids == ["late"] and [r.request_id for r in slow.received] == ["late"]
