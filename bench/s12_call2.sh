#!/usr/bin/env bash
# Session 12, call 2: W1 (--overlap) of 5425786 against this tree, interleaved (the numpy staging of
# decode graph inputs at batch 1); then bench/profiles/w2_profile.sh (W2 with per-thread CPU and
# py-spy flame graphs of worker and gateway) on this tree.
set -u
source bench/s11_env.sh
rm -rf /tmp/tree-base; git worktree prune; git worktree add -f /tmp/tree-base 5425786 >/dev/null 2>&1 || echo "no base tree"
for tree in base new base new; do
  dir=$PWD; [ $tree = base ] && dir=/tmp/tree-base
  (cd $dir && PYTHONPATH=/tmp/site:$dir python3 -m services.cli bench-engine --model /tmp/llama-3.1-8b --batch-size 1 \
    --prompt-len 128 --decode-tokens 256 --json --overlap 2>/dev/null | tail -1) > $OUT/w1x_$tree.json
  python3 -c "import json,sys; d=json.load(open(sys.argv[1])); print(sys.argv[2], 'W1 --overlap %.1f tok/s' % d['decode_tokens_per_s'])" $OUT/w1x_$tree.json $tree
  cp $OUT/w1x_$tree.json $OUT/w1x_${tree}_$SECONDS.json
done
echo "W1 A/B done ${SECONDS}s"
WHL=.whl-w2 RAW=0 bash bench/profiles/w2_profile.sh 2>&1 | tail -45
echo "profile done ${SECONDS}s"
