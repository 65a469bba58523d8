"""The kvstore against a real nats-server and real UCXX over loopback, through KvStoreClient and raw NATS."""

from __future__ import annotations

import asyncio
import os
import signal
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import aiohttp
import msgpack
import numpy as np
import pytest

from services.kvstore.config import KvStoreConfig
from services.kvstore.service import KvStore
from services.launcher import free_port
from shared.block_hash import prefix_block_hashes, request_block_key
from shared.kv_transfer import TransferClient, TransferError
from shared.kvstore_client import KvStoreClient, KvStoreError
from shared.kvstore_messages import (KvCommitReply, KvGetReply, KvGetRequest, KvLookupReply, KvLookupRequest,
                                     KvPutReply, KvPutRequest, KvStatsReply, pack_hashes)
from shared.nats_client import NatsConnection, connect_nats
from shared.subjects import Subjects
from shared.wire import decode, encode

ROOT = Path(__file__).resolve().parents[2]
BLOCK = 4
NS = f"m=tiny|dt=float32|bs={BLOCK}|L=2|H=2|D=8"
PAGE = 4096


def chain(n: int, model: str = "tiny", salt: str = "", start: int = 0) -> list[bytes]:
    """The engine's block hashes of n full blocks of a token sequence."""
    return prefix_block_hashes(list(range(start, start + n * BLOCK)), BLOCK, request_block_key(model, salt))


def pages(n: int, page_bytes: int = PAGE, seed: int = 0) -> np.ndarray:
    return np.random.default_rng(seed).integers(0, 256, n * page_bytes, dtype=np.uint8)


@dataclass
class Harness:
    store: KvStore
    client: KvStoreClient
    conn: NatsConnection  # the test's own connection, for raw requests
    subjects: Subjects

    async def stats(self) -> KvStatsReply:
        return await self.client.stats()

    async def raw(self, verb: str, data: bytes, reply_cls):
        msg = await self.conn.client.request(self.subjects.kvstore(verb), data, timeout=2.0)
        return decode(reply_cls, msg.data)


@pytest.fixture
async def kvstore(nats_config, nats_conn):
    """start(**config) → a running in-process kvstore with a client; everything stopped at the end."""
    made: list[tuple[KvStore, NatsConnection, TransferClient]] = []

    async def start(**overrides) -> Harness:
        cfg = KvStoreConfig(**{"capacity_bytes": 64 << 20, "lease_ttl": 5.0, "sweep_interval": 0.05, **overrides})
        conn = await connect_nats(nats_config, "kvstore", wait=5.0)
        store = KvStore(cfg, conn)
        await store.start()
        transfer = TransferClient()
        made.append((store, conn, transfer))
        return Harness(store, KvStoreClient(nats_conn, transfer, nats_config.subject_prefix), nats_conn,
                       Subjects(nats_config.subject_prefix))

    try:
        yield start
    finally:
        leases = [store.index.num_leases for store, _, _ in made]
        for store, conn, transfer in made:
            await transfer.close()
            await store.stop()
            await conn.close()
        assert leases == [0] * len(made), "a test left leases behind"


async def wait_for(predicate, timeout: float = 5.0, what: str = "condition") -> None:
    deadline = time.monotonic() + timeout
    while not await predicate():
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        await asyncio.sleep(0.02)


