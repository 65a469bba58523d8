"""A worker that loads, replaces and unloads models when told over NATS: a real nats-server, the real
scheduler, real `inferno worker` processes. One worker starts without a model; two reference
workers (another subject prefix, so the scheduler never sees them) start with model A and model B
as `inferno worker --model-dir` does. Greedy tokens through the scheduler must equal the reference
worker's of the model being served."""

from __future__ import annotations

import asyncio
import json
import subprocess
import sys
import time
import uuid
from pathlib import Path

import pytest

from services.scheduler.service import Scheduler
from services.worker.admin_client import AdminClient
from inferno.tools.make_model import write_model
from shared.config import NatsConfig, RouterConfig
from shared.messages import GenerateRequest, RouteReply, TokenBatch, WireSamplingParams, WorkerHeartbeat
from shared.nats_client import NatsConnection, connect_nats
from shared.sampling_params import SamplingParams
from shared.subjects import Subjects
from shared.wire import pack_ids

ROOT = Path(__file__).resolve().parents[2]
WORKER_FLAGS = ("--device", "cpu", "--num-blocks", "128", "--max-num-seqs", "16", "--heartbeat-interval", "0.3",
                "--kvstore", "off")
PROMPTS = [[5 + (i * 37) % 900 for i in range(n)] for n in (7, 40, 90)]


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    """Model A (Llama) and model B (Qwen2, other weights): tiny, random, one KV shape."""
    root = tmp_path_factory.mktemp("models")
    return (write_model(root / "a", arch="LlamaForCausalLM", preset="tiny", seed=11, dtype="float32"),
            write_model(root / "b", arch="Qwen2ForCausalLM", preset="tiny", seed=12, dtype="float32"))


def start_worker(url: str, prefix: str, worker_id: str, log_dir: Path, *args: str) -> subprocess.Popen:
    log = open(log_dir / f"{worker_id}.log", "wb")
    return subprocess.Popen([sys.executable, "-m", "services.worker", "--nats-url", url, "--subject-prefix", prefix,
                             "--worker-id", worker_id, *WORKER_FLAGS, *args], cwd=ROOT, stdout=log,
                            stderr=subprocess.STDOUT)


class Client:
    """Sends GenerateRequests (to the scheduler or straight to a worker) and collects their tokens."""

    def __init__(self, conn: NatsConnection, prefix: str):
        self.conn, self.subjects = conn, Subjects(prefix)
        self.heartbeats: dict[str, WorkerHeartbeat] = {}

    async def start(self) -> "Client":
        await self.conn.subscribe(self.subjects.heartbeat, WorkerHeartbeat,
                                  lambda hb: self.heartbeats.__setitem__(hb.worker_id, hb))
        return self

    async def generate(self, model: str, prompt: list[int], max_tokens: int = 10, worker: str = "",
                       on_route=None) -> tuple[list[int], str, str | None] | RouteReply:
        """Greedy tokens, finish reason and error; the RouteReply when the request was refused."""
        inbox = self.subjects.gateway_inbox(f"gw{uuid.uuid4().hex[:8]}")
        batches: asyncio.Queue = asyncio.Queue()
        sub = await self.conn.subscribe(inbox, TokenBatch, batches.put_nowait)
        sampling = WireSamplingParams.from_params(SamplingParams(temperature=0.0, max_tokens=max_tokens,
                                                                 ignore_eos=True))
        req = GenerateRequest(request_id=f"r-{uuid.uuid4().hex[:8]}", model=model, prompt_ids=pack_ids(prompt),
                              sampling=sampling, reply_to=inbox)
        subject = self.subjects.worker_generate(worker) if worker else self.subjects.generate
        try:
            route = await self.conn.request(subject, req, RouteReply, timeout=10.0)
            if not route.ok:
                return route
            if on_route is not None:
                on_route()
            tokens = []
            while True:
                batch = await asyncio.wait_for(batches.get(), 60.0)
                for d in batch.items:
                    tokens += d.token_id_list
                    if d.finished:
                        return tokens, d.finish_reason, d.error
        finally:
            await sub.unsubscribe()

    async def wait_heartbeat(self, worker: str, timeout: float = 60.0, **want) -> WorkerHeartbeat:
        deadline = time.monotonic() + timeout
        while True:
            hb = self.heartbeats.get(worker)
            if hb is not None and all(getattr(hb, k) == v for k, v in want.items()):
                return hb
            assert time.monotonic() < deadline, f"{worker} never sent a heartbeat with {want} (last: {hb})"
            await asyncio.sleep(0.02)


async def reference_outputs(conn: NatsConnection, prefix: str, worker: str, model: str) -> list[list[int]]:
    client = await Client(conn, prefix).start()
    await client.wait_heartbeat(worker, ready=True, model=model)
    outputs = []
    for prompt in PROMPTS:
        tokens, finish, _ = await client.generate(model, prompt, worker=worker)
        assert finish == "length"
        outputs.append(tokens)
    return outputs


