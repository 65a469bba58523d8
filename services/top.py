"""`inferno top`: a live view of a running stack, from the workers' NATS heartbeats and the gateway's
/metrics, refreshed every second. `--once` prints one snapshot and exits (scripts, tests).

Rates (tok/s, requests/s, hand-offs/s, a step's time) are differences of the cumulative counters
between two samples, so a snapshot waits for two heartbeats of each worker (~1 s apart).

    inferno top                     # the stack `inferno up` started (its run directory says where)
    inferno top --url http://host:8000 --nats nats://host:4222 --once
"""

from __future__ import annotations

import argparse
import asyncio
import json
import sys
import time
import urllib.request
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from shared import subjects
from shared.config import NatsConfig, add_nats_tls_flags, nats_tls_settings
from shared.messages import WorkerHeartbeat
from shared.nats_tls import nats_options
from shared.wire import decode

STACK_FILE = "stack.json"  # in `inferno up`'s run directory: its URLs


@dataclass
class Sample:
    """One look at the stack: the latest heartbeat of each worker and the gateway's metrics."""

    at: float
    workers: dict[str, WorkerHeartbeat] = field(default_factory=dict)
    metrics: dict[tuple[str, tuple], float] = field(default_factory=dict)  # (name, labels) -> value

    def metric(self, name: str, **labels) -> float:
        """The sum of `name`'s series whose labels include `labels`."""
        want = set(labels.items())
        return sum(v for (n, lab), v in self.metrics.items() if n == name and want <= set(lab))

    def by_label(self, name: str, label: str) -> dict[str, float]:
        out: dict[str, float] = {}
        for (n, lab), v in self.metrics.items():
            if n == name:
                key = dict(lab).get(label, "")
                out[key] = out.get(key, 0.0) + v
        return out


def read_metrics(url: str, timeout: float = 2.0) -> dict[tuple[str, tuple], float]:
    """The gateway's /metrics as {(name, sorted labels): value}; {} when it does not answer."""
    from prometheus_client.parser import text_string_to_metric_families
    try:
        with urllib.request.urlopen(url.rstrip("/") + "/metrics", timeout=timeout) as r:
            text = r.read().decode()
    except OSError:
        return {}
    out = {}
    for family in text_string_to_metric_families(text):
        for s in family.samples:
            out[(s.name, tuple(sorted(s.labels.items())))] = float(s.value)
    return out


class Watcher:
    """A subscription to the workers' heartbeats (the latest of each) and the gateway's /metrics."""

    def __init__(self, nats_url: str, prefix: str, url: str, tls: dict[str, Any] | None = None):
        self.nats_url, self.prefix, self.url = nats_url, prefix, url
        self.tls = tls or {}  # nats-py's TLS arguments (shared/nats_tls.py)
        self.latest: dict[str, WorkerHeartbeat] = {}
        self._nc = None

    async def __aenter__(self) -> Watcher:
        import nats
        self._nc = await nats.connect(self.nats_url.split(","), connect_timeout=2, max_reconnect_attempts=0,
                                      **self.tls)
        await self._nc.subscribe(subjects.heartbeat(self.prefix), cb=self._on_beat)
        return self

    async def __aexit__(self, *exc) -> None:
        await self._nc.close()

    async def _on_beat(self, msg) -> None:
        try:
            hb = decode(WorkerHeartbeat, msg.data)
        except Exception:  # another message type or version on the subject: not ours to show
            return
        self.latest[hb.worker_id] = hb

    async def sample(self) -> Sample:
        return Sample(time.monotonic(), dict(self.latest), await asyncio.to_thread(read_metrics, self.url))

    async def next_sample(self, before: Sample, gap: float, timeout: float = 5.0) -> Sample:
        """A sample `gap` seconds or more after `before`, with a newer heartbeat of each worker than it
        had (a worker that beats less often: up to `timeout`)."""
        deadline = before.at + max(gap, timeout)
        while time.monotonic() < deadline:
            await asyncio.sleep(0.05)
            old = before.workers
            fresh = all(w in old and hb.seq > old[w].seq for w, hb in self.latest.items())
            if time.monotonic() - before.at >= gap and self.latest and fresh:
                break
        return await self.sample()


