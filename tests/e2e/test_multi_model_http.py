"""Several models on one worker through the whole stack (`inferno up --model A --model B --model C`):
each answers through the openai client with its own tokenizer and chat template, as an in-process
engine of that model does; the third does not fit beside the first two, waits in standby, and is
brought in by its first request; /v1/models says which are on the device."""

from __future__ import annotations

import time

import openai
import pytest

from inferno.tools.make_model import write_model
from shared.sampling_params import SamplingParams
from shared.tokenizer import Tokenizer
from tests.e2e.conftest import MODEL_NAME, start_stack
from tests.models.conftest import make_engine
from tests.services.test_gateway_models import write_other_model

MAX_TOKENS = 12
PROMPT = "Once upon a time"
MESSAGES = [{"role": "user", "content": "Say hello."}]


@pytest.fixture(scope="module")
def models(tiny_model, tmp_path_factory):
    root = tmp_path_factory.mktemp("multi")
    return {MODEL_NAME: tiny_model,
            "other": write_other_model(root / "other", arch="Qwen2ForCausalLM", seed=5, dtype="float32", weights=True),
            "spare": write_model(root / "spare", preset="tiny", seed=6, dtype="float32")}


@pytest.fixture(scope="module")
def stack(models, tmp_path_factory):
    more = tuple((models[name], name) for name in ("other", "spare"))
    s = start_stack(tmp_path_factory.mktemp("multi-stack"), models[MODEL_NAME], more_models=more,
                    worker_args=("--memory-share", "0.45", "--memory-share", "0.45", "--memory-share", "0.45",
                                 "--host-memory-gb", "1"))
    yield s
    s.stop()


def engine_text(model_dir, messages=None) -> str:
    """The greedy answer of an in-process engine, the prompt made with that model's own tokenizer."""
    tok = Tokenizer.from_path(model_dir)
    ids = (tok.encode(tok.apply_chat_template(messages, True), add_special_tokens=False) if messages
           else tok.encode(PROMPT))
    out = make_engine(model_dir).generate([ids], SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS,
                                                                 ignore_eos=True))[0]
    return tok.decode(out)


def test_each_model_answers_with_its_own_tokenizer_and_the_standby_one_comes_in(stack, models):
    client = openai.OpenAI(base_url=stack.url + "/v1", api_key="unused", max_retries=0, timeout=60)
    deadline = time.monotonic() + 60  # the first model serves first, the second loads after it
    while (resident := {m.id: m.model_extra["resident"] for m in client.models.list().data})["other"] is False:
        assert time.monotonic() < deadline
        time.sleep(0.2)
    assert resident == {MODEL_NAME: True, "other": True, "spare": False}
    for name in (MODEL_NAME, "other", "spare"):
        r = client.completions.create(model=name, prompt=PROMPT, max_tokens=MAX_TOKENS, temperature=0,
                                      extra_body={"ignore_eos": True})
        assert r.choices[0].text == engine_text(models[name]), name
    r = client.chat.completions.create(model="other", messages=MESSAGES, max_tokens=MAX_TOKENS, temperature=0,
                                       extra_body={"ignore_eos": True})
    assert r.choices[0].message.content == engine_text(models["other"], MESSAGES)
    resident = {m.id: m.model_extra["resident"] for m in client.models.list().data}
    assert resident["spare"] and resident["other"] and not resident[MODEL_NAME]  # the least recently used left
    with pytest.raises(openai.NotFoundError):
        client.completions.create(model="nope", prompt=PROMPT, max_tokens=2)
