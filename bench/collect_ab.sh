# The sampler's second read (split over chunks of the row, sampling_collect.py) against the row
# program's alone (--collect-splits 0), on one GPU in one call: each way at B = 1, 64 and 256 in bf16
# (the engine's logits) and at B = 256 in fp32; the checks; no variant compiled after the worker's
# warm-up (1..1,024 rows, both dtypes); the kernel tests compiled for the GPU (as far as TEST_S lets
# them). Output lines go to stdout, files to $OUT.
#   bash bench/collect_ab.sh
set -u
export PYTHONUNBUFFERED=1 TRITON_CACHE_DIR=${TRITON_CACHE_DIR:-/tmp/triton-cache}
OUT=${OUT:-/tmp}
nvidia-smi --query-gpu=name,clocks.max.sm,power.limit --format=csv,noheader
for rows in 256 64 1; do
  python3 bench/sampling_variants.py --rows $rows --collect-splits 0 --bf16 "rows-B$rows-bf16" | head -1
  python3 bench/sampling_variants.py --rows $rows --bf16 "new-B$rows-bf16" | tail -2
done
python3 bench/sampling_variants.py --collect-splits 0 "rows-B256-fp32" | head -1
python3 bench/sampling_variants.py "new-B256-fp32" | head -1
python3 bench/gpu_kernels.py --only sampl --out "$OUT/kernels_sampling.json" 2>&1 | tail -29
python3 bench/sampler_compile_probe.py 128256 1024 2>&1 | tail -4 | tee "$OUT/sampler_compile_probe.txt"
TRITON_INTERPRET=0 timeout "${TEST_S:-200}" python3 -m pytest -x -q tests/kernels/test_sampling_kernel.py 2>&1 | tail -3
