"""Workload W4 through the whole stack: two workers, multi-turn sessions, prefix-cache hits per turn."""

from __future__ import annotations

import dataclasses
import json

from inferno.loadgen import BenchConfig, SessionConfig, run_sessions
from tests.e2e.conftest import start_stack

BLOCK_SIZE = 16  # the workers' default
SESSIONS, TURNS = 3, 3


def _scheduler_totals(run_dir) -> dict:
    """The counters the scheduler logs when it stops (JSON logs: one object per line)."""
    for line in (run_dir / "scheduler-0.log").read_text().splitlines():
        if line.startswith("{"):
            event = json.loads(line)
            if event.get("event") == "scheduler_stopped":
                return event
    raise AssertionError("the scheduler logged no scheduler_stopped line")


async def test_later_turns_hit_the_prefix_cache_and_sessions_stick(tiny_model, tmp_path):
    stack = start_stack(tmp_path, tiny_model, workers=2)
    try:
        sticky = BenchConfig(base_url=stack.url, endpoint="chat", prompt_mode="text", seed=3, output_len=(6, 6),
                             timeout=60, max_duration=120,
                             sessions=SessionConfig(sessions=SESSIONS, turns=TURNS, system_len=300,
                                                    user_len=(10, 20), affinity=True))
        with_affinity = await run_sessions(sticky)
        # A new seed: fresh sessions and a fresh system prompt, none of it cached by the first run.
        plain = dataclasses.replace(sticky, seed=4, sessions=dataclasses.replace(sticky.sessions, affinity=False))
        without = await run_sessions(plain)
    finally:
        stack.stop()

    for result in (with_affinity, without):
        assert (result.summary.completed, result.summary.failed) == (SESSIONS * TURNS, 0)
        ss = result.sessions
        assert ss.completed_sessions == SESSIONS
        assert [(t.completed, t.failed) for t in ss.per_turn] == [(SESSIONS, 0)] * TURNS
        assert (ss.ttft_first.count, ss.ttft_later.count) == (SESSIONS, SESSIONS * (TURNS - 1))
        assert all(r.cached_tokens is not None and r.prompt_tokens > 300 for r in result.records)
        assert ss.prompt_tokens == sum(r.prompt_tokens for r in result.records)
        assert ss.cached_tokens == sum(r.cached_tokens for r in result.records)
    # (Without affinity a later turn may land on the worker that lacks its dialogue, and even the
    # system prompt: nothing about its hits is certain, which is what W4 measures.)

    # With affinity a turn runs where its session's previous turn ran, so every full block of that
    # turn's prompt is still cached there (the pools are far from full).
    records = with_affinity.records
    for before, after in zip(records, records[1:]):
        if after.session == before.session:
            assert after.cached_tokens >= before.prompt_tokens // BLOCK_SIZE * BLOCK_SIZE > 0
    assert with_affinity.sessions.per_turn[0].cached_tokens < with_affinity.sessions.per_turn[1].cached_tokens

    # The scheduler counted every later turn of every session as routed to its session's worker,
    # and none of the run without the header.
    totals = _scheduler_totals(tmp_path)
    assert totals["routed"] == 2 * SESSIONS * TURNS
    assert totals["sticky"] == SESSIONS * (TURNS - 1)
