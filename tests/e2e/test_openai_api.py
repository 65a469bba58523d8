"""The OpenAI API through the whole stack (gateway → NATS → scheduler → worker), with the real client."""

from __future__ import annotations

import json
import time
import urllib.error
import urllib.request

import openai
import pytest

from services.worker.engine.engine import LLMEngine
from services.worker.engine.engine_config import EngineConfig
from shared.sampling_params import SamplingParams
from shared.tokenizer import Tokenizer
from tests.e2e.conftest import MODEL_NAME, metrics


@pytest.fixture(scope="module")
def client(stack):
    return openai.OpenAI(base_url=stack.url + "/v1", api_key="unused", max_retries=0, timeout=60)


def test_models_lists_the_served_model(client):
    assert [m.id for m in client.models.list().data] == [MODEL_NAME]


def test_chat_non_streaming_with_usage(client):
    r = client.chat.completions.create(model=MODEL_NAME, messages=[{"role": "user", "content": "Hello there"}],
                                       max_tokens=12, temperature=0, extra_body={"ignore_eos": True})
    choice = r.choices[0]
    assert choice.finish_reason == "length"
    assert choice.message.role == "assistant" and isinstance(choice.message.content, str)
    assert r.usage.completion_tokens == 12
    assert r.usage.prompt_tokens > 5
    assert r.usage.total_tokens == r.usage.prompt_tokens + 12


def test_chat_streaming_matches_non_streaming(client):
    kwargs = dict(model=MODEL_NAME, messages=[{"role": "user", "content": "Count with me"}], max_tokens=10,
                  temperature=0, extra_body={"ignore_eos": True})
    full = client.chat.completions.create(**kwargs).choices[0].message.content
    chunks = list(client.chat.completions.create(stream=True, stream_options={"include_usage": True}, **kwargs))
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text == full
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == 10
    assert [c.choices[0].finish_reason for c in chunks if c.choices and c.choices[0].finish_reason] == ["length"]


def test_completions_streaming_and_n2(client):
    r = client.completions.create(model=MODEL_NAME, prompt="The quick brown fox", max_tokens=8, n=2,
                                  temperature=1.0, seed=11, extra_body={"ignore_eos": True})
    assert sorted(c.index for c in r.choices) == [0, 1]
    assert r.usage.completion_tokens == 16
    streamed = {0: "", 1: ""}
    for chunk in client.completions.create(model=MODEL_NAME, prompt="The quick brown fox", max_tokens=8, n=2,
                                           temperature=1.0, seed=11, stream=True, extra_body={"ignore_eos": True}):
        for c in chunk.choices:
            streamed[c.index] += c.text
    assert streamed == {c.index: c.text for c in r.choices}


def test_seed_reproducible_and_different_seeds_differ(client):
    def sample(seed):
        return client.completions.create(model=MODEL_NAME, prompt="Once upon a time", max_tokens=16,
                                         temperature=1.0, seed=seed, extra_body={"ignore_eos": True}).choices[0].text
    assert sample(5) == sample(5)
    assert sample(5) != sample(6)


def test_greedy_output_equals_the_engine(client, tiny_model):
    tokenizer = Tokenizer.from_dir(tiny_model)
    prompt = "def fibonacci(n):"
    r = client.completions.create(model=MODEL_NAME, prompt=prompt, max_tokens=20, temperature=0,
                                  extra_body={"ignore_eos": True})
    engine = LLMEngine(EngineConfig(model_dir=str(tiny_model), num_blocks=64))
    [ids] = engine.generate([tokenizer.encode(prompt)], SamplingParams(temperature=0.0, max_tokens=20, ignore_eos=True))
    assert r.choices[0].text == tokenizer.decode(ids)


def test_stop_string_is_cut(client):
    base = client.completions.create(model=MODEL_NAME, prompt="abc", max_tokens=30, temperature=0,
                                     extra_body={"ignore_eos": True}).choices[0].text
    assert len(base) > 6
    stop = base[3:6]  # three characters from the middle, likely spanning tokens
    r = client.completions.create(model=MODEL_NAME, prompt="abc", max_tokens=30, temperature=0, stop=[stop],
                                  extra_body={"ignore_eos": True})
    assert r.choices[0].finish_reason == "stop"
    assert r.choices[0].text == base[:base.index(stop)]


