#!/usr/bin/env bash
# W1 (bench-engine, batch 1, 256 tokens, --overlap) A/B runs on one or two GPUs, in one call: each
# line of RUNS is "tag GPUs model environment-or-flags...", model 8b or 70b (dummy weights); words
# with "=" set the run's environment (INFERNO_PDL=0), the rest are bench-engine flags. Before them,
# optionally: ALLREDUCE=1 checks and times the two all-reduce kernels (custom_allreduce_check.py), and
# KERNELS="gemv rmsnorm" runs gpu_kernels.py's checks of those kernels. The table at the end gives
# tok/s, ms/step, the ratio to the TP=1 run of the same environment (tag tp1*) and how many of the
# first 32 greedy tokens equal the first run of the same model and split.
# Usage: RUNS="$(cat runs.txt)" bash bench/w1_ab.sh  (needs .whl/ from ../shared/tools/gpu-wheels.sh)
set -uo pipefail
OUT=${OUT:-/tmp/inferno-out}/w1ab; mkdir -p "$OUT"
SECONDS=0
nvidia-smi --query-gpu=index,name,memory.total --format=csv,noheader | tee "$OUT/gpus.txt"
source bench/gpu_env.sh
echo "models at ${SECONDS} s"
if [ -n "${KERNELS:-}" ]; then
  for k in $KERNELS; do
    timeout 300 python3 bench/gpu_kernels.py --only "$k" --out "$OUT/kernels_$k.json" > "$OUT/kernels_$k.log" 2>&1
    grep -E "checks passed|FAIL|^(ok|FAIL) " "$OUT/kernels_$k.log" | grep -v "^ok" | tail -5
  done
  echo "kernels at ${SECONDS} s"
fi
if [ "${ALLREDUCE:-0}" = 1 ]; then
  timeout 150 python3 bench/custom_allreduce_check.py --ranks 2 --mode procs > "$OUT/allreduce.log" 2>&1
  grep '^{' "$OUT/allreduce.log" > "$OUT/allreduce.jsonl"
  python3 - "$OUT/allreduce.jsonl" <<'PY' || { tail -30 "$OUT/allreduce.log"; exit 1; }
import json, sys
rows = [json.loads(l) for l in open(sys.argv[1])]
bad = [r for r in rows if r.get("ranks_failed") or "error" in r]
print(f"all-reduce checks: {sum('kernel' in r for r in rows)} rows, {len(bad)} failed {bad[:2]}")
for r in rows:
    if r.get("kernel") == "push":
        o = next((x for x in rows if x.get("kernel") == "one_shot" and x["bytes"] == r["bytes"] and x["dtype"] == r["dtype"]), {})
        print(f"  {r['dtype']:9} {r['bytes']:>8} B: push {r['graph_us']:6.2f} us, one-shot {o.get('graph_us', 0):6.2f}, "
              f"NCCL {r.get('nccl_graph_us', 0):6.2f}")
sys.exit(1 if bad or not rows else 0)  # a kernel that hangs would spend every W1 run's timeout
PY
  echo "all-reduce at ${SECONDS} s"
fi
TAGS=()
while read -r tag gpus model rest; do
  [ -z "${tag:-}" ] && continue
  envs=(); flags=()
  for w in $rest; do case $w in *=*) envs+=("$w") ;; *) flags+=("$w") ;; esac; done
  path=$MODEL; dummy=; [ "$model" = 70b ] && { path=$M70; dummy="--load-format dummy"; }
  env CUDA_VISIBLE_DEVICES=$gpus "${envs[@]}" timeout ${W1_TIMEOUT:-200} python3 -m services.cli bench-engine \
    --model "$path" $dummy --batch-size 1 --prompt-len 128 --decode-tokens 256 --json --overlap "${flags[@]}" \
    > "$OUT/$tag.log" 2>&1
  grep '^{' "$OUT/$tag.log" | tail -1 > "$OUT/$tag.json"
  echo "$model $gpus ${envs[*]} ${flags[*]}" > "$OUT/$tag.what"
  TAGS+=("$tag")
  echo "$tag done at ${SECONDS} s"
done <<< "${RUNS:-}"
python3 - "$OUT" "${TAGS[@]}" <<'PY'
import json, sys
out, tags = sys.argv[1], sys.argv[2:]
rows = {}
for tag in tags:
    try:
        r = json.load(open(f"{out}/{tag}.json"))
    except (OSError, ValueError):
        r = {}
    what = open(f"{out}/{tag}.what").read().split()
    if "decode_tokens_per_s" not in r:
        print(f"{tag}: no result (see {tag}.log)")
        continue
    r["what"] = " ".join(what)
    rows[tag] = r
first = {}
for tag, r in rows.items():
    model = r["what"].split()[0]
    words = r["what"].split()
    tp = words[words.index("--tensor-parallel-size") + 1] if "--tensor-parallel-size" in words else "1"
    base = first.setdefault((model, tp), r)
    envs = " ".join(w for w in r["what"].split()[2:] if "=" in w)
    tp1 = next((x for t, x in rows.items() if t.startswith("tp1") and
                " ".join(w for w in x["what"].split()[2:] if "=" in w) == envs), None)
    ratio = f" {r['decode_tokens_per_s'] / tp1['decode_tokens_per_s']:.3f} x TP=1" if tp1 and model == "8b" and r is not tp1 else ""
    same = sum(a == b for a, b in zip(r["first_tokens"], base["first_tokens"]))
    print(f"{tag:14} {r['decode_tokens_per_s']:7.1f} tok/s {r['decode_step_ms']:6.3f} ms/step{ratio:16} "
          f"tokens {same}/{len(r['first_tokens'])}  [{r['what']}]")
json.dump(rows, open(f"{out}/summary.json", "w"))
PY
