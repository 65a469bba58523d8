#!/usr/bin/env bash
# Session 11, call 2: what torch holds beyond the weights when the KV pool is sized; the eager ops' launch CPU.
set -u
source bench/s11_env.sh
timeout 200 python3 bench/memory_probe.py /tmp/llama-3.1-8b 1024 8192 2>&1 | grep -v '\[info\|\[debug' | tee $OUT/memory_probe.txt
echo "memory probe ${SECONDS}s"
timeout 200 python3 bench/eager_cpu_probe.py /tmp/llama-3.1-8b 8192 2>&1 | grep -v '\[info\|\[debug' | tee $OUT/eager_cpu_probe.txt
echo "eager probe ${SECONDS}s"
