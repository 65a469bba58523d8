"""The real demo model (SmolLM2-135M-Instruct GGUF) through the whole stack with the openai client:
20 questions with one-word answers, scored against transformers' answers on the same file."""

from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor

import pytest
import torch

from tests.conftest import left_padded
from tests.e2e.conftest import MODEL_NAME, metrics, start_stack

QUESTIONS = [
    ("What is the capital of France?", "paris"), ("What is the capital of Japan?", "tokyo"),
    ("What is the capital of Italy?", "rome"), ("What is the capital of Germany?", "berlin"),
    ("What is the capital of Spain?", "madrid"), ("What color is the sky on a clear day?", "blue"),
    ("What color is grass?", "green"), ("What is the largest planet in our solar system?", "jupiter"),
    ("Which planet is known as the Red Planet?", "mars"), ("What is the opposite of hot?", "cold"),
    ("Which animal is known as the king of the jungle?", "lion"), ("What do bees make?", "honey"),
    ("What is frozen water called?", "ice"), ("Which ocean is the largest?", "pacific"),
    ("Who wrote Romeo and Juliet?", "shakespeare"), ("What language is spoken in Brazil?", "portuguese"),
    ("What is the chemical symbol for gold?", "au"), ("What is the closest star to Earth?", "sun"),
    ("What gas do plants absorb from the air?", "carbon"), ("What is the opposite of up?", "down"),
]
MAX_TOKENS = 24


def messages(question: str) -> list[dict]:
    return [{"role": "user", "content": f"{question} Answer with one word."}]


def correct(answer: str, expected: str) -> bool:
    return expected in answer.lower()


@pytest.fixture(scope="module")
def real_stack(smollm2_gguf, tmp_path_factory):
    s = start_stack(tmp_path_factory.mktemp("real-stack"), smollm2_gguf)
    yield s
    s.stop()


@pytest.fixture(scope="module")
def hf_answers(smollm2_hf):
    """transformers' greedy answers, the twenty in one left-padded batch (one generate call, not twenty)."""
    tok, model = smollm2_hf
    prompts = [tok.apply_chat_template(messages(q), add_generation_prompt=True, return_dict=True)["input_ids"]
               for q, _ in QUESTIONS]
    ids, mask = left_padded(prompts)
    with torch.no_grad():
        gen = model.generate(input_ids=ids, attention_mask=mask, max_new_tokens=MAX_TOKENS, do_sample=False,
                             pad_token_id=2)
    return [tok.decode(row[ids.shape[1]:], skip_special_tokens=True) for row in gen]


def test_twenty_questions_score_as_transformers(real_stack, hf_answers):
    from openai import OpenAI

    client = OpenAI(base_url=real_stack.url + "/v1", api_key="unused", max_retries=0)

    def ask(question: str) -> str:
        r = client.chat.completions.create(model=MODEL_NAME, messages=messages(question), max_tokens=MAX_TOKENS,
                                           temperature=0)
        assert r.choices[0].finish_reason in ("stop", "length")
        return r.choices[0].message.content

    with ThreadPoolExecutor(len(QUESTIONS)) as pool:  # at once: the worker batches them
        ours = list(pool.map(ask, [q for q, _ in QUESTIONS]))
    ours_ok = [correct(a, e) for a, (_, e) in zip(ours, QUESTIONS)]
    hf_ok = [correct(a, e) for a, (_, e) in zip(hf_answers, QUESTIONS)]
    print(f"\nanswer check: inferno {sum(ours_ok)}/{len(QUESTIONS)}, transformers {sum(hf_ok)}/{len(QUESTIONS)}; "
          f"identical texts {sum(a == b for a, b in zip(ours, hf_answers))}/{len(QUESTIONS)}")
    assert ours_ok == hf_ok, list(zip(ours, hf_answers))
    assert sum(ours_ok) >= 10  # a real model: most of these it knows
    assert metrics(real_stack).get("inferno:num_requests_running", 0) == 0


def test_streamed_chat_answers_in_english(real_stack):
    from openai import OpenAI

    client = OpenAI(base_url=real_stack.url + "/v1", api_key="unused", max_retries=0)
    stream = client.chat.completions.create(
        model=MODEL_NAME, messages=[{"role": "user", "content": "What is the capital of France?"}],
        max_tokens=20, temperature=0, stream=True, stream_options={"include_usage": True})
    chunks = list(stream)
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text == "The capital of France is Paris."
    assert chunks[-1].usage.completion_tokens == 8  # seven tokens and <|im_end|>


def test_parse_returns_the_typed_answer(real_stack):
    """The openai client's `parse` with a Pydantic model: the schema goes as a strict json_schema,
    and the answer comes back as that model's object (SmolLM2 answers the question, in the shape)."""
    from openai import OpenAI
    from pydantic import BaseModel, Field

    class Capital(BaseModel):
        country: str = Field(max_length=20)
        capital: str = Field(max_length=20)

    client = OpenAI(base_url=real_stack.url + "/v1", api_key="unused", max_retries=0)
    r = client.chat.completions.parse(
        model=MODEL_NAME, messages=[{"role": "user", "content": "What is the capital of France? Answer in JSON."}],
        max_tokens=40, temperature=0, response_format=Capital)
    answer = r.choices[0].message.parsed
    assert isinstance(answer, Capital) and r.choices[0].finish_reason == "stop"
    assert answer.capital.lower() == "paris", answer
