"""Speculative decoding through the stack (issue 36): a worker with n-gram drafts (a draft model; an
EAGLE-3 head on the decode worker of a split stack) answers exactly as without them (a request may
opt out with "speculative": false), alone and eight at once, and /metrics counts the drafts and the
confirmed tokens."""

from __future__ import annotations

import json
import re
import time
import urllib.request
from concurrent.futures import ThreadPoolExecutor

import openai
import pytest

from tests.e2e.conftest import MODEL_NAME, start_stack

SPEC = {"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_min": 1, "prompt_lookup_max": 3}


@pytest.fixture(scope="module")
def stack(tiny_model, tmp_path_factory):
    s = start_stack(tmp_path_factory.mktemp("spec"), tiny_model,
                    worker_args=("--speculative-config", json.dumps(SPEC)))
    yield s
    s.stop()


def test_answers_are_those_without_speculation(stack):
    c = openai.OpenAI(base_url=stack.url + "/v1", api_key="unused", max_retries=0, timeout=60)
    prompts = ["one two three one two three one two three one two", "Tell me a story about a dog.",
               "a b c d a b c d a b", "The quick brown fox", "x y x y x y x y", "Hello", "1 2 1 2 1 2",
               "red green blue red green blue"]

    def ask(prompt: str, seed: int, speculative: bool) -> str:
        kw = dict(temperature=0.0) if seed < 0 else dict(temperature=0.9, seed=seed)
        r = c.completions.create(model=MODEL_NAME, prompt=prompt, max_tokens=40, **kw,
                                 extra_body={"ignore_eos": True, "speculative": speculative})
        return r.choices[0].text

    with ThreadPoolExecutor(8) as pool:
        for seed in (-1, 3):  # greedy, then seeded
            alone = [ask(p, seed, True) for p in prompts[:2]]
            together = list(pool.map(lambda p: ask(p, seed, True), prompts))
            plain = list(pool.map(lambda p: ask(p, seed, False), prompts))
            assert together == plain and alone == plain[:2]
    drafted, accepted = spec_metric(stack, "ngram", accepted_too=True)  # the counts come with the workers' heartbeats
    assert drafted > 0 and 0 < accepted <= drafted


def test_logprobs_and_usage_come_for_every_token_of_a_confirmed_run(stack):
    c = openai.OpenAI(base_url=stack.url + "/v1", api_key="unused", max_retries=0, timeout=60)

    def ask(speculative: bool):
        r = c.completions.create(model=MODEL_NAME, prompt="a b c d a b c d a b c d a b", max_tokens=30,
                                 temperature=0.0, logprobs=2, extra_body={"ignore_eos": True,
                                                                          "speculative": speculative})
        return r.choices[0].text, r.choices[0].logprobs, r.usage

    (text, lp, usage), (ref_text, ref_lp, ref_usage) = ask(True), ask(False)
    # What the drafts gave, in OpenAI's predicted-output counts; none without speculation.
    details = usage.completion_tokens_details
    assert details.accepted_prediction_tokens > 0 and details.rejected_prediction_tokens >= 0
    assert ref_usage.completion_tokens_details is None
    assert text == ref_text and lp.tokens == ref_lp.tokens and len(lp.token_logprobs) == 30
    assert max(abs(a - b) for a, b in zip(lp.token_logprobs, ref_lp.token_logprobs)) < 1e-4


