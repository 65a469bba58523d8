"""Summarizes the prefill workers' `handoff_done` debug lines (JSON logs): hand-off time per request
(p50/p99) and its phases, bytes and GB/s, overall and for prompts of ≥ 2,800 tokens. With the
decode workers' `handoff_landed` lines too, the push's timeline: the prefill worker's write into the
decode worker's slot (a CUDA IPC push), the frame in flight (prefill's send → decode's handler), the
decode worker's copy (a pull), and the rest (the reply's way back, the handler's own work)."""

from __future__ import annotations

import json
import sys


def pct(values: list[float], q: float) -> float:
    v = sorted(values)
    return v[min(len(v) - 1, int(q * len(v)))] if v else float("nan")


def summary(rows: list[dict]) -> dict:
    if not rows:
        return {"count": 0}
    total = [r["total_s"] * 1e3 for r in rows]
    push = [r["push_s"] * 1e3 for r in rows]
    gbps = [r["bytes"] / r["push_s"] / 1e9 for r in rows if r["push_s"] > 0 and r["bytes"]]
    return {"count": len(rows), "total_ms_p50": pct(total, 0.5), "total_ms_p99": pct(total, 0.99),
            "export_ms_p50": pct([r["export_s"] * 1e3 for r in rows], 0.5),
            "offer_ms_p50": pct([r["offer_s"] * 1e3 for r in rows], 0.5),
            "pushed": sum(r.get("push_copy_s", 0.0) > 0 for r in rows),
            "push_copy_ms_p50": pct([r.get("push_copy_s", 0.0) * 1e3 for r in rows], 0.5),
            "push_copy_ms_p99": pct([r.get("push_copy_s", 0.0) * 1e3 for r in rows], 0.99),
            "push_ms_p50": pct(push, 0.5), "push_ms_p99": pct(push, 0.99),
            "mib_p50": pct([r["bytes"] / 2**20 for r in rows], 0.5), "push_gbps_p50": pct(gbps, 0.5),
            "over_cuda_ipc": sum(bool(r.get("ipc")) for r in rows), **timeline(rows)}


def timeline(rows: list[dict]) -> dict:
    landed = [(r, r["landed"]) for r in rows if "landed" in r]
    if not landed:
        return {}
    return {"landed": len(landed),
            "wire_ms_p50": pct([x["wire_s"] * 1e3 for _, x in landed], 0.5),
            "copy_ms_p50": pct([x["copy_s"] * 1e3 for _, x in landed], 0.5),
            "copy_gpu_ms_p50": pct([x.get("copy_gpu_s", 0.0) * 1e3 for _, x in landed], 0.5),
            "handler_ms_p50": pct([x["handler_s"] * 1e3 for _, x in landed], 0.5),
            "back_ms_p50": pct([(r["push_s"] - r.get("push_copy_s", 0.0) - x["wire_s"] - x["handler_s"]) * 1e3
                                for r, x in landed], 0.5),
            # The first token's KV is in the decode worker's buffer and its import queued: what the
            # request waits for (the reply's way back only frees the prefill worker's slot). A
            # push's write into the decode worker's slot comes before the frame.
            "landed_ms_p50": pct(until_landed := [(r["export_s"] + r["offer_s"] + r.get("push_copy_s", 0.0)
                                                   + x["wire_s"] + x["handler_s"]) * 1e3 for r, x in landed], 0.5),
            "landed_ms_p99": pct(until_landed, 0.99)}


def main() -> int:
    rows, landed = [], {}
    for path in sys.argv[1:]:
        with open(path) as f:
            for line in f:
                try:
                    event = json.loads(line)
                except json.JSONDecodeError:
                    continue
                if event.get("event") == "handoff_done":
                    rows.append(event)
                elif event.get("event") == "handoff_landed":
                    landed[event.get("request_id")] = event
    for r in rows:
        if r["request_id"] in landed:
            r["landed"] = landed[r["request_id"]]
    block = 16
    long_rows = [r for r in rows if (r["pages"] + r["skipped"]) * block >= 2800]
    print(json.dumps({"all": summary(rows), "prompt_ge_2800": summary(long_rows)}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
