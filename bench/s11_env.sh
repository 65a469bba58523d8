# Sourced by session 11's call scripts: the wheels, the environment and the 8B model.
OUT=${OUT:-/tmp/inferno-out}; mkdir -p $OUT
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl || exit 1
export PYTHONPATH=/tmp/site:$PWD PATH=/tmp/site/bin:$PATH TRITON_CACHE_DIR=/tmp/triton-cache
[ -f /tmp/llama-3.1-8b/config.json ] || python3 -m services.cli make-model /tmp/llama-3.1-8b --preset llama-3.1-8b \
  --dtype bfloat16 --device cuda --seed 0 --quiet
