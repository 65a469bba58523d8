"""The load generator against a real streaming HTTP server on 127.0.0.1 (an aiohttp.web peer)."""

from __future__ import annotations

import asyncio
import dataclasses
import io
import json
import os
import re
import time
from dataclasses import dataclass

import pytest
from aiohttp import web

from inferno.loadgen import BenchConfig, BenchError, run_benchmark
from inferno.loadgen.cli import main
from inferno.loadgen.stats import Distribution
from shared.progress import progress

TOKEN_GAP_S = 0.002
SLOW_TOKEN_GAP_S = 0.25  # the "timeout" request: at least 8 tokens, so >= 2 s against a 1 s timeout
CLIENT_TIMEOUT_S = 1.0

# Outcome of the n-th request the server receives (arrival order), 20 requests in all:
# 429 for n = 4, 9, 14, 19; an error object in the stream for n = 6, 13; too slow for n = 10;
# the connection dropped mid-stream for n = 15; the other 12 complete.
EXPECTED_ERRORS = {"http-429": 4, "stream-error": 2, "timeout": 1, "connection-error": 1}

# Anything a terminal would act on (escape sequences, carriage returns): none in a log's progress lines.
CONTROL = re.compile(r"[\x00-\x09\x0b-\x1f\x7f]")
PROGRESS_LINE = re.compile(r"(?P<name>[^:]+): (?P<done>[0-9,]+)/(?P<total>[0-9,]+) requests \([0-9]+ %\), "
                           r"(?:in flight (?P<in_flight>[0-9,]+), )?output tok/s [0-9,]+, errors (?P<errors>[0-9,]+), "
                           r"[0-9.]+ s(?P<final> — done)?")


def progress_lines(err: str, name: str) -> list[re.Match]:
    """The plain progress lines of the run called `name`, each one checked whole."""
    assert not CONTROL.search(err)
    lines = [line for line in err.splitlines() if line.startswith(f"{name}: ")]
    matches = [PROGRESS_LINE.fullmatch(line) for line in lines]
    assert lines and all(matches), lines
    assert [m["final"] is not None for m in matches] == [False] * (len(lines) - 1) + [True]
    assert [m["in_flight"] is None for m in matches] == [m["final"] is not None for m in matches]
    done = [int(m["done"]) for m in matches]
    assert done == sorted(done)
    return matches


def outcome_of(n: int) -> str:
    if n % 5 == 4:
        return "http-429"
    if n % 7 == 6:
        return "stream-error"
    return {10: "timeout", 15: "connection-error"}.get(n, "ok")


@dataclass
class Served:
    n: int
    path: str
    body: dict
    outcome: str


