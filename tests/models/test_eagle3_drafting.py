"""Speculation's eagle3 method in the engine (issue 36): a random EAGLE-3 head drafts from the tiny
target's kept states. The answers are those without speculation (greedy and seeded, batch 1 and 5),
and each draft is what the head gives when run afresh over the whole sequence: the incremental
catch-up (the confirmed positions' kept states, the head's KV of earlier steps) loses nothing."""

from __future__ import annotations

import json

import pytest
import torch

from inferno.tools.make_model import write_eagle3
from services.worker.engine.batcher import ScheduledRequest
from services.worker.engine.kv_cache import KVCache
from services.worker.engine.request import Request
from services.worker.engine.speculative import SpeculativeConfig
from services.worker.engine.step_inputs import build_step_inputs
from shared.sampling_params import SamplingParams
from tests.models.conftest import make_engine, random_prompt, run_requests

ARCH = "LlamaForCausalLM"


@pytest.fixture(scope="module")
def model_dir(model_dirs):
    return model_dirs[ARCH]


@pytest.fixture(scope="module")
def head_dir(model_dir, tmp_path_factory):
    vocab = json.loads((model_dir / "config.json").read_text())["vocab_size"]
    return write_eagle3(tmp_path_factory.mktemp("eagle3") / "head", target_preset="tiny", seed=3, dtype="float32",
                        target_vocab_size=vocab)


def spec(head_dir, k=3):
    return SpeculativeConfig(method="eagle3", model=str(head_dir), num_speculative_tokens=k)


@pytest.mark.parametrize("batch", [1, 5])
def test_eagle3_drafts_change_no_answer(model_dir, head_dir, batch):
    vocab = make_engine(model_dir).model_config.vocab_size
    prompts = [random_prompt(7 + 4 * i, vocab, seed=60 + i) for i in range(batch)]
    params = [SamplingParams(max_tokens=20, ignore_eos=True, temperature=0.0 if i % 2 == 0 else 0.9, seed=i)
              for i in range(batch)]
    plain, _ = run_requests(make_engine(model_dir), prompts, params)
    engine = make_engine(model_dir, speculative=spec(head_dir))
    assert run_requests(engine, prompts, params)[0] == plain
    drafts, drafted, _ = engine.draft_counts["eagle3"]
    assert drafts > 0 and drafted > 0
    assert engine.block_manager.num_free_blocks == engine.block_manager.num_total_blocks


def fresh_draft(engine, tokens: list[int], k: int) -> list[int]:
    """The head's draft after `tokens`, from scratch: the target over tokens[:-1] (its kept states),
    the head over those positions with the next tokens, then its own state forward."""
    head, target, bs = engine.drafter.model, engine.model, 8
    n = len(tokens) - 1
    blocks = (n + k) // bs + 1
    request = Request("fresh", list(tokens[:-1]), SamplingParams())
    request.block_ids = list(range(blocks))
    target_kv = KVCache(engine.model_config, blocks, bs, torch.float32, "cpu")
    head_kv = KVCache(head.config.kv_config(), blocks, bs, torch.float32, "cpu")
    inputs = build_step_inputs([ScheduledRequest(request, n, 0, True)], bs, torch.device("cpu"), False)
    target(inputs.input_ids, inputs.positions, target_kv.layers, inputs.meta)
    hidden = head.fuse(target.aux_hidden)
    ids = torch.tensor(tokens[1:])
    draft = []
    for j in range(k):
        normed, prenorm = head(ids, hidden, inputs.positions, head_kv.layers[0], inputs.meta)
        token = int(head.to_target(head.compute_logits(normed[-1:]).argmax(dim=-1))[0])
        draft.append(token)
        request.all_token_ids = list(tokens) + draft  # the next position: the head's own state, the token drawn
        inputs = build_step_inputs([ScheduledRequest(request, 1, n + j, True)], bs, torch.device("cpu"), False)
        ids, hidden = torch.tensor([token]), prenorm[-1:]
    return draft


@pytest.mark.parametrize("graphs", [False, True], ids=["eager", "graphs"])
def test_each_draft_is_the_heads_over_the_whole_sequence(model_dir, head_dir, graphs):
    """The check is handed the target's own continuation instead of the random head's draft, so it
    confirms whole drafts and the head catches up on several positions at a time; each of the head's
    own drafts must still be what it gives over the whole sequence afresh. With `graphs` the head's
    steps (catch-ups too: a row per token) go through its decode graphs' static path (the CPU's
    graphs rerun the forward on the same buffers)."""
    engine = make_engine(model_dir, speculative=spec(head_dir), block_size=8)
    replays = []
    if graphs:
        from services.worker.engine.drafting import capture_graphs
        d = engine.drafter
        capture_graphs(d, spec(head_dir), 16, 256)  # as a worker whose own graphs come in stages
        launch = d.graphs.launch
        d.graphs.launch = lambda staged, *a: replays.append(staged.n) or launch(staged, *a)
    vocab = engine.model_config.vocab_size
    prompt = random_prompt(11, vocab, seed=5)
    params = SamplingParams(max_tokens=24, ignore_eos=True, temperature=0.0)
    truth = run_requests(make_engine(model_dir), [prompt], [params])[0][0][0]
    seen = []
    propose = engine.drafter.propose

    def recorded(items):
        snapshot = [list(r.all_token_ids) for r, _ in items]
        seen.extend(zip(snapshot, propose(items)))
        return [truth[len(t) - len(prompt):len(t) - len(prompt) + k] for t, (_, k) in zip(snapshot, items)]
    engine.drafter.propose = recorded
    assert run_requests(engine, [prompt], [params])[0][0][0] == truth
    assert engine.spec_accepted_tokens > 10  # whole drafts confirmed: catch-ups of k + 1 positions
    assert len(seen) > 3
    assert not graphs or max(replays) > 1  # catch-ups of several positions replayed too
    for tokens, draft in seen:
        assert draft == fresh_draft(engine, tokens, len(draft))
