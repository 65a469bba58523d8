"""A worker split over two processes (tensor parallelism, gloo on the CPU) behind the real gateway:
one worker to the cluster, the answers of a single-process worker, and a dead rank taking the
group down cleanly (clean errors, dropped by the scheduler, no process left behind)."""

from __future__ import annotations

import concurrent.futures
import os
import signal
import time
from pathlib import Path

import openai
import pytest

from tests.e2e.conftest import MODEL_NAME, heartbeats, metrics, start_stack, wait_workers

PROMPTS = ["Hello there", "A prompt long enough to fill a few KV blocks of sixteen tokens, " * 3]


@pytest.fixture(scope="module")
def tp_stack(tiny_model, tmp_path_factory):
    s = start_stack(tmp_path_factory.mktemp("tp2"), tiny_model, tensor_parallel_size=2)
    yield s
    s.stop()


@pytest.fixture(scope="module")
def single(tiny_model, tmp_path_factory):
    s = start_stack(tmp_path_factory.mktemp("tp1"), tiny_model)
    yield s
    s.stop()


def client(stack):
    return openai.OpenAI(base_url=stack.url + "/v1", api_key="unused", max_retries=0, timeout=60)


def children_of(pid: int) -> list[int]:
    out = []
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                stat = (entry / "stat").read_text()
            except OSError:
                continue
            if int(stat.rsplit(")", 1)[1].split()[1]) == pid:
                out.append(int(entry.name))
    return out


def alive(pid: int) -> bool:
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return False
    return stat.rsplit(")", 1)[1].split()[0] != "Z"


def test_one_worker_with_the_answers_of_one_process(tp_stack, single):
    hbs = heartbeats(tp_stack)
    assert list(hbs) == ["worker-0"]
    assert len(children_of(tp_stack.child("worker-0").proc.pid)) == 1  # its second rank
    for prompt in PROMPTS:
        ours, ref = (client(s).completions.create(model=MODEL_NAME, prompt=prompt, max_tokens=20, temperature=0,
                                                  logprobs=1) for s in (tp_stack, single))
        assert ours.choices[0].text == ref.choices[0].text
        a, b = ours.choices[0].logprobs.token_logprobs, ref.choices[0].logprobs.token_logprobs
        assert max(abs(x - y) for x, y in zip(a, b)) < 1e-4
    stream = client(tp_stack).chat.completions.create(
        model=MODEL_NAME, messages=[{"role": "user", "content": PROMPTS[1]}], max_tokens=12, n=2,
        temperature=0.9, seed=5, stream=True)
    texts = {0: "", 1: ""}
    for chunk in stream:
        for choice in chunk.choices:
            texts[choice.index] += choice.delta.content or ""
    assert all(texts.values())


def long_stream(stack, i):
    try:
        for _ in client(stack).completions.create(model=MODEL_NAME, prompt=f"story {i}", max_tokens=1500,
                                                  stream=True, extra_body={"ignore_eos": True}):
            pass
        return "ok", time.monotonic()
    except (openai.APIError, openai.APIConnectionError) as e:
        return f"error: {type(e).__name__}", time.monotonic()


def test_a_dead_rank_takes_the_group_down_cleanly(tp_stack):
    worker = tp_stack.child("worker-0")
    (rank,) = children_of(worker.proc.pid)
    pool = concurrent.futures.ThreadPoolExecutor(3)
    futures = [pool.submit(long_stream, tp_stack, i) for i in range(3)]
    deadline = time.monotonic() + 20
    while metrics(tp_stack).get("inferno:num_requests_running", 0) < 3 and time.monotonic() < deadline:
        time.sleep(0.1)
    os.kill(rank, signal.SIGKILL)
    killed_at = time.monotonic()
    results = [f.result(timeout=60) for f in futures]
    assert all(kind != "ok" and t - killed_at <= 5.0 for kind, t in results), [(k, t - killed_at) for k, t in results]
    assert worker.proc.wait(timeout=10) == 3  # the driver ended the group
    deadline = time.monotonic() + 10
    while metrics(tp_stack).get("inferno:num_workers_live", 1) > 0 and time.monotonic() < deadline:
        time.sleep(0.2)
    assert metrics(tp_stack)["inferno:num_workers_live"] == 0
    with pytest.raises(openai.APIStatusError):
        client(tp_stack).completions.create(model=MODEL_NAME, prompt="anyone?", max_tokens=2)
    # A fresh group (what the supervisor of `inferno up` starts) serves again.
    tp_stack.restart(worker)
    wait_workers(tp_stack, 1)
    r = client(tp_stack).completions.create(model=MODEL_NAME, prompt="again", max_tokens=4)
    assert r.usage.completion_tokens == 4


def test_a_killed_driver_leaves_no_rank_behind(tp_stack):
    worker = tp_stack.child("worker-0")
    ranks = children_of(worker.proc.pid)
    assert len(ranks) == 1
    worker.proc.send_signal(signal.SIGKILL)
    worker.proc.wait(timeout=10)
    deadline = time.monotonic() + 5
    while alive(ranks[0]) and time.monotonic() < deadline:
        time.sleep(0.1)
    assert not alive(ranks[0])
    tp_stack.restart(worker)
    wait_workers(tp_stack, 1)
