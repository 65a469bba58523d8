#!/usr/bin/env bash
# Issue 35 on two GPUs (nvidia-h200-x2): qwen3-30b-a3b W2 through HTTP on one GPU against expert
# parallelism over two (TP=2 attention, whole experts per GPU), each on its own stack; the
# communication a layer adds at decode sizes (two all-reduces of batch × 2,048 bf16: NCCL and the
# one-shot peer-memory path, bench/custom_allreduce_check.py); 8B W1 with TP=1 against TP=2.
# Random weights drawn on the GPUs (--load-format dummy). Ends with one table (summary.txt).
# PARTS "sweep": the engine's steps at batch 256 and 1,024 (SWEEP), one GPU against EP=2.
# Needs .whl/: WITH_UCX=0 ../shared/tools/gpu-wheels.sh. Usage: COMMIT=<sha> [PARTS="comm w1 w2 sweep"] bash bench/ep_gpu.sh
set -uo pipefail
export PYTHONUNBUFFERED=1 NCCL_NVLS_ENABLE=0
OUT=${OUT:-/tmp/inferno-out}; mkdir -p "$OUT"
RAW=/tmp/ep-raw; rm -rf "$RAW"; mkdir -p "$RAW"
SECONDS=0
[ -d /tmp/site ] || python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --target /tmp/site .whl/*.whl
export PYTHONPATH=/tmp/site:$PWD PATH=/tmp/site/bin:$PATH TRITON_CACHE_DIR=/tmp/triton-cache
nvidia-smi --query-gpu=index,name,memory.total --format=csv,noheader | tee "$RAW/gpus.txt"
PARTS=" ${PARTS:-comm w1 w2} "
for preset in qwen3-30b-a3b llama-3.1-8b; do
  [ -f /tmp/$preset/config.json ] || python3 -m services.cli make-model /tmp/$preset --preset $preset --config-only --quiet
done
if [[ $PARTS == *" comm "* ]]; then
  AR_HIDDEN=2048 AR_BATCHES="1 64 512" timeout 90 python3 bench/allreduce_bench.py 2 2>&1 | grep '^{' > "$RAW/nccl.jsonl"
  timeout 120 python3 bench/custom_allreduce_check.py --ranks 2 --mode procs 2>&1 | grep '^{' > "$RAW/custom.jsonl"
  echo "comm done at ${SECONDS} s"
fi
if [[ $PARTS == *" w1 "* ]]; then  # 8B W1: one GPU against TP=2 (the issue's 1.6 x)
  for tp in 1 2; do
    timeout 200 python3 -m services.cli bench-engine --model /tmp/llama-3.1-8b --load-format dummy --batch-size 1 \
      --prompt-len 128 --decode-tokens 256 --overlap --json --tensor-parallel-size $tp 2>"$RAW/w1_tp$tp.err" \
      | grep '^{' | tail -1 > "$RAW/w1_tp$tp.json"
    [ -s "$RAW/w1_tp$tp.json" ] || tail -5 "$RAW/w1_tp$tp.err"
    echo "W1 TP=$tp done at ${SECONDS} s: $(head -c 200 "$RAW/w1_tp$tp.json")"
  done
fi
if [[ $PARTS == *" sweep "* ]]; then  # the engine alone: qwen3-30b-a3b steps at W2's batches, one GPU against EP=2
  for b in ${SWEEP:-256 1024}; do
    for tp in 1 2; do
      EP=$([ $tp = 2 ] && echo "--tensor-parallel-size 2 --enable-expert-parallel")
      timeout 200 python3 -m services.cli bench-engine --model /tmp/qwen3-30b-a3b --load-format dummy --batch-size $b \
        --prompt-len 256 --decode-tokens 64 --overlap --json $EP 2>"$RAW/sweep_${b}_tp$tp.err" | grep '^{' | tail -1 \
        > "$RAW/sweep_${b}_tp$tp.json"
      [ -s "$RAW/sweep_${b}_tp$tp.json" ] || tail -5 "$RAW/sweep_${b}_tp$tp.err"
      echo "sweep batch $b TP=$tp at ${SECONDS} s: $(head -c 260 "$RAW/sweep_${b}_tp$tp.json")"
    done
  done
fi
if [[ $PARTS == *" profile "* ]]; then  # torch's profile of the decode steps at batch PROFILE_BATCH, one GPU and EP=2
  for tp in ${PROFILE_TP:-1 2}; do
    EP=$([ $tp = 2 ] && echo "--tensor-parallel-size 2 --enable-expert-parallel")
    timeout 200 python3 -m services.cli bench-engine --model /tmp/${PROFILE_MODEL:-qwen3-30b-a3b} --load-format dummy \
      --batch-size ${PROFILE_BATCH:-256} --prompt-len 256 --decode-tokens 16 --overlap --json $EP \
      ${PROFILE_TRACE:+--profile-trace} --profile "$OUT/profile_${PROFILE_MODEL:-qwen3-30b-a3b}_b${PROFILE_BATCH:-256}_tp$tp.txt" 2>/dev/null | grep '^{' | head -c 300
    echo; head -1 "$OUT/profile_${PROFILE_MODEL:-qwen3-30b-a3b}_b${PROFILE_BATCH:-256}_tp$tp.txt"
  done
fi
if [[ $PARTS == *" w2 "* ]]; then  # qwen3-30b-a3b W2: one GPU, then EP over two
  for lane in one ep2; do
    run=/tmp/run-$lane; rm -rf "$run"
    if [ $lane = one ]; then GPUS=0 ARGS=""; else GPUS=0,1 ARGS="--tensor-parallel-size 2 --enable-expert-parallel"; fi
    CUDA_VISIBLE_DEVICES=$GPUS python3 -m services.cli up --model /tmp/qwen3-30b-a3b --device cuda --port 8001 \
      --nats-port 4333 --run-dir "$run" --kvstore-capacity-gb 0 $ARGS --worker-arg=--load-format=dummy \
      > "$RAW/up_$lane.log" 2>&1 &
    UP=$!
    for _ in $(seq 300); do curl -sf localhost:8001/ready > /dev/null 2>&1 && break; sleep 1; done
    for _ in $(seq 180); do grep -q "graphs captured" "$run"/worker-0*.log 2>/dev/null && break; sleep 0.5; done
    [ -f "$run/pids.json" ] || { echo "the $lane stack did not start:"; tail -5 "$RAW/up_$lane.log"; tail -20 "$run"/worker-0*.log; }
    grep -h "kv pool sized" "$run"/worker-0*.log | head -1 | cut -c1-300 > "$RAW/kv_$lane.txt"
    python3 -m services.cli bench --base-url http://127.0.0.1:8001 --num-requests 100 --vocab-size 128000 --seed 7 \
      --no-progress --out "$RAW/warmup.json" > /dev/null 2>&1
    timeout 200 python3 -m services.cli bench --base-url http://127.0.0.1:8001 --num-requests ${W2_REQUESTS:-2000} \
      --processes 4 --vocab-size 128000 --seed 101 --no-progress --pids-file "$run/pids.json" \
      --out "$RAW/w2_$lane.json" 2>&1 | tail -2
    sleep 1.5
    curl -s localhost:8001/metrics | grep "^inferno:moe_expert_tokens" > "$RAW/experts_$lane.txt"
    kill -INT $UP; wait $UP
    grep -h -i "traceback" -A3 "$run"/*.log | head -8
    echo "W2 $lane done at ${SECONDS} s"
  done
fi
python3 - "$RAW" "$OUT" "${COMMIT:-?}" <<'PY' | tee "$OUT/summary.txt"
import json, os, sys
raw, out, commit = sys.argv[1:]
print(open(f"{raw}/gpus.txt").read().strip(), "| commit", commit)
result = {"comm": {}, "w1": {}, "w2": {}}
def lines(name):
    try:
        return [json.loads(l) for l in open(f"{raw}/{name}") if l.startswith("{")]
    except OSError:
        return []
for r in lines("nccl.jsonl"):
    print(f"NCCL all-reduce {r['batch']:4} x 2048 bf16 ({r['bytes']:>9,} B): eager {r['eager_us']:7.1f} us, "
          f"in a graph {r['graph_us']:7.1f} us; a layer (2 of them) {2 * r['graph_us']:7.1f} us")
    result["comm"][f"nccl_{r['batch']}"] = r
for r in lines("custom.jsonl"):
    if "bytes" in r or "nbytes" in r:
        result["comm"].setdefault("custom", []).append(r)
        print("one-shot", json.dumps(r)[:200])
for tp in (1, 2):
    r = (lines(f"w1_tp{tp}.json") or [None])[-1]
    if r:
        result["w1"][f"tp{tp}"] = r["decode_tokens_per_s"]
        print(f"8B W1 TP={tp}: {r['decode_tokens_per_s']:.1f} tok/s ({r['decode_step_ms']:.3f} ms a step)")
if len(result["w1"]) == 2:
    print(f"8B W1 TP=2 / TP=1: {result['w1']['tp2'] / result['w1']['tp1']:.3f} x (target >= 1.6)")
for b in os.environ.get("SWEEP", "256 1024").split():
    rows = {tp: (lines(f"sweep_{b}_tp{tp}.json") or [None])[-1] for tp in (1, 2)}
    if all(rows.values()):
        a, e = rows[1], rows[2]
        print(f"engine batch {b}: decode step {a['decode_step_ms']:.2f} ms one GPU, {e['decode_step_ms']:.2f} ms EP=2 "
              f"({a['decode_step_ms'] / e['decode_step_ms']:.2f} x); prefill {a['prefill_tokens_per_s']:,.0f} / "
              f"{e['prefill_tokens_per_s']:,.0f} tok/s")
        result.setdefault("sweep", {})[b] = {"one": a, "ep2": e}
for lane in ("one", "ep2"):
    try:
        s = json.load(open(f"{raw}/w2_{lane}.json"))["summary"]
    except Exception as e:
        print(f"W2 {lane}: no result ({e})"); continue
    kv = open(f"{raw}/kv_{lane}.txt").read().strip()[:160] if os.path.exists(f"{raw}/kv_{lane}.txt") else ""
    result["w2"][lane] = {"total_tok_s": s["total_throughput"], "failed": s["failed"],
                          "ttft_p99_ms": s["ttft"]["p99"], "tpot_p50_ms": s["tpot"]["p50"]}
    print(f"qwen3-30b-a3b W2 {lane}: {s['total_throughput']:>9,.0f} total tok/s, failed {s['failed']}, "
          f"TPOT p50 {s['tpot']['p50']:.1f} ms | {kv}")
if len(result["w2"]) == 2:
    print(f"W2 EP=2 / one GPU: {result['w2']['ep2']['total_tok_s'] / result['w2']['one']['total_tok_s']:.2f} x (target >= 1.7)")
json.dump(result, open(f"{out}/ep.json", "w"), indent=1)
PY
cp "$RAW"/*.jsonl "$RAW"/experts_*.txt "$OUT"/ 2>/dev/null
echo "total: ${SECONDS} s"