class FakeOpenAI:
    """An OpenAI-compatible streaming server: one token per SSE chunk, usage chunk, [DONE]."""

    def __init__(self, all_ok: bool = False, token_gap: float = TOKEN_GAP_S):
        self.all_ok = all_ok
        self.token_gap = token_gap
        self.served: list[Served] = []
        self.in_flight = 0
        self.max_in_flight = 0
        self.app = web.Application()
        self.app.router.add_get("/v1/models", self.models)
        self.app.router.add_post("/v1/completions", self.generate)
        self.app.router.add_post("/v1/chat/completions", self.generate)

    async def models(self, request: web.Request) -> web.Response:
        return web.json_response({"object": "list", "data": [{"id": "fake-model", "object": "model"}]})

    async def generate(self, request: web.Request) -> web.StreamResponse:
        body = await request.json()
        n = len(self.served)
        outcome = "ok" if self.all_ok else outcome_of(n)
        self.served.append(Served(n, request.path, body, outcome))
        self.in_flight += 1
        self.max_in_flight = max(self.max_in_flight, self.in_flight)
        try:
            return await self._respond(request, body, outcome)
        finally:
            self.in_flight -= 1

    async def _respond(self, request: web.Request, body: dict, outcome: str) -> web.StreamResponse:
        if outcome == "http-429":
            return web.json_response({"error": {"message": "queue full", "type": "rate_limit_error"}},
                                     status=429, headers={"Retry-After": "1"})
        chat = request.path.endswith("/chat/completions")
        prompt_tokens = len(body["messages"][0]["content"].split()) if chat else len(body["prompt"])
        resp = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
        await resp.prepare(request)

        async def send(event: dict) -> None:
            await resp.write(b"data: " + json.dumps(event).encode() + b"\n\n")

        def choice(text: str, finish: str | None) -> dict:
            if chat:
                return {"index": 0, "delta": {"content": text}, "finish_reason": finish}
            return {"index": 0, "text": text, "finish_reason": finish}

        try:
            await resp.write(b": keep-alive comment\n\n")
            for i in range(body["max_tokens"]):
                if i == 2 and outcome == "stream-error":
                    await send({"error": {"message": "engine failed", "type": "internal_error", "code": 500}})
                    await resp.write(b"data: [DONE]\n\n")
                    return resp
                if i == 2 and outcome == "connection-error":
                    request.transport.close()  # mid-body: the chunked response never terminates
                    return resp
                await asyncio.sleep(SLOW_TOKEN_GAP_S if outcome == "timeout" else self.token_gap)
                await send({"id": "cmpl-1", "choices": [choice(f" t{i}", None)], "usage": None})
            await send({"id": "cmpl-1", "choices": [choice("", "length")], "usage": None})
            await send({"id": "cmpl-1", "choices": [], "usage": {
                "prompt_tokens": prompt_tokens, "completion_tokens": body["max_tokens"],
                "total_tokens": prompt_tokens + body["max_tokens"]}})
            await resp.write(b"data: [DONE]\n\n")
            await resp.write_eof()
        except ConnectionResetError:
            pass  # the client gave up on us (its timeout)
        return resp


async def _serve(server: FakeOpenAI):
    runner = web.AppRunner(server.app)
    await runner.setup()
    site = web.TCPSite(runner, "127.0.0.1", 0)
    await site.start()
    port = runner.addresses[0][1]
    return runner, f"http://127.0.0.1:{port}"


@pytest.fixture
async def fake():
    server = FakeOpenAI()
    runner, server.base_url = await _serve(server)
    yield server
    await runner.cleanup()


def _config(base_url: str, **overrides) -> BenchConfig:
    fields = dict(base_url=base_url, num_requests=20, concurrency=4, input_len=(10, 30),
                  output_len=(8, 16), vocab_size=500, timeout=CLIENT_TIMEOUT_S, max_duration=30.0, seed=1)
    fields.update(overrides)
    return BenchConfig(**fields)


async def test_counts_tokens_and_errors_against_a_streaming_server(fake):
    result = await run_benchmark(_config(fake.base_url, pids={"self": os.getpid()}))
    s = result.summary

    assert result.model == "fake-model"
    assert len(fake.served) == 20
    assert fake.max_in_flight <= 4
    assert (s.completed, s.failed) == (12, 8)
    assert s.errors == EXPECTED_ERRORS

    for served in fake.served:
        b = served.body
        assert b["model"] == "fake-model" and b["stream"] is True
        assert b["stream_options"] == {"include_usage": True}
        assert b["ignore_eos"] is True and b["min_tokens"] == b["max_tokens"]
        assert b["temperature"] == 0.0
        assert all(isinstance(t, int) and 10 <= t < 500 for t in b["prompt"])
        assert 10 <= len(b["prompt"]) <= 30 and 8 <= b["max_tokens"] <= 16
    # Every planned request went out once, whatever the arrival order.
    assert sorted((len(x.body["prompt"]), x.body["max_tokens"]) for x in fake.served) == sorted(
        (r.planned_input_len, r.planned_output_len) for r in result.records)

    ok = [x.body for x in fake.served if x.outcome == "ok"]
    out_tokens = sum(b["max_tokens"] for b in ok)
    assert s.total_output_tokens == out_tokens
    assert s.total_input_tokens == sum(len(b["prompt"]) for b in ok)
    done = [r for r in result.records if r.ok]
    for r in done:  # one token per chunk; the empty finish chunk is not content
        assert r.completion_tokens == r.planned_output_len == len(r.chunk_times)
        assert r.prompt_tokens == r.planned_input_len
        assert 0 < r.ttft <= r.e2e
    assert s.ttft.count == s.tpot.count == s.e2e.count == 12
    assert s.itl.count == sum(r.planned_output_len - 1 for r in done)
    assert s.itl.p50 >= TOKEN_GAP_S * 1000 * 0.9
    assert s.output_throughput == pytest.approx(out_tokens / s.duration_s)
    assert s.total_throughput == pytest.approx((out_tokens + s.total_input_tokens) / s.duration_s)
    assert s.request_throughput == pytest.approx(12 / s.duration_s)

    timed_out = next(r for r in result.records if r.error == "timeout")
    assert CLIENT_TIMEOUT_S * 0.9 <= timed_out.e2e < CLIENT_TIMEOUT_S + 1.0
    assert s.duration_s >= timed_out.e2e
    assert "queue full" in next(r for r in result.records if r.error == "http-429").error_detail
    assert "engine failed" in next(r for r in result.records if r.error == "stream-error").error_detail

    cpu = result.cpu
    assert cpu.output_tokens == out_tokens
    assert cpu.cpu_s["self"] >= 0.0 and cpu.total_cpu_s == cpu.cpu_s["self"]
    assert cpu.us_per_token["self"] == pytest.approx(cpu.cpu_s["self"] * 1e6 / out_tokens)
    assert cpu.total_us_per_token == pytest.approx(cpu.us_per_token["self"])


