"""Keeps bench/results/<device>.json current: merges a run's summary.json (bench/summarize.py's fixed
keys) into it, each key with the commit, date and command it came from, and prints the target table
that bench/RESULTS.md carries, made from that file.

Usage: python bench/results_update.py SUMMARY.json --device h100 --command "STAGES=... bash bench/gpu_bench.sh"
       python bench/results_update.py --device h100 --table      (the table alone)
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

RESULTS = Path(__file__).resolve().parent / "results"
# The keys issue 9 asks for, in the table's order: (key, workload, target).
TABLE = (
    ("w1_tok_s", "W1 batch-1 decode, tok/s", "≥ 175"),
    ("w2_total_tok_s", "W2 total tok/s through HTTP", "≥ 38,000"),
    ("cpu_us_per_token", "CPU µs per output token at W2 (all services)", "≤ 40 (15 the goal)"),
    ("w3_itl_p99_ms", "W3 ITL p99, ms (10 / 20 / 40 req/s)", "≤ 25 at 20"),
    ("w3_ttft_p99_ms", "W3 TTFT p99, ms (10 / 20 / 40 req/s)", ""),
    ("w5a_first_token_s", "W5a load on a running worker → first token, s", "≤ 2.5"),
    ("w5b_first_token_s", "W5b process start → first token, s", "≤ 8"),
    ("kv_gib", "KV cache, GiB", "≥ 60"),
    ("sampling_b256_us", "sampling with top-p / min-p, batch 256, µs (worst mode)", "≤ 200"),
)


def merge(doc: dict, summary: dict, command: str) -> dict:
    source = {"commit": summary.get("commit", ""), "date": summary.get("date", ""), "command": command}
    sources = doc.setdefault("sources", {})
    for key, value in summary.items():
        if key in ("device", "date", "commit") or value in (None, {}, []):
            continue
        doc[key] = value
        sources[key] = source
    doc["device"] = summary.get("device") or doc.get("device", "")
    doc["date"], doc["commit"] = source["date"], source["commit"]
    return doc


def fmt(value) -> str:
    if isinstance(value, dict):
        if "total" in value:  # CPU per service
            rest = ", ".join(f"{k} {v:.1f}" for k, v in value.items() if k != "total" and v is not None)
            return f"{value['total']:.1f} ({rest})"
        return " / ".join(f"{v:.1f}" for v in value.values())
    if isinstance(value, float):
        return f"{value:,.1f}" if value < 1000 else f"{value:,.0f}"
    return str(value)


def table(doc: dict) -> str:
    sources = doc.get("sources", {})
    lines = ["| workload | target | measured | commit | date |", "|---|---|---|---|---|"]
    for key, label, target in TABLE:
        if key not in doc:
            continue
        src = sources.get(key, {})
        lines.append(f"| {label} | {target} | {fmt(doc[key])} | `{src.get('commit', doc.get('commit', ''))}` "
                     f"| {src.get('date', doc.get('date', ''))} |")
    return "\n".join(lines)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("summary", nargs="?", help="a run's summary.json")
    ap.add_argument("--device", required=True, help="h100, h200, h200x2, ...")
    ap.add_argument("--command", default="", help="the command that produced the run")
    ap.add_argument("--table", action="store_true", help="only print the table")
    args = ap.parse_args()
    path = RESULTS / f"{args.device}.json"
    doc = json.loads(path.read_text()) if path.exists() else {}
    if args.summary and not args.table:
        doc = merge(doc, json.loads(Path(args.summary).read_text()), args.command)
        path.write_text(json.dumps(doc, indent=1, ensure_ascii=False) + "\n")
    print(table(doc))
    return 0


if __name__ == "__main__":
    sys.exit(main())
