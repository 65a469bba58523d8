# W2 (and CPU per output token) of the tree at BASE against this tree, one run each, in one call:
# gpu_bench.sh's w2 stage run from each tree (the base from a git worktree). Needs .whl/.
#   BASE=<sha> [COLD=1] [ORDER="new base"] [W2_RUNS=2] bash bench/w2_ab.sh
set -u
OUT=${OUT:-/tmp/inferno-out}
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl || exit 1
rm -rf /tmp/tree-base; git worktree prune
git worktree add -f /tmp/tree-base "${BASE:?}" >/dev/null 2>&1 || { echo "no tree $BASE"; exit 1; }
ORDER=${ORDER:-"base new"}  # "new base": the other order, for the host's drift
for name in $ORDER; do
  t=$name:$([ $name = base ] && echo /tmp/tree-base || echo "$PWD")
  # COLD=1: each tree compiles into a Triton cache of its own, as a new machine's first worker does.
  cache=/tmp/triton-cache; [ "${COLD:-0}" = 1 ] && cache=/tmp/triton-cache-${t%%:*}
  (cd "${t#*:}" && TRITON_CACHE_DIR=$cache OUT=$OUT/${t%%:*} SKIP_SETUP=1 W2_RUNS=${W2_RUNS:-1} STAGES="w2" \
    bash bench/gpu_bench.sh 2>&1 | tail -4 | sed "s/^/${t%%:*}: /")
  grep -h "kv pool sized" /tmp/inferno-run/worker-0.log > "$OUT/${t%%:*}/kv_pool.log" 2>/dev/null  # the next tree's run removes it
done
