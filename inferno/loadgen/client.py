"""The HTTP side of a run: one aiohttp session, the arrival schedule, one SSE stream per request."""

from __future__ import annotations

import asyncio
import contextlib
import json
import time
from collections.abc import Awaitable, Callable, Mapping
from concurrent.futures import Executor
from dataclasses import dataclass

import aiohttp

from inferno.loadgen import shards
from inferno.loadgen.session_stats import SessionSummary, summarize_sessions
from inferno.loadgen.stats import CpuCost, CpuMeter, RequestRecord, Summary, summarize
from inferno.loadgen.tally import Tally, publish, refreshing
from inferno.loadgen.workload import BenchConfig, WorkItem, arrival_offsets, build_workload
from shared.progress import Progress

ERROR_DETAIL_CHARS = 200
MODELS_TIMEOUT_S = 30.0
MAX_SSE_LINE = 1 << 20


class BenchError(RuntimeError):
    """The run could not start: the endpoint is unreachable or names no model."""


@dataclass(slots=True)
class BenchResult:
    config: BenchConfig
    model: str
    started_at: float  # unix time of the first send
    summary: Summary
    cpu: CpuCost | None  # None when no service pids were given
    client_cpu_s: float  # CPU used by the client's processes meanwhile: is the load generator the limit?
    records: list[RequestRecord]
    sessions: SessionSummary | None = None  # session runs (W4) only


def api_root(base_url: str) -> str:
    """'http://h:8000/v1/' -> 'http://h:8000': paths below are always /v1/..."""
    root = base_url.rstrip("/")
    return root[: -len("/v1")] if root.endswith("/v1") else root


def request_body(cfg: BenchConfig, model: str, item: WorkItem) -> bytes:
    if cfg.endpoint == "completions":
        prompt: dict = {"prompt": item.prompt}  # a list of token ids is a valid OpenAI prompt
    else:
        prompt = {"messages": [{"role": "user", "content": item.prompt}]}
    if cfg.schemas:
        schema = cfg.schemas[item.index % len(cfg.schemas)]
        prompt["response_format"] = {"type": "json_schema",
                                     "json_schema": {"name": f"s{item.index % len(cfg.schemas)}", "schema": schema}}
    return encode_body(cfg, model, prompt, item.output_len)


def encode_body(cfg: BenchConfig, model: str, prompt: Mapping[str, object], max_tokens: int) -> bytes:
    """A streaming request with usage; `prompt` holds "prompt" or "messages"."""
    body: dict = {
        "model": model,
        "max_tokens": max_tokens,
        "stream": True,
        "stream_options": {"include_usage": True},
        **prompt,
    }
    if cfg.temperature is not None:
        body["temperature"] = cfg.temperature
    if cfg.ignore_eos:  # vLLM-compatible extensions: every request makes exactly max_tokens tokens
        body["ignore_eos"] = True
        body["min_tokens"] = max_tokens
    return json.dumps(body, separators=(",", ":")).encode()


async def fetch_model_id(session: aiohttp.ClientSession, root: str) -> str:
    """The first model id that GET /v1/models lists."""
    url = f"{root}/v1/models"
    try:
        async with session.get(url, timeout=aiohttp.ClientTimeout(total=MODELS_TIMEOUT_S),
                               allow_redirects=False) as resp:
            if resp.status != 200:
                raise BenchError(f"GET {url}: HTTP {resp.status}")
            listing = await resp.json(content_type=None)
    except (aiohttp.ClientError, asyncio.TimeoutError, ValueError) as exc:
        raise BenchError(f"GET {url}: {type(exc).__name__}: {exc}") from None
    models = listing.get("data") if isinstance(listing, dict) else None
    if not models or not isinstance(models[0], dict) or not models[0].get("id"):
        raise BenchError(f"GET {url} lists no model; pass --model")
    return str(models[0]["id"])


def _has_text(choice) -> bool:
    if not isinstance(choice, dict):
        return False
    if choice.get("text"):  # completions
        return True
    delta = choice.get("delta")  # chat
    return isinstance(delta, dict) and bool(delta.get("content") or delta.get("reasoning_content"))


