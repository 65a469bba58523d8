#!/usr/bin/env bash
# Session 11, call 3: the memory probe after the workspace fix, then W5b (KV), W1, W2 x2, W3 at this commit.
set -u
source bench/s11_env.sh
timeout 200 python3 bench/memory_probe.py /tmp/llama-3.1-8b 1024 8192 2>&1 | grep -v '\[info\|\[debug' | tee $OUT/memory_probe.txt
echo "memory probe ${SECONDS}s"
SKIP_SETUP=1 W5_COLD=0 W2_RUNS=2 STAGES="w5 w1 w2 w3" timeout 420 bash bench/gpu_bench.sh > $OUT/gpu_bench.log 2>&1
tail -30 $OUT/gpu_bench.log
grep -h "kv pool sized" /tmp/inferno-run/worker-0.log | cut -c1-500
echo "done ${SECONDS}s"
