# W2 (and CPU per output token) of the tree at BASE against this tree, one run each, in one call:
# gpu_bench.sh's w2 stage run from each tree (the base from a git worktree). Needs .whl/.
#   BASE=<sha> bash bench/w2_ab.sh
set -u
OUT=${OUT:-/tmp/inferno-out}
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl || exit 1
rm -rf /tmp/tree-base; git worktree prune
git worktree add -f /tmp/tree-base "${BASE:?}" >/dev/null 2>&1 || { echo "no tree $BASE"; exit 1; }
for t in base:/tmp/tree-base new:$PWD; do
  (cd "${t#*:}" && OUT=$OUT/${t%%:*} SKIP_SETUP=1 W2_RUNS=1 STAGES="w2" bash bench/gpu_bench.sh 2>&1 | tail -3 \
    | sed "s/^/${t%%:*}: /")
done
