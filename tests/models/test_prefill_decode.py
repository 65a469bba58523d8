"""The engine's two hand-off verbs: a prefill engine stops after the first token and exports the
prompt's KV as pages; a decode engine reserves blocks, imports the pages and goes on. The tokens
must be those of one aggregated engine, and transformers'."""

from __future__ import annotations

import pytest
import torch

from shared.sampling_params import SamplingParams
from tests.models.conftest import eos_ids, hf_greedy, make_engine, random_prompt
from tests.models.test_transformers_parity import greedy

ARCH = "LlamaForCausalLM"
LENGTHS = [1, 5, 16, 17, 33, 64, 70]  # one token, partial blocks, exact blocks, several blocks


def prefill(engine, rid, prompt, params, eos, matcher=None):
    engine.add_request(rid, prompt, params, eos, handoff=True, matcher=matcher)
    while True:
        for out in engine.step():
            if out.request_id == rid:
                return out


def hand_off(p_engine, d_engine, rid, prompt, params, eos, matchers=(None, None)):
    """Run the prompt on p_engine, move its KV to d_engine; returns (first output, reservation).
    `matchers`: a structured output's fresh matcher on each side."""
    first = prefill(p_engine, rid, prompt, params, eos, matchers[0])
    assert first.finish_reason is None and first.handoff is not None
    first.handoff.ready()
    res = d_engine.reserve_import(rid, prompt, params, eos, matcher=matchers[1])
    assert res is not None
    res.buffer.copy_(first.handoff.pages[res.skip_blocks:])
    d_engine.complete_import(rid, first.new_token_ids[0], first.handoff.seed, first.handoff.num_cached_tokens)
    return first, res


def run_all(engine) -> dict[str, list[int]]:
    out: dict[str, list[int]] = {}
    while engine.has_unfinished():
        for o in engine.step():
            out.setdefault(o.request_id, []).extend(o.new_token_ids)
    return out


@pytest.mark.parametrize("overlap", [False, True])
def test_handed_off_requests_decode_as_one_engine(overlap, model_dirs, hf_models):
    d = model_dirs[ARCH]
    eos = eos_ids(d)
    p_engine = make_engine(d, overlap=overlap, long_prefill_token_threshold=7, max_num_batched_tokens=20)
    d_engine = make_engine(d, overlap=overlap)
    vocab = p_engine.model_config.vocab_size
    prompts = [random_prompt(n, vocab, seed=200 + n) for n in LENGTHS]
    firsts = {}
    for i, prompt in enumerate(prompts):
        first, _ = hand_off(p_engine, d_engine, f"r{i}", prompt, greedy(), eos)
        firsts[f"r{i}"] = first.new_token_ids
    rest = run_all(d_engine)
    aggregated = make_engine(d).generate(prompts, greedy(), eos)
    for i, prompt in enumerate(prompts):
        tokens = firsts[f"r{i}"] + rest[f"r{i}"]
        assert tokens == aggregated[i], i
        assert tokens == hf_greedy(hf_models(ARCH), prompt, 32, eos), i
    for e in (p_engine, d_engine):
        assert e.block_manager.num_free_blocks == e.block_manager.num_total_blocks


def test_pages_the_decode_side_caches_are_not_sent(model_dirs):
    d = model_dirs[ARCH]
    p_engine, d_engine = make_engine(d), make_engine(d)
    vocab = p_engine.model_config.vocab_size
    shared = random_prompt(40, vocab, seed=7)  # two full blocks and a bit
    hand_off(p_engine, d_engine, "a", shared + [11, 12], greedy(), ())
    run_all(d_engine)
    _, res = hand_off(p_engine, d_engine, "b", shared + [13, 14, 15], greedy(), ())
    assert res.skip_blocks == 2 and res.buffer.shape[0] == 1
    [expected] = make_engine(d).generate([shared + [13, 14, 15]], greedy())
    assert run_all(d_engine)["b"] == expected[1:]


