"""Speculative decoding with n-gram drafts (issue 36): the answers are those without speculation,
greedy and seeded, at batch 1 and in a mixed batch; max_tokens and stop tokens inside a confirmed run
cut it exactly; a grammar-constrained request with drafts stays valid; a draft with the wrong token
everywhere leaves the next-token distribution that of the model (chi-square)."""

from __future__ import annotations

import asyncio
import json

import pytest
import torch

from services.worker.engine.speculative import SpeculativeConfig, ngram_draft
from shared.sampling_params import SamplingParams
from tests.models.conftest import eos_ids, make_engine, random_prompt, run_requests

ARCH = "LlamaForCausalLM"
SPEC = SpeculativeConfig(num_speculative_tokens=4, prompt_lookup_min=1, prompt_lookup_max=3)


@pytest.fixture(scope="module")
def model_dir(model_dirs):
    return model_dirs[ARCH]


def repetitive(n: int, vocab: int, seed: int) -> list[int]:
    """A prompt that repeats a phrase, so that prompt lookup finds drafts."""
    phrase = random_prompt(5 + seed % 4, vocab, seed)
    return (phrase * (n // len(phrase) + 1))[:n]


def run(engine, prompts, params, eos=(), grammar=None):
    return run_requests(engine, prompts, params, eos, [grammar] * len(prompts) if grammar else None)


def test_ngram_lookup_proposes_what_followed_the_latest_match():
    assert ngram_draft([1, 2, 3, 9, 1, 2, 3, 7, 8, 1, 2, 3], 3, 1, 3) == [7, 8, 1]
    assert ngram_draft([5, 6, 7], 2, 1, 2) == []
    assert ngram_draft([4, 4], 5, 1, 1) == [4]
    with pytest.raises(ValueError, match="needs .model."):
        SpeculativeConfig.from_json('{"method": "eagle3"}')
    with pytest.raises(ValueError, match="unknown keys"):
        SpeculativeConfig.from_json('{"method": "ngram", "num_spec": 3}')


@pytest.mark.parametrize("batch", [1, 8])
@pytest.mark.parametrize("sampled", [False, True], ids=["greedy", "seeded"])
def test_speculation_changes_no_answer(model_dir, batch, sampled):
    vocab = make_engine(model_dir).model_config.vocab_size
    prompts = [repetitive(24 + 3 * i, vocab, seed=i) if i % 2 == 0 else random_prompt(10 + i, vocab, seed=i)
               for i in range(batch)]
    params = [SamplingParams(max_tokens=40, ignore_eos=True, temperature=0.9 if sampled else 0.0, seed=i,
                             top_k=30 if sampled else 0, speculative=i != 3) for i in range(batch)]
    if batch > 1:  # penalties and min_tokens at each draft place: the history up to it
        params[4] = SamplingParams(max_tokens=40, temperature=0.7 if sampled else 0.0, seed=4, min_tokens=20,
                                   repetition_penalty=1.2, presence_penalty=0.3, frequency_penalty=0.2,
                                   logit_bias={5: 2.0})
    plain, plain_steps = run(make_engine(model_dir), prompts, params)
    engine = make_engine(model_dir, speculative=SPEC, overlap=True)
    spec, steps = run(engine, prompts, params)
    assert spec == plain
    assert engine.spec_draft_tokens > 0 and steps <= plain_steps
    assert list(engine.draft_counts) == ["ngram"] and engine.draft_counts["ngram"][1] == engine.spec_draft_tokens
    if not sampled:  # a random model repeats its greedy loops: drafts are confirmed
        assert engine.spec_accepted_tokens > 0
        assert steps < plain_steps or batch > 1  # in a batch the request that never drafts sets the pace
    assert engine.block_manager.num_free_blocks == engine.block_manager.num_total_blocks


def test_max_tokens_and_stop_ids_cut_a_confirmed_run(model_dir):
    vocab = make_engine(model_dir).model_config.vocab_size
    prompt = repetitive(30, vocab, seed=2)
    free, _ = run(make_engine(model_dir), [prompt], [SamplingParams(max_tokens=30, ignore_eos=True, temperature=0.0)])
    tokens = free[0][0]
    stop = tokens[13]
    for sp in (SamplingParams(max_tokens=11, ignore_eos=True, temperature=0.0),
               SamplingParams(max_tokens=30, ignore_eos=True, temperature=0.0, stop_token_ids=[stop])):
        plain, _ = run(make_engine(model_dir), [prompt], [sp])
        spec, _ = run(make_engine(model_dir, speculative=SPEC), [prompt], [sp])
        assert spec == plain
    assert len(run(make_engine(model_dir, speculative=SPEC), [prompt], [SamplingParams(
        max_tokens=11, ignore_eos=True, temperature=0.0)])[0][0][0]) == 11


def test_a_constrained_request_with_drafts_stays_valid(model_dir):
    import jsonschema

    from services.worker.grammar import Grammars
    from shared.tokenizer import Tokenizer

    eos = eos_ids(model_dir)
    vocab = make_engine(model_dir).model_config.vocab_size
    grammars = Grammars(str(model_dir), vocab, eos)
    schema = {"type": "array", "items": {"enum": ["ab", "cd"]}, "minItems": 3, "maxItems": 12}

    def grammar():
        return asyncio.run(grammars.matcher("json_schema", json.dumps(schema)))

    prompts = [random_prompt(12, vocab, seed=7)]
    params = [SamplingParams(max_tokens=80, temperature=0.0)]
    plain, _ = run(make_engine(model_dir), prompts, params, eos, grammar)
    spec, _ = run(make_engine(model_dir, speculative=SPEC, jump_forward=4), prompts, params, eos, grammar)
    assert spec == plain and plain[0][1] == "stop"
    jsonschema.validate(json.loads(Tokenizer.from_path(model_dir).decode(spec[0][0])), schema)
    grammars.close()


def test_a_wrong_draft_leaves_the_distribution_the_models():
    """The check's rule on a 16-token vocabulary: each of 20,000 requests drafts token 0 (unlikely
    under the target), the sampler draws its rows as a step would, and the engine keeps the draft
    where the draw confirms it, else the draw. The kept tokens must follow the target's softmax
    (chi-square, 15 degrees of freedom, p = 0.001); keeping the draft 5 % more often fails it."""
    from services.worker.engine.drafts import checked_drafts
    from services.worker.engine.ops import make_ops
    from services.worker.engine.request import Request
    from services.worker.engine.sampler import Sampler

    torch.manual_seed(0)
    n, vocab = 20_000, 16
    logits = torch.randn(vocab) * 1.5
    logits[0] = -2.0
    sampler = Sampler(make_ops("torch"), vocab, torch.device("cpu"), 2 * n)
    requests = []
    for i in range(n):
        r = Request(f"r{i}", [1, 2], SamplingParams(temperature=1.0, max_tokens=4, seed=i), seed=i)
        r.all_token_ids.append(0)  # the draft
        r.draft_len, r.num_pending_tokens, r.draft_method = 1, 1, "ngram"
        requests.append(r)
    rows = [(r, j) for r in requests for j in (0, 1)]
    result = sampler(logits.expand(2 * n, vocab).clone(), requests, draft_rows=rows).result()
    checked, counts = checked_drafts(rows, result)
    _, drafted, confirmed = counts["ngram"]
    kept = torch.tensor([e[0] for e in checked.token_ids])
    assert drafted == n and 0 < confirmed < n * 0.05

    def chi2(tokens):
        counts = torch.bincount(tokens, minlength=vocab).double()
        expected = torch.softmax(logits.double(), 0) * n
        return float(((counts - expected) ** 2 / expected).sum())

    assert chi2(kept) < 37.7
    wrong = kept.clone()
    wrong[torch.rand(n, generator=torch.Generator().manual_seed(1)) < 0.05] = 0
    assert chi2(wrong) > 37.7


def test_logprobs_are_the_targets_for_every_kept_token(model_dir):
    """A request with logprobs speculates too: each kept token comes with its own row's log-
    probabilities, those of decoding without drafts."""
    vocab = make_engine(model_dir).model_config.vocab_size
    prompts = [repetitive(30, vocab, seed=4), repetitive(22, vocab, seed=6)]
    params = [SamplingParams(max_tokens=30, ignore_eos=True, temperature=0.0, logprobs=2),
              SamplingParams(max_tokens=30, ignore_eos=True, temperature=0.8, seed=9, logprobs=1)]

    def run_logprobs(engine):
        for i, (p, sp) in enumerate(zip(prompts, params)):
            engine.add_request(f"r{i}", p, sp)
        got = {f"r{i}": ([], [], []) for i in range(len(prompts))}
        while engine.has_unfinished():
            for o in engine.step():
                tokens, lps, tops = got[o.request_id]
                tokens += o.new_token_ids
                lps += o.logprobs
                tops += o.top_logprobs
        return got

    plain = run_logprobs(make_engine(model_dir))
    engine = make_engine(model_dir, speculative=SPEC)
    spec = run_logprobs(engine)
    assert engine.spec_accepted_tokens > 0
    for rid in plain:
        (t0, lp0, top0), (t1, lp1, top1) = plain[rid], spec[rid]
        assert t1 == t0 and len(lp1) == len(t1) == len(top1)
        assert max(abs(a - b) for a, b in zip(lp0, lp1)) < 1e-4
        assert [[t for t, _ in alts] for alts in top1] == [[t for t, _ in alts] for alts in top0]


def test_a_draft_made_before_the_batch_grew_is_checked_before_steps_overlap(model_dir, monkeypatch):
    """Speculation turns off above disable_by_batch_size and the steps overlap again; a draft made
    just before must still be checked in a step of its own (that step yields several tokens). Wrong
    drafts (rejected at once) make the difference show: the answers must stay the same."""
    from services.worker.engine import drafts as drafts_module

    monkeypatch.setattr(drafts_module, "ngram_draft", lambda tokens, k, n_min, n_max: [1, 2, 3][:k])
    vocab = make_engine(model_dir).model_config.vocab_size
    late = [random_prompt(8 + i, vocab, seed=30 + i) for i in range(4)]
    params = SamplingParams(max_tokens=24, ignore_eos=True, temperature=0.0)

    def run_growing(engine, wait_for_draft):
        out = {}

        def step():
            for o in engine.step():
                out.setdefault(o.request_id, []).extend(o.new_token_ids)

        a = engine.add_request("a", random_prompt(12, vocab, seed=3), params)
        for _ in range(6):
            step()
        while wait_for_draft and not a.draft_len:
            step()
        for i, p in enumerate(late):  # the batch grows past the bound with a's draft still to check
            engine.add_request(f"b{i}", p, params)
        while engine.has_unfinished():
            step()
        return out

    plain = run_growing(make_engine(model_dir, overlap=True), False)
    spec = SpeculativeConfig(num_speculative_tokens=3, disable_by_batch_size=2)
    engine = make_engine(model_dir, speculative=spec, overlap=True)
    assert run_growing(engine, True) == plain
    assert engine.spec_draft_tokens > 0


def test_draft_checks_run_in_the_decode_graphs(model_dir):
    """A step of decodes and draft checks replays a decode graph, a row per token of each draft (the
    CPU's graphs rerun the forward on the static buffers): the answers stay those without drafts."""
    from tests.models.test_graph_decode_path import with_graphs

    vocab = make_engine(model_dir).model_config.vocab_size
    prompts = [repetitive(24 + 3 * i, vocab, seed=i) for i in range(3)] + [random_prompt(9, vocab, seed=9)]
    params = [SamplingParams(max_tokens=30, ignore_eos=True, temperature=0.0 if i < 3 else 0.8, seed=i)
              for i in range(4)]
    plain, _ = run(make_engine(model_dir), prompts, params)
    engine = make_engine(model_dir, speculative=SPEC, max_num_seqs=16)
    graphs = with_graphs(engine)
    checks = []
    stage_checks = graphs._stage_checks
    graphs._stage_checks = lambda *a: checks.append(stage_checks(*a)) or checks[-1]
    spec, _ = run(engine, prompts, params)
    assert spec == plain
    assert checks and max(c.n for c in checks) > len(prompts)  # rows beyond one per request: drafts
    assert engine.spec_accepted_tokens > 0
    assert engine.block_manager.num_free_blocks == engine.block_manager.num_total_blocks


def test_speculation_pauses_where_its_checks_would_be_compute_bound(model_dir):
    """k + 1 rows a request: past speculative.COMPUTE_BOUND_ROWS no drafts, whatever disable_by_batch_size."""
    from services.worker.engine.speculative import COMPUTE_BOUND_ROWS

    vocab = make_engine(model_dir).model_config.vocab_size
    k = 50
    spec = SpeculativeConfig(num_speculative_tokens=k, prompt_lookup_min=1, prompt_lookup_max=3, disable_by_batch_size=0)
    fits = COMPUTE_BOUND_ROWS // (k + 1)
    for n, drafts in ((fits + 1, False), (fits, True)):
        engine = make_engine(model_dir, speculative=spec)
        prompts = [repetitive(30, vocab, seed=i) for i in range(n)]
        run(engine, prompts, [SamplingParams(max_tokens=12, ignore_eos=True, temperature=0.0)] * n)
        assert (engine.spec_draft_tokens > 0) == drafts