async def test_several_client_processes_send_every_request_once_on_one_clock():
    """--processes 3: three processes share the run (each sends every third request); the records
    come back in plan order with their timings on the parent's clock, as one process would have
    measured them, and the client CPU counts the children too. The progress counts the children's
    requests (they publish their counts through shared memory)."""
    server = FakeOpenAI(all_ok=True, token_gap=0.03)  # each request in flight for 0.24 s at least
    runner, base_url = await _serve(server)
    err = io.StringIO()
    try:
        result = await run_benchmark(_config(base_url, num_requests=12, concurrency=None, processes=3),
                                     lambda n: progress("bench", n, "requests", stream=err, every=0.01, live=False))
    finally:
        await runner.cleanup()
    shown = progress_lines(err.getvalue(), "bench")
    assert max(int(m["in_flight"] or 0) for m in shown) > 4  # more than this process's share of 4
    s = result.summary
    assert (s.completed, s.failed) == (12, 0) and len(server.served) == 12
    assert sorted((len(x.body["prompt"]), x.body["max_tokens"]) for x in server.served) == sorted(
        (r.planned_input_len, r.planned_output_len) for r in result.records)
    assert [r.index for r in result.records] == list(range(12))
    for r in result.records:
        assert r.completion_tokens == r.planned_output_len == len(r.chunk_times)
        assert 0 <= r.start < r.end <= s.duration_s + r.start and 0 < r.ttft <= r.e2e
    assert s.duration_s < 10.0  # one clock: no child's times are offset by its start-up
    assert result.client_cpu_s > 0.0


async def test_cli_writes_json_and_table(fake, tmp_path, capsys):
    out, plot = tmp_path / "result.json", tmp_path / "cdf.png"
    argv = ["--base-url", fake.base_url + "/v1", "--num-requests", "20", "--concurrency", "4",
            "--input-len", "10:30", "--output-len", "8:16", "--vocab-size", "500", "--timeout", "1",
            "--request-rate", "400", "--seed", "3", "--pid", f"self={os.getpid()}",
            "--out", str(out), "--save-requests", "--plot", str(plot), "--progress-every", "0.05"]
    assert await asyncio.to_thread(main, argv) == 0

    doc = json.loads(out.read_text())
    assert doc["model"] == "fake-model"
    assert doc["config"]["request_rate"] == 400.0 and doc["config"]["concurrency"] == 4
    assert doc["config"]["input_len"] == [10, 30] and doc["config"]["pids"] == {"self": os.getpid()}
    summary = doc["summary"]
    assert (summary["completed"], summary["failed"]) == (12, 8)
    assert summary["errors"] == EXPECTED_ERRORS
    ok = [x.body for x in fake.served if x.outcome == "ok"]
    assert summary["total_output_tokens"] == doc["cpu"]["output_tokens"] == sum(b["max_tokens"] for b in ok)
    assert set(summary["ttft"]) == {"count", "mean", "p50", "p90", "p99"}
    assert set(doc["cpu"]["us_per_token"]) == {"self"}
    assert len(doc["requests"]) == 20
    assert sorted(r["error"] for r in doc["requests"] if r["error"]) == sorted(
        kind for kind, n in EXPECTED_ERRORS.items() for _ in range(n))

    captured = capsys.readouterr()
    assert "completed 12  failed 8" in captured.out and "µs/token" in captured.out
    # Progress on stderr while the run lasts (over 1 s: the slow request), a plain line every 0.05 s.
    shown = progress_lines(captured.err, "bench")
    assert len(shown) >= 5 and {m["total"] for m in shown} == {"20"}
    assert (shown[-1]["done"], shown[-1]["errors"]) == ("20", "8")
    assert "requests (" not in captured.out and captured.out.startswith("model fake-model")
    try:
        import matplotlib  # noqa: F401
    except ImportError:
        assert "needs matplotlib" in captured.err and not plot.exists()
    else:
        assert plot.stat().st_size > 0


