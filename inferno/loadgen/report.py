"""How a run is shown: a terminal table, a JSON document and optional matplotlib plots."""

from __future__ import annotations

import dataclasses
import datetime
import json
import math
from collections.abc import Sequence
from pathlib import Path

from inferno.loadgen.client import BenchResult, api_root
from inferno.loadgen.session_stats import SessionSummary
from inferno.loadgen.stats import Distribution
from inferno.loadgen.workload import BenchConfig


def _num(x: float | None, digits: int = 2) -> str:
    return "-" if x is None else f"{x:,.{digits}f}"


def _rate(rate: float) -> str:
    return "inf" if math.isinf(rate) else f"{rate:g}"


def _pct(ratio: float | None) -> str:
    return "-" if ratio is None else f"{ratio * 100:.1f} %"


def _headline(result: BenchResult) -> str:
    cfg = result.config
    output = f"output {cfg.output_len[0]}:{cfg.output_len[1]}"
    if cfg.sessions is None:
        return (f"model {result.model}  endpoint {cfg.endpoint}  requests {cfg.num_requests}  "
                f"concurrency {cfg.concurrency or 'unlimited'}  rate {_rate(cfg.request_rate)}/s  "
                f"input {cfg.input_len[0]}:{cfg.input_len[1]}  {output}")
    sc = cfg.sessions
    return (f"model {result.model}  endpoint {cfg.endpoint}  sessions {sc.sessions} x {sc.turns} turns  "
            f"concurrency {cfg.concurrency or 'unlimited'}  system {sc.system_len} words  "
            f"user {sc.user_len[0]}:{sc.user_len[1]} words  {output}  "
            f"affinity {'on' if sc.affinity else 'off'}")


def format_sessions(ss: SessionSummary) -> list[str]:
    """Prompt-cache hits and TTFT of a session run: overall, first against later turns, per turn."""
    lines = [
        f"sessions completed {ss.completed_sessions} of {ss.sessions}   prompt-cache hit ratio "
        f"{_pct(ss.hit_ratio)} ({ss.cached_tokens:,} of {ss.prompt_tokens:,} prompt tokens cached)",
        "",
        f"{'TTFT (ms)':<14}{'mean':>10}{'p50':>10}{'p90':>10}{'p99':>10}{'count':>8}",
    ]
    for name, d in (("first turns", ss.ttft_first), ("later turns", ss.ttft_later)):
        lines.append(f"{name:<14}{_num(d.mean):>10}{_num(d.p50):>10}{_num(d.p90):>10}{_num(d.p99):>10}"
                     f"{d.count:>8}")
    lines += ["", f"{'turn':>4}{'done':>6}{'failed':>8}{'prompt tok':>12}{'cached tok':>12}{'hit':>9}"
                  f"{'TTFT p50':>10}{'TTFT p99':>10}"]
    for t in ss.per_turn:
        lines.append(f"{t.turn:>4}{t.completed:>6}{t.failed:>8}{t.prompt_tokens:>12,}{t.cached_tokens:>12,}"
                     f"{_pct(t.hit_ratio):>9}{_num(t.ttft.p50, 1):>10}{_num(t.ttft.p99, 1):>10}")
    return lines


def format_result(result: BenchResult) -> str:
    s = result.summary
    errors = ", ".join(f"{kind}: {n}" for kind, n in s.errors.items())
    lines = [
        _headline(result),
        f"completed {s.completed}  failed {s.failed}" + (f"  ({errors})" if errors else ""),
        f"duration {s.duration_s:.2f} s   input tokens {s.total_input_tokens:,}   "
        f"output tokens {s.total_output_tokens:,}",
        f"requests/s {_num(s.request_throughput)}   input tok/s {_num(s.input_throughput, 1)}   "
        f"output tok/s {_num(s.output_throughput, 1)}   total tok/s {_num(s.total_throughput, 1)}",
        "",
        f"{'latency (ms)':<14}{'mean':>10}{'p50':>10}{'p90':>10}{'p99':>10}",
    ]
    for name, d in (("TTFT", s.ttft), ("ITL", s.itl), ("TPOT", s.tpot), ("E2E", s.e2e)):
        lines.append(f"{name:<14}{_num(d.mean):>10}{_num(d.p50):>10}{_num(d.p90):>10}{_num(d.p99):>10}")
    if result.sessions is not None:
        lines += ["", *format_sessions(result.sessions)]
    if result.cpu is not None:
        cpu = result.cpu
        lines += ["", f"{'CPU':<14}{'seconds':>10}{'µs/token':>10}   (over {cpu.output_tokens:,} output tokens)"]
        for name, seconds in cpu.cpu_s.items():
            lines.append(f"{name:<14}{_num(seconds, 3):>10}{_num(cpu.us_per_token[name], 1):>10}")
        lines.append(f"{'total':<14}{_num(cpu.total_cpu_s, 3):>10}{_num(cpu.total_us_per_token, 1):>10}")
    lines.append(f"load generator CPU {result.client_cpu_s:.2f} s")
    return "\n".join(lines)


