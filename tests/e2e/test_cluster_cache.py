"""Cluster prefix reuse through the kvstore: a worker writes its prompts' blocks to the store, a cold
worker fetches the prefix instead of recomputing it, tenants never share pages, and a store that
goes away costs nothing but recompute."""

from __future__ import annotations

import asyncio
import time

import pytest

from shared.kvstore_messages import KvStatsReply, KvStatsRequest
from shared.subjects import Subjects
from shared.wire import decode, encode
from tests.e2e.conftest import MODEL_NAME, start_stack, wait_workers

pytest.importorskip("ucxx", reason="UCXX (ucxx-cu12) moves the KV pages")

PROMPT = "Shared context for every worker in the cluster. " * 12  # many KV blocks


def client(stack):
    from openai import OpenAI

    return OpenAI(base_url=stack.url + "/v1", api_key="unused", max_retries=0, timeout=60)


def ask(stack, prompt=PROMPT, **extra):
    return client(stack).completions.create(model=MODEL_NAME, prompt=prompt, max_tokens=16, temperature=0,
                                            extra_body=extra or None)


def store_stats(stack) -> KvStatsReply:
    import nats

    async def go():
        nc = await nats.connect(stack.admin_nats_url.split(","))
        try:
            msg = await nc.request(Subjects().kvstore("stats"), encode(KvStatsRequest()), timeout=5)
            return decode(KvStatsReply, msg.data)
        finally:
            await nc.close()

    return asyncio.run(go())


def wait_for(predicate, timeout=15.0, what="condition"):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if predicate():
            return
        time.sleep(0.2)
    raise AssertionError(f"{what} not reached in {timeout} s")


@pytest.fixture
def cluster(tiny_model, tmp_path):
    s = start_stack(tmp_path, tiny_model, workers=1, worker_args=("--kvstore", "on"))  # CPU workers: off by default
    yield s
    s.stop()


def test_a_cold_worker_fetches_the_prefix_another_worker_computed(cluster):
    first = ask(cluster)
    assert first.usage.prompt_tokens_details.cached_tokens == 0
    # The scheduler's index of the store said it held nothing: the worker did not ask it.
    assert store_stats(cluster).miss_pages == 0
    full_blocks = first.usage.prompt_tokens // 16
    wait_for(lambda: store_stats(cluster).pages >= full_blocks, what="the prompt's blocks in the store")
    # A second, cold worker; the first one dies, so the next request can only go to the cold one.
    cluster.start_worker(1)
    wait_workers(cluster, 2)
    cluster.child("worker-0").proc.kill()
    time.sleep(3.5)  # the scheduler drops worker-0 after its heartbeat TTL
    again = ask(cluster)
    assert again.choices[0].text == first.choices[0].text
    # Every full block but the last one (a token must be computed to sample) came from the store.
    assert again.usage.prompt_tokens_details.cached_tokens >= 16 * (full_blocks - 1)
    assert store_stats(cluster).leases == 0


def test_another_tenant_never_gets_the_pages(cluster):
    ask(cluster, cache_salt="tenant-a")
    wait_for(lambda: store_stats(cluster).pages > 0, what="pages stored")
    cluster.start_worker(1)
    wait_workers(cluster, 2)
    cluster.child("worker-0").proc.kill()
    time.sleep(3.5)
    other = ask(cluster, cache_salt="tenant-b")
    assert other.usage.prompt_tokens_details.cached_tokens == 0
    same = ask(cluster, prompt=PROMPT + " More.", cache_salt="tenant-a")
    assert same.usage.prompt_tokens_details.cached_tokens > 0


def test_workers_serve_on_when_the_store_dies_and_use_it_again_when_it_returns(cluster):
    cluster.child("kvstore").proc.kill()
    for i in range(3):  # no hang, no error: the worker recomputes
        assert ask(cluster, prompt=f"{i} " + PROMPT).usage.completion_tokens == 16
    cluster.start_kvstore()
    wait_for(lambda: _answers(cluster), what="the new kvstore")
    time.sleep(2.5)  # the worker's back-off after the failures ends
    ask(cluster, prompt="fresh " + PROMPT)
    wait_for(lambda: store_stats(cluster).pages > 0, what="write-back to the new store")


def _answers(stack) -> bool:
    try:
        store_stats(stack)
        return True
    except Exception:
        return False
