#!/usr/bin/env bash
# Two GPU benchmarks at once on a four-GPU machine (nvidia-h200-x4), each on a pair of GPUs of its
# own: issue 8's prefill/decode split against two mixed workers on GPUs 0-1 (bench/gpu_bench.sh's
# `pd` stage) and issue 10's tensor/pipeline parallelism on GPUs 2-3 (its `tp` stage). A pair of
# one host is what nvidia-h200-x2 lends, so this is one call's worth of both two-GPU benchmarks.
# MULTI=x4 instead runs issue 11's four-GPU parts (the `x4` stage, X4_PARTS) on all four; MULTI=pd2
# runs 1P+1D and 2 mixed workers at once, MULTI=pdab 1P+1D twice (B with PD_B_WORKER_ARGS and the
# environment PD_B_ENV, e.g. "INFERNO_SOME_KNOB=1"). PRE: a command run first (a probe); POST: one run
# after the lanes (on all four GPUs).
# Needs the wheels the image lacks in .whl/ (../shared/tools/gpu-wheels.sh, with UCX).
# Usage: COMMIT=<sha> LANE_SECONDS=520 bash bench/multi_gpu.sh  (write the sha out: on the device,
# `git rev-parse HEAD` gives the landed commit, not the working tree the call carried)
set -uo pipefail
export PYTHONUNBUFFERED=1 NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
OUT=${OUT:-/tmp/inferno-out}; mkdir -p "$OUT"
MODEL=${MODEL:-/tmp/llama-3.1-8b}
export MODEL SKIP_SETUP=1 PACK=0
SECONDS=0
if [ ! -d /tmp/site ]; then
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --target /tmp/site .whl/*.whl || exit 1
fi
export PYTHONPATH=/tmp/site:$PWD PATH=/tmp/site/bin:$PATH
export TRITON_CACHE_DIR=${TRITON_CACHE_DIR:-/tmp/triton-cache}
nvidia-smi --query-gpu=index,name,memory.total,driver_version --format=csv,noheader | tee "$OUT/gpus.txt"
nvidia-smi topo -m > "$OUT/topo.txt" 2>&1
if [ ! -f "$MODEL/config.json" ]; then
  CUDA_VISIBLE_DEVICES=0 python3 -m services.cli make-model "$MODEL" --preset llama-3.1-8b --dtype bfloat16 --device cuda \
    --seed 0 --quiet
  cat "$MODEL"/*.safetensors > /dev/null  # in the page cache for every worker that loads it
fi
echo "setup: ${SECONDS} s"

lane() {  # name, GPUs, stages, extra environment ...
  local name=$1 gpus=$2 stages=$3; shift 3
  mkdir -p "$OUT/$name"
  env CUDA_VISIBLE_DEVICES=$gpus OUT="$OUT/$name" STAGES="$stages" "$@" \
    timeout -k 5 ${LANE_SECONDS:-520} bash bench/gpu_bench.sh > "$OUT/$name.log" 2>&1
  echo "lane $name ended at ${SECONDS} s (code $?)"
}
if [ -n "${PRE:-}" ]; then
  bash -c "$PRE" 2>&1 | tee "$OUT/pre.log" | tail -30
fi
if [ -n "${GPU_TESTS:-}" ]; then  # CPU-tested code that has a CUDA case too
  python3 -m pytest -q -p no:cacheprovider $GPU_TESTS 2>&1 | tail -3
fi
# The pd lanes: worker defaults, every prompt prefilled remotely, a kvstore large enough for W4.
PD=(PD_WORKER_ARGS="${PD_WORKER_ARGS:- }" PD_MIN_PREFILL=${PD_MIN_PREFILL:-1} PD_REQUESTS=${PD_REQUESTS:-200}
    PD_KVSTORE_GB=${PD_KVSTORE_GB:-16} PD_UP_ARGS="${PD_UP_ARGS:-}")  # PD_UP_ARGS: `inferno up` flags of 1P+1D
if [ "${MULTI:-pairs}" = x4 ]; then
  lane x4 0,1,2,3 x4 X4_PARTS="${X4_PARTS:-tp4w1 tp4w2}" &
elif [ "${MULTI:-pairs}" = pd2 ]; then  # 1P+1D on GPUs 0-1 and its baseline, 2 mixed, on GPUs 2-3, at once
  lane pd 0,1 pd PD_MODES=pd PD_PORT=8003 "${PD[@]}" &
  lane mixed 2,3 pd PD_MODES=mixed PD_PORT=8013 "${PD[@]}" &
elif [ "${MULTI:-pairs}" = pdab ]; then  # 1P+1D twice at once: an A/B of worker flags (PD_B_WORKER_ARGS)
  lane pd 0,1 pd PD_MODES=pd PD_PORT=8003 "${PD[@]}" &
  lane pdb 2,3 pd PD_MODES=pd PD_PORT=8013 PD_RUN_TAG=b "${PD[@]}" PD_WORKER_ARGS="${PD_B_WORKER_ARGS:- }" ${PD_B_ENV:-} &
else
  lane pd 0,1 pd "${PD[@]}" PD_W4=1 &
  lane tp 2,3 tp TP_W2_REQUESTS=${TP_W2_REQUESTS:-500} TP_TIMEOUT=${TP_TIMEOUT:-150} &
fi
wait
for d in "$OUT" "$OUT/pd"; do  # the pd lane against the mixed one (pd2), or both modes in one lane
  a=$d/greedy_pd.json; b=$d/greedy_mixed.json; [ -f "$b" ] || b=$OUT/mixed/greedy_mixed.json
  [ -f "$b" ] || b=$OUT/pdb/greedy_pd.json  # pdab: A's 1P+1D against B's
  [ -f "$a" ] && [ -f "$b" ] && python3 bench/greedy_probe.py --compare "$a" "$b"
done
pkill -f "services\.(cli|gateway|scheduler|worker|kvstore)" 2>/dev/null  # anything a lane's timeout left
if [ -n "${POST:-}" ]; then
  bash -c "$POST" 2>&1 | tee "$OUT/post.log" | tail -30
fi
pkill nats-server 2>/dev/null
for d in "$OUT"/*/; do
  echo "== $(basename "$d")"; tail -60 "${d%/}.log" | grep -v '^\s*$' | tail -40
done
mkdir -p "$OUT/runlogs"  # the services' logs of every stack, their last 200 kB each
for d in /tmp/inferno-run*/; do
  for f in "$d"*.log; do [ -f "$f" ] && tail -c 200000 "$f" > "$OUT/runlogs/$(basename "$d")_$(basename "$f")"; done
done
# The device tool brings back at most 8 files: everything in one archive, the lanes' logs and summaries beside it.
rm -rf /tmp/out-rest
(cd "$OUT" && tar czf /tmp/all.tgz $(ls) && mkdir -p /tmp/out-rest && mv * /tmp/out-rest/ && mv /tmp/all.tgz . \
  && for d in /tmp/out-rest/*/; do n=$(basename "$d"); [ -f "$d/summary.json" ] && cp "$d/summary.json" "${n}_summary.json"
     [ -f "/tmp/out-rest/$n.log" ] && cp "/tmp/out-rest/$n.log" "$n.log"; done)
ls -la "$OUT"; echo "total: ${SECONDS} s"
