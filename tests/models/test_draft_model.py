"""Speculation's draft_model method (issue 36): a smaller model of the same tokenizer drafts, its KV
in a pool of its own indexed by the target's pages. The answers are those without speculation, greedy
and seeded, at batch 1 and 8, with a draft that agrees (the target itself: every greedy draft token is
confirmed) and one that does not (other weights); preempted requests start their draft KV again."""

from __future__ import annotations

import pytest

from inferno.tools.make_model import write_model
from services.worker.engine.speculative import SpeculativeConfig
from shared.sampling_params import SamplingParams
from tests.models.conftest import make_engine, random_prompt, run_requests

ARCH = "LlamaForCausalLM"


@pytest.fixture(scope="module")
def model_dir(model_dirs):
    return model_dirs[ARCH]


@pytest.fixture(scope="module")
def other_draft(tmp_path_factory):
    return write_model(tmp_path_factory.mktemp("draft") / "d", arch=ARCH, preset="tiny", seed=7, dtype="float32")


def spec(path, k=4):
    return SpeculativeConfig(method="draft_model", model=str(path), num_speculative_tokens=k)


def prompts_and_params(vocab, batch):
    prompts = [random_prompt(6 + 5 * i, vocab, seed=40 + i) for i in range(batch)]
    params = [SamplingParams(max_tokens=24, ignore_eos=True, temperature=0.0 if i % 3 else 0.8, seed=i, top_k=20)
              for i in range(batch)]
    return prompts, params


@pytest.mark.parametrize("batch", [1, 8])
def test_a_draft_model_changes_no_answer(model_dir, other_draft, batch):
    vocab = make_engine(model_dir).model_config.vocab_size
    prompts, params = prompts_and_params(vocab, batch)
    params[0] = SamplingParams(max_tokens=24, ignore_eos=True, temperature=0.0)
    plain, plain_steps = run_requests(make_engine(model_dir), prompts, params)
    same = make_engine(model_dir, speculative=spec(model_dir))
    got, steps = run_requests(same, prompts, params)
    assert got == plain
    drafts, drafted, confirmed = same.draft_counts["draft_model"]
    assert drafted > 0 and steps < plain_steps
    if batch == 1:  # the target as its own draft: every greedy draft token is what the target draws
        assert confirmed == drafted
    other = make_engine(model_dir, speculative=spec(other_draft, k=3))
    assert run_requests(other, prompts, params)[0] == plain
    assert other.draft_counts["draft_model"][1] > 0
    for engine in (same, other):
        assert engine.block_manager.num_free_blocks == engine.block_manager.num_total_blocks


def test_draft_steps_replay_the_draft_models_graphs_and_survive_preemption(model_dir):
    """Few pages: requests are preempted mid-answer and their draft KV is computed again; the
    draft's decode steps go through its graph runner's static path (the CPU's graphs rerun the
    forward on the same buffers)."""
    from services.worker.engine.drafting import capture_graphs

    vocab = make_engine(model_dir).model_config.vocab_size
    prompts, params = prompts_and_params(vocab, 6)
    plain, _ = run_requests(make_engine(model_dir, num_blocks=14, block_size=8), prompts, params)
    engine = make_engine(model_dir, num_blocks=14, block_size=8, speculative=spec(model_dir))
    d = engine.drafter
    capture_graphs(d, spec(model_dir), 16, 256)
    staged = []
    stage = d.graphs.stage
    d.graphs.stage = lambda *a: staged.append(1) or stage(*a)
    assert run_requests(engine, prompts, params)[0] == plain
    assert engine.batcher.num_preemptions_total > 0 and staged
    assert engine.spec_accepted_tokens > 0
    assert engine.block_manager.num_free_blocks == engine.block_manager.num_total_blocks