def test_seeded_sampling_and_logprobs_survive_the_hand_off(model_dirs):
    d = model_dirs[ARCH]
    p_engine, d_engine = make_engine(d), make_engine(d)
    prompt = random_prompt(21, p_engine.model_config.vocab_size, seed=9)
    params = SamplingParams(temperature=0.8, top_p=0.9, seed=1234, max_tokens=24, ignore_eos=True, logprobs=2)
    first, _ = hand_off(p_engine, d_engine, "s", prompt, params, ())
    tokens, logprobs = list(first.new_token_ids), list(first.logprobs)
    while d_engine.has_unfinished():
        for o in d_engine.step():
            tokens += o.new_token_ids
            logprobs += o.logprobs
    agg = make_engine(d)
    agg.add_request("s", prompt, params, ())
    want_tokens, want_logprobs = [], []
    while agg.has_unfinished():
        for o in agg.step():
            want_tokens += o.new_token_ids
            want_logprobs += o.logprobs
    assert tokens == want_tokens
    assert max(abs(a - b) for a, b in zip(logprobs, want_logprobs)) < 1e-5


def test_short_requests_end_on_the_prefill_side(model_dirs):
    d = model_dirs[ARCH]
    engine = make_engine(d)
    out = prefill(engine, "one", [5, 6, 7], SamplingParams(temperature=0.0, max_tokens=1), ())
    assert out.finish_reason == "length" and out.handoff is None
    assert engine.block_manager.num_free_blocks == engine.block_manager.num_total_blocks


def test_reservations_refused_cancelled_and_aborted(model_dirs):
    d = model_dirs[ARCH]
    engine = make_engine(d, num_blocks=6)
    total = engine.block_manager.num_total_blocks
    params = SamplingParams(temperature=0.0, max_tokens=8)
    big = engine.reserve_import("big", list(range(5, 85)), params)  # 80 tokens: 5 blocks
    assert big is not None and engine.block_manager.num_free_blocks == 1
    assert engine.reserve_import("more", list(range(5, 45)), params) is None  # no room now
    with pytest.raises(ValueError):  # never fits: more blocks than the pool has
        engine.reserve_import("huge", list(range(5, 200)), params)
    assert engine.abort("big")  # an abort before the pages arrived frees the reservation
    assert engine.block_manager.num_free_blocks == total
    res = engine.reserve_import("c", list(range(5, 25)), params)
    assert engine.cancel_import("c") and not engine.cancel_import("c")
    assert engine.block_manager.num_free_blocks == total and not engine.has_unfinished()
    assert res.buffer.shape[0] == 2
    engine.reserve_import("bad", [5, 6], params)
    with pytest.raises(ValueError):  # a first token outside the vocabulary drops the reservation
        engine.complete_import("bad", 10**9, 1)
    torch.testing.assert_close(torch.tensor(engine.block_manager.num_free_blocks), torch.tensor(total))


