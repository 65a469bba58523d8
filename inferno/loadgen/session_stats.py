"""What a session run (W4) measured beyond the usual figures: prompt-cache hits and TTFT per turn."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from inferno.loadgen.stats import Distribution, RequestRecord


@dataclass(frozen=True, slots=True)
class CacheHits:
    """Prompt tokens the server reported as served from its prefix cache.

    Only completed requests whose usage carried both counts are summed, so a server that does
    not report cached tokens gives a ratio of None rather than 0.
    """

    reported: int  # requests counted
    prompt_tokens: int
    cached_tokens: int

    @property
    def hit_ratio(self) -> float | None:
        return self.cached_tokens / self.prompt_tokens if self.prompt_tokens > 0 else None

    @classmethod
    def of(cls, records: Sequence[RequestRecord]) -> "CacheHits":
        counted = [r for r in records if r.ok and r.prompt_tokens is not None and r.cached_tokens is not None]
        return cls(len(counted), sum(r.prompt_tokens for r in counted), sum(r.cached_tokens for r in counted))


@dataclass(frozen=True, slots=True)
class TurnSummary:
    """The k-th turn of every session."""

    turn: int
    completed: int
    failed: int
    prompt_tokens: int  # of the requests in `cache`
    cached_tokens: int
    hit_ratio: float | None  # cached / prompt tokens
    ttft: Distribution


@dataclass(frozen=True, slots=True)
class SessionSummary:
    sessions: int
    turns: int
    completed_sessions: int  # every turn completed
    prompt_tokens: int  # over the completed requests that reported cached tokens
    cached_tokens: int
    hit_ratio: float | None  # Σ cached / Σ prompt tokens; None when the server reported none
    ttft_first: Distribution  # turn 0: nothing of the session is cached yet, only the system prompt
    ttft_later: Distribution  # turns 1..: the dialogue so far may be cached
    per_turn: tuple[TurnSummary, ...]


def _ttft(records: Sequence[RequestRecord]) -> Distribution:
    return Distribution.of_seconds([r.ttft for r in records if r.ok and r.ttft is not None])


def summarize_sessions(records: Sequence[RequestRecord], sessions: int, turns: int) -> SessionSummary:
    """Records carry their session and turn; those without (not of a session run) are ignored."""
    by_turn: list[list[RequestRecord]] = [[] for _ in range(turns)]
    failed_sessions: set[int] = set()
    for r in records:
        if r.turn is None or r.session is None:
            continue
        by_turn[r.turn].append(r)
        if not r.ok:
            failed_sessions.add(r.session)
    per_turn = []
    for k, group in enumerate(by_turn):
        cache = CacheHits.of(group)
        done = sum(r.ok for r in group)
        per_turn.append(TurnSummary(k, done, len(group) - done, cache.prompt_tokens, cache.cached_tokens,
                                    cache.hit_ratio, _ttft(group)))
    total = CacheHits.of([r for group in by_turn for r in group])
    seen = {r.session for group in by_turn for r in group}
    return SessionSummary(
        sessions=sessions,
        turns=turns,
        completed_sessions=len(seen - failed_sessions),
        prompt_tokens=total.prompt_tokens,
        cached_tokens=total.cached_tokens,
        hit_ratio=total.hit_ratio,
        ttft_first=_ttft(by_turn[0]) if by_turn else Distribution.of_seconds([]),
        ttft_later=_ttft([r for group in by_turn[1:] for r in group]),
        per_turn=tuple(per_turn),
    )
