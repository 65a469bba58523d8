#!/usr/bin/env bash
# Session 11, call 8: where an eager 8,192-token forward's launch CPU goes (cProfile).
set -u
source bench/s11_env.sh
python3 -c "import triton; print('triton', triton.__version__)"
timeout 300 python3 bench/eager_cpu_probe.py /tmp/llama-3.1-8b 8192 --profile 2>&1 | grep -v '\[info\|\[debug' | tee $OUT/eager_profile.txt | head -80
