#!/usr/bin/env bash
# Session 12, call 5: W2 and CPU per output token, this tree against 5425786 (the session's start), this tree
# first, two runs each on one stack per tree, on one host.
set -u
source bench/s11_env.sh
BASE=5425786 W2_RUNS=2 ORDER="new base" bash bench/w2_ab.sh 2>&1 | tail -12
echo "done ${SECONDS}s"