def _content(choice: dict) -> str:
    """The text a chunk adds to the reply (reasoning_content is left out: clients do not send it back)."""
    text = choice.get("text")
    if isinstance(text, str):
        return text
    delta = choice.get("delta")
    content = delta.get("content") if isinstance(delta, dict) else None
    return content if isinstance(content, str) else ""


def fail(record: RequestRecord, kind: str, detail: object = "") -> None:
    record.error = kind
    record.error_detail = str(detail)[:ERROR_DETAIL_CHARS]


def _count(value) -> int | None:
    return value if isinstance(value, int) and not isinstance(value, bool) and value >= 0 else None


class SseReader:
    """Turns the raw bytes of one streamed response into its record's chunk times and usage,
    and, given a list, collects the reply's text into it (a session sends it back next turn)."""

    def __init__(self, record: RequestRecord, text: list[str] | None = None):
        self.record = record
        self.text = text
        self._tail = b""  # a line not yet ended

    def feed(self, data: bytes, now: float) -> bool:
        """Take the bytes of one read, which arrived at `now`; False once the stream has failed.

        After `data: [DONE]` (record.end set) the rest is ignored.
        """
        *lines, self._tail = (self._tail + data).split(b"\n")
        if len(self._tail) > MAX_SSE_LINE:
            fail(self.record, "bad-sse", f"a line longer than {MAX_SSE_LINE} bytes")
            return False
        for line in lines:
            if self.record.end is not None:
                break
            if line.startswith(b"data:") and not self._on_data(line[5:].strip(), now):
                return False
            # other lines: blank separators, comments, event: and id: fields
        return True

    def _on_data(self, payload: bytes, now: float) -> bool:
        record = self.record
        if payload == b"[DONE]":
            record.end = now
            return True
        try:
            event = json.loads(payload)
        except ValueError:
            event = None
        if not isinstance(event, dict):
            fail(record, "bad-sse", payload)
            return False
        if event.get("error"):
            fail(record, "stream-error", event["error"])
            return False
        usage = event.get("usage")
        if isinstance(usage, dict):
            record.prompt_tokens = _count(usage.get("prompt_tokens"))
            record.completion_tokens = _count(usage.get("completion_tokens"))
            details = usage.get("prompt_tokens_details")
            record.cached_tokens = _count(details.get("cached_tokens")) if isinstance(details, dict) else None
        choices = event.get("choices")
        if isinstance(choices, list) and choices and _has_text(choices[0]):
            record.chunk_times.append(now)
            if self.text is not None:
                self.text.append(_content(choices[0]))
        return True


async def _read_sse(resp: aiohttp.ClientResponse, record: RequestRecord, t0: float,
                    text: list[str] | None) -> None:
    # Whole reads rather than an await per line: a client that falls behind catches up a
    # buffer at a time. After [DONE] it still reads to EOF, so the connection is reused.
    reader = SseReader(record, text)
    async for data in resp.content.iter_any():
        now = time.perf_counter() - t0  # before any parsing; the lines of one read came together
        if record.end is None and not reader.feed(data, now):
            return
    if record.end is None:
        fail(record, "incomplete-stream", "the stream ended without data: [DONE]")


async def stream_one(session: aiohttp.ClientSession, url: str, body: bytes,
                     record: RequestRecord, t0: float, *, headers: Mapping[str, str] | None = None,
                     text: list[str] | None = None, tally: Tally | None = None) -> None:
    """Send one request and fill its record; a failure becomes its error kind, not an exception.

    headers: added to the session's own; text: a list that collects the reply's text; tally: the
    run's counts for its progress.
    """
    record.start = time.perf_counter() - t0
    if tally is not None:
        tally.start(record)
    try:
        async with session.post(url, data=body, headers=headers, allow_redirects=False) as resp:
            if resp.status != 200:
                detail = await resp.content.read(ERROR_DETAIL_CHARS)
                return fail(record, f"http-{resp.status}", detail.decode("utf-8", "replace"))
            await _read_sse(resp, record, t0, text)
    except asyncio.CancelledError:
        if record.end is None:
            fail(record, "run-deadline", "unfinished when the run's deadline passed")
        raise
    except Exception as exc:  # one request's failure, whatever it is, never ends the run
        if record.end is None:  # past [DONE] the response is whole; draining to EOF may fail
            fail(record, *_error_kind(exc))
    finally:
        if record.error is not None or record.end is None:
            record.end = time.perf_counter() - t0
        if tally is not None:
            tally.end(record)