async def test_sweep_runs_each_rate(tmp_path, capsys):
    server = FakeOpenAI(all_ok=True)
    runner, base_url = await _serve(server)
    try:
        out = tmp_path / "sweep.json"
        argv = ["--base-url", base_url, "--num-requests", "10", "--input-len", "16", "--output-len", "4",
                "--sweep-rates", "200,400", "--out", str(out)]
        assert await asyncio.to_thread(main, argv) == 0
    finally:
        await runner.cleanup()
    runs = json.loads(out.read_text())["runs"]
    assert [r["config"]["request_rate"] for r in runs] == [200.0, 400.0]
    assert [r["summary"]["completed"] for r in runs] == [10, 10]
    assert [r["summary"]["total_output_tokens"] for r in runs] == [40, 40]
    assert [r["summary"]["total_input_tokens"] for r in runs] == [160, 160]
    assert [r["config"]["seed"] for r in runs] == [0, 1]
    # Each rate sends new prompts, so none is served from the previous rate's prefix cache.
    prompts = [tuple(x.body["prompt"]) for x in server.served]
    assert len(prompts) == 20 and not set(prompts[:10]) & set(prompts[10:])
    captured = capsys.readouterr()
    assert "rate/s" in captured.out
    for rate in ("200", "400"):  # the runs are shorter than the 5 s between lines: just their last
        [last] = progress_lines(captured.err, f"rate {rate}/s")
        assert (last["done"], last["total"], last["errors"]) == ("10", "10", "0")


async def test_progress_changes_nothing_on_stdout_or_in_the_json(tmp_path, capsys):
    """The same run with progress and with --no-progress: stdout and the JSON document read the same but
    for the measured times, and stderr is empty with --no-progress."""
    server = FakeOpenAI(all_ok=True)
    runner, base_url = await _serve(server)
    runs = []
    try:
        for i, flag in enumerate(["--progress-every=0.01", "--no-progress"]):
            out = tmp_path / f"{i}.json"
            argv = ["--base-url", base_url, "--num-requests", "8", "--input-len", "16", "--output-len", "4",
                    "--out", str(out), flag]
            assert await asyncio.to_thread(main, argv) == 0
            runs.append((capsys.readouterr(), json.loads(out.read_text())))
    finally:
        await runner.cleanup()
    (shown, shown_doc), (quiet, quiet_doc) = runs
    assert progress_lines(shown.err, "bench")[-1]["done"] == "8"
    assert quiet.err == ""

    def figures_out(text: str) -> list[str]:  # the columns' widths follow the figures' too
        return [" ".join(re.sub(r"[0-9][0-9.,]*", "N", line).split()) for line in text.splitlines()]

    assert figures_out(shown.out) == figures_out(quiet.out)
    assert shown_doc.keys() == quiet_doc.keys() and shown_doc["config"] == quiet_doc["config"]
    counts = ("completed", "failed", "errors", "total_input_tokens", "total_output_tokens")
    assert [shown_doc["summary"][k] for k in counts] == [quiet_doc["summary"][k] for k in counts]


