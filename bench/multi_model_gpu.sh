#!/usr/bin/env bash
# Issue 38, several models on one GPU (bench/multi_model_bench.py): the four models' kernels compiled
# first in parallel processes (inferno warm-kernels), then each model alone, the four together
# (W1 each, a mixed W2), the 8B's reload from pinned host memory, and a small model's ITL while others load.
# Needs .whl/: WITH_UCX=0 ../shared/tools/gpu-wheels.sh.
# Usage: COMMIT=<sha> [PHASES=alone,together,reload,itl] bash bench/multi_model_gpu.sh
set -uo pipefail
export PYTHONUNBUFFERED=1
OUT=${OUT:-/tmp/inferno-out}; mkdir -p "$OUT"
SECONDS=0
[ -d /tmp/site ] || python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --target /tmp/site .whl/*.whl
export PYTHONPATH=/tmp/site:$PWD PATH=/tmp/site/bin:$PATH TRITON_CACHE_DIR=/tmp/triton-cache
nvidia-smi --query-gpu=name,memory.total --format=csv,noheader | tee "$OUT/gpu.txt"
for preset in llama-3.1-8b llama-3.2-1b qwen2.5-1.5b llama-3.2-3b; do
  [ -f /tmp/mm-$preset/config.json ] || python3 -m services.cli make-model /tmp/mm-$preset --preset $preset --config-only --quiet
done
if [ "${WARM:-1}" = 1 ]; then
  for preset in llama-3.1-8b llama-3.2-1b qwen2.5-1.5b llama-3.2-3b; do
    python3 -m services.cli warm-kernels --model-dir /tmp/mm-$preset --device cuda --num-blocks 4096 \
      > "$OUT/warm-$preset.log" 2>&1 &
  done
  wait
  echo "kernels warmed in parallel at ${SECONDS} s: $(ls $TRITON_CACHE_DIR | wc -l) cache entries"
  for f in "$OUT"/warm-*.log; do tail -1 "$f" | cut -c1-200; done
fi
timeout ${LIMIT:-480} python3 bench/multi_model_bench.py --phases "${PHASES:-alone,together,reload,itl}" --out /tmp/mm-out && true
cp /tmp/mm-out/*.json "$OUT/" 2>/dev/null
for f in /tmp/mm-out/*/worker-0.log; do cp "$f" "$OUT/$(basename $(dirname $f))-worker.log"; done 2>/dev/null
echo "commit ${COMMIT:-?}, done at ${SECONDS} s"
