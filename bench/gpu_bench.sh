#!/usr/bin/env bash
# The GPU benchmark in one call (H100, offline image): writes the 8B-shape model, checks every
# kernel on the GPU, runs W1, W5, an offline batch sweep, W2 and W3 through HTTP, and the CPU
# cost per output token; prints one table at the end.
# Needs the wheels the image lacks in .whl/ (WITH_UCX=0 ../shared/tools/gpu-wheels.sh).
# Usage: STAGES="kernels w1 w5 sweep w2 w3" bash bench/gpu_bench.sh  (also: w1x, w5a, w4, pd, tp, x4, smol, gemv)
# w5: process start → first token (bench/cold_start.py; W5_COLD=0 skips the run with the page cache dropped);
# w5a: a model loaded on a running worker → first token, and a replace (bench/hot_load.py).
# smol: the real demo model (SMOL=path/to/SmolLM2-135M-Instruct.Q4_1.gguf), check + W1 + W2 shapes.
# pd: 1 prefill + 1 decode against 2 mixed workers, W3 and a long-prompt mix, the hand-off timeline
#     (needs the UCX wheels: ../shared/tools/gpu-wheels.sh without WITH_UCX=0).
# tp: tensor/pipeline parallelism (two GPUs): all-reduce cost, 8B W1 TP=1 vs TP=2, 70B (dummy weights)
#     W1 with TP=2, W2 through HTTP with TP=2 and with PP=2.
# x4: issue 11 on four GPUs (70B TP=4 / TP=2×PP=2, 2 prefill + 2 decode vs 4 mixed, W2 scaling 1/2/4).
# WORKER_ARGS overrides the W2/W3 worker flags (default: the worker's own defaults); BENCH_ARGS adds
# load-generator flags to W2 (e.g. "--temperature 0.8": sampled, not greedy, requests).
# gemv: bench/gemv_probe.py (the batch-1 GEMV's block sizes against cuBLAS; retune on a new GPU).
set -uo pipefail
export PYTHONUNBUFFERED=1
OUT=${OUT:-/tmp/inferno-out}; mkdir -p "$OUT"
STAGES=${STAGES:-"kernels w1 w5 sweep w2 w3"}
MODEL=${MODEL:-/tmp/llama-3.1-8b}
DEV=${DEVICE:-cuda}
VOCAB=${VOCAB:-128000}  # random prompts' token ids (the pd/tp/x4 stages)  # cpu: a dry run of the pd/tp/x4 stages' commands with a small model (MODEL, M70)
[ "${SKIP_SETUP:-0}" = 1 ] || python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
  --target /tmp/site .whl/*.whl || exit 1
export PYTHONPATH=/tmp/site:$PWD PATH=/tmp/site/bin:$PATH
export TRITON_CACHE_DIR=${TRITON_CACHE_DIR:-/tmp/triton-cache}
has() { [[ " $STAGES " == *" $1 "* ]]; }
wait_graphs() {  # every worker of a run dir has captured its CUDA graphs (the steady state), at most $2 s
  for i in $(seq 1 $((2 * $2))); do
    n=$(ls $1/worker-*.log $1/prefill-*.log $1/decode-*.log 2>/dev/null | wc -l)
    k=$(grep -l "graphs captured" $1/worker-*.log $1/prefill-*.log $1/decode-*.log 2>/dev/null | wc -l)
    [ $n -gt 0 ] && [ $k -ge $n ] && return 0; sleep 0.5
  done
  echo "wait_graphs: $k of $n workers captured within $2 s"
}
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader | tee "$OUT/gpu.txt"

if [ ! -f "$MODEL/config.json" ] && [ "$STAGES" != "smol" ]; then
  SECONDS=0
  python3 -m services.cli make-model "$MODEL" --preset llama-3.1-8b --dtype bfloat16 --device cuda --seed 0 --quiet
  echo "make-model 8B: ${SECONDS} s"; du -sh "$MODEL"
fi

if has gemv; then  # the batch-1 GEMV against cuBLAS on the 8B shapes (W1's weight reads)
  python3 bench/gemv_probe.py 2>&1 | grep -v '\[info' | tee "$OUT/gemv_probe.txt" | tail -40
fi
if has kernels; then
  python3 bench/gpu_kernels.py --out "$OUT/kernels.json" 2>&1 | tail -40
fi
if has w1; then
  python3 -m services.cli bench-engine --model "$MODEL" --batch-size 1 --prompt-len 128 --decode-tokens 256 --json \
    | tee "$OUT/w1.json"
fi
if has w1x; then  # W1 with overlapped steps, for comparison
  python3 -m services.cli bench-engine --model "$MODEL" --batch-size 1 --prompt-len 128 --decode-tokens 256 --json \
    --overlap ${ENGINE_ARGS:-} | tee "$OUT/w1_overlap.json"
fi
if has w5; then  # W5b: `inferno worker --model-dir` from process start to its first token
  for run in 1 2; do  # the first start compiles Triton kernels into the on-disk cache; the second reuses it
    python3 bench/cold_start.py "$MODEL" --max-num-seqs 256 | tee "$OUT/w5_run$run.json"
  done
  [ "${W5_COLD:-1}" = 1 ] && python3 bench/cold_start.py "$MODEL" --max-num-seqs 256 --drop-caches \
    | tee "$OUT/w5_cold.json"  # the weights from the drive, read ahead while torch is imported
fi
if has w5a; then  # W5a: a running worker with no model told to load the 8B directory (then to replace it);
  # 256 running requests as w5, whose runs leave the Triton kernels of that shape in the on-disk cache
  python3 bench/hot_load.py "$MODEL" --max-num-seqs 256 | tee "$OUT/w5a.json"
fi
if has sweep; then
  for b in 16 64 256; do
    python3 -m services.cli bench-engine --model "$MODEL" --batch-size $b --prompt-len 220 --decode-tokens 200 \
      --max-num-batched-tokens 8192 --json | tee "$OUT/engine_b$b.json"
  done
  python3 -m services.cli bench-engine --model "$MODEL" --batch-size 256 --prompt-len 220 --decode-tokens 200 \
    --max-num-batched-tokens 8192 --json --overlap | tee "$OUT/engine_b256_overlap.json"
fi
if has w2 || has w3; then
  rm -rf /tmp/inferno-run  # a warm machine keeps the last run's logs; the waits below read this one's
  rm -f "$OUT/w2_steps.jsonl"
  INFERNO_STEP_TRACE="$OUT/w2_steps.jsonl" python3 -m services.cli up --model "$MODEL" --model-name llama-3.1-8b \
    --device cuda --port 8000 --run-dir /tmp/inferno-run --log-format json \
    --worker-arg "${WORKER_ARGS:-}" > "$OUT/up.log" 2>&1 &
  UP=$!
  for i in $(seq 1 240); do curl -sf localhost:8000/ready >/dev/null && break; sleep 0.5; done
  curl -s localhost:8000/ready; echo
  # A worker is ready before its CUDA graphs are all captured (they follow on the step thread):
  # W2 and W3 measure the steady state, so they start once the last one is in.
  for i in $(seq 1 120); do grep -q "graphs captured" /tmp/inferno-run/worker-0.log 2>/dev/null && break; sleep 0.5; done
  if has w2; then  # W2_RUNS > 1 repeats it on the same stack with other prompts (run-to-run spread)
    for run in $(seq 1 ${W2_RUNS:-1}); do
      name=w2; [ $run -gt 1 ] && name=w2_run$run
      start=$(date +%s.%N)
      # power and clocks every 100 ms: is the GPU at its power cap (and its clocks down)?
      nvidia-smi --query-gpu=timestamp,power.draw,clocks.sm,clocks.mem,utilization.gpu,temperature.gpu,clocks_throttle_reasons.active,memory.used,memory.total \
        --format=csv,noheader,nounits -lms 100 > "$OUT/${name}_smi.csv" 2>/dev/null &
      SMI=$!
      python3 -m services.cli bench --base-url http://127.0.0.1:8000 --num-requests 1000 --vocab-size 128000 \
        --seed $((100 + run)) --pids-file /tmp/inferno-run/pids.json --out "$OUT/$name.json" ${BENCH_ARGS:-} 2>&1 \
        | tail -25
      kill $SMI 2>/dev/null
      sleep 1  # the worker writes its trace when it goes idle
      python3 bench/step_trace_summary.py "$OUT/w2_steps.jsonl" --start $start --end $(date +%s.%N) \
        | tee "$OUT/${name}_steps_summary.json"
    done
  fi
  if has w3; then
    python3 -m services.cli bench --base-url http://127.0.0.1:8000 --num-requests 300 --vocab-size 128000 \
      --sweep-rates 10,20,40 --pids-file /tmp/inferno-run/pids.json --out "$OUT/w3.json" --plot "$OUT/w3.png" 2>&1 | tail -12
  fi
  kill -INT $UP; wait $UP
  tail -5 /tmp/inferno-run/worker-0.log > "$OUT/worker_tail.log" 2>/dev/null
  # A kernel compiled while serving is a step that waited for the compiler: there should be none.
  grep "kernel compiled while serving" /tmp/inferno-run/worker-0.log > "$OUT/late_compiles.log"
  echo "kernels compiled while serving: $(wc -l < "$OUT/late_compiles.log")"
fi
if has w4; then  # two workers on the one GPU, each with a fixed KV pool (16 GB) beside its weights
  python3 -m services.cli up --model "$MODEL" --model-name llama-3.1-8b --device cuda --port 8001 --workers 2 \
    --run-dir /tmp/inferno-run-w4 --log-format json \
    --worker-arg "--num-blocks 8000 --max-num-seqs 128 --max-num-batched-tokens 4096" > "$OUT/up_w4.log" 2>&1 &
  UP=$!
  for i in $(seq 1 480); do curl -sf localhost:8001/ready >/dev/null && break; sleep 0.5; done
  sleep 3  # both workers registered
  for mode in affinity plain; do
    python3 -m services.cli bench --base-url http://127.0.0.1:8001 --sessions ${W4_SESSIONS:-16} --turns 8 --system-len ${W4_SYSTEM_LEN:-4000} \
      --output-len 64 --seed 0 $([ $mode = affinity ] && echo --session-affinity) \
      --pids-file /tmp/inferno-run-w4/pids.json --out "$OUT/w4_$mode.json" 2>&1 | tail -16
  done
  kill -INT $UP; wait $UP
fi
if has pd; then
  PD_PORT=${PD_PORT:-8003}  # 1 prefill + 1 decode against 2 mixed workers (spread over the visible GPUs): W3, long prompts
  for mode in ${PD_MODES:-pd mixed}; do
    if [ $mode = pd ]; then W="--prefill-workers 1 --decode-workers 1 --disagg-min-prefill-tokens ${PD_MIN_PREFILL:-256} ${PD_UP_ARGS:-}"
    else W="--workers 2"; fi
    python3 -m services.cli up --model "$MODEL" --model-name llama-3.1-8b --device $DEV --port $PD_PORT $W \
      --kvstore-capacity-gb ${PD_KVSTORE_GB:-2} \
      --run-dir /tmp/inferno-run-$mode${PD_RUN_TAG:-} --log-format json \
      --worker-arg "${PD_WORKER_ARGS:---max-num-seqs 256 --max-num-batched-tokens 8192} --log-level DEBUG" \
      > "$OUT/up_$mode.log" 2>&1 &
    UP=$!
    for i in $(seq 1 480); do curl -sf localhost:$PD_PORT/ready >/dev/null && break; sleep 0.5; done
    sleep 4  # both workers registered
    wait_graphs /tmp/inferno-run-$mode${PD_RUN_TAG:-} 90
    python3 -m services.cli bench --base-url http://127.0.0.1:$PD_PORT --num-requests 30 --vocab-size $VOCAB \
      --seed 7 --out /tmp/pd_warmup_$mode.json > /dev/null 2>&1  # first shapes and hand-offs out of the figures
    python3 bench/greedy_probe.py --base-url http://127.0.0.1:$PD_PORT --vocab-size $VOCAB --out "$OUT/greedy_$mode.json" \
      || echo "greedy probe failed"  # compared across modes: the hand-off must move the KV intact
    python3 -m services.cli bench --base-url http://127.0.0.1:$PD_PORT --num-requests ${PD_REQUESTS:-300} --vocab-size $VOCAB \
      --sweep-rates ${PD_RATES:-10,20,40} --pids-file /tmp/inferno-run-$mode${PD_RUN_TAG:-}/pids.json --out "$OUT/pd_w3_$mode.json" 2>&1 | tail -12
    python3 -m services.cli bench --base-url http://127.0.0.1:$PD_PORT --num-requests ${PD_LONG_REQUESTS:-100} \
      --input-len 1000:3000 --output-len 100:300 --vocab-size $VOCAB --sweep-rates ${PD_LONG_RATES:-5,10} \
      --pids-file /tmp/inferno-run-$mode${PD_RUN_TAG:-}/pids.json --out "$OUT/pd_long_$mode.json" 2>&1 | tail -12
    if [ $mode = mixed ] && [ "${PD_W4:-0}" = 1 ]; then  # W4 on the two mixed workers and the kvstore
      for w4 in affinity plain; do  # other seeds: other system prompts, so the second run starts cold too
        python3 -m services.cli bench --base-url http://127.0.0.1:$PD_PORT --sessions ${W4_SESSIONS:-16} --turns 8 --system-len ${W4_SYSTEM_LEN:-4000} \
          --output-len 64 --seed $([ $w4 = affinity ] && echo 1 || echo 2) $([ $w4 = affinity ] && echo --session-affinity) \
          --pids-file /tmp/inferno-run-$mode${PD_RUN_TAG:-}/pids.json --out "$OUT/w4_$w4.json" 2>&1 | tail -8
      done
    fi
    kill -INT $UP; wait $UP
    grep -h "handoff_done\|handoff_landed" /tmp/inferno-run-$mode${PD_RUN_TAG:-}/prefill-*.log /tmp/inferno-run-$mode${PD_RUN_TAG:-}/decode-*.log > "$OUT/handoffs_$mode.jsonl" 2>/dev/null
    grep -h -i "error\|Traceback" /tmp/inferno-run-$mode${PD_RUN_TAG:-}/*.log | head -20
  done
  [ -s "$OUT/handoffs_pd.jsonl" ] && python3 bench/handoff_stats.py "$OUT/handoffs_pd.jsonl" | tee "$OUT/handoff_summary.json"
fi
if has tp; then  # tensor/pipeline parallelism on two GPUs (nvidia-h200-x2): 8B TP=2 W1, 70B dummy TP=2 / PP=2
  export NCCL_NVLS_ENABLE=0
  T=${TP_TIMEOUT:-200}  # per command: a group that hangs must not eat the call
  timeout 90 python3 bench/allreduce_bench.py 2 2>&1 | grep '^{' | tee "$OUT/allreduce.jsonl"
  # the one-shot all-reduce over peer memory on two GPUs: exact against the reference sum, and timed beside NCCL
  timeout 120 python3 bench/custom_allreduce_check.py --ranks 2 --mode procs 2>&1 | grep '^{' > "$OUT/custom_allreduce.jsonl"
  tail -4 "$OUT/custom_allreduce.jsonl"
  timeout $T python3 -m services.cli bench-engine --model "$MODEL" --batch-size 1 --prompt-len 128 --decode-tokens 256 \
    --json --overlap | tee "$OUT/tp1_w1.json"
  timeout $T python3 -m services.cli bench-engine --model "$MODEL" --batch-size 1 --prompt-len 128 --decode-tokens 256 \
    --json --overlap --tensor-parallel-size 2 --no-fused-all-reduce-norm 2>&1 | tee "$OUT/tp2_w1.log" | tail -3 > "$OUT/tp2_w1.json"
  tail -3 "$OUT/tp2_w1.json"
  timeout $T python3 -m services.cli bench-engine --model "$MODEL" --batch-size 1 --prompt-len 128 --decode-tokens 256 \
    --json --overlap --tensor-parallel-size 2 --no-custom-all-reduce 2>&1 | tee "$OUT/tp2_nccl_w1.log" | tail -3 \
    > "$OUT/tp2_nccl_w1.json"
  tail -1 "$OUT/tp2_nccl_w1.json"
  # the one-shot all-reduce with the residual add and RMSNorm in the same kernel (the default since 2026-11-27)
  timeout $T python3 -m services.cli bench-engine --model "$MODEL" --batch-size 1 --prompt-len 128 --decode-tokens 256 \
    --json --overlap --tensor-parallel-size 2 --fused-all-reduce-norm 2>&1 | tee "$OUT/tp2_fused_w1.log" | tail -3 \
    > "$OUT/tp2_fused_w1.json"
  python3 - "$OUT" <<'PY'
import json, sys
rows = {}
for tag in ("tp1", "tp2", "tp2_nccl", "tp2_fused"):
    try:
        rows[tag] = [json.loads(l) for l in open(f"{sys.argv[1]}/{tag}_w1.json") if l.startswith("{")][-1]
    except (OSError, IndexError, ValueError):
        pass
for tag, r in rows.items():
    same = sum(a == b for a, b in zip(r["first_tokens"], rows.get("tp2", r)["first_tokens"]))
    print(f"W1 {tag}: {r['decode_tokens_per_s']:.1f} tok/s, {r['decode_step_ms']:.3f} ms/step, "
          f"first tokens equal to tp2's: {same}/{len(r['first_tokens'])}")
PY
  M70=${M70:-/tmp/llama-3.1-70b}
  [ -f "$M70/config.json" ] || python3 -m services.cli make-model "$M70" --preset llama-3.1-70b --dtype bfloat16 --config-only --quiet
  timeout $T python3 -m services.cli bench-engine --model "$M70" --load-format dummy --batch-size 1 --prompt-len 128 \
    --decode-tokens 128 --json --overlap --tensor-parallel-size 2 2>&1 | tee "$OUT/tp2_70b_w1.log" | tail -3 > "$OUT/tp2_70b_w1.json"
  tail -3 "$OUT/tp2_70b_w1.json"
  for split in ${TP_SPLITS:-"--tensor-parallel-size=2" "--pipeline-parallel-size=2"}; do
    tag=$([[ $split == *tensor* ]] && echo 70b_tp2 || echo 70b_pp2)
    python3 -m services.cli up --model "$M70" --model-name llama-3.1-70b --device $DEV --port 8004 \
      --run-dir /tmp/inferno-run-$tag --log-format json $split \
      --worker-arg "--load-format dummy" > "$OUT/up_$tag.log" 2>&1 &
    UP=$!
    for i in $(seq 1 400); do curl -sf localhost:8004/ready >/dev/null && break
      grep -q Traceback /tmp/inferno-run-$tag/worker-0.log 2>/dev/null && break; sleep 0.5; done
    grep -h "kv pool sized" /tmp/inferno-run-$tag/worker-0.log | tail -1 > "$OUT/kv_$tag.log"
    timeout $T python3 -m services.cli bench --base-url http://127.0.0.1:8004 --model llama-3.1-70b \
      --num-requests ${TP_W2_REQUESTS:-1000} --vocab-size $VOCAB --pids-file /tmp/inferno-run-$tag/pids.json \
      --out "$OUT/w2_$tag.json" 2>&1 | tail -14
    kill -INT $UP; wait $UP
    grep -h -i "error\|traceback" /tmp/inferno-run-$tag/worker-0.log | head -5
    tail -c 2000000 /tmp/inferno-run-$tag/worker-0.log > "$OUT/worker_$tag.log"
  done
fi
if has x4; then  # issue 11 on nvidia-h200-x4; X4_PARTS picks (in this order): tp4w1 tp4w2 tp2pp2 pd scale
  export NCCL_NVLS_ENABLE=0
  P=" ${X4_PARTS:-tp4w1 tp4w2 tp2pp2 pd scale} "; T=${X4_TIMEOUT:-300}
  M70=${M70:-/tmp/llama-3.1-70b}
  [ -f "$M70/config.json" ] || python3 -m services.cli make-model "$M70" --preset llama-3.1-70b --dtype bfloat16 --config-only --quiet
  [[ $P == *" tp4w1 "* ]] && timeout $T python3 -m services.cli bench-engine --model "$M70" --load-format dummy \
    --batch-size 1 --prompt-len 128 --decode-tokens 128 --json --overlap --tensor-parallel-size 4 2>&1 \
    | tee "$OUT/tp4_70b_w1.log" | tail -1 > "$OUT/tp4_70b_w1.json"; cat "$OUT/tp4_70b_w1.json" 2>/dev/null
  serve() {  # tag, model, up flags, worker flags
    python3 -m services.cli up --model "$2" --model-name m --device $DEV --port 8005 --run-dir /tmp/inferno-run-$1 \
      --log-format json $3 --worker-arg "$4" > "$OUT/up_$1.log" 2>&1 &
    UP=$!
    for i in $(seq 1 600); do curl -sf localhost:8005/ready >/dev/null && break
      grep -q Traceback /tmp/inferno-run-$1/*.log 2>/dev/null && break; sleep 0.5; done
    sleep 4
  }
  stop() { kill -INT $UP; wait $UP; grep -h "kv pool sized" /tmp/inferno-run-$1/*.log | tail -2 > "$OUT/kv_$1.log"
    grep -h -i "error\|traceback" /tmp/inferno-run-$1/*.log | head -5; }
  for part in tp4w2 tp2pp2; do
    [[ $P == *" $part "* ]] || continue
    split=$([ $part = tp4w2 ] && echo "--tensor-parallel-size 4" || echo "--tensor-parallel-size 2 --pipeline-parallel-size 2")
    tag=$([ $part = tp4w2 ] && echo 70b_tp4 || echo 70b_tp2pp2)
    serve $tag "$M70" "$split" "--load-format dummy"
    timeout $T python3 -m services.cli bench --base-url http://127.0.0.1:8005 --model m --num-requests ${X4_W2_REQUESTS:-1000} \
      --vocab-size $VOCAB --pids-file /tmp/inferno-run-$tag/pids.json --out "$OUT/w2_$tag.json" 2>&1 | tail -14
    stop $tag
  done
  if [[ $P == *" pd "* ]]; then
    for mode in pd mixed; do
      if [ $mode = pd ]; then W="--prefill-workers 2 --decode-workers 2 --disagg-min-prefill-tokens ${PD_MIN_PREFILL:-1}"
      else W="--workers 4"; fi
      serve x4_$mode "$MODEL" "$W" "--log-level DEBUG"
      wait_graphs /tmp/inferno-run-x4_$mode 90
      python3 -m services.cli bench --base-url http://127.0.0.1:8005 --model m --num-requests 60 --vocab-size $VOCAB \
        --seed 7 --out /tmp/x4_warmup_$mode.json > /dev/null 2>&1  # first shapes and hand-offs out of the figures
      python3 -m services.cli bench --base-url http://127.0.0.1:8005 --model m --num-requests ${X4_PD_REQUESTS:-600} --vocab-size $VOCAB \
        --sweep-rates 20,40,80 --pids-file /tmp/inferno-run-x4_$mode/pids.json --out "$OUT/x4_w3_$mode.json" 2>&1 | tail -6
      python3 -m services.cli bench --base-url http://127.0.0.1:8005 --model m --num-requests ${X4_LONG_REQUESTS:-200} \
        --input-len 1000:3000 --output-len 100:300 --vocab-size $VOCAB --sweep-rates 10,20 \
        --pids-file /tmp/inferno-run-x4_$mode/pids.json --out "$OUT/x4_long_$mode.json" 2>&1 | tail -6
      stop x4_$mode
      grep -h "handoff_done\|handoff_landed" /tmp/inferno-run-x4_$mode/prefill-*.log /tmp/inferno-run-x4_$mode/decode-*.log > "$OUT/x4_handoffs_$mode.jsonl" 2>/dev/null
    done
    [ -s "$OUT/x4_handoffs_pd.jsonl" ] && python3 bench/handoff_stats.py "$OUT/x4_handoffs_pd.jsonl" | tee "$OUT/x4_handoff_summary.json"
  fi
  if [[ $P == *" scale "* ]]; then
    for n in 1 2 4; do
      serve scale$n "$MODEL" "--workers $n" ""
      wait_graphs /tmp/inferno-run-scale$n 90
      python3 -m services.cli bench --base-url http://127.0.0.1:8005 --model m --num-requests $((${X4_SCALE_REQUESTS:-1000} * n)) ${X4_SCALE_ARGS:-} \
        --vocab-size $VOCAB --pids-file /tmp/inferno-run-scale$n/pids.json --out "$OUT/scale_w2_$n.json" 2>&1 | tail -14
      stop scale$n
    done
  fi
fi
if has smol; then  # the real demo model: SmolLM2-135M-Instruct GGUF (Q4_1 + Q8_0 → bf16), launch-bound
  SMOL=${SMOL:-/tmp/SmolLM2-135M-Instruct.Q4_1.gguf}
  python3 bench/real_model_check.py "$SMOL" 2>&1 | grep -v '\[info' | tee "$OUT/smol_check.json"
  python3 -m services.cli bench-engine --model "$SMOL" --batch-size 1 --prompt-len 128 --decode-tokens 256 --json \
    | tee "$OUT/smol_w1.json"
  python3 -m services.cli bench-engine --model "$SMOL" --batch-size 1 --prompt-len 128 --decode-tokens 256 --json \
    --overlap | tee "$OUT/smol_w1_overlap.json"
  python3 -m services.cli bench-engine --model "$SMOL" --batch-size 256 --prompt-len 220 --decode-tokens 200 \
    --max-num-batched-tokens 8192 --json --overlap | tee "$OUT/smol_b256_overlap.json"
  for flags in "--max-num-seqs 256 --max-num-batched-tokens 8192" \
               "--max-num-seqs 1024 --max-num-batched-tokens 16384 --overlap"; do
    tag=$([[ $flags == *overlap* ]] && echo big || echo default)
    python3 -m services.cli up --model "$SMOL" --model-name smollm2 --device cuda --port 8002 \
      --run-dir /tmp/inferno-run-smol --log-format json --worker-arg "$flags" > "$OUT/up_smol_$tag.log" 2>&1 &
    UP=$!
    for i in $(seq 1 240); do curl -sf localhost:8002/ready >/dev/null && break; sleep 0.5; done
    python3 -m services.cli bench --base-url http://127.0.0.1:8002 --model smollm2 --num-requests 1000 \
      --vocab-size 49152 --pids-file /tmp/inferno-run-smol/pids.json --out "$OUT/smol_w2_$tag.json" 2>&1 | tail -14
    kill -INT $UP; wait $UP
  done
fi
python3 bench/summarize.py "$OUT"
# The device tool brings back at most 8 files: everything but the summary (and a caller's log) in one archive.
if [ "${PACK:-1}" = 1 ]; then
  (cd "$OUT" && files=$(ls | grep -v '^summary.json$\|^bench.log$\|^all.tgz$') && [ -n "$files" ] && tar czf all.tgz --remove-files $files)
fi
