"""Per-tenant rate limits: token buckets for requests/min and tokens/min, a count of concurrent requests,
and the OpenAI `x-ratelimit-*` headers that describe them."""

from __future__ import annotations

import math
import time
from dataclasses import dataclass
from typing import Callable

EPSILON = 1e-9  # units: a refill that falls short by float rounding only is a full one


@dataclass(frozen=True, slots=True)
class TenantLimits:
    """A tenant's limits; None means unlimited."""

    requests_per_minute: int | None = None
    tokens_per_minute: int | None = None
    max_concurrent: int | None = None

    def __post_init__(self) -> None:
        for name in ("requests_per_minute", "tokens_per_minute", "max_concurrent"):
            v = getattr(self, name)
            if v is not None and (isinstance(v, bool) or not isinstance(v, int) or v <= 0):
                raise ValueError(f"{name} must be a positive integer or absent, got {v!r}")


class TokenBucket:
    """`capacity` units that refill evenly over a minute: a client may spend a whole minute's worth
    at once, then at the steady rate (OpenAI's limits behave this way)."""

    __slots__ = ("capacity", "rate", "level", "updated")

    def __init__(self, capacity: int, now: float):
        self.capacity = capacity
        self.rate = capacity / 60.0  # units per second
        self.level = float(capacity)
        self.updated = now

    def refill(self, now: float) -> None:
        if now > self.updated:
            self.level = min(self.capacity, self.level + (now - self.updated) * self.rate)
            self.updated = now

    def wait(self, amount: int) -> float:
        """Seconds until `amount` units are there (refilled first); inf if they never fit."""
        if amount > self.capacity:
            return math.inf
        short = amount - self.level
        return short / self.rate if short > EPSILON else 0.0

    def reset(self) -> float:
        """Seconds until the bucket is full again."""
        return max(0.0, self.capacity - self.level - EPSILON) / self.rate


def duration(seconds: float) -> str:
    """OpenAI's form of a reset time: "1s", "6m0s", "0.5s"."""
    seconds = math.ceil(seconds * 1000) / 1000
    if seconds < 60:
        return f"{seconds:g}s"
    m, s = divmod(math.ceil(seconds), 60)
    return f"{m}m{s}s"


@dataclass(frozen=True, slots=True)
class Verdict:
    """The limiter's answer: admitted or not, why not, when to retry, and the headers to send."""

    admitted: bool
    headers: dict[str, str]
    reason: str = ""
    retry_after: float = 0.0


class TenantLimiter:
    """The buckets and concurrency of one tenant. Single-threaded (the gateway's event loop)."""

    def __init__(self, limits: TenantLimits, clock: Callable[[], float] = time.monotonic):
        self.limits = limits
        self.clock = clock
        now = clock()
        self.requests = TokenBucket(limits.requests_per_minute, now) if limits.requests_per_minute else None
        self.tokens = TokenBucket(limits.tokens_per_minute, now) if limits.tokens_per_minute else None
        self.in_flight = 0

    def acquire(self, num_tokens: int) -> Verdict:
        """Take one request of `num_tokens` (prompt + the most it may generate), or refuse it and take
        nothing. A refused request's Retry-After is the longest of its waits."""
        now = self.clock()
        for b in (self.requests, self.tokens):
            if b is not None:
                b.refill(now)
        reasons: list[str] = []
        waits = [0.0]
        lim = self.limits
        if self.requests is not None and (w := self.requests.wait(1)) > 0:
            reasons.append(f"requests per minute (limit {lim.requests_per_minute})")
            waits.append(w)
        if self.tokens is not None and (w := self.tokens.wait(num_tokens)) > 0:
            if math.isinf(w):
                reasons.append(f"tokens per minute: this request needs {num_tokens}, more than the limit of "
                               f"{lim.tokens_per_minute}")
            else:
                reasons.append(f"tokens per minute (limit {lim.tokens_per_minute}, this request needs {num_tokens})")
            waits.append(w)
        if lim.max_concurrent is not None and self.in_flight >= lim.max_concurrent:
            reasons.append(f"concurrent requests (limit {lim.max_concurrent})")
            waits.append(1.0)  # a slot frees when some request ends: no better guess
        if reasons:
            retry = max(waits)
            return Verdict(False, self.headers(), "Rate limit reached for " + "; ".join(reasons) + ".",
                           60.0 if math.isinf(retry) else retry)
        if self.requests is not None:
            self.requests.level -= 1
        if self.tokens is not None:
            self.tokens.level -= num_tokens
        self.in_flight += 1
        return Verdict(True, self.headers())

    def release(self) -> None:
        """One admitted request ended (in any way)."""
        self.in_flight -= 1

    def headers(self) -> dict[str, str]:
        out: dict[str, str] = {}
        now = self.clock()
        for kind, b in (("requests", self.requests), ("tokens", self.tokens)):
            if b is not None:
                b.refill(now)
                out[f"x-ratelimit-limit-{kind}"] = str(b.capacity)
                out[f"x-ratelimit-remaining-{kind}"] = str(max(0, math.floor(b.level)))
                out[f"x-ratelimit-reset-{kind}"] = duration(b.reset())
        return out