def test_hand_offs_take_the_buffer_set_aside_and_give_it_back(model_dirs):
    """A prefill engine with a hand-off buffer (page_arena.py) gathers into it while it has room,
    allocates afresh when it has not, and gets each run back when its pages have been sent."""
    d = model_dirs[ARCH]
    p_engine, d_engine = make_engine(d, handoff_buffer_tokens=64), make_engine(d)  # 4 pages of 16 tokens
    vocab = p_engine.model_config.vocab_size
    prompts = {"a": random_prompt(17, vocab, seed=301), "b": random_prompt(33, vocab, seed=302),
               "c": random_prompt(70, vocab, seed=303)}  # 2, 3 and 5 pages
    a = prefill(p_engine, "a", prompts["a"], greedy(), ())
    arena = p_engine.exporter.arena
    buffer = arena.buffer
    assert a.handoff.release is not None and arena.free_pages == 2
    assert a.handoff.pages.data_ptr() == buffer.data_ptr()
    b = prefill(p_engine, "b", prompts["b"], greedy(), ())  # 3 pages, 2 free: a fresh allocation
    c = prefill(p_engine, "c", prompts["c"], greedy(), ())  # more than the whole buffer
    assert b.handoff.release is None and c.handoff.release is None
    firsts = {}
    for rid, out in (("a", a), ("b", b), ("c", c)):
        res = d_engine.reserve_import(rid, prompts[rid], greedy(), ())
        res.buffer.copy_(out.handoff.pages[res.skip_blocks:])
        out.handoff.done()
        out.handoff.done()  # twice: released once
        d_engine.complete_import(rid, out.new_token_ids[0], out.handoff.seed, out.handoff.num_cached_tokens)
        firsts[rid] = out.new_token_ids
    assert arena.free_pages == 4
    b2 = prefill(p_engine, "b2", prompts["b"], greedy(), ())  # room again: into the buffer
    assert b2.handoff.release is not None and b2.handoff.pages.data_ptr() == buffer.data_ptr()
    b2.handoff.done()
    p_engine.abort("b2")
    rest = run_all(d_engine)
    expected = make_engine(d).generate(list(prompts.values()), greedy())
    for rid, tokens in zip(prompts, expected):
        assert firsts[rid] + rest[rid] == tokens, rid
    assert arena.free_pages == 4


@pytest.mark.parametrize("overlap", [False, True])
def test_a_structured_output_decodes_on_from_the_prefill_workers_first_token(overlap, model_dirs):
    """The prefill engine draws the first token under the grammar; the decode engine's fresh matcher
    takes it at the import and masks the rest: the answer is the aggregated engine's, and valid."""
    import asyncio
    import json

    import jsonschema

    from services.worker.grammar import Grammars
    from shared.tokenizer import Tokenizer

    d = model_dirs[ARCH]
    eos = eos_ids(d)
    schema = {"type": "object", "properties": {"ok": {"type": "boolean"}, "tag": {"enum": ["red", "green"]}},
              "required": ["ok", "tag"]}
    p_engine, d_engine = make_engine(d, overlap=overlap), make_engine(d, overlap=overlap)
    vocab = p_engine.model_config.vocab_size
    grammars = Grammars(str(d), vocab, eos)

    def matcher():
        return asyncio.run(grammars.matcher("json_schema", json.dumps(schema)))

    prompts = [random_prompt(n, vocab, seed=300 + n) for n in (6, 21)]
    params = [SamplingParams(max_tokens=40, temperature=0.0), SamplingParams(max_tokens=40, temperature=0.9, seed=4)]
    firsts = {}
    for i, (prompt, sp) in enumerate(zip(prompts, params)):
        first, _ = hand_off(p_engine, d_engine, f"r{i}", prompt, sp, eos, (matcher(), matcher()))
        firsts[f"r{i}"] = first.new_token_ids
    rest = run_all(d_engine)
    one = make_engine(d)
    for i, (prompt, sp) in enumerate(zip(prompts, params)):
        one.add_request(f"a{i}", prompt, sp, eos, matcher=matcher())
    aggregated = run_all(one)
    tok = Tokenizer.from_path(d)
    for i in range(len(prompts)):
        tokens = firsts[f"r{i}"] + rest[f"r{i}"]
        assert tokens == aggregated[f"a{i}"]
        jsonschema.validate(json.loads(tok.decode(tokens)), schema)
    # A first token the grammar does not allow is refused at the import, and the blocks come back.
    bad = matcher()
    d_engine.reserve_import("bad", prompts[0], params[0], eos, matcher=bad)
    with pytest.raises(ValueError, match="grammar"):
        d_engine.complete_import("bad", tok.encode("x")[-1], 1)
    assert d_engine.block_manager.num_free_blocks == d_engine.block_manager.num_total_blocks
    grammars.close()
