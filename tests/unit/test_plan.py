"""`inferno plan`: a model's memory on each GPU of a layout, against exact counts and the worker's own figures."""

from __future__ import annotations

import json
import math

import pytest
from safetensors import safe_open

from inferno.tools.make_model import write_model
from services.worker.engine.gpu_memory import GRAPH_RESERVE_BYTES
from services.worker.main import max_num_seqs_default, parse_args
from services.worker.plan.gpus import GIB, MIB, parse_gpus
from services.worker.plan.main import main
from tests.models.gguf_builder import write_gguf

ROPE_8B = 131072 * 128 * 4  # the rotary table: max_model_len × head_dim, fp32
PARAMS_8B = 8_030_261_248


def plan(capsys, *argv) -> tuple[int, dict]:
    code = main([*argv, "--json"])
    return code, json.loads(capsys.readouterr().out)


def test_8b_on_one_h200_matches_the_worker(capsys):
    code, out = plan(capsys, "llama-3.1-8b", "--gpus", "1xH200")
    assert code == 0 and out["plan"]["fits"] and out["plan"]["replicas"] == 1
    (rank,) = out["plan"]["ranks"]
    assert rank["total"] == 143_156 * MIB  # 150,109,880,320 bytes: CUDA's total on an H200
    assert rank["weights"] == PARAMS_8B * 2 + ROPE_8B
    assert rank["activation_peak"] == 8192 * (2 * 4096 + 2 * 1024 + 3 * 14336 + 5 * 4096) * 2  # 1.125 GiB
    assert rank["graph_reserve"] == GRAPH_RESERVE_BYTES + 2048 * (2 * 4096 + 2 * 1024 + 3 * 14336 + 4 * 4096) * 2
    assert rank["kv_block_bytes"] == 2 * 32 * 16 * 1024 * 2 and rank["handoff"] == 0
    # The worker's "kv pool sized from memory" on an H200 with these flags (2026-11-29): 61,223 blocks.
    assert rank["kv_blocks"] == pytest.approx(61_223, rel=0.03)
    assert out["plan"]["kv_tokens_per_replica"] == rank["kv_blocks"] * 16
    # The worker's defaults on a GPU, not copies of them.
    worker = parse_args([])
    assert out["settings"]["max_num_seqs"] == max_num_seqs_default(None, "cuda")
    assert out["settings"]["max_num_batched_tokens"] == worker.max_num_batched_tokens
    assert out["settings"]["gpu_memory_utilization"] == worker.gpu_memory_utilization
    assert out["settings"]["kv_dtype"] == "bfloat16"


def test_flags_move_the_figures_as_the_worker_does(capsys):
    _, base = plan(capsys, "llama-3.1-8b", "--gpus", "1xH200")
    _, prefill = plan(capsys, "llama-3.1-8b", "--gpus", "1xH200", "--role", "prefill")
    _, fp8 = plan(capsys, "llama-3.1-8b", "--gpus", "1xH200", "--quantization", "fp8", "--kv-cache-dtype", "fp8")
    # A prefill worker keeps two steps' tokens for hand-offs (model_build.handoff_buffer_tokens): 2 GiB at 8B.
    assert prefill["plan"]["ranks"][0]["handoff"] == 2 * 8192 * 2 * 32 * 1024 * 2
    assert prefill["plan"]["ranks"][0]["kv_blocks"] == pytest.approx(60_199, rel=0.03)  # the worker's
    rank = fp8["plan"]["ranks"][0]
    assert rank["kv_block_bytes"] * 2 == base["plan"]["ranks"][0]["kv_block_bytes"]
    assert rank["weights"] < base["plan"]["ranks"][0]["weights"] * 0.6
    assert rank["kv_blocks"] == pytest.approx(128_424, rel=0.03)  # the worker's


def test_mixtral_on_two_h100_compares_tp_and_expert_parallel(capsys):
    code, out = plan(capsys, "mixtral-8x7b", "--gpus", "2xH100", "--compare")
    assert code == 0
    layouts = {(row["tp"], row["pp"], row["expert_parallel"]): row for row in out["compare"]}
    assert set(layouts) == {(1, 1, False), (2, 1, False), (2, 1, True), (1, 2, False)}
    tp, ep = layouts[2, 1, False], layouts[2, 1, True]
    assert tp["fits"] and ep["fits"] and tp["replicas"] == ep["replicas"] == 1
    # Half of every expert or half of the experts: the same bytes; but EP's fused_moe rows are whole experts'
    # width (a larger activation peak), so TP=2 keeps more KV.
    assert out["plan"]["tp"] == 2 and not out["plan"]["expert_parallel"]
    assert tp["kv_tokens_per_replica"] > ep["kv_tokens_per_replica"] > 0
    one = layouts[1, 1, False]  # 87 GiB of weights on one 80 GB GPU
    assert not one["fits"] and one["replicas"] == 2
    assert one["reason"] == "rank 0 cannot load 87.01 GiB of weights on a 79.18 GiB GPU"
    tokens = [row["kv_tokens_per_replica"] for row in out["compare"]]
    assert tokens == sorted(tokens, reverse=True)


