#!/usr/bin/env bash
# Issue 36 on one GPU: the oracle draft at batch 1 (bench/spec_oracle.py; ORACLE=0 skips it), then W2 (1,000 requests at once, 8B random weights, one worker) with n-gram
# speculation on (its default disable_by_batch_size, 32: off while more requests run) against off,
# each on its own stack after 200 warm-up requests, in the order off on off; then the speculation
# counters from /metrics. Ends with one table (summary.txt).
# Needs .whl/: WITH_UCX=0 ../shared/tools/gpu-wheels.sh (and xgrammar, jsonschema, pydantic wheels).
# Three stacks on a fresh machine (the first compiles the Triton kernels): give it a call of its own,
# 600 s, and no pipe that holds its output back (a 400 s call ran out with nothing printed, 2026-11-29).
# Usage: COMMIT=<sha> bash bench/spec_gpu.sh
set -uo pipefail
export PYTHONUNBUFFERED=1
OUT=${OUT:-/tmp/inferno-out}; mkdir -p "$OUT"
RAW=/tmp/spec-raw; rm -rf "$RAW"; mkdir -p "$RAW"
MODEL=${MODEL:-/tmp/llama-3.1-8b}
SECONDS=0
[ -d /tmp/site ] || python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --target /tmp/site .whl/*.whl
export PYTHONPATH=/tmp/site:$PWD PATH=/tmp/site/bin:$PATH TRITON_CACHE_DIR=/tmp/triton-cache
nvidia-smi --query-gpu=name,memory.total --format=csv,noheader | tee "$RAW/gpu.txt"
[ -f "$MODEL/config.json" ] || python3 -m services.cli make-model "$MODEL" --preset llama-3.1-8b --dtype bfloat16 \
  --device cuda --seed 0 --quiet
if [ "${ORACLE:-1}" = 1 ]; then  # the mechanism at batch 1: checking steps' cost against k, tok/s against alpha
  python3 bench/spec_oracle.py "$MODEL" --tokens 256 --profile --out "$OUT/spec_oracle.json" 2>&1 | grep -v "Warning\|USDT"
  echo "oracle done at ${SECONDS} s"
fi
if [ "${DRAFTERS:-1}" = 1 ]; then  # the model drafters' cost at batch 1: a random EAGLE-3 head, a 1B-shape draft model
  [ -f /tmp/eagle3-8b/config.json ] || python3 -m services.cli make-model /tmp/eagle3-8b --preset eagle3-llama-3.1-8b \
    --dtype bfloat16 --device cuda --seed 0 --quiet
  [ -f /tmp/llama-1b/config.json ] || python3 -m services.cli make-model /tmp/llama-1b --preset llama-3.2-1b \
    --dtype bfloat16 --device cuda --seed 0 --quiet
  python3 bench/spec_drafters.py "$MODEL" --eagle3 /tmp/eagle3-8b --draft-model /tmp/llama-1b \
    --out "$OUT/spec_drafters.json" 2>&1 | grep -v Warning | tail -4
  echo "drafters done at ${SECONDS} s"
fi
[ "${W2:-1}" = 1 ] || exit 0
SPEC='--speculative-config={"method":"ngram","num_speculative_tokens":4}'
for tag in off on off_b; do
  run=/tmp/run-spec-$tag; rm -rf "$run"
  args=(); [ "$tag" = on ] && args=(--worker-arg "$SPEC")
  python3 -m services.cli up --model "$MODEL" --device cuda --port 8001 --nats-port 4333 --run-dir "$run" \
    --kvstore-capacity-gb 0 "${args[@]}" > "$RAW/up_$tag.log" 2>&1 &
  UP=$!
  for _ in $(seq 300); do curl -sf localhost:8001/ready > /dev/null 2>&1 && break; sleep 1; done
  for _ in $(seq 180); do grep -q "graphs captured" "$run"/worker-0.log 2>/dev/null && break; sleep 0.5; done
  python3 -m services.cli bench --base-url http://127.0.0.1:8001 --num-requests 200 --vocab-size 128000 --seed 7 \
    --out "$RAW/warmup.json" > /dev/null 2>&1
  [ -f "$run/pids.json" ] || { echo "the $tag stack did not start:"; tail -5 "$RAW/up_$tag.log"; tail -20 "$run"/worker-0.log; }
  timeout 300 python3 -m services.cli bench --base-url http://127.0.0.1:8001 --num-requests 1000 --vocab-size 128000 \
    --seed 101 --pids-file "$run/pids.json" --out "$RAW/w2_$tag.json" 2>&1 | tail -2
  sleep 1.5  # a heartbeat with the last counts
  curl -s localhost:8001/metrics | grep "^inferno:spec_decode" > "$RAW/metrics_$tag.txt"
  kill -INT $UP; wait $UP
  echo "$tag done at ${SECONDS} s"
done
python3 - "$RAW" "$OUT" "${COMMIT:-?}" <<'PY' | tee "$OUT/summary.txt"
import json, sys
raw, out, commit = sys.argv[1:]
print(f"{open(f'{raw}/gpu.txt').read().strip()}, commit {commit}")
tok = {}
for tag in ("off", "on", "off_b"):
    s = json.load(open(f"{raw}/w2_{tag}.json"))["summary"]
    tok[tag] = s["total_throughput"]
    print(f"W2 speculation {tag:5} {s['total_throughput']:>9,.0f} tok/s  failed {s['failed']}  "
          f"{open(f'{raw}/metrics_{tag}.txt').read().split()}")
ratio = tok["on"] / ((tok["off"] + tok["off_b"]) / 2)
print(f"on / off: {ratio:.3f} (target >= 0.97)")
json.dump({"total_tok_s": tok, "ratio": round(ratio, 3)}, open(f"{out}/spec_w2.json", "w"))
PY
echo "total: ${SECONDS} s"
