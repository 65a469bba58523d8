# W5b A/B of several trees in one call: process start → first token, interleaved, after one first
# start that fills the Triton cache; then (AFTER) gpu_bench.sh stages of this tree, e.g. "w1x w2".
# Needs .whl/ (WITH_UCX=0 ../shared/tools/gpu-wheels.sh).
#   TREES="base:<sha> early:. variant:.:edit.sh" RUNS=3 AFTER="" bash bench/w5b_ab.sh
# (a tree is a commit, or "." this working tree; a script named after it edits a copy of it)
set -u
export PYTHONUNBUFFERED=1 TRITON_CACHE_DIR=${TRITON_CACHE_DIR:-/tmp/triton-cache}
OUT=${OUT:-/tmp/inferno-out}; mkdir -p "$OUT"
MODEL=${MODEL:-/tmp/llama-3.1-8b}
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl || exit 1
export PATH=/tmp/site/bin:$PATH
[ -f "$MODEL/config.json" ] || PYTHONPATH=/tmp/site:$PWD python3 -m services.cli make-model "$MODEL" \
  --preset llama-3.1-8b --dtype bfloat16 --device cuda --seed 0 --quiet
start() {  # $1: tree, $2: label; one JSON line per start to w5b_ab.jsonl, a summary line to stdout
  (cd "$1" && PYTHONPATH=/tmp/site:$1 python3 bench/cold_start.py "$MODEL" --max-num-seqs 256 2>/dev/null) \
    | grep '^{' | sed "s/^{/{\"tree\": \"$2\", /" | tee -a "$OUT/w5b_ab.jsonl" | python3 -c "
import json, sys
r = json.loads(sys.stdin.read()); b = r['breakdown']
print(r['tree'], round(r['start_to_first_token_s'], 2), *(f'{k} {b.get(k)}' for k in ('imports_s', 'device_s',
      'context_s', 'staging_s', 'weights_s', 'kv_s', 'early_device_s', 'early_staging')))"
}
dirs=()
for t in ${TREES:-"early:."}; do
  IFS=: read -r label sha patch <<< "$t"
  rm -rf "/tmp/tree-$label"; git worktree prune
  if [ "$sha" = . ] && [ -z "$patch" ]; then dirs+=("$label:$PWD"); continue; fi
  if [ "$sha" = . ]; then cp -a "$PWD" "/tmp/tree-$label"; else
    git worktree add -f "/tmp/tree-$label" "$sha" >/dev/null 2>&1 || { echo "no tree $sha"; exit 1; }; fi
  [ -z "$patch" ] || (cd "/tmp/tree-$label" && bash "$OLDPWD/$patch") || { echo "edit $patch failed"; exit 1; }
  dirs+=("$label:/tmp/tree-$label")
done
start "$PWD" first-start
for i in $(seq 1 "${RUNS:-3}"); do for d in "${dirs[@]}"; do start "${d#*:}" "${d%%:*}"; done; done
python3 - "$OUT/w5b_ab.jsonl" <<'PY'
import json, sys, statistics as st
rows = [json.loads(l) for l in open(sys.argv[1])]
for tree in dict.fromkeys(r["tree"] for r in rows if r["tree"] != "first-start"):
    rs = [r for r in rows if r["tree"] == tree]
    f = lambda k: st.median(r["breakdown"].get(k) or 0 for r in rs)
    print(f"{tree:10s} first token median {st.median(r['start_to_first_token_s'] for r in rs):.2f} s of {len(rs)}; "
          f"imports {f('imports_s'):.2f} device {f('device_s'):.2f} weights {f('weights_s'):.2f} kv {f('kv_s'):.2f}")
PY
[ -n "${AFTER:-}" ] && SKIP_SETUP=1 W2_RUNS=1 STAGES="$AFTER" bash bench/gpu_bench.sh 2>&1 | tail -8
