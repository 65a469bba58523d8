#!/usr/bin/env bash
# --fused-all-reduce-norm (default since 2026-11-27: the one-shot all-reduce, residual add and RMSNorm in one kernel) against
# the plain one-shot all-reduce at W1 (bench-engine, batch 1), on a four-GPU machine: 8B TP=1 and
# TP=2 on GPUs 0-1 while the 70B shape (dummy weights) runs TP=2 on GPUs 2-3, then 70B TP=4 on all
# four. First tokens compared with the plain run's; the one-shot kernel's exactness check first.
# Usage: bash bench/fused_norm_ab.sh  (after bench/multi_gpu.sh's setup, or as its POST)
set -uo pipefail
OUT=${OUT:-/tmp/inferno-out}/fused; mkdir -p "$OUT"
source bench/gpu_env.sh
SECONDS=0
timeout 120 python3 bench/custom_allreduce_check.py --ranks 2 --mode procs 2>&1 | grep '^{' > "$OUT/custom_allreduce.jsonl"
tail -2 "$OUT/custom_allreduce.jsonl"
w1() {  # tag, GPUs, model, flags...
  local tag=$1 gpus=$2 model=$3; shift 3
  local dummy=; [ "$model" = "$M70" ] && dummy="--load-format dummy"
  CUDA_VISIBLE_DEVICES=$gpus timeout ${W1_TIMEOUT:-200} python3 -m services.cli bench-engine --model "$model" $dummy \
    --batch-size 1 --prompt-len 128 --decode-tokens 256 --json --overlap "$@" > "$OUT/$tag.log" 2>&1
  grep '^{' "$OUT/$tag.log" | tail -1 > "$OUT/$tag.json"
  echo "$tag done at ${SECONDS} s"
}
(w1 8b_tp1 0 "$MODEL"; w1 8b_tp2 0,1 "$MODEL" --tensor-parallel-size 2 --no-fused-all-reduce-norm
 w1 8b_tp2_fused 0,1 "$MODEL" --tensor-parallel-size 2 --fused-all-reduce-norm) &
(w1 70b_tp2 2,3 "$M70" --tensor-parallel-size 2 --no-fused-all-reduce-norm; w1 70b_tp2_fused 2,3 "$M70" --tensor-parallel-size 2 --fused-all-reduce-norm) &
wait
w1 70b_tp4 0,1,2,3 "$M70" --tensor-parallel-size 4 --no-fused-all-reduce-norm
w1 70b_tp4_fused 0,1,2,3 "$M70" --tensor-parallel-size 4 --fused-all-reduce-norm
python3 - "$OUT" <<'PY'
import json, sys
rows = {}
for tag in ("8b_tp1", "8b_tp2", "8b_tp2_fused", "70b_tp2", "70b_tp2_fused", "70b_tp4", "70b_tp4_fused"):
    try:
        rows[tag] = json.load(open(f"{sys.argv[1]}/{tag}.json"))
    except (OSError, ValueError):
        print(f"{tag}: no result (see {tag}.log)")
for tag, r in rows.items():
    base = rows.get(tag.removesuffix("_fused"), r)
    same = sum(a == b for a, b in zip(r["first_tokens"], base["first_tokens"]))
    print(f"W1 {tag}: {r['decode_tokens_per_s']:.1f} tok/s, {r['decode_step_ms']:.3f} ms/step, "
          f"first tokens equal to the plain run's: {same}/{len(r['first_tokens'])}")
json.dump(rows, open(f"{sys.argv[1]}/summary.json", "w"))
PY
