#!/usr/bin/env bash
# Session 11, call 6: W5b (KV at the worker's start), W2 x2 and W3 at this commit (the table's figures).
set -u
source bench/s11_env.sh
SKIP_SETUP=1 W5_COLD=0 W2_RUNS=${W2_RUNS:-2} STAGES="${STAGES:-w5 w1 w2 w3}" timeout 560 bash bench/gpu_bench.sh > /tmp/gpu_bench.log 2>&1
cp /tmp/gpu_bench.log $OUT/gpu_bench.log
grep -v "^ \|^{\|^}" /tmp/gpu_bench.log | tail -16
grep -h "kv pool sized" /tmp/inferno-run/worker-0.log | cut -c1-420
