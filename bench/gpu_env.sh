# Sourced by bench/w1_ab.sh (and any GPU A/B script of the same kind): the wheels the
# image lacks (.whl/, ../shared/tools/gpu-wheels.sh), the environment, and the benchmark models:
# $MODEL (8B shape, random weights on disk) and $M70 (70B shape, config only: --load-format dummy).
# MODELS="70b" makes only the second.
export PYTHONUNBUFFERED=1 NCCL_NVLS_ENABLE=0
[ -d /tmp/site ] || python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --target /tmp/site .whl/*.whl
export PYTHONPATH=/tmp/site:$PWD PATH=/tmp/site/bin:$PATH TRITON_CACHE_DIR=${TRITON_CACHE_DIR:-/tmp/triton-cache}
MODEL=${MODEL:-/tmp/llama-3.1-8b} M70=${M70:-/tmp/llama-3.1-70b}
case " ${MODELS:-8b 70b} " in *" 8b "*)
  [ -f "$MODEL/config.json" ] || python3 -m services.cli make-model "$MODEL" --preset llama-3.1-8b --dtype bfloat16 \
    --device cuda --seed 0 --quiet ;; esac
[ -f "$M70/config.json" ] || python3 -m services.cli make-model "$M70" --preset llama-3.1-70b --dtype bfloat16 \
  --config-only --quiet
