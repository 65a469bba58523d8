#!/usr/bin/env bash
# Issue 37 on one GPU: DeepSeek-architecture models with latent attention. A tiny DeepSeek-V3 on the GPU
# (Triton, CUDA graphs) against the CPU's torch path; W1 (batch-1 decode, bench-engine --overlap) of
# moonlight-16b-a3b and deepseek-v2-lite against their rooflines (active bytes over the measured HBM
# copy rate); the KV tokens their workers size against `inferno plan` with the same flags, and against
# pages of MHA's size; W2 of moonlight through HTTP. Random weights drawn on the device (--load-format
# dummy; make-model --config-only). Ends with one table (summary.txt, mla.json).
# The MLA decode kernel alone: python3 bench/mla_decode_bench.py. Needs .whl/: WITH_UCX=0 ../shared/tools/gpu-wheels.sh.
# Usage: COMMIT=<sha> [W1_MODELS="moonlight-16b-a3b deepseek-v2-lite"] [W2=0] bash bench/mla_gpu.sh
set -uo pipefail
export PYTHONUNBUFFERED=1
OUT=${OUT:-/tmp/inferno-out}; mkdir -p "$OUT"
RAW=/tmp/mla-raw; rm -rf "$RAW"; mkdir -p "$RAW"
SECONDS=0
[ -d /tmp/site ] || python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --target /tmp/site .whl/*.whl
export PYTHONPATH=/tmp/site:$PWD PATH=/tmp/site/bin:$PATH TRITON_CACHE_DIR=/tmp/triton-cache
W1_MODELS=${W1_MODELS:-moonlight-16b-a3b deepseek-v2-lite}
nvidia-smi --query-gpu=name,memory.total --format=csv,noheader | tee "$RAW/gpu.txt"
for preset in $W1_MODELS; do
  [ -f /tmp/$preset/config.json ] || python3 -m services.cli make-model /tmp/$preset --preset $preset --config-only --quiet
done
python3 bench/hbm_copy.py > "$RAW/hbm.txt"
echo "HBM copy $(cat $RAW/hbm.txt) TB/s"
timeout 150 python3 - > "$RAW/parity.txt" 2>"$RAW/parity.err" <<'PY'
# Greedy tokens of tiny DeepSeek-V3 and -V2 (float32): the GPU's Triton kernels under CUDA graphs
# (prefill in the expanded form, decode in the absorbed kernel) against the CPU's torch path.
import tempfile
from inferno.tools.make_model import write_model
from services.worker.engine.engine import LLMEngine
from services.worker.engine.engine_config import EngineConfig
from shared.sampling_params import SamplingParams
params = SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True)
prompts = [[5 + (i * 7 + j) % 900 for j in range(n)] for i, n in enumerate([3, 40, 130])]
for arch in ("DeepseekV3ForCausalLM", "DeepseekV2ForCausalLM"):
    d = write_model(tempfile.mkdtemp() + "/m", arch=arch, preset="tiny", seed=4, dtype="float32")
    out = {dev: LLMEngine(EngineConfig(model_dir=str(d), device=dev, dtype="float32", num_blocks=128,
                                       max_num_seqs=8)).generate(prompts, params) for dev in ("cuda", "cpu")}
    same = sum(a == b for a, b in zip(out["cuda"], out["cpu"]))
    print(f"{arch}: {same}/{len(prompts)} greedy sequences equal")
PY
cat "$RAW/parity.txt"; [ -s "$RAW/parity.txt" ] || tail -5 "$RAW/parity.err"
echo "parity done at ${SECONDS} s"
for preset in $W1_MODELS; do
  timeout 200 python3 -m services.cli bench-engine --model /tmp/$preset --device cuda --load-format dummy --batch-size 1 \
    --prompt-len 128 --decode-tokens 256 --overlap --json 2>"$RAW/w1_$preset.err" | tail -1 > "$RAW/w1_$preset.json"
  [ -s "$RAW/w1_$preset.json" ] || tail -20 "$RAW/w1_$preset.err"
  python3 -m services.cli plan /tmp/$preset --gpus 1xH200 --max-num-seqs 1 --json > "$RAW/plan_w1_$preset.json" 2>&1
  echo "W1 $preset done at ${SECONDS} s"
done
if [ "${W2:-1}" = 1 ]; then
  preset=moonlight-16b-a3b; run=/tmp/run-$preset; rm -rf "$run"
  python3 -m services.cli up --model /tmp/$preset --device cuda --port 8001 --nats-port 4333 --run-dir "$run" \
    --kvstore-capacity-gb 0 --worker-arg=--load-format=dummy > "$RAW/up.log" 2>&1 &
  UP=$!
  for _ in $(seq 240); do curl -sf localhost:8001/ready > /dev/null 2>&1 && break; sleep 1; done
  for _ in $(seq 120); do grep -q "graphs captured" "$run"/worker-0.log 2>/dev/null && break; sleep 0.5; done
  [ -f "$run/pids.json" ] || { echo "the stack did not start:"; tail -5 "$RAW/up.log"; tail -20 "$run"/worker-0.log; }
  python3 -m services.cli plan /tmp/$preset --gpus 1xH200 --json > "$RAW/plan_w2.json" 2>&1
  grep -h "kv pool sized" "$run"/worker-0.log | tail -1 > "$RAW/w2_pool.txt"
  python3 -m services.cli bench --base-url http://127.0.0.1:8001 --num-requests 100 --vocab-size 128000 --seed 7 \
    --no-progress --out "$RAW/warmup.json" > /dev/null 2>&1
  timeout 180 python3 -m services.cli bench --base-url http://127.0.0.1:8001 --num-requests 1000 --vocab-size 128000 \
    --seed 101 --no-progress --pids-file "$run/pids.json" --out "$RAW/w2.json" 2>&1 | tail -2
  kill -INT $UP; wait $UP
  echo "W2 done at ${SECONDS} s"
fi
python3 - "$RAW" "$OUT" "${COMMIT:-?}" "$W1_MODELS" <<'PY' | tee "$OUT/summary.txt"
import json, os, re, sys
import torch
sys.path.insert(0, os.getcwd())
from services.worker.engine.kv_cache import kv_bytes_per_block
from services.worker.engine.model import DecoderLM
from services.worker.engine.model_config import ModelConfig
from services.worker.engine.ops import TorchOps
raw, out, commit, models = sys.argv[1:]
hbm = float(open(f"{raw}/hbm.txt").read())
print(f"{open(f'{raw}/gpu.txt').read().strip()}, commit {commit}, HBM copy {hbm:.2f} TB/s")
print(open(f"{raw}/parity.txt").read().strip() if os.path.exists(f"{raw}/parity.txt") else "parity: no result")


def active_bytes(cfg):
    """bf16 bytes a batch-1 decode step reads: every parameter but the embedding's other rows and the
    experts a token does not visit (the router picks top_k of them a layer)."""
    with torch.device("meta"):
        model = DecoderLM(cfg, TorchOps())
    total = 0
    for name, p in model.named_parameters():
        n = p.numel()
        if name.startswith("embed_tokens") and not cfg.tie_word_embeddings:
            continue
        if name.endswith((".w13", ".w2")):
            n = n * cfg.moe.top_k // cfg.moe.num_experts
        total += n
    return 2 * total


def plan_tokens(path):
    try:
        return json.load(open(path))["plan"]["ranks"][0]["kv_tokens"]
    except Exception:
        text = open(path).read() if os.path.exists(path) else ""
        m = re.search(r'"kv_tokens":\s*(\d+)', text)
        return int(m.group(1)) if m else None


result = {"hbm_tb_s": hbm, "w1": {}, "kv": {}}
for name in models.split():
    try:
        w1 = json.load(open(f"{raw}/w1_{name}.json"))
    except Exception as e:
        print(f"W1 {name}: no result ({e})"); continue
    cfg = ModelConfig.from_dir(f"/tmp/{name}")
    tok = w1["decode_tokens_per_s"]
    gb = active_bytes(cfg) / 1e9
    roof = hbm * 1e12 / (gb * 1e9)
    print(f"W1 {name:18} {tok:8.1f} tok/s  active {gb:5.2f} GB  roofline {roof:6.0f} tok/s  {100 * tok / roof:5.1f} %")
    mem = w1.get("memory", {})
    worker, planned = mem.get("kv_tokens"), plan_tokens(f"{raw}/plan_w1_{name}.json")
    # Pages of MHA's size for the same model: every head's expanded key (nope + rope) and value.
    mla = cfg.mla
    mha_token = 2 * cfg.num_hidden_layers * cfg.num_attention_heads * (mla.qk_nope_head_dim + mla.qk_rope_head_dim
                                                                         + mla.v_head_dim)
    mla_token = kv_bytes_per_block(cfg, 1, torch.bfloat16)
    print(f"KV {name:18} worker {worker} tokens ({mem.get('kv_gib', 0):.1f} GiB, activation peak "
          f"{mem.get('activation_peak_gib', 0):.2f} GiB); plan {planned}"
          f"{f' ({100 * (planned - worker) / worker:+.2f} %)' if worker and planned else ''}; "
          f"{mla_token} B a token against MHA's {mha_token} B: {mha_token / mla_token:.1f} x the tokens")
    result["w1"][name] = {"tok_s": tok, "active_gb": round(gb, 2), "roofline_tok_s": round(roof), "raw": w1}
    result["kv"][name] = {"worker_tokens": worker, "plan_tokens": planned, "mla_bytes_per_token": mla_token,
                          "mha_bytes_per_token": mha_token}
try:
    s = json.load(open(f"{raw}/w2.json"))["summary"]
    pool = open(f"{raw}/w2_pool.txt").read()
    m = re.search(r"kv_tokens[\"=:\s]+(\d+)", pool)
    worker, planned = (int(m.group(1)) if m else None), plan_tokens(f"{raw}/plan_w2.json")
    print(f"W2 moonlight-16b-a3b {s['total_throughput']:>9,.0f} tok/s  failed {s['failed']}; worker KV {worker} "
          f"tokens, plan {planned}")
    result["w2"] = {"tok_s": s["total_throughput"], "summary": s, "worker_kv_tokens": worker, "plan_kv_tokens": planned}
except Exception as e:
    print(f"W2: no result ({e})")
json.dump(result, open(f"{out}/mla.json", "w"), indent=1)
PY
echo "total: ${SECONDS} s"