async def test_put_commit_lookup_get_round_trip(kvstore):
    kv = await kvstore()
    c = kv.client
    hashes, data = chain(6), pages(6)
    assert await c.lookup(NS, BLOCK, hashes) == 0
    assert await c.put(NS, hashes[:4], data[:4 * PAGE], PAGE) == 4
    assert await c.lookup(NS, BLOCK, hashes) == 4
    assert await c.put(NS, hashes[:4], data[:4 * PAGE], PAGE) == 0  # all there: nothing sent
    # pages 0-3 are stored, 4-5 are new: only those travel, and they land in their own extent
    assert await c.put(NS, hashes, data, PAGE) == 2
    assert c.last_put[0] == 2 * PAGE
    count, got = await c.get(NS, hashes)  # spans two extents: the store gathers them into one frame
    assert count == 6 and got.tobytes() == data.tobytes()
    count, got = await c.get(NS, hashes[:2] + chain(1, start=999) + hashes[3:])  # a prefix, then a miss
    assert count == 2 and got.tobytes() == data[:2 * PAGE].tobytes()
    count, got = await c.get(NS, hashes[4:], allocate=lambda n, size: np.zeros(n * size, dtype=np.uint8))
    assert count == 2 and got.tobytes() == data[4 * PAGE:].tobytes()
    assert await c.get(NS, chain(2, start=500)) == (0, None)
    # a put whose accepted pages are not one run: the client gathers them
    more = chain(3, start=7000)
    assert await c.put(NS, [more[0], hashes[0], more[1]], pages(3, seed=3), PAGE) == 2
    assert c.reuse == pytest.approx((10 + 64) / (6 + 64))  # 10 pages leased to gets, 6 stored, the prior 64/64
    count, got = await c.get(NS, [more[1]])
    assert got.tobytes() == pages(3, seed=3)[2 * PAGE:].tobytes()
    s = await kv.stats()
    assert (s.pages, s.stored_pages, s.leases, s.reserved_pages) == (8, 8, 0, 0)
    assert s.bytes_used == 8 * PAGE and s.transfer_bytes_in == 8 * PAGE
    assert (s.hit_pages, s.miss_pages, s.hit_tokens) == (4, 8, 4 * BLOCK)


async def test_a_probe_times_a_page_round_trip_and_counts_in_no_figure(kvstore):
    """The worker's cost probe: its page is put once, then only read back; the store's reuse figure,
    which decides write-back, does not move."""
    kv = await kvstore()
    c = kv.client
    key = chain(1, start=4242)[0]
    put_s, get_s = await c.probe(NS, key, PAGE)
    assert put_s > 0 and get_s > 0
    put_s, get_s = await c.probe(NS, key, PAGE)
    assert put_s == 0 and get_s > 0
    s = await kv.stats()
    assert (s.pages, s.stored_pages, s.leases) == (1, 0, 0)
    assert await c.lookup(NS, BLOCK, [key]) == 0  # another namespace than the model's pages


async def test_a_large_transfer_is_byte_identical(kvstore, capsys):
    kv = await kvstore()
    page_bytes = 256 << 10
    hashes, data = chain(40), pages(40, page_bytes, seed=1)  # 10 MiB in one frame each way
    assert await kv.client.put(NS, hashes, data, page_bytes) == 40
    count, got = await kv.client.get(NS, hashes)
    assert count == 40 and np.array_equal(got, data)
    put_bytes, put_s = kv.client.last_put
    get_bytes, get_s = kv.client.last_get
    assert put_bytes == get_bytes == 10 << 20
    with capsys.disabled():
        print(f"\nkvstore loopback, one process: put {put_bytes / put_s / 1e9:.2f} GB/s, "
              f"get {get_bytes / get_s / 1e9:.2f} GB/s ({put_bytes >> 20} MiB)")
    assert (await kv.stats()).leases == 0


