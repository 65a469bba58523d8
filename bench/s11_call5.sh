#!/usr/bin/env bash
# Session 11, call 5 (warm machine): the memory probe after the fix; W1 A/B of 1bfbff1 (ninth, 178.1) against this tree.
set -u
source bench/s11_env.sh
timeout 200 python3 bench/memory_probe.py /tmp/llama-3.1-8b 1024 8192 2>&1 | grep -v '\[info\|\[debug' | cut -c1-420 | tee $OUT/memory_probe.txt
rm -rf /tmp/tree-old; git worktree prune; git worktree add -f /tmp/tree-old ${OLD:-1bfbff1} >/dev/null 2>&1
for i in 1 2; do for t in old:/tmp/tree-old new:$PWD; do
  (cd ${t#*:} && PYTHONPATH=/tmp/site:$PWD python3 -m services.cli bench-engine --model /tmp/llama-3.1-8b --batch-size 1 --prompt-len 128 --decode-tokens 256 --json 2>/dev/null | tail -1 | python3 -c "import json,sys; d=json.load(sys.stdin); print('${t%%:*}', round(d['decode_tokens_per_s'],1), 'tok/s', round(d['decode_step_ms'],3), 'ms', 'kv', d.get('kv_gib'))")
done; done | tee $OUT/w1_ab.txt
