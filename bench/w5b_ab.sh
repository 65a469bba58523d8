# W5b A/B in one call: process start → first token of the tree at BASE (default HEAD~1) against this
# tree, interleaved, after one first start that fills the Triton cache; then W1 (overlap) and W2 of
# this tree through gpu_bench.sh. Needs .whl/ (WITH_UCX=0 ../shared/tools/gpu-wheels.sh).
#   BASE=<sha> RUNS=3 bash bench/w5b_ab.sh
set -u
export PYTHONUNBUFFERED=1 TRITON_CACHE_DIR=${TRITON_CACHE_DIR:-/tmp/triton-cache}
OUT=${OUT:-/tmp/inferno-out}; mkdir -p "$OUT"
MODEL=${MODEL:-/tmp/llama-3.1-8b}
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl || exit 1
export PATH=/tmp/site/bin:$PATH
git worktree add -f /tmp/base "${BASE:-HEAD~1}" >/dev/null 2>&1 || exit 1
[ -f "$MODEL/config.json" ] || PYTHONPATH=/tmp/site:$PWD python3 -m services.cli make-model "$MODEL" \
  --preset llama-3.1-8b --dtype bfloat16 --device cuda --seed 0 --quiet
start() {  # $1: tree, $2: label
  (cd "$1" && PYTHONPATH=/tmp/site:$1 python3 bench/cold_start.py "$MODEL" --max-num-seqs 256) | tee -a "$OUT/w5b_ab.jsonl" \
    | python3 -c "import json,sys; r=json.loads(sys.stdin.read()); b=r['breakdown']; print('$2', round(r['start_to_first_token_s'],2), 'imports', b.get('imports_s'), 'device', b.get('device_s'), 'context', b.get('context_s'), 'staging', b.get('staging_s'), 'weights', b.get('weights_s'), 'kv', b.get('kv_s'), 'early', b.get('early_device_s'), b.get('early_staging'), b.get('early_device_error',''))"
}
start "$PWD" first-start
for i in $(seq 1 "${RUNS:-3}"); do start /tmp/base base; start "$PWD" early; done
SKIP_SETUP=1 W2_RUNS=1 STAGES="${AFTER:-w1x w2}" bash bench/gpu_bench.sh 2>&1 | tail -25
