"""Where requests waited, hop by hop, from a stack run with INFERNO_HOP_TRACE=DIR (shared/hop_trace.py).

    python bench/hop_trace_summary.py DIR [DIR ...]   (several: one table each, side by side)

Each segment is the time between two marks of one request (all services on one host's clock):
gateway → scheduler, the scheduler's routing until its worker acknowledged, the worker's way
from the request to its step queue (a cluster-store fetch sits there), and from the queue to the
first token reaching the gateway (waiting for a step, the prefill, the publish)."""

from __future__ import annotations

import glob
import json
import sys

SEGMENTS = (("gw_in", "gw_route", "gateway: HTTP in → routing"), ("gw_route", "sc_in", "gateway → scheduler"), ("sc_in", "wk_in", "scheduler routing → worker"),
            ("wk_in", "wk_queued", "worker: in → step queue"), ("wk_queued", "wk_added", "step queue → the engine"),
            ("wk_added", "wk_out", "engine → first token out"), ("wk_out", "gw_first", "first token → gateway"),
            ("gw_route", "gw_first", "gateway: routed → first token"))


def load(directory: str) -> dict[str, dict[str, float]]:
    marks: dict[str, dict[str, float]] = {}
    for path in glob.glob(f"{directory}/*.jsonl"):
        for line in open(path):
            if line.strip():
                m = json.loads(line)
                marks.setdefault(m["rid"], {}).setdefault(m["hop"], m["t"])  # a retry keeps the first
    return marks


def pct(values: list[float], q: float) -> float:
    values = sorted(values)
    return values[min(len(values) - 1, int(q * len(values)))] if values else float("nan")


def table(marks: dict[str, dict[str, float]]) -> dict[str, tuple[float, float, float, int]]:
    out = {}
    for a, b, name in SEGMENTS:
        d = [1e3 * (m[b] - m[a]) for m in marks.values() if a in m and b in m]
        out[name] = (pct(d, 0.5), pct(d, 0.9), pct(d, 0.99), len(d))
    return out


def main() -> None:
    tables = [(d, table(load(d))) for d in sys.argv[1:]]
    print(f"{'segment (ms: p50 / p90 / p99)':32}" + "".join(f"{d[-28:]:>30}" for d, _ in tables))
    for _, _, name in SEGMENTS:
        print(f"{name:32}" + "".join(f"{t[name][0]:>10.1f}{t[name][1]:>9.1f}{t[name][2]:>9.1f} " for _, t in tables))


if __name__ == "__main__":
    main()
