#!/usr/bin/env bash
# Session 11, call 4: the segments torch keeps after the KV sizing's dry run; W1 twice.
set -u
source bench/s11_env.sh
timeout 200 python3 bench/memory_probe.py /tmp/llama-3.1-8b 1024 8192 2>&1 | grep -v '\[info\|\[debug' | tee $OUT/memory_probe.txt
echo "memory probe ${SECONDS}s"
for i in 1 2; do python3 -m services.cli bench-engine --model /tmp/llama-3.1-8b --batch-size 1 --prompt-len 128 --decode-tokens 256 --json 2>/dev/null | tail -1 | cut -c1-200; done
echo "done ${SECONDS}s"
