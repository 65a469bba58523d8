#!/usr/bin/env bash
# The 70B shape with TP=2 at W2 through HTTP, twice at once on a four-GPU machine: GPUs 0-1 with the
# one-shot all-reduce (up to 4 MiB on two ranks: batch 256 × 8192 × bf16), GPUs 2-3 with NCCL for
# every all-reduce (--no-custom-all-reduce). An A/B of custom_all_reduce.default_max_bytes.
# Usage: COMMIT=<sha> bash bench/tp_allreduce_ab.sh   (needs .whl/ as multi_gpu.sh does)
set -uo pipefail
OUT=${OUT:-/tmp/inferno-out}; mkdir -p "$OUT"
MODELS=70b source bench/gpu_env.sh
lane() {  # tag, GPUs, port, worker flags
  CUDA_VISIBLE_DEVICES=$2 python3 -m services.cli up --model "$M70" --model-name m --device cuda --port $3 \
    --run-dir /tmp/inferno-run-$1 --log-format json --tensor-parallel-size 2 --worker-arg "--load-format dummy $4" \
    > "$OUT/up_$1.log" 2>&1 &
  local up=$!
  for i in $(seq 1 400); do curl -sf localhost:$3/ready >/dev/null && break; sleep 0.5; done
  sleep 3
  timeout 200 python3 -m services.cli bench --base-url http://127.0.0.1:$3 --model m --num-requests ${REQUESTS:-400} \
    --vocab-size 128256 --pids-file /tmp/inferno-run-$1/pids.json --out "$OUT/w2_$1.json" > "$OUT/w2_$1.log" 2>&1
  kill -INT $up; wait $up
  grep -h -i "traceback\|error" /tmp/inferno-run-$1/*.log | head -3
}
lane oneshot 0,1 8006 "" &
lane nccl 2,3 8007 "--no-custom-all-reduce" &
wait
for t in oneshot nccl; do echo "== $t"; grep -E "total|TTFT|ITL|failed" "$OUT/w2_$t.log" | head -8; done
python3 - "$OUT" "${COMMIT:-?}" <<'PY'
import json, sys
out, commit = sys.argv[1], sys.argv[2]
rows = {t: json.load(open(f"{out}/w2_{t}.json"))["summary"] for t in ("oneshot", "nccl")}
print(json.dumps({"commit": commit, **{t: {"total_tok_s": round(s["total_throughput"]), "failed": s["failed"],
                                               "itl_p50": s["itl"]["p50"], "tpot_p50": s["tpot"]["p50"]}
                                           for t, s in rows.items()}}))
PY
