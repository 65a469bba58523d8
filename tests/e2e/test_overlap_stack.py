"""A worker started with --overlap serves the same tokens through the whole stack as the engine
run plainly, streaming and not, with concurrent requests and a client that leaves early."""

from __future__ import annotations

import concurrent.futures
import time

import openai
import pytest

from services.worker.engine.engine import LLMEngine
from services.worker.engine.engine_config import EngineConfig
from shared.sampling_params import SamplingParams
from shared.tokenizer import Tokenizer
from tests.e2e.conftest import MODEL_NAME, metrics, start_stack


@pytest.fixture(scope="module")
def overlap_stack(tiny_model, tmp_path_factory):
    s = start_stack(tmp_path_factory.mktemp("overlap-stack"), tiny_model, worker_args=("--overlap",))
    yield s
    s.stop()


@pytest.fixture(scope="module")
def client(overlap_stack):
    return openai.OpenAI(base_url=overlap_stack.url + "/v1", api_key="unused", max_retries=0, timeout=60)


def test_concurrent_greedy_requests_equal_the_plain_engine(client, tiny_model):
    tokenizer = Tokenizer.from_dir(tiny_model)
    prompts = ["def fibonacci(n):", "Once upon a time", "abc", "The quick brown fox jumps"]
    lengths = [20, 7, 33, 12]
    engine = LLMEngine(EngineConfig(model_dir=str(tiny_model), num_blocks=64))
    expected = [tokenizer.decode(engine.generate([tokenizer.encode(p)],
                                                 SamplingParams(temperature=0.0, max_tokens=n, ignore_eos=True))[0])
                for p, n in zip(prompts, lengths)]

    def ask(i):
        if i % 2:  # streamed
            chunks = client.completions.create(model=MODEL_NAME, prompt=prompts[i], max_tokens=lengths[i],
                                               temperature=0, stream=True, extra_body={"ignore_eos": True})
            return "".join(c.choices[0].text for c in chunks if c.choices)
        return client.completions.create(model=MODEL_NAME, prompt=prompts[i], max_tokens=lengths[i], temperature=0,
                                         extra_body={"ignore_eos": True}).choices[0].text

    with concurrent.futures.ThreadPoolExecutor(4) as pool:
        assert list(pool.map(ask, range(4))) == expected


def test_usage_counts_every_token_once(client):
    r = client.completions.create(model=MODEL_NAME, prompt="Once upon a time", max_tokens=9, temperature=0.7,
                                  seed=3, n=2, extra_body={"ignore_eos": True})
    assert r.usage.completion_tokens == 18
    assert all(c.finish_reason == "length" for c in r.choices)


def test_early_disconnect_frees_kv(overlap_stack, client):
    stream = client.completions.create(model=MODEL_NAME, prompt="hello", max_tokens=2000, temperature=0,
                                       stream=True, extra_body={"ignore_eos": True})
    for i, _ in enumerate(stream):
        if i == 3:
            break
    stream.close()
    deadline = time.monotonic() + 5
    m = metrics(overlap_stack)
    while (m.get("inferno:num_requests_running", 1) or m.get("inferno:kv_cache_usage_perc", 1)) \
            and time.monotonic() < deadline:
        time.sleep(0.1)
        m = metrics(overlap_stack)
    assert m["inferno:num_requests_running"] == 0 and m["inferno:kv_cache_usage_perc"] == 0
