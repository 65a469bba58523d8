"""Workload W4: chat sessions sharing one system prompt, each turn resending the dialogue so far."""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import Sequence
from dataclasses import dataclass

import aiohttp

from inferno.loadgen.client import BenchResult, Driver, Show, Tally, encode_body, fail, measure, stream_one
from inferno.loadgen.stats import RequestRecord
from inferno.loadgen.workload import BenchConfig, random_words, seeded_rng

SESSION_HEADER = "x-session-affinity"


@dataclass(frozen=True, slots=True)
class Turn:
    user: str  # the new user message of this turn
    user_len: int  # its words
    output_len: int  # max_tokens


@dataclass(frozen=True, slots=True)
class SessionPlan:
    index: int
    session_id: str | None  # the x-session-affinity value; None when affinity is off
    turns: tuple[Turn, ...]

    @property
    def headers(self) -> dict[str, str] | None:
        return {SESSION_HEADER: self.session_id} if self.session_id is not None else None


@dataclass(frozen=True, slots=True)
class SessionWorkload:
    system: str  # one system prompt, shared by every session
    sessions: tuple[SessionPlan, ...]


def build_sessions(cfg: BenchConfig) -> SessionWorkload:
    """What a session run sends besides the replies: the same for the same seed."""
    sc = cfg.sessions
    if sc is None:
        raise ValueError("the config has no session workload")
    system = random_words(seeded_rng(cfg.seed, "system"), sc.system_len)
    plans = []
    for s in range(sc.sessions):
        # One generator per session: a session's turns do not depend on how many sessions run.
        rng = seeded_rng(cfg.seed, f"session-{s}")
        turns = []
        for _ in range(sc.turns):
            n_user, n_out = rng.randint(*sc.user_len), rng.randint(*cfg.output_len)
            turns.append(Turn(random_words(rng, n_user), n_user, n_out))
        plans.append(SessionPlan(s, f"{cfg.seed}-{s}" if sc.affinity else None, tuple(turns)))
    return SessionWorkload(system, tuple(plans))


def turn_messages(system: str, plan: SessionPlan, turn: int, replies: Sequence[str]) -> list[dict[str, str]]:
    """The system prompt, each earlier user message followed by the reply it got, the new user message."""
    if len(replies) != turn:
        raise ValueError(f"turn {turn} comes after {turn} replies, got {len(replies)}")
    messages = [{"role": "system", "content": system}]
    for earlier, reply in zip(plan.turns, replies):
        messages.append({"role": "user", "content": earlier.user})
        messages.append({"role": "assistant", "content": reply})
    messages.append({"role": "user", "content": plan.turns[turn].user})
    return messages


def _words(messages: Sequence[dict[str, str]]) -> int:
    return sum(len(m["content"].split()) for m in messages)


def session_records(workload: SessionWorkload) -> list[RequestRecord]:
    """One record per turn, session after session (index = session * turns + turn).

    The planned input length counts the words known in advance; each turn's send adds its replies'.
    """
    records = []
    system_len = len(workload.system.split())
    for plan in workload.sessions:
        user_words = 0
        for k, turn in enumerate(plan.turns):
            user_words += turn.user_len
            records.append(RequestRecord(plan.index * len(plan.turns) + k, system_len + user_words,
                                         turn.output_len, session=plan.index, turn=k))
    return records


async def _run_session(session: aiohttp.ClientSession, url: str, cfg: BenchConfig, model: str, system: str,
                       plan: SessionPlan, records: Sequence[RequestRecord], t0: float, tally: Tally | None) -> None:
    """The turns of one session, one after another; a failed turn ends the session."""
    replies: list[str] = []
    for k, turn in enumerate(plan.turns):
        record = records[k]
        messages = turn_messages(system, plan, k, replies)
        record.planned_input_len = _words(messages)
        body = encode_body(cfg, model, {"messages": messages}, turn.output_len)
        text: list[str] = []
        await stream_one(session, url, body, record, t0, headers=plan.headers, text=text, tally=tally)
        if not record.ok:  # without its reply the dialogue cannot go on
            for later in records[k + 1:]:
                fail(later, "session-aborted", f"turn {k} failed: {record.error}")
                if tally is not None:
                    tally.end(later)
            return
        replies.append("".join(text))  # as the stream returned it, untrimmed


async def _drive(session: aiohttp.ClientSession, url: str, cfg: BenchConfig, model: str,
                 workload: SessionWorkload, records: Sequence[RequestRecord], t0: float,
                 tally: Tally | None) -> None:
    # A session has one request in flight at most, so the run's request cap is a session cap.
    slots = asyncio.Semaphore(cfg.concurrency) if cfg.concurrency else contextlib.nullcontext()

    async def one(plan: SessionPlan) -> None:
        async with slots:
            n = len(plan.turns)
            await _run_session(session, url, cfg, model, workload.system, plan,
                               records[plan.index * n:(plan.index + 1) * n], t0, tally)

    tasks = [asyncio.create_task(one(plan)) for plan in workload.sessions]
    try:
        await asyncio.gather(*tasks)
    finally:
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)


async def run_sessions(cfg: BenchConfig, show: Show | None = None) -> BenchResult:
    """Run workload W4 (cfg.sessions) against cfg.base_url's chat endpoint and measure it."""
    workload = build_sessions(cfg)
    records = session_records(workload)

    def plan(model: str, url: str, tally: Tally | None) -> Driver:
        return lambda session, t0: _drive(session, url, cfg, model, workload, records, t0, tally)

    return await measure(cfg, records, plan, show)