async def test_a_dead_writer_and_a_dead_reader_hold_nothing_past_the_ttl(kvstore, nats_config):
    kv = await kvstore(lease_ttl=1.0)
    hashes = chain(3)
    assert await kv.client.put(NS, hashes[:1], pages(1), PAGE) == 1
    dead = await connect_nats(nats_config, "dead-client", wait=5.0)
    reserved = await dead.request(kv.subjects.kvstore("put"), KvPutRequest(namespace=NS, page_bytes=PAGE,
                                                                           hashes=pack_hashes(hashes)), KvPutReply)
    leased = await dead.request(kv.subjects.kvstore("get"), KvGetRequest(namespace=NS, hashes=pack_hashes(hashes)),
                                KvGetReply)
    await dead.close()  # it never sends, commits or releases
    assert reserved.ok and len(reserved.accepted) == 2 * 16 and leased.count == 1
    s = await kv.stats()
    assert (s.leases, s.reserved_pages, s.bytes_used) == (2, 2, 3 * PAGE)
    assert await kv.client.lookup(NS, BLOCK, hashes) == 1  # reserved pages stay invisible

    async def swept() -> bool:
        return (await kv.stats()).leases == 0
    await wait_for(swept, what="the leases to expire")
    s = await kv.stats()
    assert (s.lease_expiries, s.reserved_pages, s.bytes_used, s.pages) == (2, 0, PAGE, 1)
    assert len(kv.store.store) == 1  # the reservation's buffer is gone too
    # the dead writer's pages can be written by someone else now
    assert await kv.client.put(NS, hashes, pages(3), PAGE) == 2
    # data for an expired lease is refused on the UCXX stream, which keeps serving
    with pytest.raises(TransferError):
        await kv.client.transfer.call(reserved.address, {"op": "put", "lease": reserved.lease_id}, pages(2))
    assert (await kv.client.get(NS, hashes))[0] == 3
    assert (await kv.stats()).leases == 0


async def test_capacity_evicts_in_lru_order(kvstore):
    kv = await kvstore(capacity_bytes=4 * PAGE)
    c = kv.client
    hashes = chain(6)
    for i in range(4):
        assert await c.put(NS, [hashes[i]], pages(1, seed=i), PAGE) == 1
    assert (await c.get(NS, hashes[:1]))[0] == 1  # 0 becomes the most recently used
    assert await c.put(NS, [hashes[4]], pages(1, seed=4), PAGE) == 1  # evicts 1
    assert await c.put(NS, [hashes[5]], pages(1, seed=5), PAGE) == 1  # evicts 2
    held = [await c.lookup(NS, BLOCK, [h]) for h in hashes]
    assert held == [1, 0, 0, 1, 1, 1]
    assert kv.store.index.lru_order(NS) == [hashes[i] for i in (3, 0, 4, 5)]
    s = await kv.stats()
    assert (s.evictions, s.pages, s.bytes_used, s.capacity_bytes, s.leases) == (2, 4, 4 * PAGE, 4 * PAGE, 0)
    # a put larger than the whole store is refused cleanly: the client reports 0 stored
    assert await c.put(NS, chain(5, start=900), pages(5), PAGE) == 0
    assert (await kv.stats()).no_space == 1
    count, got = await c.get(NS, [hashes[0]])
    assert got.tobytes() == pages(1, seed=0).tobytes()
    assert (await kv.stats()).leases == 0


async def test_another_model_salt_or_layout_never_matches(kvstore):
    kv = await kvstore()
    c = kv.client
    hashes = chain(4, model="tiny", salt="tenant-a")
    assert await c.put(NS, hashes, pages(4), PAGE) == 4
    assert await c.lookup(NS, BLOCK, hashes) == 4
    assert await c.lookup(NS, BLOCK, chain(4, model="tiny", salt="tenant-b")) == 0  # other tenant: other hashes
    assert await c.lookup(NS, BLOCK, chain(4, model="other", salt="tenant-a")) == 0  # other model
    other_layout = NS.replace("dt=float32", "dt=bfloat16")
    assert await c.lookup(other_layout, BLOCK, hashes) == 0  # same hashes, other namespace
    assert await c.get(other_layout, hashes) == (0, None)
    with pytest.raises(KvStoreError) as err:  # one page size per namespace
        await c.put(NS, chain(1, salt="x"), pages(1, PAGE * 2), PAGE * 2)
    assert err.value.code == "page_size"
    assert (await kv.stats()).leases == 0


