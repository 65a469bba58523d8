"""Overlapped steps (step N+1 planned before step N's tokens are read) give exactly the outputs of
plain steps: same tokens, stops, logprobs and lengths, with aborts, penalties and grammars mixed in."""

from __future__ import annotations

import asyncio
import json

import jsonschema
import pytest

from services.worker.engine.request import RequestStatus
from shared.sampling_params import SamplingParams
from tests.models.conftest import eos_ids, make_engine, random_prompt

ARCH = "LlamaForCausalLM"


def run_all(engine, prompts, params, eos=(), matchers=None):
    """Add every request, step until done; per request: tokens, finish reason, logprobs.
    `matchers`: per request, a function making its grammar's matcher, or None."""
    for i, (p, sp) in enumerate(zip(prompts, params)):
        make = matchers[i] if matchers else None
        engine.add_request(f"r{i}", p, sp, eos, matcher=make() if make else None)
    tokens = {f"r{i}": [] for i in range(len(prompts))}
    finish, logprobs = {}, {f"r{i}": [] for i in range(len(prompts))}
    while engine.has_unfinished():
        for out in engine.step():
            assert out.request_id not in finish, "a token after the request finished"
            tokens[out.request_id].extend(out.new_token_ids)
            if out.logprobs is not None:
                logprobs[out.request_id].append((out.logprobs, out.top_logprobs))
            if out.finished:
                finish[out.request_id] = out.finish_reason
    return [(tokens[f"r{i}"], finish.get(f"r{i}"), logprobs[f"r{i}"]) for i in range(len(prompts))]


def same_answers(got, want) -> bool:
    """The same tokens and finish reasons, and log-probabilities to 1e-5: a CPU GEMM's last bits may
    follow the batch's row count (its blocking), which overlapped steps change (seen on some hosts)."""
    def flat(answers):
        return [(t, f, [(c, [[i for i, _ in row] for row in top]) for c, top in lp]) for t, f, lp in answers]

    def numbers(answers):
        return [x for _, _, lp in answers for c, top in lp for x in [*c, *(v for row in top for _, v in row)]]

    return flat(got) == flat(want) and numbers(got) == pytest.approx(numbers(want), abs=1e-5)


@pytest.fixture
def model_dir(model_dirs):
    return model_dirs[ARCH]


def workload(vocab: int):
    prompts = [random_prompt(n, vocab, seed=50 + n) for n in (7, 23, 3, 40, 16, 11)]
    sample = dict(temperature=0.8, top_k=40, top_p=0.95, seed=7)
    params = [
        SamplingParams(max_tokens=9, ignore_eos=True, temperature=0.0),
        SamplingParams(max_tokens=14, **sample),
        SamplingParams(max_tokens=1, ignore_eos=True, temperature=0.0),
        SamplingParams(max_tokens=12, logprobs=3, **sample),
        SamplingParams(max_tokens=20, min_tokens=5, temperature=1.5, seed=3),
        SamplingParams(max_tokens=10, repetition_penalty=1.3, presence_penalty=0.5, seed=5,
                       temperature=0.7),
    ]
    return prompts, params


def test_overlap_matches_plain_steps(model_dir):
    vocab = make_engine(model_dir).model_config.vocab_size
    prompts, params = workload(vocab)
    plain = run_all(make_engine(model_dir, overlap=False), prompts, params, eos_ids(model_dir))
    engine = make_engine(model_dir, overlap=True)
    overlapped = run_all(engine, prompts, params, eos_ids(model_dir))
    assert overlapped == plain
    assert [len(t) for t, _, _ in plain][:4] == [9, 14, 1, 12]
    assert engine.block_manager.num_free_blocks == engine.block_manager.num_total_blocks


def test_stop_token_mid_stream_drops_the_extra_row(model_dir):
    """A stop id found in step N's token; step N+1 already holds a row for that request."""
    vocab = make_engine(model_dir).model_config.vocab_size
    prompt = random_prompt(9, vocab, seed=77)
    free_run = make_engine(model_dir, overlap=False).generate([prompt], SamplingParams(
        max_tokens=12, ignore_eos=True, temperature=0.0))[0]
    stop_id = free_run[5]
    first = free_run.index(stop_id)  # the first time it appears, maybe before index 5
    params = SamplingParams(max_tokens=12, ignore_eos=True, stop_token_ids=[stop_id], temperature=0.0)
    engine = make_engine(model_dir, overlap=True)
    [(tokens, reason, _)] = run_all(engine, [prompt], [params])
    assert tokens == free_run[:first + 1] and reason == "stop"
    assert engine.block_manager.num_free_blocks == engine.block_manager.num_total_blocks
    assert not engine.has_unfinished()


