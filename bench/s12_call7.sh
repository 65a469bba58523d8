#!/usr/bin/env bash
# Session 12, call 7: bench/overlap_probe.py — does paged decode attention overlap with the GEMMs of another
# micro-batch on two streams (the two-batch overlap W2's large decode steps would need)?
set -u
OUT=${OUT:-/tmp/inferno-out}; mkdir -p $OUT
export TRITON_CACHE_DIR=/tmp/triton-cache PYTHONPATH=$PWD
nvidia-smi --query-gpu=name,power.limit,clocks.max.sm --format=csv,noheader
for cfg in "--rows 480 --ctx 384" "--rows 480 --ctx 1024" "--rows 240 --ctx 384"; do
  echo "== $cfg"
  timeout 150 python3 bench/overlap_probe.py $cfg 2>&1 | grep -v Warning | tee -a $OUT/overlap_probe.jsonl
done
echo "done ${SECONDS}s"
