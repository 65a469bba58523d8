"""Workload W4 against a real streaming chat server on 127.0.0.1 (an aiohttp.web peer with a pretend cache)."""

from __future__ import annotations

import asyncio
import json
import re
from dataclasses import dataclass

import pytest
from aiohttp import web

from inferno.loadgen import BenchConfig, SessionConfig, run_sessions
from inferno.loadgen.cli import build_parser, config_from_args, main
from inferno.loadgen.sessions import SESSION_HEADER, SessionWorkload, build_sessions

TOKEN_GAP_S = 0.002
PREFILL_S_PER_WORD = 0.0005  # the pretend prefill: uncached prompt words cost this each before the first token
SYSTEM_LEN = 200


@dataclass
class Served:
    body: dict
    session_header: str | None
    reply: str | None  # None: answered with an error


def _words(messages) -> int:
    return sum(len(m["content"].split()) for m in messages)


class FakeChat:
    """A streaming chat server. One word per token. Its pretend prefix cache holds everything
    before a request's last user message, except on a dialogue's first turn; prefill time is
    proportional to the uncached words. The user message `fail_user` is answered with 429."""

    def __init__(self, fail_user: str | None = None):
        self.fail_user = fail_user
        self.served: list[Served] = []
        self.replies: dict[str, str] = {}  # user message -> the reply streamed to it
        self.in_flight = 0
        self.max_in_flight = 0
        self.app = web.Application()
        self.app.router.add_get("/v1/models", self.models)
        self.app.router.add_post("/v1/chat/completions", self.chat)

    async def models(self, request: web.Request) -> web.Response:
        return web.json_response({"object": "list", "data": [{"id": "fake-chat", "object": "model"}]})

    async def chat(self, request: web.Request) -> web.StreamResponse:
        body = await request.json()
        n = len(self.served)
        served = Served(body, request.headers.get(SESSION_HEADER), None)
        self.served.append(served)
        messages = body["messages"]
        user = messages[-1]["content"]
        if user == self.fail_user:
            return web.json_response({"error": {"message": "queue full", "type": "rate_limit_error"}}, status=429)
        self.in_flight += 1
        self.max_in_flight = max(self.max_in_flight, self.in_flight)
        try:
            prompt = _words(messages)
            cached = _words(messages[:-1]) if len(messages) > 2 else 0
            await asyncio.sleep((prompt - cached) * PREFILL_S_PER_WORD)
            resp = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
            await resp.prepare(request)

            async def send(event: dict) -> None:
                await resp.write(b"data: " + json.dumps(event).encode() + b"\n\n")

            # Leading space and trailing newline: the client must send the reply back untrimmed.
            pieces = [f" r{n}.{i}" for i in range(body["max_tokens"])]
            pieces[-1] += "\n"
            await send({"choices": [{"index": 0, "delta": {"role": "assistant", "content": ""}}]})
            for piece in pieces:
                await asyncio.sleep(TOKEN_GAP_S)
                await send({"choices": [{"index": 0, "delta": {"content": piece}, "finish_reason": None}]})
            await send({"choices": [{"index": 0, "delta": {}, "finish_reason": "length"}]})
            await send({"choices": [], "usage": {
                "prompt_tokens": prompt, "completion_tokens": len(pieces), "total_tokens": prompt + len(pieces),
                "prompt_tokens_details": {"cached_tokens": cached}}})
            await resp.write(b"data: [DONE]\n\n")
            await resp.write_eof()
            served.reply = self.replies[user] = "".join(pieces)
            return resp
        finally:
            self.in_flight -= 1


@pytest.fixture
async def serve():
    runners = []

    async def start(server: FakeChat) -> str:
        runner = web.AppRunner(server.app)
        await runner.setup()
        await web.TCPSite(runner, "127.0.0.1", 0).start()
        runners.append(runner)
        return f"http://127.0.0.1:{runner.addresses[0][1]}"

    yield start
    for runner in runners:
        await runner.cleanup()


def _expected(w: SessionWorkload, session: int, turn: int) -> tuple[int, int]:
    """(prompt, cached) words of a turn: the fake's replies have one word per max_tokens."""
    turns = w.sessions[session].turns
    prompt = SYSTEM_LEN + sum(t.user_len for t in turns[:turn + 1]) + sum(t.output_len for t in turns[:turn])
    return prompt, (prompt - turns[turn].user_len if turn else 0)


def _check_dialogues(server: FakeChat, w: SessionWorkload, affinity: bool, seed: int) -> None:
    """Each request resends exactly the replies its session got, and the header only with affinity."""
    session_of = {p.turns[0].user: p.index for p in w.sessions}
    for s in server.served:
        messages = s.body["messages"]
        assert messages[0] == {"role": "system", "content": w.system}
        session = session_of[messages[1]["content"]]
        turn = (len(messages) - 2) // 2
        assert [m["role"] for m in messages[1:]] == ["user", "assistant"] * turn + ["user"]
        for k in range(turn):
            user, reply = messages[1 + 2 * k]["content"], messages[2 + 2 * k]["content"]
            assert user == w.sessions[session].turns[k].user
            assert reply == server.replies[user]  # as streamed, leading space and newline kept
        assert messages[-1]["content"] == w.sessions[session].turns[turn].user
        assert s.session_header == (f"{seed}-{session}" if affinity else None)


