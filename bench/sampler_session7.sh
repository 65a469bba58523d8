export TRITON_CACHE_DIR=/tmp/tc PYTHONUNBUFFERED=1
nvidia-smi --query-gpu=name,clocks.max.sm,power.limit --format=csv,noheader
git log --oneline -1
echo "== compile probe"; python3 bench/sampler_compile_probe.py 128256 1024 2>&1 | tail -5
echo "== variants"; python3 bench/sampling_variants.py --rows 256 --collect-splits 0 --bf16 rows-B256 | head -1
python3 bench/sampling_variants.py --rows 256 --collect-splits 8 --bf16 chunks-B256
echo "== per kernel"; python3 bench/sampling_kernels_probe.py 256 rows bf16 rows; python3 bench/sampling_kernels_probe.py 256 chunks bf16 chunks
echo "== compiled tests"; TRITON_INTERPRET=0 timeout 330 python3 -m pytest -q tests/kernels/test_sampling_kernel.py 2>&1 | tail -5