def test_logprobs_shapes(client):
    r = client.chat.completions.create(model=MODEL_NAME, messages=[{"role": "user", "content": "hi"}], max_tokens=4,
                                       logprobs=True, top_logprobs=3, extra_body={"ignore_eos": True})
    content = r.choices[0].logprobs.content
    assert len(content) == 4
    for entry in content:
        assert entry.logprob <= 0 and len(entry.top_logprobs) == 3
        assert entry.top_logprobs[0].logprob >= entry.top_logprobs[-1].logprob
    c = client.completions.create(model=MODEL_NAME, prompt="hi", max_tokens=3, logprobs=2,
                                  extra_body={"ignore_eos": True})
    lp = c.choices[0].logprobs
    assert len(lp.tokens) == len(lp.token_logprobs) == len(lp.top_logprobs) == 3
    assert all(len(alts) == 2 for alts in lp.top_logprobs)


def post(stack, path, body: bytes | dict, headers=None):
    data = body if isinstance(body, bytes) else json.dumps(body).encode()
    req = urllib.request.Request(stack.url + path, data=data, method="POST",
                                 headers={"Content-Type": "application/json", **(headers or {})})
    try:
        with urllib.request.urlopen(req, timeout=30) as r:
            return r.status, json.loads(r.read()), dict(r.headers)
    except urllib.error.HTTPError as e:
        return e.code, json.loads(e.read()), dict(e.headers)


BAD = [
    (b"{not json", 400, None),
    ({"model": MODEL_NAME, "prompt": "x", "max_tokens": -1}, 400, "max_tokens"),
    ({"model": MODEL_NAME, "prompt": "x", "temperature": -1}, 400, "temperature"),
    ({"model": MODEL_NAME, "prompt": "x", "n": 1000}, 400, "n"),
    ({"model": MODEL_NAME, "prompt": "x", "logprobs": 99}, 400, "logprobs"),
    ({"model": MODEL_NAME, "prompt": "x", "logit_bias": {"99999999": 1}}, 400, "logit_bias"),
    ({"model": MODEL_NAME, "prompt": "x", "stop": ["s"] * 100}, 400, "stop"),
    ({"model": MODEL_NAME, "prompt": "x", "max_tokens": 5000}, 400, None),
    ({"model": "no-such-model", "prompt": "x"}, 404, None),
]


@pytest.mark.parametrize("body,status,param", BAD)
def test_bad_input_gets_openai_error_and_stack_keeps_serving(stack, client, body, status, param):
    code, payload, _ = post(stack, "/v1/completions", body)
    assert code == status, payload
    err = payload["error"]
    assert set(err) >= {"message", "type", "param", "code"} and err["message"]
    if param:
        assert err["param"] == param
    assert client.completions.create(model=MODEL_NAME, prompt="still alive", max_tokens=2).choices


def test_context_length_exceeded(stack):
    code, payload, _ = post(stack, "/v1/completions", {"model": MODEL_NAME, "prompt": [10] * 2040,
                                                        "max_tokens": 16})
    assert code == 400 and payload["error"]["code"] == "context_length_exceeded"


def test_body_over_limit_is_413(stack):
    code, payload, _ = post(stack, "/v1/completions", {"model": MODEL_NAME, "prompt": "x" * 100_000})
    assert code == 413 and payload["error"]["message"]


def test_client_disconnect_aborts_and_frees_kv(stack):
    import http.client

    conn = http.client.HTTPConnection("127.0.0.1", stack.cfg.port, timeout=30)
    body = json.dumps({"model": MODEL_NAME, "prompt": "a long story", "max_tokens": 1500, "stream": True,
                       "ignore_eos": True})
    conn.request("POST", "/v1/completions", body=body, headers={"Content-Type": "application/json"})
    resp = conn.getresponse()
    assert resp.status == 200
    resp.readline()  # the first event: the request is running on the worker
    deadline = time.monotonic() + 10
    while metrics(stack).get("inferno:num_requests_running", 0) < 1 and time.monotonic() < deadline:
        time.sleep(0.1)
    assert metrics(stack)["inferno:kv_cache_usage_perc"] > 0
    conn.sock.close()
    conn.close()
    deadline = time.monotonic() + 5
    m = metrics(stack)
    while (m.get("inferno:num_requests_running", 1) or m.get("inferno:kv_cache_usage_perc", 1)) and time.monotonic() < deadline:
        time.sleep(0.1)
        m = metrics(stack)
    assert m["inferno:num_requests_running"] == 0
    assert m["inferno:kv_cache_usage_perc"] == 0
