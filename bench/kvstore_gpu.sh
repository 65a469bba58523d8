#!/usr/bin/env bash
# Issue 42 on GPUs: the cluster kvstore at its default against no kvstore (--kvstore-capacity-gb 0),
# 8B random weights, one mixed worker a GPU:
#   - W2: 2,000 requests at once from 4 client processes, on 2 workers and (with 4 GPUs) on 4, each
#     pair twice (off, store, store, off), after the graphs are captured and 200 warm-up requests;
#   - W4 on 2 workers: 16 sessions x 8 turns, a 4,000-word system prompt, 64 output tokens, no
#     session affinity, the store at its default, with write-back forced (INFERNO_KVSTORE=on), and off;
#   - the kvstore's CPU while idle with its workers connected (ucxx's request futures, shared/kv_transfer.py);
#   - with SCALE=1 (issue 40), W2 on one worker and on all the GPUs behind one gateway per GPU
#     (--api-server-count), 8 client processes, no kvstore: the scaling figure.
# Ends with one table (summary.txt). Needs the image's missing wheels in .whl/ (../shared/tools/gpu-wheels.sh).
# Usage: COMMIT=<sha> [W4=0: the W2 pairs only] [WS="2 4": the worker counts] [MORE=1: a third pair] [SCALE=1] bash bench/kvstore_gpu.sh
set -uo pipefail
export PYTHONUNBUFFERED=1 NCCL_NVLS_ENABLE=0
OUT=${OUT:-/tmp/inferno-out}; mkdir -p "$OUT"
MODEL=${MODEL:-/tmp/llama-3.1-8b}
SECONDS=0
if [ ! -d /tmp/site ]; then
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --target /tmp/site .whl/*.whl || exit 1
fi
export PYTHONPATH=/tmp/site:$PWD PATH=/tmp/site/bin:$PATH TRITON_CACHE_DIR=/tmp/triton-cache
nvidia-smi --query-gpu=index,name,memory.total --format=csv,noheader | tee "$OUT/gpus.txt"
NGPU=$(nvidia-smi -L | wc -l)
if [ ! -f "$MODEL/config.json" ]; then
  python3 -m services.cli make-model "$MODEL" --preset llama-3.1-8b --dtype bfloat16 --device cuda --seed 0 --quiet
  cat "$MODEL"/*.safetensors > /dev/null
fi
echo "setup: ${SECONDS} s"

UP=
up() {  # tag, workers, extra `inferno up` flags ...
  local tag=$1 workers=$2; shift 2
  rm -rf "/tmp/run-$tag"
  python3 -m services.cli up --model "$MODEL" --device cuda --workers "$workers" --port 8001 --nats-port 4333 \
    --run-dir "/tmp/run-$tag" "$@" > "$OUT/up-$tag.log" 2>&1 &
  UP=$!
  for _ in $(seq 300); do curl -sf localhost:8001/ready > /dev/null 2>&1 && break; sleep 1; done
  sleep 3  # every worker's heartbeat
  for _ in $(seq 180); do  # a worker is ready before its CUDA graphs are captured: the steady state follows
    [ "$(grep -l "graphs captured" /tmp/run-$tag/worker-*.log 2>/dev/null | wc -l)" -ge "$workers" ] && break; sleep 0.5
  done
  python3 -m services.cli bench --base-url http://127.0.0.1:8001 --num-requests 200 --vocab-size 128000 --seed 7 \
    --out /tmp/warmup.json > /dev/null 2>&1  # first shapes (and Triton compiles, on the first stack) out of the figures
  echo "$tag up and warm at ${SECONDS} s"
}
down() { kill -INT "$UP"; wait "$UP"; grep -h -i "traceback\|error\|capture failed" /tmp/run-$1/*.log | head -5; }
w2() { timeout 240 python3 -m services.cli bench --base-url http://127.0.0.1:8001 --num-requests 2000 --processes ${PROCS:-4} \
         --vocab-size 128000 --pids-file "/tmp/run-$1/pids.json" --out "$OUT/w2_$1.json" 2>&1 | tail -4; }
w4() { timeout 240 python3 -m services.cli bench --base-url http://127.0.0.1:8001 --sessions 16 --turns 8 --system-len 4000 \
         --output-len 64 --seed "$2" --pids-file "/tmp/run-$1/pids.json" --out "$OUT/w4_$1.json" 2>&1 | tail -4; }
idle_cpu() {  # percent of a core each service used over 5 s of no load
  python3 - "/tmp/run-$1/pids.json" <<'PY' | tee "$OUT/idle_$1.txt"
import json, os, sys, time
pids = json.load(open(sys.argv[1]))
def cpu(pid):
    f = open(f"/proc/{pid}/stat").read().split(") ")[1].split()
    return (int(f[11]) + int(f[12])) / os.sysconf("SC_CLK_TCK")
a = {k: cpu(v) for k, v in pids.items()}; time.sleep(5); b = {k: cpu(v) for k, v in pids.items()}
print("idle CPU % of a core: " + ", ".join(f"{k} {100 * (b[k] - a[k]) / 5:.0f}" for k in pids))
PY
}

summary() {
python3 - "$OUT" "${COMMIT:-?}" <<'PY' > "$OUT/summary.txt"
import glob, json, os, sys
out, commit = sys.argv[1], sys.argv[2]
card = open(f"{out}/gpus.txt").read().splitlines()[0].split(", ")[1]
print(f"{card}, commit {commit}")
for f in sorted(glob.glob(f"{out}/w2_*.json")):
    d = json.load(open(f)); s = d["summary"]
    cpu = {k: v for k, v in ((d.get("cpu") or {}).get("us_per_token") or {}).items() if v is not None}
    print(f"W2 {os.path.basename(f)[3:-5]:12} {s['total_throughput']:>10,.0f} tok/s  TTFT p50/p99 "
          f"{s['ttft']['p50']:,.0f} / {s['ttft']['p99']:,.0f} ms  failed {s['failed']}  "
          + ("CPU us/token " if cpu else "") + " ".join(f"{k} {v:.1f}" for k, v in cpu.items()))
for f in sorted(glob.glob(f"{out}/w4_*.json")):
    s = json.load(open(f))["sessions"]
    print(f"W4 {os.path.basename(f)[3:-5]:12} hit {100 * s['hit_ratio']:.1f} %  later TTFT p50/p99 "
          f"{s['ttft_later']['p50']:,.0f} / {s['ttft_later']['p99']:,.0f} ms")
for f in sorted(glob.glob(f"{out}/idle_*.txt")):
    print(f"{os.path.basename(f)[5:-4]:12} {open(f).read().strip()}")
PY
}

# Each W2 pair twice, in both orders: the first stack of a call also warms the machine.
for W in ${WS:-2 4}; do
  [ "$W" -le "$NGPU" ] || continue
  for tag in off$W store$W store${W}b off${W}b ${MORE:+off${W}c store${W}c}; do
    up "$tag" "$W" $([[ $tag == off* ]] && echo --kvstore-capacity-gb 0)
    w2 "$tag"
    [ "$W" = 2 ] && [[ $tag != *b ]] && [ "${W4:-1}" = 1 ] && w4 "$tag" 2
    [[ $tag == store$W ]] && idle_cpu "$tag"
    down "$tag"; summary
  done
done
if [ "${SCALE:-0}" = 1 ]; then  # issue 40's scaling: one GPU, then all of them behind a gateway each
  PROCS=8
  up scale1 1; w2 scale1; down scale1; summary
  up "scale$NGPU" "$NGPU" --kvstore-capacity-gb 0 --api-server-count "$NGPU"; w2 "scale$NGPU"; down "scale$NGPU"; summary
  PROCS=4
fi
if [ "${W4:-1}" = 1 ]; then
  INFERNO_KVSTORE=on up writeback2 2
  w4 writeback2 2
  idle_cpu writeback2
  down writeback2
fi

summary; cat "$OUT/summary.txt"
echo "total: ${SECONDS} s"