async def test_load_serve_replace_unload(nats_server, models, tmp_path):
    model_a, model_b = models
    prefix, ref_prefix = f"t{uuid.uuid4().hex[:8]}", f"r{uuid.uuid4().hex[:8]}"
    nats_cfg = NatsConfig(url=nats_server.url, subject_prefix=prefix, request_timeout=5.0)
    procs = [start_worker(nats_server.url, prefix, "hot", tmp_path),
             start_worker(nats_server.url, ref_prefix, "ref-a", tmp_path, "--model-dir", str(model_a),
                          "--model-name", "model-a"),
             start_worker(nats_server.url, ref_prefix, "ref-b", tmp_path, "--model-dir", str(model_b),
                          "--model-name", "model-b")]
    conn = await connect_nats(nats_cfg, "test", wait=10.0)
    sched_conn = await connect_nats(nats_cfg, "sched", wait=10.0)
    scheduler = Scheduler(RouterConfig(heartbeat_ttl=3.0), sched_conn)
    try:
        await scheduler.start()
        client = await Client(conn, prefix).start()
        admin = AdminClient(conn, prefix)
        expected_a, expected_b = await asyncio.gather(reference_outputs(conn, ref_prefix, "ref-a", "model-a"),
                                                      reference_outputs(conn, ref_prefix, "ref-b", "model-b"))
        assert expected_a != expected_b

        # No model: it says so, and the scheduler routes nothing to it.
        hb = await client.wait_heartbeat("hot", state="no_model")
        assert (hb.ready, hb.model) == (False, "")
        status = await admin.status("hot")
        assert (status.ok, status.state, status.model) == (True, "no_model", "")
        while "hot" not in scheduler.registry.workers:
            await asyncio.sleep(0.02)
        refused = await client.generate("model-a", PROMPTS[0])
        assert (refused.error_status, refused.error_message) == (503, "no worker is available")

        # Load A: the reply comes once it serves; greedy tokens are those of a worker started with A.
        reply = await admin.load("hot", str(model_a), "model-a")
        assert (reply.ok, reply.state, reply.model, reply.model_dir) == (True, "ready", "model-a", str(model_a))
        assert reply.load.weights_s > 0 and not reply.load.kv_reused and reply.load.ready_s > 0
        assert [(await client.generate("model-a", p))[0] for p in PROMPTS] == expected_a

        # Replace by B while A serves: a short request finishes (drain), a long one is aborted at the
        # drain deadline with an error; a load sent meanwhile is refused as busy.
        routed = asyncio.Event()
        short = asyncio.ensure_future(client.generate("model-a", PROMPTS[1], max_tokens=5))
        long = asyncio.ensure_future(client.generate("model-a", PROMPTS[0], max_tokens=1900, on_route=routed.set))
        await routed.wait()
        replace = asyncio.ensure_future(admin.load("hot", str(model_b), "model-b", drain_timeout=1.0))
        await client.wait_heartbeat("hot", state="unloading")
        busy = await admin.load("hot", str(model_a), "model-a")
        assert (busy.ok, busy.code) == (False, "busy")
        reply = await replace
        assert (reply.ok, reply.state, reply.model) == (True, "ready", "model-b")
        assert reply.load.kv_reused and reply.load.unload_s >= 0.9  # one KV shape: the pool was kept
        assert (await short)[1] == "length"
        tokens, finish, error = await long
        assert finish == "abort" and "replacing its model" in error and 0 < len(tokens) < 1900
        assert [(await client.generate("model-b", p))[0] for p in PROMPTS] == expected_b
        gone = await client.generate("model-a", PROMPTS[0])
        assert (gone.error_status, gone.error_type) == (404, "model_not_found")

        # A bad load is refused before anything is freed: B still serves, token for token.
        bad = await admin.load("hot", str(tmp_path / "no-such-model"), "model-x")
        assert (bad.ok, bad.code, bad.state, bad.model) == (False, "bad_request", "ready", "model-b")
        assert "no such model directory" in bad.error
        assert (await client.generate("model-b", PROMPTS[2]))[0] == expected_b[2]

        # Unload: no model, nothing routed.
        reply = await admin.unload("hot")
        assert (reply.ok, reply.state, reply.model) == (True, "no_model", "")
        await client.wait_heartbeat("hot", state="no_model")
        while scheduler.registry.workers["hot"].heartbeat.state != "no_model":
            await asyncio.sleep(0.02)
        refused = await client.generate("model-b", PROMPTS[0])
        assert (refused.error_status, refused.error_message) == (503, "no worker is available")

        # The command-line verbs speak the same subjects.
        out = await asyncio.to_thread(subprocess.run, [sys.executable, "-m", "services.cli", "worker-status",
                                                       "--worker", "hot", "--nats-url", nats_server.url,
                                                       "--subject-prefix", prefix],
                                      cwd=ROOT, capture_output=True, text=True, timeout=60)
        assert out.returncode == 0 and json.loads(out.stdout)["state"] == "no_model"
        out = await asyncio.to_thread(subprocess.run, [sys.executable, "-m", "services.cli", "load-model",
                                                       "--worker", "hot", "--model-dir", str(model_a),
                                                       "--model-name", "model-a", "--nats-url", nats_server.url,
                                                       "--subject-prefix", prefix],
                                      cwd=ROOT, capture_output=True, text=True, timeout=60)
        assert out.returncode == 0 and json.loads(out.stdout)["model"] == "model-a", out.stderr
        assert [(await client.generate("model-a", p))[0] for p in PROMPTS] == expected_a
    finally:
        await scheduler.stop()
        await sched_conn.close()
        await conn.close()
        for p in procs:
            p.terminate()
        for p in procs:
            try:
                p.wait(30)
            except subprocess.TimeoutExpired:
                p.kill()