async def test_plots_name_the_stack_and_the_load_with_plain_numbers_and_percentiles():
    pytest.importorskip("matplotlib")
    from inferno.loadgen.report import result_figure, sweep_figure

    server = FakeOpenAI(all_ok=True)
    runner, base_url = await _serve(server)
    try:
        result = await run_benchmark(_config(base_url, num_requests=10, concurrency=3))
    finally:
        await runner.cleanup()
    s = result.summary

    def plain(ax) -> bool:
        labels = [t.get_text() for t in ax.get_xticklabels(which="both") + ax.get_yticklabels(which="both")]
        labels = [x for x in labels if x]
        offsets = ax.xaxis.get_offset_text().get_text() + ax.yaxis.get_offset_text().get_text()
        return (len(labels) >= 4 and not offsets
                and all(re.fullmatch(r"-?[0-9]{1,3}(,[0-9]{3})*(\.[0-9]+)?", x) for x in labels))

    fig = result_figure(result)
    fig.canvas.draw()
    assert fig.get_suptitle().splitlines() == [
        f"fake-model at {base_url} (completions)",
        "10 requests, concurrency 3, input 10:30, output 8:16, all at once",
        f"10 completed, 0 failed, {s.output_throughput:,.0f} output tok/s"]
    for ax, d in zip(fig.axes, (s.ttft, s.itl)):
        assert plain(ax)
        assert [t.get_text() for t in ax.get_legend().get_texts()] == [
            f"{d.count:,} samples", f"p50 {d.p50:,.1f} ms", f"p90 {d.p90:,.1f} ms", f"p99 {d.p99:,.1f} ms"]

    # A second rate whose TTFT p99 is far above the ITL's: a log axis, labelled in plain numbers too.
    slow = dataclasses.replace(s, ttft=Distribution(10, 900.0, 800.0, 1200.0, 2500.0))
    sweep = [result, dataclasses.replace(result, config=dataclasses.replace(result.config, request_rate=50.0),
                                         summary=slow)]
    fig = sweep_figure(sweep)
    fig.canvas.draw()
    [ax] = fig.axes
    assert ax.get_yscale() == "log" and plain(ax)
    assert ax.get_title().splitlines() == [f"fake-model at {base_url} (completions)",
                                           "10 requests, concurrency 3, input 10:30, output 8:16,",
                                           "a run at each rate: all at once, 50/s"]


async def test_chat_endpoint_streams_text_prompts():
    server = FakeOpenAI(all_ok=True)
    runner, base_url = await _serve(server)
    try:
        result = await run_benchmark(BenchConfig(base_url=base_url, endpoint="chat", prompt_mode="text",
                                                 num_requests=6, input_len=(5, 9), output_len=(3, 5)))
    finally:
        await runner.cleanup()
    assert result.summary.completed == 6
    assert {x.path for x in server.served} == {"/v1/chat/completions"}
    assert sorted(len(x.body["messages"][0]["content"].split()) for x in server.served) == sorted(
        r.planned_input_len for r in result.records)
    assert result.summary.total_input_tokens == sum(r.planned_input_len for r in result.records)
    assert result.summary.total_output_tokens == sum(x.body["max_tokens"] for x in server.served)
    assert all(len(r.chunk_times) == r.completion_tokens for r in result.records)


async def test_run_deadline_bounds_the_run():
    server = FakeOpenAI(all_ok=True, token_gap=0.05)
    runner, base_url = await _serve(server)
    try:
        t = time.perf_counter()
        result = await run_benchmark(BenchConfig(base_url=base_url, num_requests=8, concurrency=2,
                                                 input_len=(8, 8), output_len=(20, 20), max_duration=0.5))
        elapsed = time.perf_counter() - t
    finally:
        await runner.cleanup()
    assert elapsed < 3.0  # unbounded, the 8 requests would take 4 s
    assert result.summary.completed == 0  # each request needs 20 x 50 ms
    assert result.summary.errors == {"run-deadline": 8}
    assert len(server.served) == 2  # never more than the concurrency in flight


async def test_unreachable_server_is_a_bench_error():
    with pytest.raises(BenchError, match="/v1/models"):
        await run_benchmark(BenchConfig(base_url="http://127.0.0.1:9", num_requests=1))