async def test_sessions_hit_ratio_and_per_turn_summary(serve):
    server = FakeChat()
    cfg = BenchConfig(base_url=await serve(server), endpoint="chat", prompt_mode="text", seed=4, concurrency=2,
                      output_len=(3, 6), sessions=SessionConfig(sessions=4, turns=3, system_len=SYSTEM_LEN,
                                                                user_len=(5, 9), affinity=True))
    result = await run_sessions(cfg)
    w = build_sessions(cfg)

    assert result.model == "fake-chat"
    assert len(server.served) == 12 and server.max_in_flight <= 2
    _check_dialogues(server, w, affinity=True, seed=4)
    s, ss = result.summary, result.sessions
    assert (s.completed, s.failed, s.errors) == (12, 0, {})

    for r in result.records:
        prompt, cached = _expected(w, r.session, r.turn)
        assert (r.prompt_tokens, r.cached_tokens) == (prompt, cached)
        assert r.completion_tokens == len(r.chunk_times) == w.sessions[r.session].turns[r.turn].output_len
    for a, b in zip(result.records, result.records[1:]):
        if a.session == b.session:
            assert b.start >= a.end  # a session's turns run one after another

    per_turn = [[_expected(w, p.index, k) for p in w.sessions] for k in range(3)]
    assert [(t.turn, t.completed, t.failed) for t in ss.per_turn] == [(0, 4, 0), (1, 4, 0), (2, 4, 0)]
    for t, expected in zip(ss.per_turn, per_turn):
        assert (t.prompt_tokens, t.cached_tokens) == (sum(p for p, _ in expected), sum(c for _, c in expected))
        assert t.hit_ratio == pytest.approx(t.cached_tokens / t.prompt_tokens)
        assert t.ttft.count == 4
    assert ss.per_turn[0].cached_tokens == 0
    prompt_total = sum(p for turn in per_turn for p, _ in turn)
    cached_total = sum(c for turn in per_turn for _, c in turn)
    assert (ss.prompt_tokens, ss.cached_tokens) == (prompt_total, cached_total)
    assert s.total_input_tokens == prompt_total
    assert ss.hit_ratio == pytest.approx(cached_total / prompt_total)
    assert (ss.sessions, ss.turns, ss.completed_sessions) == (4, 3, 4)

    # First turns wait for their whole prompt's pretend prefill (>= 205 words), later turns for 9 words at most.
    assert ss.ttft_first.count == 4 and ss.ttft_later.count == 8
    assert ss.ttft_first.p50 >= (SYSTEM_LEN + 5) * PREFILL_S_PER_WORD * 1000
    assert ss.ttft_later.p50 < ss.ttft_first.p50


async def test_cli_without_affinity_writes_the_session_figures(serve, tmp_path, capsys):
    argv = ["--sessions", "3", "--turns", "3", "--system-len", str(SYSTEM_LEN), "--user-len", "4:8",
            "--output-len", "2:4", "--seed", "11"]
    cfg = config_from_args(build_parser().parse_args(argv))
    w = build_sessions(cfg)
    failing = w.sessions[1].turns[1].user  # session 1 fails at turn 1, so its turn 2 is never sent
    server = FakeChat(fail_user=failing)
    out = tmp_path / "w4.json"
    argv += ["--base-url", await serve(server) + "/v1", "--out", str(out), "--save-requests",
             "--progress-every", "0.01"]
    assert await asyncio.to_thread(main, argv) == 0

    assert len(server.served) == 8
    assert not any(s.body["messages"][-1]["content"] == w.sessions[1].turns[2].user for s in server.served)
    _check_dialogues(server, w, affinity=False, seed=11)

    doc = json.loads(out.read_text())
    assert doc["config"]["sessions"] == {"sessions": 3, "turns": 3, "system_len": SYSTEM_LEN,
                                         "user_len": [4, 8], "affinity": False}
    summary, sessions = doc["summary"], doc["sessions"]
    assert (summary["completed"], summary["failed"]) == (7, 2)
    assert summary["errors"] == {"http-429": 1, "session-aborted": 1}
    assert sessions["completed_sessions"] == 2
    assert [(t["completed"], t["failed"]) for t in sessions["per_turn"]] == [(3, 0), (2, 1), (2, 1)]
    done = [(s, k) for s in range(3) for k in range(3) if s != 1 or k == 0]
    assert sessions["prompt_tokens"] == sum(_expected(w, s, k)[0] for s, k in done)
    assert sessions["cached_tokens"] == sum(_expected(w, s, k)[1] for s, k in done)
    assert sessions["hit_ratio"] == pytest.approx(sessions["cached_tokens"] / sessions["prompt_tokens"])
    assert set(sessions["ttft_first"]) == {"count", "mean", "p50", "p90", "p99"}
    assert (sessions["ttft_first"]["count"], sessions["ttft_later"]["count"]) == (3, 4)
    requests = {(r["session"], r["turn"]): r for r in doc["requests"]}
    assert requests[(1, 2)]["error"] == "session-aborted" and requests[(1, 2)]["start"] is None
    assert requests[(0, 2)]["cached_tokens"] == _expected(w, 0, 2)[1]

    captured = capsys.readouterr()
    printed = captured.out
    assert "sessions 3 x 3 turns" in printed and "affinity off" in printed
    assert f"prompt-cache hit ratio {sessions['hit_ratio'] * 100:.1f} %" in printed
    assert "first turns" in printed and "later turns" in printed

    # Progress on stderr, plain lines (no terminal): every turn counts, the one given up unsent too.
    assert not re.search(r"[\x00-\x09\x0b-\x1f\x7f]", captured.err)
    shown = [line for line in captured.err.splitlines() if line.startswith("sessions: ")]
    assert len(shown) >= 2 and "requests (" not in printed
    assert all(re.fullmatch(r"sessions: [0-9]/9 requests \([0-9]+ %\), in flight [0-3], output tok/s [0-9,]+, "
                            r"errors [0-2], [0-9.]+ s", line) for line in shown[:-1]), shown
    assert re.fullmatch(r"sessions: 9/9 requests \(100 %\), output tok/s [0-9,]+, errors 2, [0-9.]+ s — done",
                        shown[-1])
