"""Several models in one worker process (services/worker/model_host.py): a real nats-server, the real
scheduler, real `inferno worker` processes on the CPU, where the models' shares of the device are
accounted exactly as on a GPU.

One worker holds four models at 0.45 of the device each: two fit (A, B), C waits in standby, BAD
(weights missing) fails when its turn comes. Greedy tokens through the scheduler must equal an
in-process engine's for the model asked for, whichever was on the device when it was asked; at no
heartbeat do the models on the device hold more than the budget. A second worker starts with one
model, takes another with `load-model --mode add`, and lets both go idle to zero."""

from __future__ import annotations

import asyncio
import contextlib
import time

import pytest

from inferno.tools.make_model import write_model
from services.scheduler.service import Scheduler
from services.worker.admin_client import AdminClient
from shared.config import NatsConfig, RouterConfig
from shared.messages import WorkerHeartbeat
from shared.nats_client import connect_nats
from shared.sampling_params import SamplingParams
from tests.models.conftest import make_engine
from tests.services.test_model_loading import PROMPTS, Client, start_worker

BUDGET = 0.98  # the worker's --gpu-memory-utilization default
MAX_TOKENS = 8


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    root = tmp_path_factory.mktemp("models")
    out = {name: write_model(root / name, arch=arch, preset="tiny", seed=seed, dtype="float32")
           for name, arch, seed in (("a", "LlamaForCausalLM", 21), ("b", "Qwen2ForCausalLM", 22),
                                    ("c", "LlamaForCausalLM", 23))}
    bad = write_model(root / "bad", preset="tiny", seed=24, dtype="float32")
    for f in bad.glob("*.safetensors"):
        f.unlink()  # its config and tokenizer, no weights: registered, then fails at its load
    out["bad"] = bad
    return out


@pytest.fixture(scope="module")
def expected(models):
    params = SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, ignore_eos=True)
    return {name: make_engine(models[name]).generate(PROMPTS, params) for name in ("a", "b", "c")}


class Budget:
    """Every heartbeat of one worker process's slots: the shares of the models on the device, summed."""

    def __init__(self, host: str):
        self.host, self.latest, self.peak = host, {}, 0.0

    def on(self, hb: WorkerHeartbeat) -> None:
        if hb.host != self.host:
            return
        self.latest[hb.worker_id] = hb
        on_device = sum(h.memory_share for h in self.latest.values() if h.state == "ready")
        self.peak = max(self.peak, on_device)

    def states(self) -> dict[str, str]:
        return {hb.model: hb.state for hb in self.latest.values()}


@contextlib.asynccontextmanager
async def serving(nats_server, tmp_path, prefix: str, worker_id: str, *flags: str):
    """One worker process with `flags`, the real scheduler, a client and its Budget of that worker."""
    worker = start_worker(nats_server.url, prefix, worker_id, tmp_path, *flags)
    conn = await connect_nats(NatsConfig(url=nats_server.url, subject_prefix=prefix), "test")
    scheduler = Scheduler(RouterConfig(heartbeat_ttl=3.0), conn)
    try:
        await scheduler.start()
        client = await Client(conn, prefix).start()
        budget = Budget(worker_id)
        await conn.subscribe(client.subjects.heartbeat, WorkerHeartbeat, budget.on)
        yield conn, client, budget
    finally:
        await scheduler.stop()
        worker.terminate()
        worker.wait(30)
        await conn.close()


async def _until(check, timeout: float = 60.0) -> None:
    deadline = time.monotonic() + timeout
    while not check():
        assert time.monotonic() < deadline, "timed out"
        await asyncio.sleep(0.1)


async def test_models_share_one_worker(nats_server, tmp_path, models, expected):
    names = ("a", "b", "c", "bad")
    flags = [f for n in names for f in ("--model-dir", str(models[n]), "--model-name", n, "--memory-share", "0.45")]
    async with serving(nats_server, tmp_path, "mm", "w", *flags, "--host-memory-gb", "1") as (_, client, budget):
        await _until(lambda: budget.states() == {"a": "ready", "b": "ready", "c": "standby", "bad": "standby"})

        async def ask(name: str, i: int = 0):
            out = await client.generate(name, PROMPTS[i], MAX_TOKENS)
            assert not hasattr(out, "ok"), out  # a RouteReply: refused
            return out

        for name in ("a", "b"):
            tokens, reason, error = await ask(name)
            assert (tokens, error) == (expected[name][0], None)
        # C comes in for the least recently used (A), three of its requests waiting meanwhile.
        got = await asyncio.gather(*(ask("c", i) for i in range(3)))
        assert [g[0] for g in got] == expected["c"]
        assert budget.states()["a"] == "standby" and budget.states()["b"] == "ready"
        # A comes back from host memory for B (least recent now), with all its prompts at once.
        got = await asyncio.gather(*(ask("a", i) for i in range(3)))
        assert [g[0] for g in got] == expected["a"]
        assert budget.states() == {"a": "ready", "b": "standby", "c": "ready", "bad": "standby"}
        # The model that cannot load fails its own requests, the others serve on.
        tokens, reason, error = await ask("bad")
        assert tokens == [] and "could not be loaded" in error
        assert (await ask("b", 1))[0] == expected["b"][1]
        refused = await client.generate("nope", PROMPTS[0], MAX_TOKENS)
        assert refused.error_status == 404
        assert 0 < budget.peak <= BUDGET
        assert "host memory" in (tmp_path / "w.log").read_text()


async def test_added_model_and_scale_to_zero(nats_server, tmp_path, models, expected):
    flags = ("--model-dir", str(models["a"]), "--model-name", "a", "--memory-share", "0.4", "--model-idle-timeout", "1.5")
    async with serving(nats_server, tmp_path, "mz", "z", *flags) as (conn, client, budget):
        await _until(lambda: budget.states().get("a") == "ready")
        reply = await AdminClient(conn, "mz").load("z", str(models["b"]), "b", mode="add", memory_share=0.4)
        assert reply.ok and reply.worker_id == "z-1" and reply.model == "b", reply
        assert (await client.generate("b", PROMPTS[0], MAX_TOKENS))[0] == expected["b"][0]
        # Idle past the timeout: both leave the device; a request brings its model back.
        await _until(lambda: set(budget.states().values()) == {"standby"}, timeout=30)
        assert (await client.generate("a", PROMPTS[2], MAX_TOKENS))[0] == expected["a"][2]
        assert budget.states()["a"] == "ready"
