#!/usr/bin/env bash
# Session 12, call 6: bench/profiles/w2_profile.sh on the session's last tree (W2 three times on one stack,
# per-thread CPU, py-spy flame graphs of worker and gateway): where the CPU per token goes now.
set -u
source bench/s11_env.sh
WHL=.whl-w2 RAW=0 bash bench/profiles/w2_profile.sh 2>&1 | grep -v triton_compile | tail -30
echo "done ${SECONDS}s"
