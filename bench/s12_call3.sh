#!/usr/bin/env bash
# Session 12, call 3: W2 (two runs a stack) with the runner's wait before an eager step behind an
# eager step in flight (INFERNO_EAGER_WAIT=1, the default) and without it (=0), on, off, on.
set -u
source bench/s11_env.sh
for mode in on off on2; do
  flag=1; [ $mode = off ] && flag=0
  INFERNO_EAGER_WAIT=$flag OUT=$OUT/$mode SKIP_SETUP=1 W2_RUNS=2 STAGES="w2" bash bench/gpu_bench.sh 2>&1 | tail -3 | sed "s/^/$mode: /"
done
echo "done ${SECONDS}s"
python3 - <<'PY'
import glob, json, os
out = os.environ.get("OUT", "/tmp/inferno-out")
print("| mode | run | total tok/s | prompt steps s | CPU µs/token (total; per service) |")
for mode in ("on", "off", "on2"):
    for f in sorted(glob.glob(f"{out}/{mode}/w2*.json")):
        if "steps" in f:
            continue
        d = json.load(open(f)); s = d["summary"]; c = d.get("cpu") or {}
        st = json.load(open(f.replace(".json", "_steps_summary.json")))
        per = ", ".join(f"{k} {v:.1f}" for k, v in (c.get("us_per_token") or {}).items() if v is not None)
        print(f"| {mode} | {os.path.basename(f)} | {s['total_throughput']:.0f} | {st['with_prompt_tokens']['seconds']:.2f} "
              f"| {c.get('total_us_per_token', 0):.1f}; {per} |")
PY
