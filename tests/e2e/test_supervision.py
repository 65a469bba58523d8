"""Supervision: every child of the stack is SIGKILLed in turn under streaming load; the Supervisor
restarts it (same name and argv) and the stack serves again (within 30 s here), with no request left
running and every KV block free. Streams end completed or with a clean error event (those of a
killed gateway lose their connection: nothing is left to send the event)."""

from __future__ import annotations

import concurrent.futures
import signal
import time
import urllib.error
import urllib.request

import openai
import pytest

from services.supervisor import Backoff, Supervisor
from tests.e2e.conftest import MODEL_NAME, heartbeats, metrics, start_stack, wait_workers

# A bound that says "it came back", not a figure: a restarted worker imports torch again, which
# takes 5-16 s on a 2-core machine running another test module beside it (the seconds of a
# restart are the benchmarks' business).
RECOVERY_S = 30.0
STREAMS = 4


@pytest.fixture(scope="module")
def supervised(tiny_model, tmp_path_factory):
    stack = start_stack(tmp_path_factory.mktemp("supervised"), tiny_model, workers=1)
    supervisor = Supervisor(stack, Backoff(first=0.5, cap=10.0, reset_after=30.0)).start(interval=0.1)
    yield stack, supervisor
    supervisor.stop()
    stack.stop()


def client(stack, timeout=60.0):
    return openai.OpenAI(base_url=stack.url + "/v1", api_key="unused", max_retries=0, timeout=timeout)


def stream_once(stack, i: int) -> str:
    """One long streamed completion: 'ok', or the error it ended with (a clean error event)."""
    try:
        for _ in client(stack).completions.create(model=MODEL_NAME, prompt=f"story {i}", max_tokens=1200,
                                                  stream=True, extra_body={"ignore_eos": True}):
            pass
        return "ok"
    except (openai.APIError, openai.APIConnectionError) as e:
        return f"error: {type(e).__name__}: {e}"


def ready_status(stack) -> int:
    try:
        with urllib.request.urlopen(stack.url + "/ready", timeout=2) as r:
            return r.status
    except urllib.error.HTTPError as e:
        return e.code
    except OSError:
        return 0


def serve_again(stack, since: float) -> tuple[float, list[str]]:
    """Seconds from `since` until a new request succeeds, and the refusals met meanwhile (each
    must be a 503 with Retry-After: the gateway stays up and says when to come back)."""
    refusals = []
    c = client(stack, timeout=5)
    while time.monotonic() - since < 60:
        try:
            r = c.with_raw_response.completions.create(model=MODEL_NAME, prompt="are you back?", max_tokens=3)
            assert r.parse().usage.completion_tokens == 3
            return time.monotonic() - since, refusals
        except openai.APIStatusError as e:
            assert e.status_code == 503, (e.status_code, e.message)
            assert int(e.response.headers["retry-after"]) >= 1
            refusals.append(e.message)
        except (openai.APIConnectionError, openai.APITimeoutError) as e:
            refusals.append(f"{type(e).__name__}")
        time.sleep(0.2)
    raise AssertionError(f"the stack did not serve again within 60 s: {refusals[-3:]}")


def wait_idle(stack, timeout: float = 30.0) -> None:
    """No request running at the gateway or on any worker, and every worker's KV blocks free."""
    deadline = time.monotonic() + timeout
    while True:
        m = metrics(stack)
        hbs = heartbeats(stack)
        idle = (m.get("inferno:gateway_requests_in_flight") == 0 and m.get("inferno:num_requests_running") == 0
                and hbs and all(hb.num_running == 0 and hb.num_free_blocks == hb.num_total_blocks
                                for hb in hbs.values()))
        if idle:
            return
        if time.monotonic() > deadline:
            raise AssertionError({"in_flight": m.get("inferno:gateway_requests_in_flight"),
                                  "running": m.get("inferno:num_requests_running"),
                                  "workers": {w: (hb.num_running, hb.num_free_blocks, hb.num_total_blocks)
                                              for w, hb in hbs.items()}})
        time.sleep(0.3)


@pytest.mark.parametrize("name", ["worker-0", "scheduler-0", "kvstore", "gateway", "nats"])
def test_killed_child_is_restarted_and_the_stack_serves_again(supervised, name):
    stack, supervisor = supervised
    restarts = supervisor.restarts.get(name, 0)
    pool = concurrent.futures.ThreadPoolExecutor(STREAMS)
    streams = [pool.submit(stream_once, stack, i) for i in range(STREAMS)]
    deadline = time.monotonic() + 30
    while metrics(stack).get("inferno:num_requests_running", 0) < STREAMS and time.monotonic() < deadline:
        time.sleep(0.1)
    child = stack.child(name)
    old_pid = child.proc.pid
    child.proc.send_signal(signal.SIGKILL)
    killed = time.monotonic()

    recovery, refusals = serve_again(stack, killed)
    print(f"\n{name}: served again {recovery:.2f} s after SIGKILL ({len(refusals)} refusals: {refusals[:2]})")
    assert recovery <= RECOVERY_S, (recovery, refusals)

    # Every stream ended, completed or with a clean error event; none hangs.
    results = [f.result(timeout=180) for f in streams]
    pool.shutdown()
    print(f"{name}: streams: {results}")
    clean = "error: APIConnectionError" if name == "gateway" else "error: APIError"
    assert all(r == "ok" or r.startswith(clean) for r in results), results
    assert supervisor.restarts.get(name, 0) == restarts + 1
    assert child.proc.poll() is None and child.proc.pid != old_pid and stack.child(name) is child
    assert ready_status(stack) == 200
    wait_workers(stack, 1)
    wait_idle(stack)


def test_missing_worker_makes_ready_503_and_requests_503_with_retry_after(supervised):
    stack, supervisor = supervised
    supervisor.stop()  # hold the restart, so the gap is long enough to look at
    try:
        worker = stack.child("worker-0")
        worker.proc.send_signal(signal.SIGKILL)
        worker.proc.wait(10)
        deadline = time.monotonic() + 10
        while ready_status(stack) != 503 and time.monotonic() < deadline:
            time.sleep(0.1)
        assert ready_status(stack) == 503
        with pytest.raises(openai.APIStatusError) as refused:
            client(stack, timeout=10).completions.create(model=MODEL_NAME, prompt="anyone?", max_tokens=3)
        assert refused.value.status_code == 503
        assert int(refused.value.response.headers["retry-after"]) >= 1
    finally:
        supervisor.start(interval=0.1)
    recovery, _ = serve_again(stack, time.monotonic())
    print(f"\nworker restarted after a held restart: serving in {recovery:.2f} s")
    assert ready_status(stack) == 200
    wait_idle(stack)
