#!/usr/bin/env bash
# Issue 40 on two GPUs (nvidia-h200-x2), every lane a stack of `inferno up` at its defaults on GPUs 0-1,
# one after another: 2 mixed workers (the baseline), 1 prefill + 1 decode, and 1P+1D with the pages
# moved as bytes over UCXX instead of CUDA IPC (--no-handoff-ipc; UCX's own choice of transport),
# then the same with UCX_TLS=tcp,cuda_copy,self (what a cross-host TCP link costs). Each lane: warm-up,
# the greedy probe (the hand-off must move the KV intact), long prompts (input 1,000-3,000, output
# 100-300) at LONG_RATE req/s, the hand-offs from the workers' logs. Ends with one table (summary.txt).
# A lane named twice runs twice and its requests are pooled: LANES="mixed pd mixed pd" for the TTFT verdict.
# 8B shape, random weights written once (make-model: every lane loads the same weights).
# Needs .whl/ with UCX (../shared/tools/gpu-wheels.sh). Usage: COMMIT=<sha> [LANES="mixed pd pd_bytes pd_tcp"]
#   [LONG_RATE=5] [LONG_REQUESTS=100] [PD_ARGS="..."] bash bench/pd_gpu.sh
set -uo pipefail
export PYTHONUNBUFFERED=1
OUT=${OUT:-/tmp/inferno-out}; mkdir -p "$OUT"
RAW=/tmp/pd-raw; rm -rf "$RAW"; mkdir -p "$RAW"
SECONDS=0
[ -d /tmp/site ] || python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --target /tmp/site .whl/*.whl
export PYTHONPATH=/tmp/site:$PWD PATH=/tmp/site/bin:$PATH TRITON_CACHE_DIR=/tmp/triton-cache
nvidia-smi --query-gpu=index,name,memory.total --format=csv,noheader | tee "$RAW/gpus.txt"
M=/tmp/llama-3.1-8b
[ -f $M/config.json ] || python3 -m services.cli make-model $M --preset llama-3.1-8b --dtype bfloat16 --device cuda \
  --seed 0 --quiet
echo "model at ${SECONDS} s"
declare -A SEEN
for lane in ${LANES:-mixed pd pd_bytes pd_tcp}; do  # a lane named again runs again (k): its requests are pooled
  k=$(( ${SEEN[$lane]:-0} + 1 )); SEEN[$lane]=$k
  run=/tmp/run-$lane; rm -rf $run
  W="--prefill-workers 1 --decode-workers 1 ${PD_ARGS:-}"; ENV=()
  case $lane in
    mixed) W="--workers 2" ;;
    pd_b) W="$W ${PD_B_ARGS:-}" ;;  # an A/B of 1P+1D flags, e.g. PD_B_ARGS="--disagg-max-prefill-queue-tokens 2048"
    pd_bytes) W="$W --worker-arg=--no-handoff-ipc" ;;
    pd_tcp) W="$W --worker-arg=--no-handoff-ipc"; ENV=(UCX_TLS=tcp,cuda_copy,self) ;;
  esac
  env "${ENV[@]}" python3 -m services.cli up --model $M --model-name llama-3.1-8b --device cuda --port 8001 \
    --nats-port 4333 --run-dir $run --log-format json $W --worker-arg=--log-level=DEBUG > "$RAW/up_$lane.log" 2>&1 &
  UP=$!
  for _ in $(seq 400); do curl -sf localhost:8001/ready > /dev/null 2>&1 && break; sleep 0.5; done
  sleep 3  # both workers registered
  # Both workers settled: graphs captured and the sampler's kernels compiled (a thread of the worker
  # compiles them once it serves; a lane measured during that had first tokens of ~1 s, 2026-11-29).
  for _ in $(seq 240); do
    [ "$(grep -l "sampler kernels compiled" $run/*-*.log 2>/dev/null | wc -l)" -ge 2 ] && break; sleep 0.5
  done
  echo "$lane ready at ${SECONDS} s"
  python3 -m services.cli bench --base-url http://127.0.0.1:8001 --num-requests 30 --input-len 1000:3000 \
    --vocab-size 128000 --seed 7 --no-progress --out "$RAW/warm_$lane.json" > /dev/null 2>&1
  python3 bench/greedy_probe.py --base-url http://127.0.0.1:8001 --vocab-size 128000 --out "$RAW/greedy_$lane.json" \
    > /dev/null 2>&1 || echo "greedy probe failed"
  timeout 150 python3 -m services.cli bench --base-url http://127.0.0.1:8001 --num-requests ${LONG_REQUESTS:-100} \
    --input-len 1000:3000 --output-len 100:300 --vocab-size 128000 --request-rate ${LONG_RATE:-5} --seed 11 \
    --no-progress --save-requests --pids-file $run/pids.json --out "$RAW/long_${lane}_$k.json" 2>&1 | tail -1
  curl -s localhost:8001/metrics | grep -E "^inferno:kv_handoffs" > "$RAW/metrics_$lane.txt"
  kill -INT $UP; wait $UP
  grep -h "handoff_done\|handoff_landed" $run/prefill-*.log $run/decode-*.log >> "$RAW/handoffs_$lane.jsonl" 2>/dev/null
  [ -s "$RAW/handoffs_$lane.jsonl" ] && python3 bench/handoff_stats.py "$RAW/handoffs_$lane.jsonl" > "$RAW/handoff_$lane.json"
  grep -h -i "traceback" -A3 $run/*.log | head -8
  echo "$lane done at ${SECONDS} s"
done
python3 - "$RAW" "$OUT" "${COMMIT:-?}" <<'PY' | tee "$OUT/summary.txt"
import json, os, subprocess, sys
raw, out, commit = sys.argv[1:]
print(open(f"{raw}/gpus.txt").read().strip().replace("\n", "; "), "| commit", commit)
import glob

def pct(values, q):  # linear between ranks, as the load generator's
    v = sorted(values)
    if not v:
        return float("nan")
    x = q * (len(v) - 1)
    i = int(x)
    return v[i] + (v[min(i + 1, len(v) - 1)] - v[i]) * (x - i)

def itls(r):  # the load generator's RequestRecord.itls: a chunk's gap over its share of the tokens
    t = r["chunk_times"]
    if len(t) < 2:
        return []
    share = max((r.get("completion_tokens") or len(t)) - 1, len(t) - 1) / (len(t) - 1)
    return [1e3 * (b - a) / share for a, b in zip(t, t[1:])]

result = {}
for lane in ("mixed", "pd", "pd_b", "pd_bytes", "pd_tcp"):
    # long_pd_1.json, not long_pd_tcp_1.json: a lane's runs are numbered, other lanes' names go on.
    runs = [json.load(open(p)) for p in sorted(glob.glob(f"{raw}/long_{lane}_[0-9]*.json"))]
    if not runs:
        continue
    # Every run's requests pooled: a p99 of 100 requests moved +-20 % between calls (2026-11-29).
    reqs = [r for run in runs for r in run.get("requests", []) if r.get("error") is None and r.get("ttft") is not None]
    ttft = [1e3 * r["ttft"] for r in reqs]
    itl = [x for r in reqs for x in itls(r)]
    row = {"runs": len(runs), "requests": len(reqs), "ttft_p50": pct(ttft, 0.5), "ttft_p99": pct(ttft, 0.99),
           "itl_p50": pct(itl, 0.5), "itl_p99": pct(itl, 0.99),
           "failed": sum(run["summary"]["failed"] for run in runs),
           "ttft_p99_each": [round(run["summary"]["ttft"]["p99"], 1) for run in runs],
           "itl_p99_each": [round(run["summary"]["itl"]["p99"], 1) for run in runs],
           "total_tok_s": sum(run["summary"]["total_throughput"] for run in runs) / len(runs)}
    # The requests behind the p99 (start s, prompt tokens, TTFT ms), and why any failed.
    row["slowest"] = [(round(r.get("start") or 0.0, 2), r.get("prompt_tokens") or r.get("planned_input_len"), round(1e3 * r["ttft"]))
                      for r in sorted(reqs, key=lambda r: -r["ttft"])[:4]]
    row["errors"] = sorted({(r.get("error_detail") or r.get("error") or "")[:120]
                            for run in runs for r in run.get("requests", []) if r.get("error")})[:3]
    try:
        h = json.load(open(f"{raw}/handoff_{lane}.json"))
        row["handoff"] = h
    except Exception:
        pass
    result[lane] = row
    print(f"{lane:9} slowest (start s, prompt, TTFT ms): {row['slowest']}  errors: {row['errors']}")
    print(f"{lane:9} x{row['runs']} TTFT p50 / p99 {row['ttft_p50']:7.1f} / {row['ttft_p99']:7.1f} ms   ITL p50 / p99 "
          f"{row['itl_p50']:5.1f} / {row['itl_p99']:6.1f} ms   failed {row['failed']}   p99s a run: TTFT "
          f"{row['ttft_p99_each']} ITL {row['itl_p99_each']}")
base = result.get("mixed")
for lane in ("pd", "pd_b", "pd_bytes", "pd_tcp"):
    if base and lane in result:
        r = result[lane]
        print(f"{lane} against mixed: TTFT p99 {r['ttft_p99'] / base['ttft_p99']:.2f} x (target <= 1.3), "
              f"ITL p99 {r['itl_p99'] / base['itl_p99']:.2f} x (target <= 0.5)")
for lane in ("pd", "pd_b", "pd_bytes", "pd_tcp"):
    h = result.get(lane, {}).get("handoff", {})
    for key, label in (("all", "all"), ("prompt_ge_2800", ">= 2,800 tokens")):
        x = h.get(key)
        if x and x.get("count"):
            print(f"hand-off {lane:8} {label:16} n {x['count']:3}  total p50 / p99 {x['total_ms_p50']:6.2f} / "
                  f"{x['total_ms_p99']:6.2f} ms  push p50 {x['push_ms_p50']:6.2f} ms  {x['mib_p50']:6.1f} MiB  "
                  f"{x.get('push_gbps_p50', 0):6.1f} GB/s  over IPC {x.get('over_cuda_ipc')}")
for lane in ("pd", "pd_bytes", "pd_tcp"):
    a, b = f"{raw}/greedy_mixed.json", f"{raw}/greedy_{lane}.json"
    if os.path.exists(a) and os.path.exists(b):
        r = subprocess.run([sys.executable, "bench/greedy_probe.py", "--compare", a, b], capture_output=True, text=True)
        print(f"greedy {lane} against mixed:", (r.stdout.strip().splitlines() or ["?"])[-1])
json.dump(result, open(f"{out}/pd.json", "w"), indent=1)
PY
cp "$RAW"/metrics_*.txt "$OUT"/ 2>/dev/null
echo "total: ${SECONDS} s"
