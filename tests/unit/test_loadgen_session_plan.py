"""Workload W4 without a server: the session plan, each turn's messages, the header, the flags, the summary."""

from __future__ import annotations

import dataclasses
import json
import math

import pytest

from inferno.loadgen import run_benchmark
from inferno.loadgen.cli import build_parser, config_from_args, main
from inferno.loadgen.client import SseReader, encode_body
from inferno.loadgen.report import format_sessions
from inferno.loadgen.session_stats import summarize_sessions
from inferno.loadgen.sessions import SESSION_HEADER, build_sessions, session_records, turn_messages
from inferno.loadgen.stats import RequestRecord
from inferno.loadgen.workload import WORDS, BenchConfig, SessionConfig


def _cfg(seed=0, affinity=False, sessions=3, turns=4, system_len=40, user_len=(5, 9), output_len=(2, 6)):
    return BenchConfig(endpoint="chat", prompt_mode="text", seed=seed, output_len=output_len,
                       sessions=SessionConfig(sessions=sessions, turns=turns, system_len=system_len,
                                              user_len=user_len, affinity=affinity))


def test_plan_has_the_asked_shape_and_lengths():
    w = build_sessions(_cfg(sessions=3, turns=4))
    assert len(w.system.split(" ")) == 40 and set(w.system.split(" ")) <= set(WORDS)
    assert [p.index for p in w.sessions] == [0, 1, 2]
    for plan in w.sessions:
        assert len(plan.turns) == 4
        for turn in plan.turns:
            words = turn.user.split(" ")
            assert len(words) == turn.user_len and 5 <= turn.user_len <= 9 and set(words) <= set(WORDS)
            assert 2 <= turn.output_len <= 6
    # Sessions share the system prompt and nothing else.
    users = [t.user for p in w.sessions for t in p.turns]
    assert len(set(users)) == len(users)


def test_same_seed_same_prompts_other_seed_other_prompts():
    a = build_sessions(_cfg(seed=5))
    assert build_sessions(_cfg(seed=5)) == a
    b = build_sessions(_cfg(seed=6))
    assert b.system != a.system
    assert all(pa.turns != pb.turns for pa, pb in zip(a.sessions, b.sessions))
    # A session's turns do not depend on how many sessions the run has, nor on affinity.
    more = build_sessions(_cfg(seed=5, sessions=7, affinity=True))
    assert [p.turns for p in more.sessions[:3]] == [p.turns for p in a.sessions]
    assert more.system == a.system


def test_header_only_with_affinity():
    plain = build_sessions(_cfg(seed=7, affinity=False))
    assert all(p.session_id is None and p.headers is None for p in plain.sessions)
    sticky = build_sessions(_cfg(seed=7, affinity=True))
    assert [p.headers for p in sticky.sessions] == [{SESSION_HEADER: f"7-{i}"} for i in range(3)]
    assert SESSION_HEADER == "x-session-affinity"


def test_turn_k_holds_exactly_the_earlier_replies():
    w = build_sessions(_cfg(turns=4))
    plan = w.sessions[1]
    u = [t.user for t in plan.turns]
    assert turn_messages(w.system, plan, 0, []) == [
        {"role": "system", "content": w.system}, {"role": "user", "content": u[0]}]
    replies = [" first reply, untrimmed ", "\nsecond", ""]
    assert turn_messages(w.system, plan, 3, replies) == [
        {"role": "system", "content": w.system},
        {"role": "user", "content": u[0]}, {"role": "assistant", "content": " first reply, untrimmed "},
        {"role": "user", "content": u[1]}, {"role": "assistant", "content": "\nsecond"},
        {"role": "user", "content": u[2]}, {"role": "assistant", "content": ""},
        {"role": "user", "content": u[3]},
    ]
    for wrong in ([], replies[:2], replies + ["x"]):
        with pytest.raises(ValueError):
            turn_messages(w.system, plan, 3, wrong)