async def test_malformed_and_oversized_messages_get_error_replies(kvstore):
    kv = await kvstore()
    valid = KvLookupRequest(namespace=NS, block_size=BLOCK, hashes=pack_hashes(chain(2)))
    wrong_field = msgpack.packb({"t": "kv_lookup_request", "v": 1, "namespace": NS, "block_size": "4",
                                 "hashes": b""})
    cases = {
        "not msgpack": (b"\xc1\xc1garbage", "malformed"),
        "wrong type": (encode(KvPutRequest(namespace=NS, page_bytes=1, hashes=b"")), "type"),
        "future version": (msgpack.packb({"t": "kv_lookup_request", "v": 2}), "version"),
        "mistyped field": (wrong_field, "field"),
        "ragged hashes": (msgpack.packb({"t": "kv_lookup_request", "v": 1, "namespace": NS, "block_size": 4,
                                         "hashes": b"x" * 17}), "field"),
        "oversized": (encode(valid) + b"\x00" * (600 << 10), "size"),
    }
    for name, (data, reason) in cases.items():
        reply = await kv.raw("lookup", data, KvLookupReply)
        assert reply.code == "bad_request", name
        assert reply.error, name
    commit = await kv.raw("commit", msgpack.packb({"t": "kv_commit_request", "v": 1, "lease_id": "x" * 500}),
                          KvCommitReply)
    assert commit.code == "bad_request" and "lease_id" in commit.error
    s = await kv.stats()
    assert s.bad_messages == len(cases) + 1
    assert kv.store.conn.bad_messages.count(reason="size") == 1
    assert (await kv.raw("lookup", encode(valid), KvLookupReply)).ok  # still serving
    with pytest.raises(KvStoreError) as err:  # a well-formed request for a lease that does not exist
        await kv.client.release("no-such-lease")
    assert err.value.code == "unknown_lease"
    # garbage on the data path is refused and the store keeps serving both paths
    address = kv.store.address
    with pytest.raises(TransferError):
        await kv.client.transfer.call(address, {"op": "get", "lease": "nope"})
    with pytest.raises(TransferError):
        await kv.client.transfer.call(address, {"op": "steal"}, pages(1))
    assert await kv.client.put(NS, chain(2), pages(2), PAGE) == 2
    assert (await kv.client.get(NS, chain(2)))[0] == 2
    assert (await kv.stats()).leases == 0


async def test_metrics_and_health_over_http(kvstore):
    port = free_port()
    kv = await kvstore(http_port=port, capacity_bytes=1 << 20)
    assert await kv.client.put(NS, chain(3), pages(3), PAGE) == 3
    assert await kv.client.lookup(NS, BLOCK, chain(5)) == 3
    await kv.raw("lookup", b"junk", KvLookupReply)
    async with aiohttp.ClientSession() as http:
        async with http.get(f"http://127.0.0.1:{port}/health") as r:
            assert r.status == 200
            health = await r.json()
        async with http.get(f"http://127.0.0.1:{port}/metrics") as r:
            assert r.status == 200
            text = await r.text()
    assert health == {"status": "ok", "nats_connected": True, "address": kv.store.address, "pages": 3,
                      "bytes_used": 3 * PAGE, "capacity_bytes": 1 << 20, "leases": 0}
    metrics = {line.split(" ")[0]: float(line.split(" ")[1]) for line in text.splitlines()
               if line and not line.startswith("#")}
    assert metrics["inferno_kvstore:pages"] == 3
    assert metrics["inferno_kvstore:bytes_used"] == 3 * PAGE
    assert metrics["inferno_kvstore:capacity_bytes"] == 1 << 20
    assert metrics["inferno_kvstore:hit_tokens_total"] == 3 * BLOCK
    assert metrics["inferno_kvstore:miss_tokens_total"] == 2 * BLOCK
    assert metrics['inferno_kvstore:transfer_bytes_total{op="put"}'] == 3 * PAGE
    assert metrics['inferno_kvstore:transfer_gbps{op="put"}'] > 0
    assert metrics['inferno_kvstore:bad_messages_total{reason="malformed",verb="lookup"}'] == 1
    assert metrics['inferno_kvstore:requests_total{code="ok",verb="commit"}'] == 1
    assert metrics["inferno_kvstore:leases"] == 0
    # Latency histograms: each verb answered, the put's payload, the event loop's lag.
    assert metrics['inferno_kvstore:request_seconds_count{verb="lookup"}'] == 2  # one answered, one malformed
    assert metrics['inferno_kvstore:request_seconds_count{verb="put"}'] == 1
    assert metrics['inferno_kvstore:request_seconds_bucket{le="10.0",verb="commit"}'] == 1
    assert metrics["inferno_kvstore:put_receive_seconds_count"] == 1
    assert "inferno_kvstore:loop_lag_seconds_count" in metrics


