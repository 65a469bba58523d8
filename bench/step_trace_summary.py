"""Where a serving benchmark's seconds went, from a worker's step trace (INFERNO_STEP_TRACE).

    python bench/step_trace_summary.py STEPS.jsonl [--start EPOCH] [--end EPOCH]

--start is the load generator's start (wall clock, same host): the time before the first step is
the requests' way in. Steps are split into those that computed prompt tokens (prefill or mixed)
and decode-only ones, the latter bucketed by rows; "between" is the step thread outside steps.
"""

from __future__ import annotations

import argparse
import json

BUCKETS = (64, 128, 256, 512, 768, 1024, 1 << 30)


def load(path: str, start: float | None, end: float | None) -> list[dict]:
    steps = [json.loads(line) for line in open(path) if line.strip()]
    return [s for s in steps if (start is None or s["t"] >= start) and (end is None or s["t"] <= end)]


def summarize(steps: list[dict], start: float | None) -> dict:
    first_begin = steps[0]["t"] - steps[0]["seconds"]
    span = steps[-1]["t"] - (start if start is not None else first_begin)
    busy = sum(s["seconds"] for s in steps)
    out = {"steps": len(steps), "span_s": round(span, 3), "in_steps_s": round(busy, 3),
           "between_steps_s": round(steps[-1]["t"] - first_begin - busy, 3),
           "tokens": sum(s["tokens"] for s in steps)}
    if start is not None:
        out["before_first_step_s"] = round(first_begin - start, 3)
    masked = [s for s in steps if s.get("mask_fill_s")]
    if masked:  # structured outputs: the bitmask fill on the host, and the GPU's wait for it
        out["grammar_masks"] = {"steps": len(masked),
                                "fill_us_per_step": round(1e6 * sum(s["mask_fill_s"] for s in masked) / len(masked), 1),
                                "gpu_wait_us_per_step": round(1e6 * sum(s["mask_wait_s"] for s in masked) / len(masked), 1),
                                "mean_rows": round(sum(s["rows"] for s in masked) / len(masked), 1)}
    mixed = [s for s in steps if s["tokens"] > s["rows"]]
    out["with_prompt_tokens"] = _row(mixed)
    decode = [s for s in steps if s["tokens"] == s["rows"] and s["rows"] > 0]
    lo = 0
    for hi in BUCKETS:
        part = [s for s in decode if lo < s["rows"] <= hi]
        if part:
            out[f"decode_rows_{lo + 1}_{min(hi, 4096)}"] = _row(part)
        lo = hi
    return out


def _row(steps: list[dict]) -> dict:
    if not steps:
        return {"steps": 0}
    secs = sum(s["seconds"] for s in steps)
    toks = sum(s["tokens"] for s in steps)
    return {"steps": len(steps), "seconds": round(secs, 3), "tokens": toks,
            "ms_per_step": round(1e3 * secs / len(steps), 2), "tok_s": round(toks / secs) if secs else None,
            "mean_rows": round(sum(s["rows"] for s in steps) / len(steps), 1)}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("trace")
    ap.add_argument("--start", type=float, default=None, help="the load generator's start, epoch seconds")
    ap.add_argument("--end", type=float, default=None)
    args = ap.parse_args()
    steps = load(args.trace, args.start, args.end)
    if not steps:
        raise SystemExit("no steps in that window")
    print(json.dumps(summarize(steps, args.start), indent=1))


if __name__ == "__main__":
    main()
