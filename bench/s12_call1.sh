#!/usr/bin/env bash
# Session 12, call 1: W2 and CPU per output token, the tree at 5425786 against this one (columnar step
# outputs), two runs each on one stack per tree; then W1 of this tree. One table at the end.
set -u
source bench/s11_env.sh
BASE=5425786 W2_RUNS=2 ORDER="base new" bash bench/w2_ab.sh 2>&1 | tail -12
echo "A/B done ${SECONDS}s"
STAGES="w1" SKIP_SETUP=1 bash bench/gpu_bench.sh 2>&1 | tail -2
echo "W1 done ${SECONDS}s"
python3 - <<'PY'
import glob, json, os
out = os.environ.get("OUT", "/tmp/inferno-out")
print("| tree | run | total tok/s | CPU µs/token (total; per service) |")
for tree in ("base", "new"):
    for f in sorted(glob.glob(f"{out}/{tree}/w2*.json")):
        if "steps" in f:
            continue
        d = json.load(open(f)); s = d["summary"]; c = d.get("cpu") or {}
        per = ", ".join(f"{k} {v:.1f}" for k, v in (c.get("us_per_token") or {}).items() if v is not None)
        print(f"| {tree} | {os.path.basename(f)} | {s['total_throughput']:.0f} | {c.get('total_us_per_token', 0):.1f}; {per} |")
w1 = json.load(open(f"{out}/w1.json"))
print("W1:", {k: w1[k] for k in w1 if "tok" in k})
PY