def test_a_model_that_does_not_fit_says_why(capsys):
    code, out = plan(capsys, "llama-3.1-70b", "--gpus", "1xH100")
    assert code == 1 and out["plan"]["reason"] == "rank 0 cannot load 131.48 GiB of weights on a 79.18 GiB GPU"
    # It loads on an H200, but leaves no KV block within 95 % of it.
    code, out = plan(capsys, "llama-3.1-70b", "--gpus", "1xH200", "--gpu-memory-utilization", "0.95")
    reason = out["plan"]["reason"]
    assert code == 1 and reason.startswith("rank 0 needs") and "weights 131.48" in reason
    assert "132.81 GiB usable" in reason
    # fp8 halves the weights, but quantizes them after a 16-bit load.
    code, out = plan(capsys, "llama-3.1-70b", "--gpus", "1xH100", "--quantization", "fp8")
    assert code == 1 and out["plan"]["reason"].startswith("rank 0 cannot load: fp8 quantizes the loaded 16-bit")
    code, out = plan(capsys, "llama-3.1-70b", "--gpus", "3xH100")  # TP=3: 64 heads do not split
    assert code == 1 and "do not split over tensor_parallel_size 3" in out["plan"]["reason"]
    code, out = plan(capsys, "llama-3.1-8b", "--gpus", "1xH100", "-tp", "2")
    assert code == 1 and out["plan"]["reason"] == "TP × PP = 2 GPUs, --gpus gives 1"
    assert main(["llama-3.1-70b", "--gpus", "1xH100"]) == 1
    assert "does not fit: rank 0 cannot load" in capsys.readouterr().out


def test_preset_directory_config_json_and_gguf_give_one_plan(capsys, tmp_path):
    model_dir = write_model(tmp_path / "tiny", preset="tiny", dtype="float32")  # float32: the GGUF writer reads it
    gguf = write_gguf(model_dir, tmp_path / "tiny.gguf")
    with safe_open(str(model_dir / "model.safetensors"), framework="pt") as f:
        params = sum(math.prod(f.get_slice(name).get_shape()) for name in f.keys())
    rope = 2048 * 16 * 4  # max_model_len × head_dim, fp32
    plans = [plan(capsys, source, "--gpus", "1xL40S", "--dtype", "bfloat16")[1]["plan"]
             for source in ("tiny", str(model_dir), str(model_dir / "config.json"), str(gguf))]
    assert plans[0] == plans[1] == plans[2] == plans[3]
    assert plans[0]["ranks"][0]["weights"] == params * 2 + rope
    _, own = plan(capsys, str(model_dir), "--gpus", "1xL40S")  # config.json's torch_dtype
    assert own["settings"]["dtype"] == "float32" and own["plan"]["ranks"][0]["weights"] == params * 4 + rope
    _, moe = plan(capsys, "tiny", "--arch", "MixtralForCausalLM", "--gpus", "1xL40S")
    assert moe["architecture"] == "MixtralForCausalLM"
    assert moe["plan"]["ranks"][0]["weights"] != plans[0]["ranks"][0]["weights"]


def test_text_report_and_bad_input(capsys):
    assert main(["tiny", "--gpus", "2xA100-80G", "--compare"]) == 0
    text = capsys.readouterr().out
    assert "on 2 × A100-80G" in text and "TP=2 PP=1 fits:" in text and "KV tokens/replica" in text
    assert main(["no-such-model", "--gpus", "1xH100"]) == 2
    assert main(["tiny", "--gpus", "1xTPU"]) == 2
    assert "unknown GPU kind" in capsys.readouterr().err


def test_parse_gpus():
    assert parse_gpus("2xH200") == parse_gpus("2 × h200")
    assert parse_gpus("H100").count == 1 and parse_gpus("8xB200").count == 8
    assert parse_gpus("4xMI300", memory_gib=191.5).total_bytes == int(191.5 * GIB)
    with pytest.raises(ValueError):
        parse_gpus("0xH100")
