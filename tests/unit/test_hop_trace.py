"""The per-request hop trace (shared/hop_trace.py) and its summary (bench/hop_trace_summary.py)."""

from __future__ import annotations

import importlib.util
from pathlib import Path

from shared.hop_trace import HopTrace


def summary_module():
    path = Path(__file__).parents[2] / "bench" / "hop_trace_summary.py"
    spec = importlib.util.spec_from_file_location("hop_trace_summary", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_marks_from_several_services_join_into_segments(tmp_path):
    gateway, worker = HopTrace(str(tmp_path / "gateway-1.jsonl")), HopTrace(str(tmp_path / "worker-2.jsonl"))
    for rid in ("a", "b"):
        gateway.mark(rid, "gw_route")
        worker.mark(rid, "wk_in")
        worker.mark_first(rid, "wk_out")
        worker.mark_first(rid, "wk_out")  # later tokens: not marked again
        gateway.mark(rid, "gw_first")
    gateway.flush()
    worker.flush()
    s = summary_module()
    assert sum(1 for line in open(tmp_path / "worker-2.jsonl")) == 4
    marks = s.load(str(tmp_path))
    assert set(marks) == {"a", "b"} and set(marks["a"]) == {"gw_route", "wk_in", "wk_out", "gw_first"}
    assert marks["a"]["wk_out"] <= marks["a"]["gw_first"]
    table = s.table(marks)
    p50, _, _, n = table["gateway: routed → first token"]
    assert n == 2 and p50 >= 0
    assert table["scheduler routing → worker"][3] == 0  # no scheduler marks
