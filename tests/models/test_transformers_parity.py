"""The engine's math against transformers on the same random weights (float32, CPU)."""

from __future__ import annotations

import pytest
import torch

from services.worker.engine.step_inputs import build_step_inputs
from shared.sampling_params import SamplingParams
from tests.models.conftest import ARCHS, eos_ids, hf_greedy, make_engine, random_prompt

N_NEW = 32


def greedy(n=N_NEW, eos=()):
    # min_tokens mirrors transformers' min_new_tokens: EOS is masked until n tokens exist.
    return SamplingParams(temperature=0.0, max_tokens=n, min_tokens=n)


def engine_prefill_logits(engine, prompt):
    """Logits at every prompt position, through the paged path (one request, one chunk)."""
    engine.add_request("probe", prompt, SamplingParams(temperature=0.0, max_tokens=1))
    plan = engine.batcher.schedule()
    inputs = build_step_inputs(plan.scheduled, engine.kv_cache.block_size, engine.device, pin=False)
    with torch.inference_mode():
        hidden = engine.model(inputs.input_ids, inputs.positions, engine.kv_cache.layers, inputs.meta)
        logits = engine.model.compute_logits(hidden)
    engine.abort("probe")
    return logits


@pytest.mark.parametrize("arch", ARCHS)
def test_prefill_logits_match(arch, model_dirs, hf_models):
    engine = make_engine(model_dirs[arch])
    prompt = random_prompt(45, engine.model_config.vocab_size, seed=3)
    ours = engine_prefill_logits(engine, prompt)
    with torch.no_grad():
        ref = hf_models(arch)(torch.tensor([prompt])).logits[0].float()
    rel = (ours - ref).norm() / ref.norm()
    assert rel < 1e-4, f"{arch}: relative error {rel:.2e}"
    assert engine.block_manager.num_free_blocks == engine.block_manager.num_total_blocks


@pytest.mark.parametrize("arch", ARCHS)
def test_greedy_tokens_match_generate(arch, model_dirs, hf_models):
    engine = make_engine(model_dirs[arch])
    eos = eos_ids(model_dirs[arch])
    prompt = random_prompt(23, engine.model_config.vocab_size, seed=4)
    [ours] = engine.generate([prompt], greedy(), eos)
    assert ours == hf_greedy(hf_models(arch), prompt, N_NEW, eos)


def run_staggered(engine, prompts, eos, params=None, admit_every=2):
    """Admit one request every `admit_every` steps, so requests join a running batch."""
    outputs: dict[str, list[int]] = {f"r{i}": [] for i in range(len(prompts))}
    pending = list(enumerate(prompts))
    step = 0
    while pending or engine.has_unfinished():
        if pending and step % admit_every == 0:
            i, p = pending.pop(0)
            engine.add_request(f"r{i}", p, params[i] if params else greedy(), eos)
        for out in engine.step():
            outputs[out.request_id].extend(out.new_token_ids)
        step += 1
    return [outputs[f"r{i}"] for i in range(len(prompts))]


LENGTHS = [5, 17, 33, 8, 64, 1, 40, 29]


@pytest.fixture(scope="module")
def hf_expected(model_dirs, hf_models):
    cache = {}

    def get(arch):
        if arch not in cache:
            vocab = hf_models(arch).config.vocab_size
            prompts = [random_prompt(n, vocab, seed=100 + i) for i, n in enumerate(LENGTHS)]
            eos = eos_ids(model_dirs[arch])
            cache[arch] = prompts, [hf_greedy(hf_models(arch), p, N_NEW, eos) for p in prompts]
        return cache[arch]

    return get


@pytest.mark.parametrize("overlap", [False, True])
@pytest.mark.parametrize("arch", ARCHS)
def test_continuous_batching_changes_no_tokens(arch, overlap, model_dirs, hf_expected):
    prompts, expected = hf_expected(arch)
    engine = make_engine(model_dirs[arch], overlap=overlap)
    assert run_staggered(engine, prompts, eos_ids(model_dirs[arch])) == expected
    assert engine.block_manager.num_free_blocks == engine.block_manager.num_total_blocks


@pytest.mark.parametrize("overlap", [False, True])
@pytest.mark.parametrize("arch", ARCHS)
def test_tiny_chunks_change_no_tokens(arch, overlap, model_dirs, hf_expected):
    prompts, expected = hf_expected(arch)
    engine = make_engine(model_dirs[arch], long_prefill_token_threshold=7, max_num_batched_tokens=20,
                         overlap=overlap)
    assert run_staggered(engine, prompts, eos_ids(model_dirs[arch]), admit_every=1) == expected


@pytest.mark.parametrize("overlap", [False, True])
@pytest.mark.parametrize("arch", ARCHS)
def test_prefix_cache_hits_change_no_tokens(arch, overlap, model_dirs, hf_models):
    engine = make_engine(model_dirs[arch], overlap=overlap)
    eos = eos_ids(model_dirs[arch])
    vocab = engine.model_config.vocab_size
    shared_prefix = random_prompt(40, vocab, seed=7)  # two full blocks and a bit
    first = shared_prefix + random_prompt(5, vocab, seed=8)
    second = shared_prefix + random_prompt(9, vocab, seed=9)
    engine.generate([first], greedy(), eos)
    hits_before = engine.block_manager.prefix_cache_hits
    [out] = engine.generate([second], greedy(), eos)
    assert engine.block_manager.prefix_cache_hits - hits_before == 32  # two blocks of 16
    assert out == hf_greedy(hf_models(arch), second, N_NEW, eos)


@pytest.mark.parametrize("overlap", [False, True])
@pytest.mark.parametrize("arch", ARCHS)
def test_preemption_changes_no_tokens(arch, overlap, model_dirs, hf_expected):
    prompts, expected = hf_expected(arch)
    # 14 blocks of 16 tokens cannot hold all eight requests at once: some are preempted and recomputed.
    engine = make_engine(model_dirs[arch], num_blocks=14, overlap=overlap)
    outputs = run_staggered(engine, prompts, eos_ids(model_dirs[arch]), admit_every=1)
    assert outputs == expected
    assert engine.batcher.num_preemptions_total > 0
    assert engine.block_manager.num_free_blocks == 14


@pytest.mark.parametrize("overlap", [False, True])
def test_seeded_sampling_ignores_batch_composition(overlap, model_dirs):
    model_dir = model_dirs["LlamaForCausalLM"]
    vocab = make_engine(model_dir).model_config.vocab_size
    target = random_prompt(12, vocab, seed=21)
    params = SamplingParams(temperature=0.9, top_p=0.9, top_k=50, seed=1234, max_tokens=24, ignore_eos=True)

    alone = make_engine(model_dir).generate([target], params)[0]
    others = [random_prompt(n, vocab, seed=30 + n) for n in (3, 30, 9)]
    noisy = SamplingParams(temperature=1.3, max_tokens=30, ignore_eos=True)
    mixed = make_engine(model_dir, overlap=overlap).generate(others[:2] + [target] + others[2:],
                                            [noisy, noisy, params, noisy])[2]
    assert mixed == alone
    # A different seed draws a different continuation.
    other_seed = SamplingParams(temperature=0.9, top_p=0.9, top_k=50, seed=99, max_tokens=24, ignore_eos=True)
    assert make_engine(model_dir).generate([target], other_seed)[0] != alone
