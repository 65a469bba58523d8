#!/usr/bin/env bash
# Issue 35 on one GPU: W1 (batch-1 decode, bench-engine --overlap) of qwen3-30b-a3b and mixtral-8x7b
# against their rooflines (the bytes a decode step reads: attention, norms, router, the chosen
# experts, the LM head; over the measured HBM copy rate), then W2 through HTTP (1,000 requests)
# of qwen3-30b-a3b against the dense 8B, each on its own stack. Random weights drawn on the device
# (--load-format dummy; make-model --config-only). Ends with one table (summary.txt).
# Needs .whl/: WITH_UCX=0 ../shared/tools/gpu-wheels.sh.
# Usage: COMMIT=<sha> [MODELS="qwen3-30b-a3b"] [SWEEP="64 256 1024"] [W2=0] [W2_MODELS=...] bash bench/moe_gpu.sh
set -uo pipefail
export PYTHONUNBUFFERED=1
OUT=${OUT:-/tmp/inferno-out}; mkdir -p "$OUT"
RAW=/tmp/moe-raw; rm -rf "$RAW"; mkdir -p "$RAW"
SECONDS=0
[ -d /tmp/site ] || python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --target /tmp/site .whl/*.whl
export PYTHONPATH=/tmp/site:$PWD PATH=/tmp/site/bin:$PATH TRITON_CACHE_DIR=/tmp/triton-cache
nvidia-smi --query-gpu=name,memory.total --format=csv,noheader | tee "$RAW/gpu.txt"
for preset in ${MODELS:-qwen3-30b-a3b mixtral-8x7b} llama-3.1-8b; do
  [ -f /tmp/$preset/config.json ] || python3 -m services.cli make-model /tmp/$preset --preset $preset --config-only --quiet
done
python3 bench/hbm_copy.py > "$RAW/hbm.txt"
echo "HBM copy $(cat $RAW/hbm.txt) TB/s"
for preset in ${MODELS:-qwen3-30b-a3b mixtral-8x7b}; do
  timeout 240 python3 -m services.cli bench-engine --model /tmp/$preset --device cuda --load-format dummy --batch-size 1 \
    --prompt-len 128 --decode-tokens 256 --overlap --json 2>"$RAW/w1_$preset.err" | tail -1 > "$RAW/w1_$preset.json"
  [ -s "$RAW/w1_$preset.json" ] || tail -20 "$RAW/w1_$preset.err"
  echo "W1 $preset done at ${SECONDS} s: $(cat $RAW/w1_$preset.json | head -c 300)"
done
if [ -n "${SWEEP:-}" ]; then  # decode steps at larger batches: SWEEP="64 256 1024", the MoE against the dense 8B
  for preset in qwen3-30b-a3b llama-3.1-8b; do
    for b in $SWEEP; do
      timeout 200 python3 -m services.cli bench-engine --model /tmp/$preset --device cuda --load-format dummy \
        --batch-size $b --prompt-len 128 --decode-tokens 64 --overlap --json 2>/dev/null | tail -1 > "$RAW/sweep_${preset}_$b.json"
      echo "batch $b $preset: $(python3 -c "import json,sys; r=json.load(open(sys.argv[1])); print(round(r['decode_tokens_per_s']), 'tok/s', round(r['decode_step_ms'], 2), 'ms/step')" "$RAW/sweep_${preset}_$b.json" 2>&1 | tail -1)"
    done
  done
fi
if [ "${W2:-1}" = 1 ]; then
  for preset in ${W2_MODELS:-qwen3-30b-a3b llama-3.1-8b}; do
    run=/tmp/run-$preset; rm -rf "$run"
    python3 -m services.cli up --model /tmp/$preset --device cuda --port 8001 --nats-port 4333 --run-dir "$run" \
      --kvstore-capacity-gb 0 --worker-arg=--load-format=dummy > "$RAW/up_$preset.log" 2>&1 &
    UP=$!
    for _ in $(seq 300); do curl -sf localhost:8001/ready > /dev/null 2>&1 && break; sleep 1; done
    for _ in $(seq 180); do grep -q "graphs captured" "$run"/worker-0.log 2>/dev/null && break; sleep 0.5; done
    [ -f "$run/pids.json" ] || { echo "the $preset stack did not start:"; tail -5 "$RAW/up_$preset.log"; tail -20 "$run"/worker-0.log; }
    python3 -m services.cli bench --base-url http://127.0.0.1:8001 --num-requests 100 --vocab-size 128000 --seed 7 \
      --no-progress --out "$RAW/warmup.json" > /dev/null 2>&1
    timeout 200 python3 -m services.cli bench --base-url http://127.0.0.1:8001 --num-requests 1000 --vocab-size 128000 \
      --seed 101 --no-progress --pids-file "$run/pids.json" --out "$RAW/w2_$preset.json" 2>&1 | tail -2
    sleep 1.5
    curl -s localhost:8001/metrics | grep "^inferno:moe_expert_tokens" | sort -t' ' -k2 -n | tail -3 > "$RAW/experts_$preset.txt"
    kill -INT $UP; wait $UP
    echo "W2 $preset done at ${SECONDS} s"
  done
fi
python3 - "$RAW" "$OUT" "${COMMIT:-?}" <<'PY' | tee "$OUT/summary.txt"
import json, os, sys
sys.path.insert(0, os.getcwd())
from services.worker.engine.model_config import ModelConfig
raw, out, commit = sys.argv[1:]
hbm = float(open(f"{raw}/hbm.txt").read())
print(f"{open(f'{raw}/gpu.txt').read().strip()}, commit {commit}, HBM copy {hbm:.2f} TB/s")

def active_bytes(cfg):  # bf16 bytes one batch-1 decode step reads
    h, moe = cfg.hidden_size, cfg.moe
    attn = h * (cfg.q_size + 2 * cfg.kv_size) + cfg.q_size * h + 2 * h
    experts = moe.top_k * 3 * moe.intermediate_size * h + moe.num_experts * h
    return 2 * (cfg.num_hidden_layers * (attn + experts) + cfg.vocab_size * h + h)

result = {"hbm_tb_s": hbm, "w1": {}, "w2": {}}
for name in os.environ.get("MODELS", "qwen3-30b-a3b mixtral-8x7b").split():
    try:
        w1 = json.load(open(f"{raw}/w1_{name}.json"))
    except Exception as e:
        print(f"W1 {name}: no result ({e})"); continue
    tok = w1.get("decode_tok_s") or w1.get("decode_tokens_per_s") or w1.get("decode", {}).get("tok_s")
    gb = active_bytes(ModelConfig.from_dir(f"/tmp/{name}")) / 1e9
    roof = hbm * 1e12 / (gb * 1e9)
    print(f"W1 {name:15} {tok:8.1f} tok/s  active {gb:5.2f} GB  roofline {roof:6.0f} tok/s  {100 * tok / roof:5.1f} %")
    result["w1"][name] = {"tok_s": tok, "active_gb": round(gb, 2), "roofline_tok_s": round(roof), "raw": w1}
for name in ("qwen3-30b-a3b", "llama-3.1-8b"):
    try:
        s = json.load(open(f"{raw}/w2_{name}.json"))["summary"]
    except Exception as e:
        print(f"W2 {name}: no result ({e})"); continue
    result["w2"][name] = s["total_throughput"]
    print(f"W2 {name:15} {s['total_throughput']:>9,.0f} tok/s  failed {s['failed']}  "
          f"{open(f'{raw}/experts_{name}.txt').read().split()[-2:] if os.path.exists(f'{raw}/experts_{name}.txt') else ''}")
if len(result["w2"]) == 2:
    print(f"W2 qwen3-30b-a3b / dense 8B: {result['w2']['qwen3-30b-a3b'] / result['w2']['llama-3.1-8b']:.2f} (target >= 2)")
json.dump(result, open(f"{out}/moe.json", "w"), indent=1)
PY
echo "total: ${SECONDS} s"
