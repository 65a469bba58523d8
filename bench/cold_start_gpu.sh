#!/usr/bin/env bash
# Issue 38, part 1: the 8B worker's start with an empty Triton cache, without and with the kernel
# manifest beside the model (services/worker/kernel_manifest.py, `--kernel-manifest auto`), then warm;
# the weights in the page cache (written just before) unless said. Each with a cache directory of its own:
#   1. process start -> first token, empty cache, no manifest (`off`: a model's first start on a volume);
#   2. `inferno warm-kernels` records the manifest beside the model (its time: the serial compile again);
#   3. process start -> first token, empty cache, the manifest found beside the model and replayed by
#      helper processes (the default: every later replica's start on a fresh machine);
#   4. the same again with 3's cache (warm);
#   5. the replay alone into an empty cache (`python -m services.worker.kernel_manifest`, its --jobs);
#   6. the drive's read floor for the weights, then a start with the page cache dropped (warm Triton cache);
#   7. with two GPUs (and WITH_70B=1, the default): the 70B TP=2 start (--load-format dummy), empty cache then warm.
# Targets (H200, 8B bf16): empty cache <= 12 s to the first token, warm <= 6 s, page cache dropped <=
# the drive's floor + 3 s. Worker defaults (--max-num-seqs 1024 on a GPU). Needs .whl/
# (WITH_UCX=0 ../shared/tools/gpu-wheels.sh). Usage: COMMIT=<sha> bash bench/cold_start_gpu.sh
set -uo pipefail
export PYTHONUNBUFFERED=1
OUT=${OUT:-/tmp/inferno-out}; mkdir -p "$OUT"
RAW=/tmp/cold-raw; rm -rf "$RAW" /tmp/tc-*; mkdir -p "$RAW"
SECONDS=0
[ -d /tmp/site ] || python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --target /tmp/site .whl/*.whl
export PYTHONPATH=/tmp/site:$PWD PATH=/tmp/site/bin:$PATH
nvidia-smi --query-gpu=name,memory.total --format=csv,noheader | tee "$RAW/gpu.txt"
nproc > "$RAW/cores.txt"
M=/tmp/llama-3.1-8b MAN=/tmp/llama-3.1-8b/.inferno-kernels.json FLAGS="--max-num-seqs 1024"
[ -f $M/config.json ] || TRITON_CACHE_DIR=/tmp/tc-make python3 -m services.cli make-model $M --preset llama-3.1-8b \
  --dtype bfloat16 --device cuda --seed 0 --quiet
rm -f $MAN
echo "model at ${SECONDS} s"
TRITON_CACHE_DIR=/tmp/tc-1 timeout 240 python3 bench/cold_start.py $M $FLAGS --kernel-manifest off | tail -1 \
  > "$RAW/1_empty.json"
echo "1 (empty cache) at ${SECONDS} s: $(head -c 160 $RAW/1_empty.json)"
t=$SECONDS
TRITON_CACHE_DIR=/tmp/tc-2 timeout 240 python3 -m services.cli warm-kernels --model-dir $M --device cuda $FLAGS \
  2>&1 | grep "inferno warm-kernels" | tee "$RAW/2_record.txt"
echo "2 (record) $((SECONDS - t)) s"
TRITON_CACHE_DIR=/tmp/tc-3 timeout 240 python3 bench/cold_start.py $M $FLAGS | tail -1 > "$RAW/3_manifest.json"
echo "3 (empty cache, manifest) at ${SECONDS} s: $(head -c 160 $RAW/3_manifest.json)"
TRITON_CACHE_DIR=/tmp/tc-3 timeout 240 python3 bench/cold_start.py $M $FLAGS | tail -1 > "$RAW/4_warm.json"
echo "4 (warm cache) at ${SECONDS} s: $(head -c 160 $RAW/4_warm.json)"
TRITON_CACHE_DIR=/tmp/tc-5 timeout 240 python3 -m services.worker.kernel_manifest $MAN 2>/dev/null | tail -1 \
  > "$RAW/5_replay.json"
echo "5 (replay alone): $(cat $RAW/5_replay.json)"
python3 - $M > "$RAW/6_floor.json" <<'PY'
import glob, json, sys, time
from pathlib import Path
Path("/proc/sys/vm/drop_caches").write_text("3\n")
t0, n = time.perf_counter(), 0
for f in sorted(glob.glob(f"{sys.argv[1]}/*.safetensors")):
    with open(f, "rb", buffering=0) as h:
        while chunk := h.read(64 << 20):
            n += len(chunk)
s = time.perf_counter() - t0
print(json.dumps({"bytes": n, "seconds": round(s, 2), "gb_s": round(n / s / 1e9, 2)}))
PY
echo "6 (drive floor): $(cat $RAW/6_floor.json)"
TRITON_CACHE_DIR=/tmp/tc-3 timeout 240 python3 bench/cold_start.py $M $FLAGS --drop-caches | tail -1 > "$RAW/6_dropped.json"
echo "6 (page cache dropped) at ${SECONDS} s: $(head -c 160 $RAW/6_dropped.json)"
if [ "${WITH_70B:-1}" = 1 ] && [ "$(nvidia-smi -L | wc -l)" -ge 2 ]; then
  M70=/tmp/llama-3.1-70b
  [ -f $M70/config.json ] || python3 -m services.cli make-model $M70 --preset llama-3.1-70b --dtype bfloat16 --config-only --quiet
  for k in 7_70b_empty 7_70b_warm; do
    TRITON_CACHE_DIR=/tmp/tc-7 timeout 300 python3 bench/cold_start.py $M70 $FLAGS --tensor-parallel-size 2 \
      --load-format dummy --kernel-manifest off | tail -1 > "$RAW/$k.json"
    echo "$k at ${SECONDS} s: $(head -c 160 $RAW/$k.json)"
  done
fi
python3 - "$RAW" "$OUT" "${COMMIT:-?}" <<'PY' | tee "$OUT/summary.txt"
import json, sys
raw, out, commit = sys.argv[1:]
print(open(f"{raw}/gpu.txt").read().strip(), f"({open(f'{raw}/cores.txt').read().strip()} cores) | commit {commit}")
result = {}
for tag, label in (("1_empty", "empty cache"), ("3_manifest", "empty cache + manifest"), ("4_warm", "warm cache"),
                   ("6_dropped", "page cache dropped"), ("7_70b_empty", "70B TP=2 empty cache"),
                   ("7_70b_warm", "70B TP=2 warm cache")):
    try:
        r = json.load(open(f"{raw}/{tag}.json"))
    except Exception as e:
        print(f"{label}: no result ({e})"); continue
    result[tag] = r
    print(f"{label:24} ready {r['start_to_ready_s']:6.1f} s  first token {r['start_to_first_token_s']:6.1f} s  "
          f"imports {r['imports_s']}  weights {r['load_weights_s']}  kv {r['kv_s']}  graphs {r['graph_capture_s']}  "
          f"dry head {r['memory'].get('dry_head_s')}")
try:
    result["replay"] = json.load(open(f"{raw}/5_replay.json"))
    print("replay alone:", {k: result["replay"][k] for k in ("compiled", "failed_count", "seconds", "jobs")})
except Exception as e:
    print("replay alone: no result", e)
try:
    result["floor"] = json.load(open(f"{raw}/6_floor.json"))
    print(f"drive floor: {result['floor']['bytes'] / 1e9:.2f} GB in {result['floor']['seconds']} s "
          f"({result['floor']['gb_s']} GB/s)")
except Exception as e:
    print("drive floor: no result", e)
result["record"] = open(f"{raw}/2_record.txt").read().strip()
print(result["record"])
print("targets: empty cache <= 12 s, warm <= 6 s to the first token, page cache dropped <= floor + 3 s")
json.dump(result, open(f"{out}/cold_start.json", "w"), indent=1)
PY
echo "total: ${SECONDS} s"