def _error_kind(exc: Exception) -> tuple[str, str]:
    if isinstance(exc, asyncio.TimeoutError):  # also aiohttp's ServerTimeoutError
        return "timeout", "no complete response within --timeout"
    if isinstance(exc, aiohttp.ClientError):
        return "connection-error", f"{type(exc).__name__}: {exc}"
    return "client-error", f"{type(exc).__name__}: {exc}"


async def _send_all(session: aiohttp.ClientSession, url: str, bodies: list[bytes],
                    offsets: list[float], records: list[RequestRecord],
                    concurrency: int | None, t0: float, tally: Tally | None = None) -> None:
    slots = asyncio.Semaphore(concurrency) if concurrency else None

    async def one(i: int) -> None:
        try:
            await stream_one(session, url, bodies[i], records[i], t0, tally=tally)
        finally:
            if slots is not None:
                slots.release()

    tasks: list[asyncio.Task] = []
    try:
        for i, offset in enumerate(offsets):
            delay = t0 + offset - time.perf_counter()
            if delay > 0:
                await asyncio.sleep(delay)
            if slots is not None:
                await slots.acquire()
            tasks.append(asyncio.create_task(one(i)))
        await asyncio.gather(*tasks)
    finally:
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)


def run_shard(shard: shards.Shard, counts: tuple[str, int, float] | None = None) -> tuple[list[RequestRecord], float]:
    """A child process of the pool: send the shard's requests, return its records and its CPU seconds.

    counts: where it publishes its counts for the run's progress (the name of the parent's shared
    memory, its slot there) and how often.
    """

    async def go() -> None:
        tally = publishing = None
        if counts is not None:
            name, slot, every = counts
            tally = Tally(every)
            publishing = asyncio.create_task(publish(tally, name, slot))
        connector = aiohttp.TCPConnector(limit=shard.concurrency or 0)
        async with aiohttp.ClientSession(connector=connector, headers=shard.headers,
                                         timeout=aiohttp.ClientTimeout(total=shard.timeout)) as session:
            try:
                await asyncio.wait_for(_send_all(session, shard.url, shard.bodies, shard.offsets, shard.records,
                                                 shard.concurrency, shard.t0, tally), shard.max_duration)
            except asyncio.TimeoutError:
                pass
            finally:
                if publishing is not None:
                    publishing.cancel()
                    await asyncio.gather(publishing, return_exceptions=True)

    cpu0 = time.process_time()
    asyncio.run(go())
    return shard.records, time.process_time() - cpu0