def format_sweep(results: Sequence[BenchResult]) -> str:
    head = (f"{'rate/s':>8}{'done':>7}{'failed':>7}{'req/s':>9}{'out tok/s':>11}"
            f"{'TTFT p50':>10}{'TTFT p99':>10}{'ITL p50':>9}{'ITL p99':>9}{'µs/tok':>9}")
    rows = [head]
    for r in results:
        s = r.summary
        us = r.cpu.total_us_per_token if r.cpu is not None else None
        rows.append(f"{_rate(r.config.request_rate):>8}{s.completed:>7}{s.failed:>7}"
                    f"{_num(s.request_throughput):>9}{_num(s.output_throughput, 1):>11}"
                    f"{_num(s.ttft.p50, 1):>10}{_num(s.ttft.p99, 1):>10}"
                    f"{_num(s.itl.p50, 1):>9}{_num(s.itl.p99, 1):>9}{_num(us, 1):>9}")
    return "\n".join(rows)


def _jsonable(value):
    """Dataclasses and tuples to plain JSON; inf becomes the string "inf" (JSON has no inf)."""
    if dataclasses.is_dataclass(value):
        return {f.name: _jsonable(getattr(value, f.name)) for f in dataclasses.fields(value)}
    if isinstance(value, dict):
        return {str(k): _jsonable(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_jsonable(v) for v in value]
    if isinstance(value, float) and not math.isfinite(value):
        return str(value)
    return value


def result_to_dict(result: BenchResult) -> dict:
    config = _jsonable(result.config)
    if config.get("api_key"):
        config["api_key"] = "***"
    doc = {
        "config": config,
        "model": result.model,
        "started_at": datetime.datetime.fromtimestamp(result.started_at, datetime.timezone.utc).isoformat(),
        "summary": _jsonable(result.summary),
        "cpu": _jsonable(result.cpu),
        "client_cpu_s": result.client_cpu_s,
    }
    if result.sessions is not None:
        doc["sessions"] = _jsonable(result.sessions)
    if result.config.save_requests:
        doc["requests"] = [
            {**_jsonable(r), "ttft": r.ttft, "e2e": r.e2e, "tpot": r.tpot} for r in result.records
        ]
    return doc


def write_json(results: Sequence[BenchResult], path: str | Path, sweep: bool = False) -> None:
    """One run as an object; a sweep as {"runs": [one object per rate]}."""
    doc = {"runs": [result_to_dict(r) for r in results]} if sweep else result_to_dict(results[0])
    Path(path).write_text(json.dumps(doc, indent=2) + "\n")


class PlotUnavailable(RuntimeError):
    """matplotlib is not installed (pip install 'inferno[bench]')."""


def _pyplot():
    try:
        import matplotlib
    except ImportError:
        raise PlotUnavailable("--plot needs matplotlib: pip install matplotlib "
                              "(or the project's 'bench' extra)") from None
    matplotlib.use("Agg")  # files only, never a window
    import matplotlib.pyplot as plt

    return plt


def _tick(value: float, _pos=None) -> str:
    """A plain tick label with thousands separated (0.5, 20, 1,500): never 2×10^1 nor an offset."""
    value = round(value, 6) + 0.0  # no 1e-17 or -0 from the locator's arithmetic
    return f"{value:,.0f}" if value.is_integer() else f"{value:,g}"


def _plain_axes(ax, log_y: bool = False) -> None:
    """Plain numbers on both axes; on a log y axis the minor ticks get some too (matplotlib's own
    labels there read 2×10^1)."""
    from matplotlib.ticker import FuncFormatter

    ax.xaxis.set_major_formatter(FuncFormatter(_tick))
    ax.yaxis.set_major_formatter(FuncFormatter(_tick))
    if not log_y:
        return

    def minor(value: float, _pos=None) -> str:
        lo, hi = ax.yaxis.get_view_interval()
        powers = math.floor(math.log10(hi)) - math.ceil(math.log10(lo)) + 1  # labelled 1, 10, 100... in view
        if powers < 2:  # too few labels to read a value by: label every minor tick
            return _tick(value)
        mantissa = value / 10 ** math.floor(math.log10(value))
        return _tick(value) if powers <= 3 and round(mantissa, 6) in (2, 5) else ""

    ax.yaxis.set_minor_formatter(FuncFormatter(minor))


def _stack(result: BenchResult) -> str:
    """What was measured: the model, where it was served and through which endpoint."""
    return f"{result.model} at {api_root(result.config.base_url)} ({result.config.endpoint})"


def _load(cfg: BenchConfig) -> str:
    """The workload of a run in words, its rate left out (a sweep names its rates itself)."""
    concurrency = f"concurrency {cfg.concurrency or 'unlimited'}"
    output = f"output {cfg.output_len[0]}:{cfg.output_len[1]}"
    if cfg.sessions is not None:
        sc = cfg.sessions
        return (f"{sc.sessions} sessions x {sc.turns} turns, {concurrency}, system {sc.system_len} words, "
                f"user {sc.user_len[0]}:{sc.user_len[1]} words, {output}")
    return f"{cfg.num_requests:,} requests, {concurrency}, input {cfg.input_len[0]}:{cfg.input_len[1]}, {output}"


def _arrivals(rate: float) -> str:
    return "all at once" if math.isinf(rate) else f"{_rate(rate)}/s"


# CDF percentiles marked on each plot, with the summary's values (the table's).
MARKED = (("p50", ":"), ("p90", "--"), ("p99", "-."))


def _cdf(ax, values_ms: list[float], title: str, d: Distribution) -> None:
    xs = sorted(values_ms)
    ax.plot(xs, [(i + 1) / len(xs) for i in range(len(xs))], label=f"{d.count:,} samples")
    for name, style in MARKED:
        at = getattr(d, name)
        if at is not None:
            ax.axvline(at, linestyle=style, color="gray", linewidth=1, label=f"{name} {at:,.1f} ms")
    ax.set_title(title)
    ax.set_xlabel("ms")
    ax.set_ylabel("fraction of samples")
    ax.grid(True, alpha=0.3)
    ax.legend(loc="lower right", fontsize=8)
    _plain_axes(ax)


def result_figure(result: BenchResult):
    """CDFs of TTFT and ITL of one run (a matplotlib Figure), titled with the stack and the workload."""
    plt = _pyplot()
    done = [r for r in result.records if r.ok]
    ttft = [r.ttft * 1000 for r in done if r.ttft is not None]
    itl = [x * 1000 for r in done for x in r.itls()]
    s = result.summary
    fig, axes = plt.subplots(1, 2, figsize=(11, 4.5))
    for ax, values, title, d in ((axes[0], ttft, "TTFT", s.ttft), (axes[1], itl, "ITL", s.itl)):
        if values:
            _cdf(ax, values, title, d)
        else:
            ax.set_title(f"{title}: no samples")
    cfg = result.config
    arrivals = "" if cfg.sessions is not None else f", {_arrivals(cfg.request_rate)}"
    fig.suptitle(f"{_stack(result)}\n{_load(cfg)}{arrivals}\n"
                 f"{s.completed:,} completed, {s.failed:,} failed, {s.output_throughput:,.0f} output tok/s",
                 fontsize=10)
    fig.tight_layout()
    return fig


def plot_result(result: BenchResult, path: str | Path) -> None:
    """CDFs of TTFT and ITL of one run, as a PNG."""
    plt = _pyplot()
    fig = result_figure(result)
    fig.savefig(path, dpi=120)
    plt.close(fig)


def sweep_figure(results: Sequence[BenchResult]):
    """Latency against throughput over a rate sweep (a matplotlib Figure): ITL p99 and TTFT p99 per output tok/s."""
    plt = _pyplot()
    xs = [r.summary.output_throughput for r in results]
    fig, ax = plt.subplots(figsize=(7, 5))

    def series(d: list[Distribution], label: str, marker: str) -> None:
        pts = [(x, v.p99) for x, v in zip(xs, d) if v.p99 is not None]
        if pts:
            ax.plot([p[0] for p in pts], [p[1] for p in pts], marker=marker, label=label)

    series([r.summary.itl for r in results], "ITL p99", "o")
    series([r.summary.ttft for r in results], "TTFT p99", "s")
    for x, r in zip(xs, results):
        if r.summary.itl.p99 is not None:
            ax.annotate(f"{_rate(r.config.request_rate)}/s", (x, r.summary.itl.p99),
                        textcoords="offset points", xytext=(0, 6), ha="center", fontsize=8)
    ax.set_xlabel("output tokens/s")
    ax.set_ylabel("ms")
    p99s = [d.p99 for r in results for d in (r.summary.itl, r.summary.ttft) if d.p99 is not None]
    log_y = bool(p99s) and max(p99s) > 10 * min(p99s)  # TTFT far above ITL: a log scale shows both
    if log_y:
        ax.set_yscale("log")
    _plain_axes(ax, log_y)
    ax.grid(True, alpha=0.3)
    ax.legend()
    rates = ", ".join(_arrivals(r.config.request_rate) for r in results)
    ax.set_title(f"{_stack(results[0])}\n{_load(results[0].config)},\na run at each rate: {rates}", fontsize=10)
    fig.tight_layout()
    return fig


def plot_sweep(results: Sequence[BenchResult], path: str | Path) -> None:
    """Latency against throughput over a rate sweep, as a PNG."""
    plt = _pyplot()
    fig = sweep_figure(results)
    fig.savefig(path, dpi=120)
    plt.close(fig)
