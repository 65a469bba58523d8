"""Structured outputs through the whole stack on the random-weight demo model, which otherwise
writes noise: every answer under a JSON Schema validates, a choice is one of the choices, a regex
matches, and what cannot be a grammar is a 400 naming its field (issue 34). The worker drafts
what the grammars force (--jump-forward), as a user may run it."""

from __future__ import annotations

import json
import re
from concurrent.futures import ThreadPoolExecutor

import jsonschema
import openai
import pytest

from inferno.tools.schema_corpus import schema_corpus
from tests.e2e.conftest import MODEL_NAME, start_stack

HAND_WRITTEN = [
    {"type": "object", "properties": {"city": {"enum": ["Paris", "Rome", "Oslo"]},
                                      "n": {"type": "integer", "minimum": 0, "maximum": 99}},
     "required": ["city", "n"], "additionalProperties": False},
    {"type": "array", "items": {"type": "boolean"}, "minItems": 1, "maxItems": 4},
    {"type": "object", "properties": {"tags": {"type": "array", "items": {"enum": ["a", "b"]}, "maxItems": 3},
                                      "inner": {"type": "object", "properties": {"x": {"type": "integer",
                                                                                       "minimum": -5, "maximum": 5}},
                                                "required": ["x"], "additionalProperties": False}},
     "required": ["inner"], "additionalProperties": False},
    {"anyOf": [{"type": "integer", "minimum": 0, "maximum": 9}, {"type": "null"}]},
    {"$defs": {"p": {"type": "string", "pattern": "^[A-Z][a-z]{2}$"}}, "type": "object",
     "properties": {"name": {"$ref": "#/$defs/p"}, "alias": {"$ref": "#/$defs/p"}}, "required": ["name"],
     "additionalProperties": False},
    {"type": "string", "pattern": "^[0-9]{3}-[0-9]{4}$"},
    {"type": "string", "minLength": 2, "maxLength": 6},
    {"type": "object", "properties": {"ok": {"type": "boolean"}, "note": {"type": "string", "maxLength": 5}},
     "required": ["ok", "note"], "additionalProperties": False},
    {"enum": [1, "two", None, True]},
    {"const": "fixed"},
]


SCHEMAS = HAND_WRITTEN + schema_corpus(190, seed=0, bounded=True)


@pytest.fixture(scope="module")
def stack(tiny_model, tmp_path_factory):
    s = start_stack(tmp_path_factory.mktemp("jf-stack"), tiny_model, worker_args=("--jump-forward", "8"))
    yield s
    s.stop()


def client(stack) -> openai.OpenAI:
    return openai.OpenAI(base_url=stack.url + "/v1", api_key="unused", max_retries=0, timeout=120)


def test_every_answer_under_a_schema_validates(stack):
    """200 schemas, chat and completions alternately, sampled (seeded) and greedy: 100 % valid."""
    c = client(stack)

    def ask(i_schema):
        i, schema = i_schema
        fmt = {"type": "json_schema", "json_schema": {"name": f"s{i}", "schema": schema, "strict": True}}
        if i % 2:
            r = c.chat.completions.create(model=MODEL_NAME, messages=[{"role": "user", "content": "answer"}],
                                          max_tokens=256, temperature=1.0, seed=i, response_format=fmt)
            return schema, r.choices[0].message.content, r.choices[0].finish_reason
        r = c.completions.create(model=MODEL_NAME, prompt="answer:", max_tokens=256, temperature=0,
                                 extra_body={"response_format": fmt})
        return schema, r.choices[0].text, r.choices[0].finish_reason

    with ThreadPoolExecutor(16) as pool:
        answers = list(pool.map(ask, enumerate(SCHEMAS)))
    assert len(answers) >= 200
    for schema, text, finish in answers:
        assert finish == "stop", (schema, text)
        jsonschema.validate(json.loads(text), schema)


def test_json_object_choice_regex_grammar_and_n(stack):
    c = client(stack)
    r = c.chat.completions.create(model=MODEL_NAME, messages=[{"role": "user", "content": "x"}], max_tokens=64,
                                  temperature=0, response_format={"type": "json_object"})
    assert r.choices[0].finish_reason in ("stop", "length")  # any JSON: it may run long on noise
    r = c.completions.create(model=MODEL_NAME, prompt="x", max_tokens=16, n=3, seed=1,
                             extra_body={"guided_choice": ["yes", "no", "maybe"]})
    assert {ch.text for ch in r.choices} <= {"yes", "no", "maybe"} and len(r.choices) == 3
    r = c.completions.create(model=MODEL_NAME, prompt="x", max_tokens=16,
                             extra_body={"structured_outputs": {"regex": "[0-9]{3}-[a-z]{2}"}})
    assert re.fullmatch("[0-9]{3}-[a-z]{2}", r.choices[0].text)
    r = c.completions.create(model=MODEL_NAME, prompt="x", max_tokens=16,
                             extra_body={"guided_grammar": 'root ::= "(" ("a" | "b")+ ")"'})
    assert re.fullmatch(r"\([ab]+\)", r.choices[0].text) or r.choices[0].finish_reason == "length"
    # ignore_eos and min_tokens do not carry an answer past its grammar's end
    r = c.completions.create(model=MODEL_NAME, prompt="x", max_tokens=32,
                             extra_body={"guided_choice": ["yes", "no"], "ignore_eos": True, "min_tokens": 32})
    assert r.choices[0].text in ("yes", "no") and r.choices[0].finish_reason == "stop"
    stream = c.chat.completions.create(model=MODEL_NAME, messages=[{"role": "user", "content": "x"}],
                                       max_tokens=64, temperature=0, stream=True,
                                       response_format={"type": "json_schema",
                                                        "json_schema": {"name": "a", "schema": HAND_WRITTEN[0]}})
    text = "".join(chunk.choices[0].delta.content or "" for chunk in stream if chunk.choices)
    jsonschema.validate(json.loads(text), HAND_WRITTEN[0])


@pytest.mark.parametrize("extra, param", [
    ({"guided_json": {"type": "objekt"}}, "guided_json"),
    ({"guided_regex": "(unclosed"}, "guided_regex"),
    ({"guided_grammar": "root ::= ("}, "structured_outputs.grammar"),  # found by the worker's compile
])
def test_what_is_not_a_grammar_is_a_400_naming_its_field(stack, extra, param):
    with pytest.raises(openai.BadRequestError) as info:
        client(stack).completions.create(model=MODEL_NAME, prompt="x", max_tokens=8, extra_body=extra)
    assert param in (info.value.body.get("param") or "") + info.value.body["message"]
    # ... and the worker serves on
    assert client(stack).completions.create(model=MODEL_NAME, prompt="x", max_tokens=4).choices[0].text is not None