def test_a_stop_string_inside_a_confirmed_run_cuts_it_exactly(stack):
    c = openai.OpenAI(base_url=stack.url + "/v1", api_key="unused", max_retries=0, timeout=60)
    prompt = "one two three one two three one two three one two"
    free = c.completions.create(model=MODEL_NAME, prompt=prompt, max_tokens=30, temperature=0.0,
                                extra_body={"ignore_eos": True, "speculative": False}).choices[0].text
    stop = free[len(free) // 2:len(free) // 2 + 3]

    def ask(speculative: bool):
        return c.completions.create(model=MODEL_NAME, prompt=prompt, max_tokens=30, temperature=0.0, stop=[stop],
                                    extra_body={"ignore_eos": True, "speculative": speculative})

    r, ref = ask(True), ask(False)
    assert r.choices[0].text == ref.choices[0].text == free[:free.index(stop)]
    assert r.choices[0].finish_reason == ref.choices[0].finish_reason == "stop"
    assert r.usage.completion_tokens == ref.usage.completion_tokens


def spec_metric(stack, method: str, accepted_too: bool = False) -> tuple[float, float]:
    """(draft tokens, accepted tokens) of `method` in /metrics, once a heartbeat carried drafts (and
    confirmed tokens: `accepted_too`)."""
    deadline = time.monotonic() + 5
    while True:
        text = urllib.request.urlopen(stack.url + "/metrics").read().decode()
        found = [re.search(rf'^inferno:spec_decode_num_{name}_total{{method="{method}"}} (\S+)', text, re.M)
                 for name in ("draft_tokens", "accepted_tokens")]
        drafted, accepted = (float(m.group(1)) if m else 0.0 for m in found)
        if (accepted if accepted_too else drafted) > 0 or time.monotonic() > deadline:
            return drafted, accepted
        time.sleep(0.2)


def same_answers(stack, prompts) -> None:
    c = openai.OpenAI(base_url=stack.url + "/v1", api_key="unused", max_retries=0, timeout=60)

    def ask(prompt: str, seed: int, speculative: bool) -> str:
        kw = dict(temperature=0.0) if seed < 0 else dict(temperature=0.9, seed=seed)
        return c.completions.create(model=MODEL_NAME, prompt=prompt, max_tokens=24, **kw,
                                    extra_body={"ignore_eos": True, "speculative": speculative}).choices[0].text

    with ThreadPoolExecutor(4) as pool:
        for seed in (-1, 3):
            spec = list(pool.map(lambda p: ask(p, seed, True), prompts))
            assert spec == list(pool.map(lambda p: ask(p, seed, False), prompts))


def test_a_draft_model_through_the_stack(tiny_model, tmp_path_factory):
    """The target as its own draft model: the answers as without it, every greedy draft confirmed."""
    draft = {"method": "draft_model", "model": str(tiny_model), "num_speculative_tokens": 3}
    stack = start_stack(tmp_path_factory.mktemp("spec-draft"), tiny_model,
                        worker_args=("--speculative-config", json.dumps(draft)))
    try:
        same_answers(stack, ["Tell me a story.", "one two three", "The quick brown fox", "Hello"])
        drafted, accepted = spec_metric(stack, "draft_model", accepted_too=True)
        assert drafted > 0 and accepted > 0
    finally:
        stack.stop()


def test_an_eagle3_head_on_the_decode_worker_of_a_split_stack(tiny_model, tmp_path_factory):
    """Prefill and decode apart, the decode worker drafting with an EAGLE-3 head (its flag after the
    others wins): the answers as without drafts."""
    from inferno.tools.make_model import write_eagle3

    vocab = json.loads((tiny_model / "config.json").read_text())["vocab_size"]
    head = write_eagle3(tmp_path_factory.mktemp("head") / "eagle3", target_preset="tiny", dtype="float32",
                        target_vocab_size=vocab)
    eagle = {"method": "eagle3", "model": str(head), "num_speculative_tokens": 3}
    stack = start_stack(tmp_path_factory.mktemp("spec-pd"), tiny_model, workers=0, prefill_workers=1,
                        decode_workers=1, scheduler_args=("--disagg-min-prefill-tokens", "1", "--no-disagg-by-time"),
                        decode_worker_args=("--speculative-config", json.dumps(eagle)))
    try:
        same_answers(stack, ["Tell me a story.", "one two three one two three", "Hello there"])
        assert spec_metric(stack, "eagle3")[0] > 0
    finally:
        stack.stop()
