#!/usr/bin/env bash
# Issue 37: Llama 4 Scout (llama-4-scout-17b-16e, bf16, random weights drawn on the GPUs) on two GPUs
# through `inferno up`: TP=2 attention with expert parallelism (tensor parallelism alone is refused
# for Llama 4: its stacked experts go to the GPUs whole), --max-model-len 131072. Prints the KV pool
# the workers sized against `inferno plan`'s, W1 through HTTP (one stream at a time) and W2.
# Needs .whl/ (../shared/tools/gpu-wheels.sh). Usage: COMMIT=<sha> bash bench/scout_gpu.sh
set -uo pipefail
export PYTHONUNBUFFERED=1 NCCL_NVLS_ENABLE=0
OUT=${OUT:-/tmp/inferno-out}; mkdir -p "$OUT"
SECONDS=0
[ -d /tmp/site ] || python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --target /tmp/site .whl/*.whl
export PYTHONPATH=/tmp/site:$PWD PATH=/tmp/site/bin:$PATH TRITON_CACHE_DIR=/tmp/triton-cache
nvidia-smi --query-gpu=index,name,memory.total --format=csv,noheader | tee "$OUT/gpus.txt"
M=/tmp/llama-4-scout-17b-16e
[ -f $M/config.json ] || python3 -m services.cli make-model $M --preset llama-4-scout-17b-16e --config-only --quiet
python3 -m services.cli plan $M --gpus 2xH200 --enable-expert-parallel --max-model-len 131072 > "$OUT/plan.txt" 2>&1
run=/tmp/run-scout; rm -rf $run
python3 -m services.cli up --model $M --device cuda --port 8001 --nats-port 4333 --run-dir $run --kvstore-capacity-gb 0 \
  --tensor-parallel-size 2 --enable-expert-parallel --worker-arg=--load-format=dummy \
  --worker-arg=--max-model-len=131072 > "$OUT/up.log" 2>&1 &
UP=$!
for _ in $(seq 400); do curl -sf localhost:8001/ready > /dev/null 2>&1 && break; sleep 1; done
echo "ready at ${SECONDS} s"
for _ in $(seq 240); do grep -q "graphs captured" $run/worker-0*.log 2>/dev/null && break; sleep 0.5; done
echo "graphs at ${SECONDS} s"
grep -h "kv pool sized\|model ready" $run/worker-*.log | cut -c1-400 > "$OUT/pool.txt"
python3 -m services.cli bench --base-url http://127.0.0.1:8001 --num-requests 20 --vocab-size 200000 --seed 7 \
  --no-progress --out /tmp/warm.json > /dev/null 2>&1
timeout 120 python3 -m services.cli bench --base-url http://127.0.0.1:8001 --num-requests 8 --concurrency 1 \
  --input-len 128 --output-len 256 --vocab-size 200000 --no-progress --out "$OUT/w1.json" 2>&1 | tail -3
echo "W1 at ${SECONDS} s"
timeout 200 python3 -m services.cli bench --base-url http://127.0.0.1:8001 --num-requests 1000 --processes 4 \
  --vocab-size 200000 --no-progress --pids-file $run/pids.json --out "$OUT/w2.json" 2>&1 | tail -14
echo "W2 at ${SECONDS} s"
kill -INT $UP; wait $UP
grep -h -i "traceback\|error" $run/*.log | head -5
python3 - "$OUT" "${COMMIT:-?}" <<'PY' | tee "$OUT/summary.txt"
import json, re, sys
out, commit = sys.argv[1], sys.argv[2]
print(open(f"{out}/gpus.txt").read().strip(), "commit", commit)
for line in open(f"{out}/pool.txt"):
    if "kv pool" in line:
        m = re.search(r'"?kv_gib"?[=:] ?([0-9.]+)', line); t = re.search(r'"?kv_tokens"?[=:] ?([0-9]+)', line)
        print("worker KV GiB", m and m.group(1), "tokens", t and t.group(1))
print([l for l in open(f"{out}/plan.txt") if "fits" in l or l.startswith(("0 ", "1 "))][:3])
for name in ("w1", "w2"):
    try:
        s = json.load(open(f"{out}/{name}.json"))["summary"]
        print(name, f"output tok/s {s['output_throughput']:,.1f}  total {s['total_throughput']:,.0f}  "
                    f"TPOT p50 {s['tpot']['p50']:.2f} ms  failed {s['failed']}")
    except Exception as e:
        print(name, "missing", e)
PY
echo "total ${SECONDS} s"
