"""Jump-forward decoding (issue 34): the tokens a grammar forces are drafted and checked in one
forward against the model's own draws, so the answers are token for token those of plain
constrained decoding, greedy and seeded, on 50 schemas, in fewer steps."""

from __future__ import annotations

import asyncio
import json

import jsonschema
import pytest

from inferno.tools.schema_corpus import schema_corpus
from shared.sampling_params import SamplingParams
from tests.models.conftest import eos_ids, make_engine, random_prompt, run_requests

ARCH = "LlamaForCausalLM"
SCHEMAS = schema_corpus(50, seed=9, bounded=True)


@pytest.fixture(scope="module")
def setup(model_dirs):
    from services.worker.grammar import Grammars

    d = model_dirs[ARCH]
    eos = eos_ids(d)
    vocab = make_engine(d).model_config.vocab_size
    grammars = Grammars(str(d), vocab, eos)
    yield d, eos, vocab, grammars
    grammars.close()


def run(engine, grammars, prompts, params, eos):
    """Every request under its schema; per request its tokens and finish reason, and the forwards taken."""
    def matcher(i):
        return lambda: asyncio.run(grammars.matcher("json_schema", json.dumps(SCHEMAS[i % len(SCHEMAS)])))
    return run_requests(engine, prompts, params, eos, [matcher(i) for i in range(len(prompts))])


@pytest.mark.parametrize("sampled", [False, True], ids=["greedy", "seeded"])
def test_jump_forward_answers_are_plain_constrained_decodings(setup, sampled):
    from shared.tokenizer import Tokenizer

    d, eos, vocab, grammars = setup
    prompts = [random_prompt(3 + i % 11, vocab, seed=400 + i) for i in range(len(SCHEMAS))]
    params = [SamplingParams(max_tokens=48, temperature=0.8, top_k=40, seed=i) if sampled
              else SamplingParams(max_tokens=48, temperature=0.0) for i in range(len(SCHEMAS))]
    plain, plain_steps = run(make_engine(d, max_num_seqs=64), grammars, prompts, params, eos)
    engine = make_engine(d, max_num_seqs=64, jump_forward=8, overlap=True)
    jumped, jumped_steps = run(engine, grammars, prompts, params, eos)
    assert jumped == plain
    assert jumped_steps < plain_steps
    assert list(engine.draft_counts) == ["jump_forward"]  # [drafts, tokens, confirmed], by method
    tok = Tokenizer.from_path(d)
    ended = [(i, t) for i, (t, reason) in enumerate(plain) if reason == "stop"]
    assert len(ended) >= 25
    for i, tokens in ended:
        jsonschema.validate(json.loads(tok.decode(tokens)), SCHEMAS[i])
    assert engine.block_manager.num_free_blocks == engine.block_manager.num_total_blocks


def test_one_request_takes_fewer_forwards_than_tokens(setup):
    """Batch 1 under a schema of fixed keys: forwards per output token below one."""
    d, eos, vocab, grammars = setup
    prompt = [random_prompt(9, vocab, seed=5)]
    params = [SamplingParams(max_tokens=64, temperature=0.0)]
    [plain], plain_steps = run(make_engine(d), grammars, prompt, params, eos)
    [(jumped, reason)], steps = run(make_engine(d, jump_forward=16), grammars, prompt, params, eos)
    assert (jumped, reason) == plain
    assert plain_steps == len(jumped) and steps < 0.9 * len(jumped)
    print(f"batch 1: {steps} forwards for {len(jumped)} tokens")