def test_records_are_one_per_turn_session_by_session():
    w = build_sessions(_cfg(sessions=2, turns=3))
    records = session_records(w)
    assert [(r.index, r.session, r.turn) for r in records] == [
        (0, 0, 0), (1, 0, 1), (2, 0, 2), (3, 1, 0), (4, 1, 1), (5, 1, 2)]
    for r in records:
        turns = w.sessions[r.session].turns
        assert r.planned_output_len == turns[r.turn].output_len
        assert r.planned_input_len == 40 + sum(t.user_len for t in turns[:r.turn + 1])  # replies come later


def test_turn_body_is_a_streaming_chat_request():
    w = build_sessions(_cfg())
    messages = turn_messages(w.system, w.sessions[0], 0, [])
    body = json.loads(encode_body(_cfg(), "m", {"messages": messages}, 5))
    assert body == {"model": "m", "max_tokens": 5, "stream": True, "stream_options": {"include_usage": True},
                    "messages": messages, "temperature": 0.0, "ignore_eos": True, "min_tokens": 5}


def test_sse_reader_collects_the_reply_and_cached_tokens():
    r = RequestRecord(0, 3, 2, start=0.0)
    text: list[str] = []
    reader = SseReader(r, text)
    assert reader.feed(b'data: {"choices":[{"delta":{"role":"assistant","content":""}}]}\n\n'
                       b'data: {"choices":[{"delta":{"content":" Hel"}}]}\n\n'
                       b'data: {"choices":[{"delta":{"reasoning_content":"hmm"}}]}\n\n'
                       b'data: {"choices":[{"delta":{"content":"lo\\n"}}]}\n\n', now=0.5)
    assert reader.feed(b'data: {"choices":[],"usage":{"prompt_tokens":40,"completion_tokens":2,'
                       b'"prompt_tokens_details":{"cached_tokens":32}}}\n\ndata: [DONE]\n\n', now=0.6)
    assert "".join(text) == " Hello\n"
    assert (r.prompt_tokens, r.completion_tokens, r.cached_tokens) == (40, 2, 32)
    plain = RequestRecord(1, 3, 2, start=0.0)
    assert SseReader(plain).feed(b'data: {"choices":[],"usage":{"prompt_tokens":4,"completion_tokens":1}}\n\n', 0.1)
    assert plain.cached_tokens is None  # the server did not say


def _done(session, turn, start, first_chunk, prompt, cached):
    r = RequestRecord(session * 10 + turn, prompt, 2, start=start, end=first_chunk + 0.1, session=session, turn=turn)
    r.chunk_times = [first_chunk, first_chunk + 0.05]
    r.prompt_tokens, r.completion_tokens, r.cached_tokens = prompt, 2, cached
    return r


def test_summary_hit_ratio_and_ttft_per_turn():
    records = [
        _done(0, 0, 0.0, 0.400, prompt=100, cached=0),
        _done(0, 1, 1.0, 1.020, prompt=150, cached=96),
        _done(0, 2, 2.0, 2.030, prompt=200, cached=144),
        _done(1, 0, 0.0, 0.200, prompt=100, cached=96),
        _done(1, 1, 1.0, 1.010, prompt=160, cached=None),  # no cached count: left out of the ratio
        RequestRecord(12, 5, 2, start=2.0, end=2.5, error="http-429", session=1, turn=2),
    ]
    ss = summarize_sessions(records, sessions=2, turns=3)
    assert (ss.sessions, ss.turns, ss.completed_sessions) == (2, 3, 1)
    assert (ss.prompt_tokens, ss.cached_tokens) == (550, 336)
    assert ss.hit_ratio == pytest.approx(336 / 550)
    assert [(t.turn, t.completed, t.failed) for t in ss.per_turn] == [(0, 2, 0), (1, 2, 0), (2, 1, 1)]
    assert [(t.prompt_tokens, t.cached_tokens) for t in ss.per_turn] == [(200, 96), (150, 96), (200, 144)]
    assert [t.hit_ratio for t in ss.per_turn] == pytest.approx([0.48, 0.64, 0.72])
    assert ss.ttft_first.count == 2 and ss.ttft_first.p50 == pytest.approx(300.0)
    assert ss.ttft_later.count == 3 and ss.ttft_later.p50 == pytest.approx(20.0)
    assert ss.ttft_later.mean == pytest.approx(20.0) and ss.ttft_later.p99 == pytest.approx(29.8)
    assert [t.ttft.count for t in ss.per_turn] == [2, 2, 1]
    assert ss.per_turn[2].ttft.p50 == pytest.approx(30.0)

    table = "\n".join(format_sessions(ss))
    assert "sessions completed 1 of 2" in table and "61.1 %" in table and "336 of 550" in table


