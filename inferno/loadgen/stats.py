"""What a run measured: per-request records, latency distributions, throughput and CPU cost."""

from __future__ import annotations

import math
from collections import Counter
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field


@dataclass(slots=True)
class RequestRecord:
    """One request as the client saw it; times are seconds since the run began."""

    index: int
    planned_input_len: int
    planned_output_len: int
    start: float | None = None  # None: never sent
    end: float | None = None  # the [DONE] line, or when the request failed
    chunk_times: list[float] = field(default_factory=list)  # arrivals of chunks carrying text
    prompt_tokens: int | None = None  # from the final usage chunk
    completion_tokens: int | None = None
    cached_tokens: int | None = None  # usage.prompt_tokens_details.cached_tokens: prefix-cache hits
    error: str | None = None  # http-<status>, timeout, connection-error, stream-error, ...
    error_detail: str = ""
    session: int | None = None  # W4 only: which session and which of its turns (from 0)
    turn: int | None = None

    @property
    def ok(self) -> bool:
        return self.error is None and self.end is not None

    @property
    def input_tokens(self) -> int:
        return self.prompt_tokens if self.prompt_tokens is not None else self.planned_input_len

    @property
    def output_tokens(self) -> int:
        # Without a usage chunk, assume one token per content chunk.
        return self.completion_tokens if self.completion_tokens is not None else len(self.chunk_times)

    @property
    def ttft(self) -> float | None:
        if self.start is None or not self.chunk_times:
            return None
        return self.chunk_times[0] - self.start

    @property
    def e2e(self) -> float | None:
        if self.start is None or self.end is None:
            return None
        return self.end - self.start

    @property
    def tpot(self) -> float | None:
        """(e2e - ttft) / (output tokens - 1), as vLLM's benchmark defines it."""
        if self.ttft is None or self.end is None or self.output_tokens < 2:
            return None
        return (self.end - self.chunk_times[0]) / (self.output_tokens - 1)

    def itls(self) -> list[float]:
        """Per-token inter-token latency: one value per content chunk after the first.

        A chunk may carry several tokens (a server that batches deltas, speculative decoding).
        The first chunk is taken to hold the first token and the rest of the usage count to be
        spread evenly over the later chunks, so each gap is divided by its chunk's share. All
        later chunks of a request then have the same share, and the token-weighted mean of the
        values is (last chunk - first chunk) / (tokens - 1): TPOT without the tail between the
        last token and the end of the stream. One token per chunk gives the plain gaps.
        """
        times = self.chunk_times
        if len(times) < 2:
            return []
        per_chunk = max(self.output_tokens - 1, len(times) - 1) / (len(times) - 1)
        return [(b - a) / per_chunk for a, b in zip(times, times[1:])]


def percentile(sorted_values: Sequence[float], q: float) -> float:
    """q-th percentile (0..100) of sorted values, linear between ranks (numpy's default)."""
    if not sorted_values:
        raise ValueError("percentile of no values")
    pos = (len(sorted_values) - 1) * q / 100.0
    lo = math.floor(pos)
    hi = min(lo + 1, len(sorted_values) - 1)
    return sorted_values[lo] + (sorted_values[hi] - sorted_values[lo]) * (pos - lo)


@dataclass(frozen=True, slots=True)
class Distribution:
    """Mean and percentiles in milliseconds; all None when there were no values."""

    count: int
    mean: float | None
    p50: float | None
    p90: float | None
    p99: float | None

    @classmethod
    def of_seconds(cls, values: Sequence[float]) -> "Distribution":
        if not values:
            return cls(0, None, None, None, None)
        ms = sorted(v * 1000.0 for v in values)
        return cls(len(ms), math.fsum(ms) / len(ms), percentile(ms, 50), percentile(ms, 90), percentile(ms, 99))


