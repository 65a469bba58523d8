# The sampler's second read, split over chunks (small batches) or the row program's (large), on one
# GPU in one call: no variant compiles after the worker's warm-up (1..1,024 rows, both dtypes); each
# way timed at B = 1, 64 and 256 in bf16 (the engine's logits) and at B = 256 in fp32; the checks; the
# kernel tests compiled for the GPU. Output lines go to stdout, files to $OUT.
#   bash bench/collect_ab.sh
set -u
export PYTHONUNBUFFERED=1 TRITON_CACHE_DIR=${TRITON_CACHE_DIR:-/tmp/triton-cache}
OUT=${OUT:-/tmp}
nvidia-smi --query-gpu=name,clocks.max.sm,power.limit --format=csv,noheader
python3 bench/sampler_compile_probe.py 128256 1024 2>&1 | tail -4 | tee "$OUT/sampler_compile_probe.txt"
for rows in 1 64 256; do
  python3 bench/sampling_variants.py --rows $rows --collect-splits 0 --bf16 "rows-B$rows-bf16" | head -1
  python3 bench/sampling_variants.py --rows $rows --collect-splits 8 --bf16 "chunks-B$rows-bf16" | head -1
done
python3 bench/sampling_variants.py --bf16 "auto-B256-bf16" | tail -2
python3 bench/sampling_variants.py "auto-B256-fp32" | head -1
python3 bench/gpu_kernels.py --only sampl --out "$OUT/kernels_sampling.json" 2>&1 | tail -29
TRITON_INTERPRET=0 timeout ${TEST_S:-200} python3 -m pytest -x -q tests/kernels/test_sampling_kernel.py 2>&1 | tail -3
