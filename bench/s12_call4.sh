#!/usr/bin/env bash
# Session 12, call 4: the session's figures at its last code commit: W1 (plain and --overlap), W2 twice on one
# stack (CPU per output token), W3; writes $OUT/summary.json for bench/results_update.py.
set -u
source bench/s11_env.sh
COMMIT=$(git log -1 --format=%h) SKIP_SETUP=1 W2_RUNS=2 STAGES="w1 w1x w2 w3" bash bench/gpu_bench.sh 2>&1 | tail -22
echo "done ${SECONDS}s"
