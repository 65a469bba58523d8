"""Mixture-of-experts models (Mixtral, Qwen2-MoE, Qwen3-MoE, OLMoE) against transformers on the same
random weights (float32, CPU): logits, greedy tokens, and batching that changes no token."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from inferno.tools.make_model import write_model
from services.worker.engine.model_config import ModelConfig
from shared.sampling_params import SamplingParams
from tests.models.conftest import MOE_ARCHS, assert_group_equals_one_process, eos_ids, hf_greedy, make_engine, random_prompt
from tests.models.test_transformers_parity import engine_prefill_logits, run_staggered

N_NEW = 64


@pytest.fixture(scope="module")
def moe_dirs(tmp_path_factory):
    root = tmp_path_factory.mktemp("moe")
    return {arch: write_model(root / arch, arch=arch, preset="tiny", seed=2, dtype="float32") for arch in MOE_ARCHS}


@pytest.fixture(scope="module")
def hf_moe(moe_dirs):
    from transformers import AutoModelForCausalLM

    return {arch: AutoModelForCausalLM.from_pretrained(path, torch_dtype=torch.float32,
                                                       attn_implementation="eager").eval()
            for arch, path in moe_dirs.items()}


def test_configs_read_each_familys_keys(moe_dirs):
    mixtral = ModelConfig.from_dir(moe_dirs["MixtralForCausalLM"]).moe
    assert (mixtral.num_experts, mixtral.top_k, mixtral.intermediate_size, mixtral.renormalize) == (4, 2, 32, True)
    qwen2 = ModelConfig.from_dir(moe_dirs["Qwen2MoeForCausalLM"])
    assert qwen2.attention_bias and qwen2.moe.shared_intermediate_size == 64 and not qwen2.moe.renormalize
    olmoe = ModelConfig.from_dir(moe_dirs["OlmoeForCausalLM"])
    assert olmoe.qk_norm and olmoe.qk_norm_whole and olmoe.moe.sparse_layers == (0, 1)


@pytest.mark.parametrize("arch", MOE_ARCHS)
def test_prefill_logits_and_greedy_tokens_match(arch, moe_dirs, hf_moe):
    engine = make_engine(moe_dirs[arch])
    prompt = random_prompt(37, engine.model_config.vocab_size, seed=5)
    ours = engine_prefill_logits(engine, prompt)
    with torch.no_grad():
        ref = hf_moe[arch](torch.tensor([prompt])).logits[0].float()
    rel = (ours - ref).norm() / ref.norm()
    assert rel < 1e-4, f"{arch}: relative error {rel:.2e}"
    eos = eos_ids(moe_dirs[arch])
    [tokens] = engine.generate([prompt], SamplingParams(temperature=0.0, max_tokens=N_NEW, min_tokens=N_NEW), eos)
    assert tokens == hf_greedy(hf_moe[arch], prompt, N_NEW, eos)


def test_batching_changes_no_tokens(moe_dirs, hf_moe):
    """Requests joining a running batch (mixed prefill and decode steps): each token routed per row."""
    arch = "Qwen2MoeForCausalLM"  # the one with every part: bias, shared expert, unnormalised top-k
    engine = make_engine(moe_dirs[arch], overlap=True)
    eos = eos_ids(moe_dirs[arch])
    vocab = engine.model_config.vocab_size
    prompts = [random_prompt(n, vocab, seed=50 + i) for i, n in enumerate([5, 23, 1, 40])]
    params = [SamplingParams(temperature=0.0, max_tokens=16, min_tokens=16)] * len(prompts)
    expected = [hf_greedy(hf_moe[arch], p, 16, eos) for p in prompts]
    assert run_staggered(engine, prompts, eos, params) == expected


@pytest.mark.parametrize("arch,expert_parallel", [("Qwen2MoeForCausalLM", True), ("OlmoeForCausalLM", False)],
                         ids=["ep2-qwen2moe", "tp2-olmoe"])
def test_a_group_equals_one_process(arch, expert_parallel, moe_dirs):
    """Two ranks (gloo): whole experts per rank (the shared expert still split), or every expert's
    intermediate split (OLMoE: its QK-norm's mean square summed over the ranks' heads)."""
    def experts_counted(engine, prompts):
        experts = engine.stats().expert_tokens
        # Every token of every sparse layer went to top_k experts (the driver's counters: both layers).
        assert sum(experts) == 2 * 2 * sum(len(p) + 24 - 1 for p in prompts)

    assert_group_equals_one_process(moe_dirs[arch], 70, 24, experts_counted, tensor_parallel_size=2,
                                    enable_expert_parallel=expert_parallel)


def test_layout_splits_experts():
    from services.worker.engine.parallel.layout import ParallelConfigError, ParallelLayout
    from services.worker.engine.model_config import MoEConfig

    cfg = ModelConfig(architecture="Qwen3MoeForCausalLM", vocab_size=64, hidden_size=32, intermediate_size=96,
                      num_hidden_layers=4, num_attention_heads=4, num_key_value_heads=2, head_dim=8,
                      rms_norm_eps=1e-6, rope_theta=1e4, max_position_embeddings=64, tie_word_embeddings=False,
                      moe=MoEConfig(num_experts=8, top_k=2, intermediate_size=24, renormalize=True,
                                    sparse_layers=(1, 2, 3)))
    ep = ParallelLayout(tp=2, pp=2, rank=3, expert_parallel=True).local_config(cfg).moe
    assert (ep.first_expert, ep.held_experts, ep.intermediate_size, ep.sparse_layers) == (4, 4, 24, (0, 1))
    tp = ParallelLayout(tp=2, rank=1).local_config(cfg).moe
    assert (tp.first_expert, tp.held_experts, tp.intermediate_size) == (0, 8, 12)
    six = dataclasses.replace(cfg, moe=dataclasses.replace(cfg.moe, num_experts=6))
    with pytest.raises(ParallelConfigError, match="6 experts do not spread"):
        ParallelLayout(tp=4, expert_parallel=True).check(six)


@pytest.mark.parametrize("arch", ["MixtralForCausalLM", "Qwen2MoeForCausalLM"])
def test_gguf_file_is_the_same_model_as_its_directory(arch, moe_dirs, tmp_path):
    """llama.cpp's layout: experts stacked [E, N, K], Mixtral written as "llama" with experts (q/k
    permuted), Qwen2-MoE's shared expert and its vector gate; Q8_0 experts dequantized."""
    pytest.importorskip("gguf", reason="the gguf package writes the test file")
    from tests.models.gguf_builder import write_gguf

    path = write_gguf(moe_dirs[arch], tmp_path / f"{arch}.gguf")
    assert ModelConfig.from_path(path).moe == ModelConfig.from_dir(moe_dirs[arch]).moe
    prompt = random_prompt(29, ModelConfig.from_dir(moe_dirs[arch]).vocab_size, seed=6)
    want = engine_prefill_logits(make_engine(moe_dirs[arch]), prompt)
    got = engine_prefill_logits(make_engine(path), prompt)
    assert ((got - want).norm() / want.norm()) < 1e-6
    quantized = write_gguf(moe_dirs[arch], tmp_path / f"{arch}-q8.gguf", matrix_type="Q8_0")
    got = engine_prefill_logits(make_engine(quantized), prompt)
    assert ((got - want).norm() / want.norm()) < 0.05


def test_bench_engine_reports_how_evenly_decode_tokens_fell_on_the_experts(moe_dirs):
    """bench-engine's expert_spread: EP's step waits for its busiest GPU, so its figure needs the
    split of the decode tokens over contiguous blocks of experts beside it."""
    from services.worker.engine.bench_engine import expert_spread, run

    engine = make_engine(moe_dirs["Qwen3MoeForCausalLM"])
    spread = run(engine, batch_size=3, prompt_len=8, decode_tokens=4)["expert_spread"]
    experts = engine.model_config.moe.num_experts
    assert 1.0 <= spread["max_over_mean"] <= experts and 1.0 <= spread["ep2_max_over_mean"] <= 2.0
    assert expert_spread(torch.tensor([6, 2, 0, 0])) == {"max_over_mean": 3.0, "ep2_max_over_mean": 2.0,
                                                          "ep4_max_over_mean": 3.0}