async def sample_twice(nats_url: str, prefix: str, url: str, gap: float = 1.0,
                       tls: dict[str, Any] | None = None) -> tuple[Sample, Sample]:
    """Two samples for rates: the first once every worker has beaten once (up to 3 s), the second
    once each has beaten again."""
    async with Watcher(nats_url, prefix, url, tls) as w:
        started = time.monotonic()
        await asyncio.sleep(0.2)
        while not w.latest and time.monotonic() - started < 3.0:
            await asyncio.sleep(0.05)
        first = await w.sample()
        return first, await w.next_sample(first, gap)


def rate(now: float, before: float, seconds: float) -> float:
    return max(0.0, now - before) / seconds if seconds > 0 else 0.0


def worker_rows(a: Sample, b: Sample) -> list[dict]:
    """One row per worker: what it is, its load, and its rates between the two samples."""
    rows = []
    for wid in sorted(b.workers):
        hb, old = b.workers[wid], a.workers.get(wid, b.workers[wid])
        dt = hb.timestamp - old.timestamp
        steps = hb.steps - old.steps
        rows.append({
            "worker": wid, "role": hb.role, "device": hb.device or "?", "model": hb.model or "-",
            "state": "draining" if hb.draining else hb.state, "running": hb.num_running, "waiting": hb.num_waiting,
            "kv_pct": 100 * hb.kv_usage, "kv_tokens": hb.num_total_blocks * hb.block_size,
            "in_tok_s": rate(hb.computed_tokens, old.computed_tokens, dt),
            "out_tok_s": rate(hb.output_tokens, old.output_tokens, dt),
            "step_ms": 1e3 * (hb.busy_seconds - old.busy_seconds) / steps if steps > 0 else 0.0,
            "handoffs_s": rate(hb.kv_handoffs, old.kv_handoffs, dt), "handoff_p50_ms": hb.kv_handoff_p50_ms,
            "dtype": hb.dtype, "graphs": hb.graphs,
        })
    return rows


def gateway_row(a: Sample, b: Sample) -> dict:
    dt = b.at - a.at
    done = b.metric("inferno:request_success_total") + b.metric("inferno:request_errors_total")
    done_before = a.metric("inferno:request_success_total") + a.metric("inferno:request_errors_total")
    errors = {k or "?": v for k, v in b.by_label("inferno:request_errors_total", "status").items() if v}
    return {"requests_s": rate(done, done_before, dt), "in_flight": b.metric("inferno:gateway_requests_in_flight"),
            "errors": errors, "waiting": b.metric("inferno:num_requests_waiting"),
            "workers": f"{b.metric('inferno:num_workers_ready'):.0f}/{b.metric('inferno:num_workers_live'):.0f}",
            "answering": bool(b.metrics)}


def render(a: Sample, b: Sample, title: str):
    """The view: a workers table and a gateway line (a rich renderable)."""
    from rich.console import Group
    from rich.table import Table
    from rich.text import Text

    workers = Table(title=title, title_justify="left", expand=False)
    for name, justify in (("worker", "left"), ("role", "left"), ("device", "left"), ("model", "left"),
                          ("state", "left"), ("run", "right"), ("wait", "right"), ("KV %", "right"),
                          ("in tok/s", "right"), ("out tok/s", "right"), ("step ms", "right"), ("h-offs/s", "right"),
                          ("h-off p50 ms", "right")):
        workers.add_column(name, justify=justify)
    for r in worker_rows(a, b):
        workers.add_row(r["worker"], r["role"], r["device"], r["model"], r["state"], str(r["running"]),
                        str(r["waiting"]), f"{r['kv_pct']:.0f}", f"{r['in_tok_s']:,.0f}", f"{r['out_tok_s']:,.0f}",
                        f"{r['step_ms']:.1f}", f"{r['handoffs_s']:.1f}",
                        f"{r['handoff_p50_ms']:.1f}" if r["handoff_p50_ms"] else "-")
    g = gateway_row(a, b)
    if not g["answering"]:
        line = Text("gateway: /metrics does not answer")
    else:
        errors = ", ".join(f"{k} {v:.0f}" for k, v in sorted(g["errors"].items())) or "none"
        line = Text(f"gateway: {g['requests_s']:.1f} requests/s, {g['in_flight']:.0f} in flight, "
                    f"workers ready {g['workers']}, waiting {g['waiting']:.0f}; errors: {errors}")
    return Group(workers, line)


def wide_console():
    """A rich Console; into a file or a pipe 160 columns wide, so that a row stays on one line."""
    from rich.console import Console
    return Console() if sys.stdout.isatty() else Console(width=160)


