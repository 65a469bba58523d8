#!/usr/bin/env bash
# Issue 42's CPU reproduction: two workers of the random demo model, a burst of 400 requests
# (input 100-340, output 20-40), the cluster kvstore on (2 GB, the default with two workers) and
# off. Prints each run's `inferno bench` table (tok/s, TTFT, CPU seconds per service).
# W4=1 runs issue 42's W4 shape instead (8 sessions x 5 turns, a 250-word system prompt, no session
# affinity): the prompt-cache hit ratio and later turns' TTFT, store on against off.
# SPY=1 also records 7 s of py-spy (raw, per thread) of worker-0 and the kvstore during the burst.
# REPEAT=N runs the pair N times, alternating, and ends with the median of each figure per lane
# (one W4 run on this 2-core VM varies by +-100 %: single runs decide nothing).
# TURNS=20 lengthens W4 (the issue's 5 turns last 0.6 s; 20 give medians that hold), LANES="2" or
# "0" runs one lane, SETTLE=s waits after ready. INFERNO_HOP_TRACE=DIR (shared/hop_trace.py) and
# `python bench/hop_trace_summary.py DIR` say where the requests waited.
# usage: bash bench/kvstore_burst_cpu.sh [OUT_DIR]   (default /tmp/kvstore-burst)
set -euo pipefail
cd "$(dirname "$0")/.."
OUT=${1:-/tmp/kvstore-burst}
mkdir -p "$OUT"
PY=.venv/bin
for R in $(seq "${REPEAT:-1}"); do
for GB in ${LANES:-2 0}; do
  TAG=kvstore-$GB-$R
  PORT=$(python3 -c 'import socket; s=socket.socket(); s.bind(("",0)); print(s.getsockname()[1])')
  NATS=$(python3 -c 'import socket; s=socket.socket(); s.bind(("",0)); print(s.getsockname()[1])')
  RUN=$OUT/run-$TAG; rm -rf "$RUN"
  $PY/inferno up --random-demo --workers 2 --kvstore-capacity-gb $GB --port $PORT --nats-port $NATS \
    --run-dir "$RUN" > "$OUT/up-$TAG.log" 2>&1 &
  UP=$!
  for _ in $(seq 120); do curl -sf localhost:$PORT/ready >/dev/null 2>&1 && break; sleep 1; done
  sleep ${SETTLE:-2}  # the heartbeats of both workers
  if [ -n "${SPY:-}" ]; then
    for name in worker-0 kvstore; do
      PID=$(python3 -c "import json; print(json.load(open('$RUN/pids.json')).get('$name', ''))")
      [ -n "$PID" ] && $PY/py-spy record -p "$PID" -d 7 -r 250 --format raw -t -o "$OUT/spy-$name-$TAG.txt" \
        >/dev/null 2>&1 &
    done
    sleep 0.5
  fi
  if [ -n "${W4:-}" ]; then
    LOAD=(--sessions 8 --turns ${TURNS:-5} --system-len 250 --user-len 10:30 --output-len 16)
  else
    LOAD=(--num-requests 400 --input-len 100:340 --output-len 20:40 --vocab-size 1000)
  fi
  $PY/inferno bench --base-url "http://localhost:$PORT" "${LOAD[@]}" \
    --pids-file "$RUN/pids.json" --out "$OUT/bench-$TAG.json" > "$OUT/bench-$TAG.log" 2>&1
  kill -INT $UP; wait $UP || true
  echo "== kvstore-capacity-gb $GB"; tail -n 22 "$OUT/bench-$TAG.log"
done
done
$PY/python - "$OUT" <<'PY'
import glob, json, statistics, sys
for gb in ("2", "0"):
    rows = [json.load(open(f)) for f in sorted(glob.glob(f"{sys.argv[1]}/bench-kvstore-{gb}-*.json"))]
    if not rows:
        continue
    if rows[0].get("sessions"):
        figs = {"hit %": [100 * r["sessions"]["hit_ratio"] for r in rows],
                "later TTFT p50": [r["sessions"]["ttft_later"]["p50"] for r in rows],
                "later TTFT p99": [r["sessions"]["ttft_later"]["p99"] for r in rows]}
    else:
        figs = {"total tok/s": [r["summary"]["total_throughput"] for r in rows],
                "TTFT p99": [r["summary"]["ttft"]["p99"] for r in rows]}
    print(f"kvstore {gb} GB, median of {len(rows)}: " + ", ".join(
        f"{k} {statistics.median(v):,.1f}" for k, v in figs.items()))
PY
