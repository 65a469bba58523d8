# The RMS norm fused into the GEMV after it (gemv.add_rmsnorm_linear) against the norm kernel then
# the GEMV, on one GPU in one call: gpu_kernels.py's GEMV checks (gemv_norm: both ways' µs per shape),
# then W1 (bench-engine, batch 1, overlap) twice each way, interleaved. Needs .whl/ (WITH_UCX=0).
#   bash bench/w1_norm_ab.sh
KERNELS="gemv" RUNS="fused1 0 8b
apart1 0 8b INFERNO_FUSED_NORM=0
fused2 0 8b
apart2 0 8b INFERNO_FUSED_NORM=0" MODELS=8b bash bench/w1_ab.sh
grep -h "gemv_norm" "${OUT:-/tmp/inferno-out}/w1ab/kernels_gemv.log" | head -4
