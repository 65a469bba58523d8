set -u
export PYTHONUNBUFFERED=1
rm -rf /tmp/tree-base; git worktree prune; git worktree add -f /tmp/tree-base 1869543 >/dev/null 2>&1
echo "== compile probe, empty Triton caches: base (serial warm-up) then this tree (threads)"
(cd /tmp/tree-base && TRITON_CACHE_DIR=/tmp/tc-base python3 bench/sampler_compile_probe.py 128256 1024 2>&1 | tail -1)
TRITON_CACHE_DIR=/tmp/tc-new python3 bench/sampler_compile_probe.py 128256 1024 2>&1 | tail -1
echo "== a worker's first start (empty cache), then a second"
TREES="early:." RUNS=1 bash bench/w5b_ab.sh 2>&1 | tail -3
