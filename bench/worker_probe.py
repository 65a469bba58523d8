"""What bench/cold_start.py (W5b) and bench/hot_load.py (W5a) share: a nats-server, a real `inferno
worker` process logging JSON, and the time to a request's first token sent straight to the worker
(no gateway or scheduler in the way: the figure is the worker's)."""

from __future__ import annotations

import asyncio
import json
import subprocess
import sys
import time
from pathlib import Path

from services.launcher import find_nats_server, free_port
from shared import subjects
from shared.config import NatsConfig
from shared.messages import GenerateRequest, RouteReply, TokenBatch, WireSamplingParams, WorkerHeartbeat
from shared.nats_client import NatsConnection, connect_nats
from shared.sampling_params import SamplingParams
from shared.wire import decode, pack_ids

PROMPT = list(range(100, 228))  # 128 tokens, as W1


class Probe:
    """A nats-server and a connection to it; workers started with start_worker() log to `run_dir`."""

    def __init__(self, run_dir: Path):
        self.run_dir = Path(run_dir)
        self.run_dir.mkdir(parents=True, exist_ok=True)
        self.port = free_port()
        self.url = f"nats://127.0.0.1:{self.port}"
        self.nats = subprocess.Popen([find_nats_server(), "-a", "127.0.0.1", "-p", str(self.port)],
                                     stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        self.workers: list[subprocess.Popen] = []
        self.conn: NatsConnection | None = None
        self.heartbeats: dict[str, WorkerHeartbeat] = {}

    async def connect(self) -> NatsConnection:
        self.conn = await connect_nats(NatsConfig(url=self.url), "bench", wait=10.0)
        await self.conn.subscribe(subjects.heartbeat(), WorkerHeartbeat, self._on_heartbeat)
        return self.conn

    def _on_heartbeat(self, hb: WorkerHeartbeat) -> None:
        self.heartbeats[hb.worker_id] = hb

    def start_worker(self, worker_id: str, *args: str) -> subprocess.Popen:
        log = open(self.run_dir / f"{worker_id}.log", "wb")
        proc = subprocess.Popen([sys.executable, "-m", "services.worker", "--nats-url", self.url, "--worker-id",
                                 worker_id, "--log-format", "json", *args], stdout=log, stderr=subprocess.STDOUT)
        self.workers.append(proc)
        return proc

    async def wait_state(self, worker_id: str, state: str, timeout: float = 300.0) -> float:
        """Until the worker's heartbeat says `state`; returns the wall-clock time it was seen."""
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            hb = self.heartbeats.get(worker_id)
            if hb is not None and hb.state == state:
                return time.time()
            await asyncio.sleep(0.002)
        raise TimeoutError(f"worker {worker_id} not {state} within {timeout} s (log: {self.run_dir})")

    async def first_token(self, worker_id: str, max_tokens: int = 1) -> tuple[float, float]:
        """Send PROMPT to the worker; wall-clock times of its first token and of its last."""
        inbox = subjects.gateway_inbox(subjects.DEFAULT_PREFIX, f"bench{time.time_ns()}")
        got: asyncio.Queue = asyncio.Queue()
        sub = await self.conn.subscribe(inbox, TokenBatch, got.put_nowait)
        sampling = WireSamplingParams.from_params(SamplingParams(temperature=0.0, max_tokens=max_tokens,
                                                                 ignore_eos=True))
        hb = self.heartbeats[worker_id]
        req = GenerateRequest(request_id=f"r{time.time_ns()}", model=hb.model, prompt_ids=pack_ids(PROMPT),
                              sampling=sampling, reply_to=inbox)
        ack = await self.conn.request(hb.generate_subject, req, RouteReply, timeout=10.0)
        if not ack.ok:
            raise RuntimeError(f"the worker refused the request: {ack.error_message}")
        first = None
        while True:
            batch = await asyncio.wait_for(got.get(), 120.0)
            for d in batch.items:
                if first is None and d.token_ids:
                    first = time.time()
                if d.finished:
                    await sub.unsubscribe()
                    if d.finish_reason not in ("length", "stop"):
                        raise RuntimeError(f"the request ended with {d.finish_reason}: {d.error}")
                    return first, time.time()

    def log_lines(self, worker_id: str, events: tuple[str, ...]) -> list[dict]:
        """The worker's JSON log records whose event is one of `events`."""
        out = []
        for line in (self.run_dir / f"{worker_id}.log").read_text(errors="replace").splitlines():
            try:
                record = json.loads(line)
            except json.JSONDecodeError:
                continue
            if record.get("event") in events:
                out.append(record)
        return out

    async def close(self) -> None:
        for proc in self.workers:
            if proc.poll() is None:
                proc.terminate()
        for proc in self.workers:
            try:
                proc.wait(30)
            except subprocess.TimeoutExpired:
                proc.kill()
        if self.conn is not None:
            await self.conn.close()
        self.nats.kill()
        self.nats.wait()
