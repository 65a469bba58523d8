#!/usr/bin/env bash
# Session 11, call 6: W5b (KV at the worker's start), W2 x2 and W3 at this commit (the table's figures).
set -u
OUT=${OUT:-/tmp/inferno-out}; mkdir -p $OUT
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl || exit 1
export PYTHONPATH=/tmp/site:$PWD PATH=/tmp/site/bin:$PATH TRITON_CACHE_DIR=/tmp/triton-cache
SKIP_SETUP=1 W5_COLD=0 W2_RUNS=${W2_RUNS:-2} STAGES="${STAGES:-w5 w1 w2 w3}" timeout 560 bash bench/gpu_bench.sh > /tmp/gpu_bench.log 2>&1
cp /tmp/gpu_bench.log $OUT/gpu_bench.log
grep -v "^ \|^{\|^}" /tmp/gpu_bench.log | tail -16
grep -h "kv pool sized" /tmp/inferno-run/worker-0.log | cut -c1-420