def test_summary_without_cache_reports_is_none():
    ss = summarize_sessions([_done(0, 0, 0.0, 0.1, prompt=10, cached=None)], sessions=1, turns=2)
    assert ss.hit_ratio is None and ss.per_turn[0].hit_ratio is None and ss.per_turn[1].completed == 0
    assert ss.completed_sessions == 1 and ss.ttft_later.count == 0


def test_cli_session_flags_and_defaults():
    cfg = config_from_args(build_parser().parse_args(["--sessions", "4"]))
    assert cfg.sessions == SessionConfig(sessions=4, turns=8, system_len=4000, user_len=(50, 150), affinity=False)
    assert (cfg.endpoint, cfg.prompt_mode, cfg.output_len) == ("chat", "text", (100, 300))
    assert math.isinf(cfg.request_rate)
    cfg = config_from_args(build_parser().parse_args(
        ["--sessions", "2", "--turns", "3", "--system-len", "300", "--user-len", "20", "--output-len", "8",
         "--session-affinity", "--concurrency", "1", "--endpoint", "chat", "--seed", "9"]))
    assert cfg.sessions == SessionConfig(sessions=2, turns=3, system_len=300, user_len=(20, 20), affinity=True)
    assert (cfg.output_len, cfg.concurrency, cfg.seed) == ((8, 8), 1, 9)
    assert config_from_args(build_parser().parse_args([])).sessions is None


def test_cli_rejects_flags_that_do_not_apply(capsys):
    for argv in (["--turns", "3"], ["--session-affinity"], ["--system-len", "10"], ["--user-len", "5"],
                 ["--sessions", "2", "--num-requests", "10"], ["--sessions", "2", "--input-len", "10"],
                 ["--sessions", "2", "--endpoint", "completions"], ["--sessions", "2", "--prompt-mode", "tokens"],
                 ["--sessions", "2", "--request-rate", "5"], ["--sessions", "2", "--sweep-rates", "1,2"],
                 ["--sessions", "0"], ["--sessions", "2", "--turns", "0"]):
        assert main(argv) == 2, argv
    err = capsys.readouterr().err
    assert "only apply with --sessions" in err and "do not apply with --sessions" in err


def test_config_validation():
    for bad in (dict(sessions=0), dict(sessions=1, turns=0), dict(sessions=1, system_len=0),
                dict(sessions=1, user_len=(5, 4)), dict(sessions=1000, turns=1001)):
        with pytest.raises(ValueError):
            SessionConfig(**bad)
    with pytest.raises(ValueError, match="chat endpoint"):
        BenchConfig(sessions=SessionConfig(sessions=1))
    with pytest.raises(ValueError, match="request_rate"):
        dataclasses.replace(_cfg(), request_rate=5.0)


async def test_run_benchmark_refuses_a_session_workload():
    with pytest.raises(ValueError, match="run_sessions"):
        await run_benchmark(_cfg())


def test_response_format_flag_puts_the_schemas_on_the_requests_in_turn(tmp_path):
    from inferno.loadgen.client import request_body
    from inferno.loadgen.workload import WorkItem

    path = tmp_path / "schemas.json"
    path.write_text(json.dumps([{"type": "object"}, {"type": "array"}]))
    cfg = config_from_args(build_parser().parse_args(["--response-format", str(path), "--num-requests", "4"]))
    bodies = [json.loads(request_body(cfg, "m", WorkItem(i, [11, 12], 2, 3))) for i in range(3)]
    assert [b["response_format"]["json_schema"]["schema"] for b in bodies] == [
        {"type": "object"}, {"type": "array"}, {"type": "object"}]
    assert bodies[0]["response_format"]["type"] == "json_schema"
    path.write_text("[1]")
    with pytest.raises(ValueError, match="JSON schema"):
        config_from_args(build_parser().parse_args(["--response-format", str(path)]))
