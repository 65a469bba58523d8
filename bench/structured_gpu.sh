#!/usr/bin/env bash
# Issue 34 on one GPU: W2 (1,000 requests at once, 8B random weights, one worker) unconstrained, every
# answer under one JSON schema, and under 16 (bench/structured_bench.py schemas: none ends before its
# max_tokens, so the runs make the same tokens), on one stack in the order plain one sixteen sixteen
# one plain; per run, the grammar masks' host fill and the GPU's wait for them per step (the worker's
# step trace); then 128 answers that end, validated; compile times over 200 schemas on the model's
# vocabulary (bench/grammar_ab.py); jump-forward at batch 1 (structured_bench.py jump). Ends with one
# table (summary.txt).
# Needs .whl/: WITH_UCX=0 ../shared/tools/gpu-wheels.sh, plus xgrammar, apache-tvm-ffi, pydantic and
# jsonschema with their dependencies (cp312 wheels; the image lacks them).
# Usage: COMMIT=<sha> bash bench/structured_gpu.sh   (a CPU dry run: DEVICE=cpu MODEL=<tiny model dir> N=50 VOCAB=1000 SKIP_SETUP=1)
set -uo pipefail
export PYTHONUNBUFFERED=1
OUT=${OUT:-/tmp/inferno-out}; mkdir -p "$OUT"
RAW=/tmp/structured-raw; rm -rf "$RAW"; mkdir -p "$RAW"  # the runs' files; $OUT gets the summary and results.json
MODEL=${MODEL:-/tmp/llama-3.1-8b}
RUN=/tmp/run-structured
SECONDS=0
N=${N:-1000} VOCAB=${VOCAB:-128000}  # requests per W2 run, and the prompts' token ids' range
if [ "${SKIP_SETUP:-0}" != 1 ] && [ ! -d /tmp/site ]; then
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --target /tmp/site .whl/*.whl || exit 1
fi
export PYTHONPATH=/tmp/site:$PWD PATH=/tmp/site/bin:$PATH TRITON_CACHE_DIR=/tmp/triton-cache
nvidia-smi --query-gpu=name,memory.total --format=csv,noheader | tee "$RAW/gpu.txt"
python3 bench/grammar_ab.py --libs xgrammar --tokenizers synthetic-128k --out "$RAW/compile.json" 2>&1 | tail -1
python3 bench/structured_bench.py schemas "$RAW/schemas"
if [ ! -f "$MODEL/config.json" ]; then
  python3 -m services.cli make-model "$MODEL" --preset llama-3.1-8b --dtype bfloat16 --device cuda --seed 0 --quiet
  cat "$MODEL"/*.safetensors > /dev/null
fi
echo "setup: ${SECONDS} s"

rm -rf "$RUN" "$RAW/steps.jsonl"
INFERNO_STEP_TRACE="$RAW/steps.jsonl" python3 -m services.cli up --model "$MODEL" --device "${DEVICE:-cuda}" --port 8001 \
  --nats-port 4333 --run-dir "$RUN" --kvstore-capacity-gb 0 > "$RAW/up.log" 2>&1 &
UP=$!
for _ in $(seq 300); do curl -sf localhost:8001/ready > /dev/null 2>&1 && break; sleep 1; done
for _ in $(seq 180); do grep -q "graphs captured" "$RUN"/worker-0.log 2>/dev/null && break; sleep 0.5; done
bench() {  # tag, seed, extra load-generator flags ...
  local tag=$1 seed=$2; shift 2
  timeout 300 python3 -m services.cli bench --base-url http://127.0.0.1:8001 --num-requests "$N" --vocab-size "$VOCAB" \
    --seed "$seed" --pids-file "$RUN/pids.json" --out "$RAW/w2_$tag.json" "$@" 2>&1 | tail -3
}
# The first shapes, Triton compiles, the vocabulary's grammar tables: out of the figures.
bench warmup 7 --num-requests 200 > /dev/null
bench warmup 8 --num-requests 200 --response-format "$RAW/schemas/sixteen.json" > /dev/null
echo "up and warm at ${SECONDS} s"
seed=100
for tag in plain one sixteen sixteen_b one_b plain_b; do
  case $tag in one*) flags="--response-format $RAW/schemas/one.json" ;;
               sixteen*) flags="--response-format $RAW/schemas/sixteen.json" ;; *) flags="" ;; esac
  seed=$((seed + 1)); start=$(date +%s.%N)
  bench "$tag" "$seed" $flags
  sleep 1  # the worker writes its trace when it goes idle
  python3 bench/step_trace_summary.py "$RAW/steps.jsonl" --start "$start" --end "$(date +%s.%N)" \
    > "$RAW/steps_$tag.json"
done
timeout 300 python3 bench/structured_bench.py valid http://127.0.0.1:8001 --requests 128 --out "$RAW/valid.json"
kill -INT "$UP"; wait "$UP"
grep -h -i "traceback\|grammar refused\|error" "$RUN"/*.log | head -20 > "$OUT/errors.txt"; head -5 "$OUT/errors.txt"
# Jump-forward at batch 1, in-process (no stack): four fixed-key schemas, plain against --jump-forward 16.
timeout 600 python3 bench/structured_bench.py jump "$MODEL" --device "${DEVICE:-cuda}" --out "$RAW/jump.json" | tail -1

python3 - "$RAW" "$OUT" "${COMMIT:-?}" <<'PY' | tee "$OUT/summary.txt"
import json, sys
raw, out, commit = sys.argv[1:]
results = {}
print(f"{open(f'{raw}/gpu.txt').read().strip()}, commit {commit}")
tok = {}
for tag in ("plain", "one", "sixteen", "sixteen_b", "one_b", "plain_b"):
    s = json.load(open(f"{raw}/w2_{tag}.json"))["summary"]
    steps = json.load(open(f"{raw}/steps_{tag}.json"))
    g = steps.get("grammar_masks", {})
    tok[tag] = s["total_throughput"]
    results[tag] = {"summary": s, "steps": steps}
    print(f"W2 {tag:10} {s['total_throughput']:>9,.0f} tok/s  out {s['output_throughput']:>9,.0f}  failed {s['failed']} {s['errors'] or ''}"
          + (f"  mask fill {g['fill_us_per_step']:.0f} us/step, GPU wait {g['gpu_wait_us_per_step']:.1f} us/step"
             f" ({g['steps']} steps, {g['mean_rows']:.0f} rows)" if g else "")
          + f"  between steps {steps['between_steps_s']:.2f} s, TTFT p50/p99 {s['ttft']['p50']:,.0f} / {s['ttft']['p99']:,.0f} ms")
plain = (tok["plain"] + tok["plain_b"]) / 2
for k in ("one", "sixteen"):
    print(f"{k:8} / plain: {(tok[k] + tok[k + '_b']) / 2 / plain:.3f}  (target >= 0.92)")
v = json.load(open(f"{raw}/valid.json"))
print(f"valid answers: {v['valid']} of {v['stopped']} that ended ({v['requests']} asked, {v['cut_by_length']} cut)")
c = json.load(open(f"{raw}/compile.json"))["xgrammar/synthetic-128k"]
print(f"compile over {c['compile_cold_ms']['of']} schemas: p50 {c['compile_cold_ms']['p50']:.2f} ms, "
      f"p99 {c['compile_cold_ms']['p99']:.2f} ms, cached p50 {c['compile_cached_ms_p50']:.3f} ms; "
      f"batch-256 fill p50 {c['mask_b256_us_per_step']['p50']:.0f} us")
j = json.load(open(f"{raw}/jump.json"))
print(f"jump-forward, batch 1: forwards per output token {j['jump_forward_0']['forwards_per_token']} -> "
      f"{j['jump_forward_16']['forwards_per_token']} (target <= 0.75), decode {j['jump_forward_0']['decode_tok_s']} -> "
      f"{j['jump_forward_16']['decode_tok_s']} tok/s, same answers: {j['same_answers']}")
results.update(valid=v, compile=c, jump=j)
json.dump(results, open(f"{out}/results.json", "w"), indent=1)
PY
echo "total: ${SECONDS} s"