async def _send_sharded(session: aiohttp.ClientSession, url: str, bodies: list[bytes], offsets: list[float],
                        records: list[RequestRecord], cfg: BenchConfig, t0: float,
                        executor: Executor, tally: Tally | None) -> float:
    """Shard 0 from this process, the others from the pool's processes on the same clock; the
    records merged back in order. Returns the children's CPU seconds."""
    n = cfg.processes
    concurrency = -(-cfg.concurrency // n) if cfg.concurrency else None
    b, o, r = shards.split(bodies, n), shards.split(offsets, n), shards.split(records, n)
    loop = asyncio.get_running_loop()
    with tally.sharing(n - 1) if tally is not None else contextlib.nullcontext() as name:
        children = [loop.run_in_executor(executor, run_shard, shards.Shard(
            url, request_headers(cfg), b[i], o[i], r[i], concurrency, cfg.timeout, cfg.max_duration, t0),
            (name, i - 1, tally.every) if tally is not None else None) for i in range(1, n)]
        try:
            await _send_all(session, url, b[0], o[0], r[0], concurrency, t0, tally)
        finally:
            done = await asyncio.gather(*children)
    shards.merge(records, [r[0]] + [recs for recs, _ in done])
    return sum(cpu for _, cpu in done)


# Given the model id, the URL and the run's tally (None: no progress shown), returns what sends
# the run's requests (given the HTTP session and the run's clock origin) and returns the CPU seconds
# of client processes other than this one (None: there are none): the plan is made before the clock
# starts.
Driver = Callable[[aiohttp.ClientSession, float], Awaitable[float | None]]
Planner = Callable[[str, str, Tally | None], Driver]
# Opens the progress of a run of n requests, as its clock starts.
Show = Callable[[int], Progress]


async def run_benchmark(cfg: BenchConfig, show: Show | None = None) -> BenchResult:
    """Run one workload of independent requests (W2, W3) against cfg.base_url and measure it."""
    if cfg.sessions is not None:
        raise ValueError("a session workload runs with inferno.loadgen.sessions.run_sessions")
    items = build_workload(cfg)
    offsets = arrival_offsets(cfg.num_requests, cfg.request_rate, cfg.seed)
    records = [RequestRecord(item.index, item.input_len, item.output_len) for item in items]
    executor = shards.pool(cfg.processes) if cfg.processes > 1 else None

    def plan(model: str, url: str, tally: Tally | None) -> Driver:
        bodies = [request_body(cfg, model, item) for item in items]  # encoded before the clock starts
        if executor is not None:
            return lambda session, t0: _send_sharded(session, url, bodies, offsets, records, cfg, t0, executor,
                                                     tally)
        return lambda session, t0: _send_all(session, url, bodies, offsets, records, cfg.concurrency, t0, tally)

    try:
        return await measure(cfg, records, plan, show)
    finally:
        if executor is not None:
            executor.shutdown(cancel_futures=True)


def request_headers(cfg: BenchConfig) -> dict[str, str]:
    headers = {"Content-Type": "application/json"}
    if cfg.api_key:
        headers["Authorization"] = f"Bearer {cfg.api_key}"
    return headers


async def measure(cfg: BenchConfig, records: list[RequestRecord], plan: Planner,
                  show: Show | None = None) -> BenchResult:
    """Open the HTTP session, find the model, run the planned driver under the run's deadline
    and CPU meter, then summarize the records the driver filled.

    show: opens the run's progress as its clock starts; it is refreshed from the run's tally until
    the summary gives its last line.
    """
    try:
        meter = CpuMeter(cfg.pids) if cfg.pids else None
    except ValueError as exc:  # a pid that is not running
        raise BenchError(str(exc)) from None
    root = api_root(cfg.base_url)
    headers = request_headers(cfg)
    tally = Tally() if show is not None else None
    # limit=0 is no limit: with unbounded concurrency every request gets its own connection.
    connector = aiohttp.TCPConnector(limit=cfg.concurrency or 0)
    with contextlib.ExitStack() as closing:  # the progress, closed whatever happens
        async with aiohttp.ClientSession(connector=connector, headers=headers,
                                         timeout=aiohttp.ClientTimeout(total=cfg.timeout)) as session:
            model = cfg.model or await fetch_model_id(session, root)
            url = f"{root}/v1/{'completions' if cfg.endpoint == 'completions' else 'chat/completions'}"
            drive = plan(model, url, tally)
            cpu_before = meter.sample() if meter else None
            client_cpu0, started_at, t0 = time.process_time(), time.time(), time.perf_counter()
            shown = closing.enter_context(show(len(records))) if show is not None else None
            if shown is not None:
                tally.every = min(tally.every, shown.every)  # plain lines asked for more often: keep up
            others = None
            try:
                others = await asyncio.wait_for(refreshing(drive(session, t0), tally, shown), cfg.max_duration)
            except asyncio.TimeoutError:
                pass  # the requests still open were cancelled and marked run-deadline
            client_cpu = time.process_time() - client_cpu0 + (others or 0.0)
            cpu_after = meter.sample() if meter else None
        for record in records:
            if record.start is None and record.error is None:
                fail(record, "run-deadline", "not sent before the run's deadline")
        summary = summarize(records)
        if shown is not None:  # the last line gives the run's own figures
            shown.close(len(records), note=f"output tok/s {summary.output_throughput:,.0f}, errors {summary.failed:,}")
    cpu = CpuCost.between(cpu_before, cpu_after, summary.total_output_tokens) if meter else None
    sessions = None
    if cfg.sessions is not None:
        sessions = summarize_sessions(records, cfg.sessions.sessions, cfg.sessions.turns)
    return BenchResult(cfg, model, started_at, summary, cpu, client_cpu, records, sessions)