def stack_urls(run_dir: Path) -> dict:
    """What `inferno up` wrote in its run directory ({} when it wrote nothing)."""
    try:
        return json.loads((run_dir / STACK_FILE).read_text())
    except (OSError, ValueError):
        return {}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="inferno top", description=__doc__.splitlines()[0])
    ap.add_argument("--run-dir", type=Path, default=Path(".inferno"), help="where `inferno up` wrote stack.json")
    ap.add_argument("--url", help="the gateway (default: stack.json's, else http://127.0.0.1:8000)")
    ap.add_argument("--nats", help="the NATS server (default: stack.json's, else nats://127.0.0.1:4222)")
    ap.add_argument("--prefix", help="the NATS subject prefix (default: stack.json's, else inferno)")
    ap.add_argument("--once", action="store_true", help="print one snapshot and exit")
    ap.add_argument("--interval", type=float, default=1.0, help="seconds between refreshes")
    add_nats_tls_flags(ap)  # --nats-tls-ca defaults to stack.json's, on a stack with TLS on the bus
    args = ap.parse_args(argv)
    known = stack_urls(args.run_dir)
    url = args.url or known.get("url", "http://127.0.0.1:8000")
    nats_url = args.nats or known.get("nats", "nats://127.0.0.1:4222")
    prefix = args.prefix or known.get("prefix", subjects.DEFAULT_PREFIX)
    try:
        nats_cfg = NatsConfig(url=nats_url, **{**nats_tls_settings(args),
                                               "tls_ca": args.nats_tls_ca or known.get("nats_tls_ca", "")})
    except ValueError as e:
        print(f"inferno top: {e}", file=sys.stderr)
        return 2
    tls = nats_options(nats_cfg)
    title = f"inferno top — {url}, {nats_url}"
    console = wide_console()
    try:
        if args.once:
            a, b = asyncio.run(sample_twice(nats_url, prefix, url, gap=args.interval, tls=tls))
            console.print(render(a, b, title))
            return 0
        return asyncio.run(_live(console, nats_url, prefix, url, title, args.interval, tls))
    except KeyboardInterrupt:
        return 0
    except OSError as e:  # NATS not there
        print(f"inferno top: cannot reach {nats_url}: {e}", file=sys.stderr)
        return 1


async def _live(console, nats_url: str, prefix: str, url: str, title: str, interval: float,
                tls: dict[str, Any]) -> int:
    from rich.live import Live
    async with Watcher(nats_url, prefix, url, tls) as w:
        before = await w.sample()
        with Live(console=console, auto_refresh=False) as live:
            while True:
                now = await w.next_sample(before, interval)
                live.update(render(before, now, f"{title} — {time.strftime('%H:%M:%S')}"), refresh=True)
                before = now


def print_started(stack, workers: int) -> None:
    """`inferno up`'s one table of what runs once the stack (services/launcher.Stack) is ready: each
    service, the workers' device, model, dtype, KV tokens and graphs (from their heartbeats), and the URLs."""
    from rich.table import Table

    async def beats():
        async with Watcher(stack.admin_nats_url, "inferno", stack.url, stack.nats_tls_options()) as w:
            deadline = time.monotonic() + 3.0
            while len(w.latest) < workers and time.monotonic() < deadline:
                await asyncio.sleep(0.05)
            return dict(w.latest)

    try:
        heartbeats = asyncio.run(beats())
    except Exception:  # the table is a courtesy: the stack serves without it
        heartbeats = {}
    table = Table(title="inferno: started", title_justify="left")
    for name in ("service", "role", "pid", "device", "model", "dtype", "KV tokens", "graphs", "address"):
        table.add_column(name)
    pids = {c.name: c.proc.pid for c in stack.children if c.proc is not None and c.proc.poll() is None}
    for c in stack.children:
        hb = heartbeats.get(c.name)
        if hb is not None:
            table.add_row(c.name, hb.role, str(pids.get(c.name, "-")), hb.device, hb.model, hb.dtype,
                          f"{hb.num_total_blocks * hb.block_size:,}", str(hb.graphs), "")
        else:
            address = {"gateway": f"{stack.url}/v1  {stack.url}/metrics", "nats": stack.nats_url}.get(c.name, "")
            if c.name.startswith("gateway-"):
                address = f"{stack.url}/v1"
            elif c.name.startswith("nats-"):  # a server of a cluster
                address = stack.nats_url.split(",")[int(c.name.split("-")[1])]
            table.add_row(c.name, "", str(pids.get(c.name, "-")), "", "", "", "", "", address)
    wide_console().print(table)
