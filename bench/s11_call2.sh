#!/usr/bin/env bash
# Session 11, call 2: what torch holds beyond the weights when the KV pool is sized; the eager ops' launch CPU.
set -u
OUT=${OUT:-/tmp/inferno-out}; mkdir -p $OUT
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl || exit 1
export PYTHONPATH=/tmp/site:$PWD PATH=/tmp/site/bin:$PATH TRITON_CACHE_DIR=/tmp/triton-cache
SECONDS=0
python3 -m services.cli make-model /tmp/llama-3.1-8b --preset llama-3.1-8b --dtype bfloat16 --device cuda --seed 0 --quiet
echo "make-model ${SECONDS}s"
timeout 200 python3 bench/memory_probe.py /tmp/llama-3.1-8b 1024 8192 2>&1 | grep -v '\[info\|\[debug' | tee $OUT/memory_probe.txt
echo "memory probe ${SECONDS}s"
timeout 200 python3 bench/eager_cpu_probe.py /tmp/llama-3.1-8b 8192 2>&1 | grep -v '\[info\|\[debug' | tee $OUT/eager_cpu_probe.txt
echo "eager probe ${SECONDS}s"
