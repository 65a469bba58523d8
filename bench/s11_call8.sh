#!/usr/bin/env bash
# Session 11, call 8: where an eager 8,192-token forward's launch CPU goes (cProfile).
set -u
OUT=${OUT:-/tmp/inferno-out}; mkdir -p $OUT
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl || exit 1
export PYTHONPATH=/tmp/site:$PWD PATH=/tmp/site/bin:$PATH TRITON_CACHE_DIR=/tmp/triton-cache
[ -f /tmp/llama-3.1-8b/config.json ] || python3 -m services.cli make-model /tmp/llama-3.1-8b --preset llama-3.1-8b --dtype bfloat16 --device cuda --seed 0 --quiet
python3 -c "import triton; print('triton', triton.__version__)"
timeout 300 python3 bench/eager_cpu_probe.py /tmp/llama-3.1-8b 8192 --profile 2>&1 | grep -v '\[info\|\[debug' | tee $OUT/eager_profile.txt | head -80
