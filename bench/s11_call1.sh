#!/usr/bin/env bash
# Session 11, call 1: the eager step's CPU and the MLP pieces, then W2 A/B (session start vs this tree), W5b memory.
set -u
source bench/s11_env.sh
nvidia-smi --query-gpu=name,memory.total,memory.used,driver_version --format=csv,noheader | tee $OUT/gpu.txt
nvidia-smi --query-compute-apps=pid,used_memory --format=csv | tee $OUT/apps_start.txt
timeout 300 python3 bench/eager_cpu_probe.py /tmp/llama-3.1-8b 8192 0,4096,2048 2>&1 | grep -v '\[info\|\[debug' | tee $OUT/eager_cpu_probe.txt
echo "probe done ${SECONDS}s"
BASE=515e603 W2_RUNS=2 ORDER="new base" timeout 420 bash bench/w2_ab.sh 2>&1 | tail -12
echo "w2 ab done ${SECONDS}s"
for t in new base; do echo "$t: $(cut -c1-700 $OUT/$t/kv_pool.log)"; done
for t in new base; do for f in $OUT/$t/w2*.json; do python3 -c "
import json,sys; d=json.load(open(sys.argv[1])); s=d['summary']; c=d['cpu']
print(sys.argv[1], round(s['total_throughput']), 'tok/s', round(c['total_us_per_token'],1), 'us/tok', {k: round(v,1) for k,v in c['us_per_token'].items()})" $f 2>/dev/null; done; done
