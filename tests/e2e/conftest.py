"""The whole stack, started by the same code as `inferno up`, on free ports with the tiny model."""

from __future__ import annotations

import contextlib
import os
import re
import signal
import subprocess
import sys
import time
import urllib.request

import pytest

from services.launcher import Stack, StackConfig, free_port
from inferno.tools.make_model import write_model

MODEL_NAME = "tiny-e2e"
# The stacks' device: cpu here and in CI; INFERNO_TEST_DEVICE=cuda runs the same tests on a GPU
# machine (a worker per GPU), e.g. the prefill/decode hand-off over CUDA IPC.
TEST_DEVICE = os.environ.get("INFERNO_TEST_DEVICE", "cpu")


@pytest.fixture(scope="session")
def tiny_model(tmp_path_factory):
    return write_model(tmp_path_factory.mktemp("e2e-model") / "tiny", preset="tiny", seed=0, dtype="float32")


def start_stack(tmp_path, model_dir, workers=1, api_keys=(), worker_args=(), scheduler_args=(),
                prefill_workers=0, decode_workers=0, gateway_args=(), **stack_config) -> Stack:
    # Two API users on the bus: the NATS API's tests show each reads its own replies only.
    stack_config.setdefault("nats_api_users", ("api", "other"))
    cfg = StackConfig(model_dir=model_dir, model_name=MODEL_NAME, port=free_port(), nats_port=free_port(),
                      workers=workers, prefill_workers=prefill_workers, decode_workers=decode_workers,
                      api_keys=tuple(api_keys), run_dir=tmp_path, log_format="json", device=TEST_DEVICE,
                      worker_args=("--num-blocks", "256", "--heartbeat-interval", "0.5", *worker_args),
                      gateway_args=("--max-body-bytes", "65536", *gateway_args), scheduler_args=tuple(scheduler_args),
                      **stack_config)
    stack = Stack(cfg).start()
    try:
        stack.wait_ready(timeout=120)
        wait_workers(stack, workers + prefill_workers + decode_workers)
        if cfg.kvstore_capacity_gb > 0:
            wait_kvstore(stack)
    except Exception:
        stack.stop()
        raise
    return stack


@contextlib.contextmanager
def inferno_up(model_dir, run_dir, *flags: str, timeout: float = 90.0):
    """`inferno up` as a user runs it, in a subprocess: yields what it printed until it served (or gave
    up); stopped with Ctrl-C's SIGINT after."""
    up = subprocess.Popen([sys.executable, "-m", "services.cli", "up", "--model", str(model_dir), "--model-name",
                           MODEL_NAME, "--port", str(free_port()), "--run-dir", str(run_dir), *flags],
                          stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True)
    try:
        lines = []
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            line = up.stdout.readline()
            lines.append(line)
            if "inferno: serving" in line or not line:
                break
        yield "".join(lines)
    finally:
        up.send_signal(signal.SIGINT)
        up.wait(timeout=30)


def wait_kvstore(stack: Stack, timeout: float = 60.0) -> None:
    """Until the stack's kvstore answers (workers may be ready before it: they no longer wait for
    their engine before they connect)."""
    import asyncio
    import concurrent.futures

    import nats

    from shared.kvstore_messages import KvStatsRequest
    from shared.subjects import Subjects
    from shared.wire import encode

    async def answers() -> bool:
        nc = await nats.connect(stack.admin_nats_url.split(","), **stack.nats_tls_options())
        try:
            await nc.request(Subjects().kvstore("stats"), encode(KvStatsRequest()), timeout=1)
            return True
        except (nats.errors.NoRespondersError, nats.errors.TimeoutError):
            return False
        finally:
            await nc.close()

    def ask() -> bool:
        # Its own thread: start_stack is also called from async tests, whose loop is running here.
        with concurrent.futures.ThreadPoolExecutor(1) as pool:
            return pool.submit(asyncio.run, answers()).result()

    deadline = time.monotonic() + timeout
    while not ask():
        if time.monotonic() > deadline:
            raise TimeoutError(f"the kvstore did not answer within {timeout} s")
        time.sleep(0.2)


def heartbeats(stack: Stack, seconds: float = 1.2) -> dict:
    """The latest WorkerHeartbeat of every worker (by id), read off NATS as the scheduler does."""
    import asyncio

    import nats

    from shared import subjects
    from shared.messages import WorkerHeartbeat
    from shared.wire import decode

    async def collect():
        nc = await nats.connect(stack.admin_nats_url.split(","), **stack.nats_tls_options())
        latest = {}

        async def on(msg):
            hb = decode(WorkerHeartbeat, msg.data)
            latest[hb.worker_id] = hb

        await nc.subscribe(subjects.heartbeat(), cb=on)
        await asyncio.sleep(seconds)
        await nc.close()
        return latest

    return asyncio.run(collect())


def metrics(stack: Stack) -> dict[str, float]:
    """Prometheus samples (name{labels} → value) from the gateway's /metrics."""
    headers = {"Authorization": f"Bearer {stack.cfg.api_keys[0]}"} if stack.cfg.api_keys else {}
    with urllib.request.urlopen(urllib.request.Request(stack.url + "/metrics", headers=headers), timeout=5) as r:
        text = r.read().decode()
    out = {}
    for line in text.splitlines():
        m = re.match(r"^([a-zA-Z_:][\w:]*(?:\{[^}]*\})?) ([-+0-9.eEinfNa]+)$", line)
        if m:
            out[m.group(1)] = float(m.group(2))
    return out


def wait_workers(stack: Stack, n: int, timeout: float = 60.0) -> None:
    """Until the gateway sees n ready workers (their heartbeats feed its metrics; a worker sends
    them from its start, saying "loading" until its model serves)."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if metrics(stack).get("inferno:num_workers_ready", 0) >= n:
            return
        time.sleep(0.2)
    raise TimeoutError(f"{n} workers were not ready within {timeout} s")


def assert_greedy_as_one_engine(stack: Stack, model_dir, prompts: list[list[int]], max_tokens: int) -> None:
    """Greedy completions of token-id prompts through the stack's HTTP API (the openai client) are the
    text of an in-process engine's tokens for the same prompts."""
    from openai import OpenAI
    from tokenizers import Tokenizer

    from shared.sampling_params import SamplingParams
    from tests.models.conftest import make_engine

    want = make_engine(model_dir, device=TEST_DEVICE).generate(
        prompts, SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True))
    tokenizer = Tokenizer.from_file(str(model_dir / "tokenizer.json"))
    client = OpenAI(base_url=stack.url + "/v1", api_key="unused", max_retries=0, timeout=60)
    for prompt, ids in zip(prompts, want):
        r = client.completions.create(model=MODEL_NAME, prompt=prompt, max_tokens=max_tokens, temperature=0,
                                      extra_body={"ignore_eos": True})
        assert r.choices[0].text == tokenizer.decode(ids)


@pytest.fixture(scope="module")
def stack(tiny_model, tmp_path_factory):
    s = start_stack(tmp_path_factory.mktemp("stack"), tiny_model)
    yield s
    s.stop()
