"""Two workers: session affinity, a worker killed mid-request, and NATS restarted under the stack."""

from __future__ import annotations

import concurrent.futures
import signal
import time
import urllib.error
import urllib.request

import openai
import pytest

from tests.e2e.conftest import MODEL_NAME, metrics, start_stack, wait_workers


@pytest.fixture(scope="module")
def duo(tiny_model, tmp_path_factory):
    s = start_stack(tmp_path_factory.mktemp("duo"), tiny_model, workers=2)
    yield s
    s.stop()


def make_client(stack, **headers):
    return openai.OpenAI(base_url=stack.url + "/v1", api_key="unused", max_retries=0, timeout=60,
                         default_headers=headers or None)


SYSTEM = "You are a careful assistant. " * 12  # a long shared prefix: several KV blocks


def test_session_affinity_reuses_the_prefix_cache(duo):
    client = make_client(duo, **{"x-session-affinity": "session-42"})
    messages = [{"role": "system", "content": SYSTEM}]
    cached = []
    for turn in range(4):
        messages.append({"role": "user", "content": f"Question number {turn}?"})
        r = client.chat.completions.create(model=MODEL_NAME, messages=messages, max_tokens=4, temperature=0,
                                           extra_body={"ignore_eos": True})
        cached.append(r.usage.prompt_tokens_details.cached_tokens)
        messages.append({"role": "assistant", "content": r.choices[0].message.content})
    # Every later turn lands on the worker holding the conversation so far.
    assert cached[0] == 0
    assert all(c >= 16 * (len(SYSTEM) // 200) for c in cached[1:]), cached
    assert cached[1] < cached[2] < cached[3], cached


def long_stream(stack, i):
    """Streams a long completion; returns ('ok' | 'error', seconds since the kill mark)."""
    client = make_client(stack)
    try:
        for chunk in client.completions.create(model=MODEL_NAME, prompt=f"story {i}", max_tokens=1800,
                                               stream=True, extra_body={"ignore_eos": True}):
            pass
        return "ok", time.monotonic()
    except (openai.APIError, openai.APIConnectionError) as e:
        return f"error: {type(e).__name__}", time.monotonic()


def test_killed_worker_fails_its_requests_fast_and_the_other_serves(duo):
    pool = concurrent.futures.ThreadPoolExecutor(6)
    futures = [pool.submit(long_stream, duo, i) for i in range(6)]
    deadline = time.monotonic() + 20
    while metrics(duo).get("inferno:num_requests_running", 0) < 6 and time.monotonic() < deadline:
        time.sleep(0.1)
    victim = duo.child("worker-1")
    victim.proc.send_signal(signal.SIGKILL)
    killed_at = time.monotonic()
    results = [f.result(timeout=120) for f in futures]
    errors = [(kind, t - killed_at) for kind, t in results if kind != "ok"]
    assert errors, "no request was running on the killed worker"
    assert all(delay <= 5.0 for _, delay in errors), errors
    # New requests route around the dead worker.
    client = make_client(duo)
    for i in range(4):
        r = client.completions.create(model=MODEL_NAME, prompt=f"after {i}", max_tokens=3)
        assert r.choices[0].text is not None
    duo.start_worker(1)
    wait_workers(duo, 2)


def ready_status(stack) -> int:
    try:
        with urllib.request.urlopen(stack.url + "/ready", timeout=3) as r:
            return r.status
    except urllib.error.HTTPError as e:
        return e.code


def test_nats_restart_services_reconnect(duo):
    nats = duo.child("nats")
    nats.proc.send_signal(signal.SIGTERM)
    nats.proc.wait(10)
    deadline = time.monotonic() + 10
    while ready_status(duo) != 503 and time.monotonic() < deadline:
        time.sleep(0.1)
    assert ready_status(duo) == 503
    duo.children.remove(nats)
    duo.reported.discard("nats")
    duo.start_nats()
    deadline = time.monotonic() + 30
    while ready_status(duo) != 200 and time.monotonic() < deadline:
        time.sleep(0.2)
    assert ready_status(duo) == 200
    wait_workers(duo, 2)
    r = make_client(duo).completions.create(model=MODEL_NAME, prompt="back again", max_tokens=3)
    assert r.usage.completion_tokens == 3
