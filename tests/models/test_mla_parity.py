"""DeepSeek-V2 and -V3 (latent attention, YaRN, grouped routing with shared experts, a dense first
layer) against transformers on the same random weights (float32, CPU): logits, greedy tokens, and
batches with cached prefixes that change no token."""

from __future__ import annotations

import pytest
import torch

from inferno.tools.make_model import write_model
from services.worker.engine.kv_cache import CacheLayout, kv_bytes_per_block
from services.worker.engine.model_config import ModelConfig, YarnScaling
from shared.sampling_params import SamplingParams
from tests.models.conftest import assert_group_equals_one_process, eos_ids, hf_greedy, make_engine, random_prompt
from tests.models.test_transformers_parity import engine_prefill_logits, run_staggered

ARCHS = ["DeepseekV2ForCausalLM", "DeepseekV3ForCausalLM"]
N_NEW = 64


@pytest.fixture(scope="module")
def dirs(tmp_path_factory):
    root = tmp_path_factory.mktemp("mla")
    return {arch: write_model(root / arch, arch=arch, preset="tiny", seed=2, dtype="float32") for arch in ARCHS}


@pytest.fixture(scope="module")
def hf(dirs):
    from transformers import AutoModelForCausalLM

    return {arch: AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32, attn_implementation="eager").eval()
            for arch, path in dirs.items()}


def test_configs_read_latent_attention_routing_and_yarn(dirs):
    v3 = ModelConfig.from_dir(dirs["DeepseekV3ForCausalLM"])
    assert (v3.mla.q_lora_rank, v3.mla.kv_lora_rank, v3.mla.qk_rope_head_dim, v3.head_dim) == (32, 32, 8, 24)
    assert (v3.moe.scoring, v3.moe.score_bias, v3.moe.n_group, v3.moe.topk_group) == ("sigmoid", True, 4, 2)
    assert v3.moe.sparse_layers == (1,) and v3.moe.routed_scaling_factor == 2.5 and not v3.moe.shared_gate
    assert isinstance(v3.rope_scaling, YarnScaling) and v3.rope_dim == 8
    v2 = ModelConfig.from_dir(dirs["DeepseekV2ForCausalLM"])
    assert v2.mla.q_lora_rank == 0 and v2.mla.rope_interleave and v2.moe.scoring == "softmax"
    assert v2.moe.shared_intermediate_size == 64 and not v2.moe.renormalize
    # One cache row a token and layer: the latent and the rotary key (32 + 8), in one plane.
    assert CacheLayout.of(v3) == CacheLayout(1, 1, 40)
    assert kv_bytes_per_block(v3, 16, torch.bfloat16) == 2 * 16 * 40 * 2


@pytest.mark.parametrize("arch", ARCHS)
def test_prefill_logits_and_greedy_tokens_match(arch, dirs, hf):
    """The prefill in the expanded form, then 64 decodes in the absorbed form."""
    engine = make_engine(dirs[arch])
    prompt = random_prompt(37, engine.model_config.vocab_size, seed=5)
    ours = engine_prefill_logits(engine, prompt)
    with torch.no_grad():
        ref = hf[arch](torch.tensor([prompt])).logits[0].float()
    rel = (ours - ref).norm() / ref.norm()
    assert rel < 1e-5, f"{arch}: relative error {rel:.2e}"
    eos = eos_ids(dirs[arch])
    [tokens] = engine.generate([prompt], SamplingParams(temperature=0.0, max_tokens=N_NEW, min_tokens=N_NEW), eos)
    assert tokens == hf_greedy(hf[arch], prompt, N_NEW, eos)


def test_cached_prefixes_and_mixed_batches_change_no_token(dirs, hf):
    """Requests join a running batch, and the later ones share a 32-token prefix with the first: their
    prefills extend cached latent pages (queries that start mid-sequence) beside decodes."""
    arch = "DeepseekV3ForCausalLM"
    engine = make_engine(dirs[arch], overlap=True)
    eos = eos_ids(dirs[arch])
    vocab = engine.model_config.vocab_size
    shared = random_prompt(32, vocab, seed=9)
    prompts = [shared + random_prompt(n, vocab, seed=60 + i) for i, n in enumerate([5, 1, 20])]
    prompts.insert(1, random_prompt(11, vocab, seed=3))
    params = [SamplingParams(temperature=0.0, max_tokens=12, min_tokens=12)] * len(prompts)
    expected = [hf_greedy(hf[arch], p, 12, eos) for p in prompts]
    assert run_staggered(engine, prompts, eos, params) == expected
    assert engine.stats().prefix_cache_hits > 0


@pytest.mark.parametrize("arch,expert_parallel", [("DeepseekV3ForCausalLM", True), ("DeepseekV2ForCausalLM", False)],
                         ids=["tp2-ep-v3", "tp2-v2"])
def test_a_group_equals_one_process(arch, expert_parallel, dirs):
    """Two ranks (gloo), each with half the heads (of q, kv_b_proj and o_proj) over the whole latent
    cache, and whole experts (V3) or half of every expert (V2)."""
    assert_group_equals_one_process(dirs[arch], 80, 16, tensor_parallel_size=2,
                                    enable_expert_parallel=expert_parallel)