async def test_the_kvstore_runs_as_a_process_and_exits_cleanly_on_sigterm(nats_config, nats_conn, capsys):
    http_port = free_port()
    proc = subprocess.Popen([sys.executable, "-m", "services.kvstore", "--nats-url", nats_config.url,
                             "--subject-prefix", nats_config.subject_prefix, "--capacity-gb", "0.0625",
                             "--lease-ttl", "2", "--http-port", str(http_port), "--log-format", "json"],
                            cwd=ROOT, env={**os.environ, "PYTHONUNBUFFERED": "1"},
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT)
    transfer = TransferClient()
    client = KvStoreClient(nats_conn, transfer, nats_config.subject_prefix)
    try:
        deadline = time.monotonic() + 30.0
        while True:
            try:
                stats = await client.stats()
                break
            except KvStoreError:
                assert proc.poll() is None, proc.stdout.read().decode()
                assert time.monotonic() < deadline, "the kvstore process did not start serving"
                await asyncio.sleep(0.1)
        assert stats.capacity_bytes == 64 << 20 and stats.address
        page_bytes = 512 << 10
        data = pages(32, page_bytes, seed=2)  # 16 MiB each way, between two processes
        for round_ in range(3):  # the first call on a new endpoint pays its setup: report the last
            hashes = chain(32, start=round_ * 1000)
            assert await client.put(NS, hashes, data, page_bytes) == 32
            count, got = await client.get(NS, hashes)
            assert count == 32 and np.array_equal(got, data)
        put_bytes, put_s = client.last_put
        get_bytes, get_s = client.last_get
        with capsys.disabled():
            print(f"\nkvstore loopback, two processes: put {put_bytes / put_s / 1e9:.2f} GB/s, "
                  f"get {get_bytes / get_s / 1e9:.2f} GB/s ({get_bytes >> 20} MiB, warm endpoint)")
        assert (await client.stats()).leases == 0
        proc.send_signal(signal.SIGTERM)
        rc = await asyncio.to_thread(proc.wait, 10)
        out = proc.stdout.read().decode()
        assert rc == 0, out
        assert '"event": "kvstore_ready"' in out and '"event": "kvstore_stopped"' in out
    finally:
        await transfer.close()
        if proc.poll() is None:
            proc.kill()
            proc.wait()


async def test_a_slow_store_makes_the_worker_recompute_at_once(nats_config, nats_conn):
    """A lookup waits no longer than the prefill it could save (here the 50 ms floor), never the
    control timeout: the request goes on without the store. One late answer is noise; a store that
    keeps answering late is then left alone like a dead one."""
    from services.worker.cluster_cache import BACKOFF, LATE_IN_A_ROW, MIN_LOOKUP_S, ClusterCache

    subjects = Subjects(nats_config.subject_prefix)

    async def answer_late(msg):
        await asyncio.sleep(1.0)  # a saturated store
        await msg.respond(encode(KvLookupReply(hits=0)))

    sub = await nats_conn.client.subscribe(subjects.kvstore("lookup"), cb=answer_late)
    cache = ClusterCache(KvStoreClient(nats_conn, None, nats_config.subject_prefix), NS, PAGE, BLOCK, "tiny",
                         write_back="off")
    assert cache.worth_asking
    started = time.monotonic()
    assert await cache.fetch(chain(8), 0) is None
    waited = time.monotonic() - started
    assert MIN_LOOKUP_S <= waited < 0.3, waited
    assert cache.stats["slow_lookups"] == 1 and cache.available
    for _ in range(LATE_IN_A_ROW - 1):
        assert await cache.fetch(chain(8), 0) is None
    assert cache.stats["slow_lookups"] == LATE_IN_A_ROW
    assert not cache.worth_asking and cache.down_until - time.monotonic() > BACKOFF - 0.5
    await sub.unsubscribe()