@dataclass(frozen=True, slots=True)
class Summary:
    completed: int
    failed: int
    errors: dict[str, int]  # error kind -> count, most frequent first
    duration_s: float  # first send to last completion (or failure)
    total_input_tokens: int  # of completed requests
    total_output_tokens: int
    request_throughput: float  # completed requests/s
    input_throughput: float  # tokens/s
    output_throughput: float
    total_throughput: float
    ttft: Distribution
    itl: Distribution
    tpot: Distribution
    e2e: Distribution


def summarize(records: Sequence[RequestRecord]) -> Summary:
    done = [r for r in records if r.ok]
    errors = Counter(r.error for r in records if r.error is not None)
    starts = [r.start for r in records if r.start is not None]
    ends = [r.end for r in records if r.end is not None]
    duration = max(ends) - min(starts) if starts and ends else 0.0
    n_in = sum(r.input_tokens for r in done)
    n_out = sum(r.output_tokens for r in done)

    def rate(x: float) -> float:
        return x / duration if duration > 0 else 0.0

    return Summary(
        completed=len(done),
        failed=len(records) - len(done),
        errors=dict(errors.most_common()),
        duration_s=duration,
        total_input_tokens=n_in,
        total_output_tokens=n_out,
        request_throughput=rate(len(done)),
        input_throughput=rate(n_in),
        output_throughput=rate(n_out),
        total_throughput=rate(n_in + n_out),
        ttft=Distribution.of_seconds([r.ttft for r in done if r.ttft is not None]),
        itl=Distribution.of_seconds([x for r in done for x in r.itls()]),
        tpot=Distribution.of_seconds([r.tpot for r in done if r.tpot is not None]),
        e2e=Distribution.of_seconds([r.e2e for r in done]),
    )


class CpuMeter:
    """CPU seconds (user + system) used so far by each named process and all its descendants."""

    def __init__(self, pids: Mapping[str, int]):
        import psutil  # only runs that measure CPU need it

        self._psutil = psutil
        self._procs = {}
        for name, pid in pids.items():
            try:
                self._procs[name] = psutil.Process(pid)
            except psutil.NoSuchProcess:
                raise ValueError(f"service {name!r}: no process with pid {pid}") from None

    def sample(self) -> dict[str, float | None]:
        """Cumulative CPU seconds per service; None for one whose process has gone."""
        return {name: self._tree_seconds(proc) for name, proc in self._procs.items()}

    def _tree_seconds(self, proc) -> float | None:
        # A live process's own times plus those of the children it has reaped; live
        # descendants are added one by one (no process counts in two places).
        try:
            tree = [proc, *proc.children(recursive=True)]
        except self._psutil.Error:
            return None
        total = 0.0
        for i, p in enumerate(tree):
            try:
                t = p.cpu_times()
            except self._psutil.Error:
                if i == 0:
                    return None
                continue  # a descendant that ended just now
            total += t.user + t.system + t.children_user + t.children_system
        return total


@dataclass(frozen=True, slots=True)
class CpuCost:
    """CPU spent by the serving processes during a run, per output token."""

    output_tokens: int
    cpu_s: dict[str, float | None]  # per service; None when it could not be read at the end
    us_per_token: dict[str, float | None]
    total_cpu_s: float  # services that could be read
    total_us_per_token: float | None  # None when no token came out

    @classmethod
    def between(cls, before: Mapping[str, float | None], after: Mapping[str, float | None],
                output_tokens: int) -> "CpuCost":
        cpu: dict[str, float | None] = {}
        for name, b in before.items():
            a = after.get(name)
            cpu[name] = None if a is None or b is None else max(a - b, 0.0)

        def per_token(seconds: float | None) -> float | None:
            return None if seconds is None or output_tokens <= 0 else seconds * 1e6 / output_tokens

        total = math.fsum(s for s in cpu.values() if s is not None)
        return cls(output_tokens, cpu, {k: per_token(v) for k, v in cpu.items()}, total, per_token(total))