def test_abort_while_a_step_is_in_flight_frees_everything(model_dir):
    vocab = make_engine(model_dir).model_config.vocab_size
    engine = make_engine(model_dir, overlap=True)
    params = SamplingParams(max_tokens=30, ignore_eos=True, temperature=0.0)
    engine.add_request("a", random_prompt(20, vocab, seed=1), params)
    engine.add_request("b", random_prompt(20, vocab, seed=2), params)
    outputs = []
    for _ in range(4):
        outputs += engine.step()
    assert engine._inflight  # a step is on its way
    assert engine.abort("a")
    while engine.has_unfinished():
        outputs += engine.step()
    assert [o for o in outputs if o.request_id == "a" and o.finished] == []
    b = [t for o in outputs if o.request_id == "b" for t in o.new_token_ids]
    assert len(b) == 30
    assert engine.block_manager.num_free_blocks == engine.block_manager.num_total_blocks


def test_penalties_wait_for_the_previous_token(model_dir):
    """A request with penalties is never planned while its last token is on the device."""
    vocab = make_engine(model_dir).model_config.vocab_size
    engine = make_engine(model_dir, overlap=True)
    params = SamplingParams(max_tokens=6, frequency_penalty=1.0, temperature=0.0)
    request = engine.add_request("p", random_prompt(10, vocab, seed=4), params)
    while engine.has_unfinished():
        for launched in engine._inflight:
            assert not any(s.pending_input for s in launched.plan.scheduled)
        engine.step()
    assert request.status is RequestStatus.FINISHED_LENGTH and request.num_output_tokens == 6


def test_preempted_request_keeps_the_token_that_was_in_flight(model_dir):
    vocab = make_engine(model_dir).model_config.vocab_size
    prompts = [random_prompt(n, vocab, seed=90 + n) for n in (30, 30, 30)]
    params = [SamplingParams(max_tokens=40, ignore_eos=True, seed=11)] * 3
    plain = run_all(make_engine(model_dir, overlap=False, num_blocks=9), prompts, params)
    engine = make_engine(model_dir, overlap=True, num_blocks=9)
    assert run_all(engine, prompts, params) == plain
    assert engine.batcher.num_preemptions_total > 0
    assert all(len(t) == 40 for t, _, _ in plain)
    assert engine.block_manager.num_free_blocks == 9


SCHEMA = {"type": "object", "properties": {"ok": {"type": "boolean"}, "tag": {"enum": ["red", "green", "blue"]},
                                           "n": {"type": "integer"}}, "required": ["ok", "tag"]}


def test_grammar_rows_overlap_like_plain_steps(model_dir):
    """Constrained rows in overlapped steps: step N+1's draw waits until step N's tokens reached the
    matchers (grammar_mask.py), so the answers are those of plain steps, and each ended one validates."""
    from services.worker.grammar import Grammars
    from shared.tokenizer import Tokenizer

    eos = eos_ids(model_dir)
    vocab = make_engine(model_dir).model_config.vocab_size
    grammars = Grammars(str(model_dir), vocab, eos)

    def matcher():
        return asyncio.run(grammars.matcher("json_schema", json.dumps(SCHEMA)))

    prompts = [random_prompt(n, vocab, seed=60 + n) for n in (5, 17, 9, 30, 12)]
    params = [SamplingParams(max_tokens=40, temperature=0.0),
              SamplingParams(max_tokens=40, temperature=0.9, seed=3, logprobs=2),
              SamplingParams(max_tokens=12, ignore_eos=True, temperature=0.0),
              SamplingParams(max_tokens=40, temperature=1.2, top_k=50, seed=8),
              SamplingParams(max_tokens=6, temperature=0.0)]  # cut mid-answer: "length"
    matchers = [matcher, matcher, None, matcher, matcher]
    plain = run_all(make_engine(model_dir, overlap=False), prompts, params, eos, matchers)
    engine = make_engine(model_dir, overlap=True)
    assert same_answers(run_all(engine, prompts, params, eos, matchers), plain)
    tok = Tokenizer.from_path(model_dir)
    for (tokens, reason, _), make in zip(plain, matchers):
        if make is not None and reason == "stop":
            jsonschema.validate(json.loads(tok.decode(tokens)), SCHEMA)
    assert [r for _, r, _ in plain].count("stop") >= 2 and plain[4][1] == "length"
    assert plain[1][2] and all(lp[0] > float("-inf") for lp, _ in plain[1][2])  # the drawn token was allowed
    assert engine.block_manager.num_free_blocks == engine.block_manager.num_total_blocks
    grammars.close()
