# Sampler A/B on one GPU in one call: bench/sampling_variants.py from each tree, fp32 and bf16 logits,
# two runs each, then the per-kernel probe and the checks of the working tree.
#   TREES="head:.exp_head new:." bash bench/sampling_ab.sh      (a tree: a copy of services/ and bench/)
# Prints one line per run; the probe's and the checks' output go to $OUT when set.
set -u
export PYTHONUNBUFFERED=1 TRITON_CACHE_DIR=${TRITON_CACHE_DIR:-/tmp/triton-cache}
OUT=${OUT:-/tmp}
for run in 1 2; do
  for t in ${TREES:-new:.}; do
    label=${t%%:*} dir=${t#*:}
    (cd "$dir" && python3 bench/sampling_variants.py "$label-fp32" && python3 bench/sampling_variants.py --bf16 "$label-bf16")
  done
done
python3 bench/sampling_kernels_probe.py 256 new-bf16 bf16 | tee "$OUT/sampling_kernels_probe.txt"
python3 bench/gpu_kernels.py --only sampl --out "$OUT/kernels_sampling.json" | tail -30
