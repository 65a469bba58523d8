"""Validation of OpenAI completions and chat bodies: every bound gives a 400 naming its field."""

from __future__ import annotations

import json

import jsonschema
import pytest

from services.gateway.errors import ApiError
from services.gateway.schemas import (MAX_CHAT_CHARS, MAX_MESSAGES, Limits, decode_body, parse_chat,
                                      parse_completion, parse_tokenize, request_schemas, resolve_max_tokens)
from shared.sampling_params import SamplingParams

LIMITS = Limits(model_name="tiny", max_model_len=128, vocab_size=1000, max_n=16)
USER = [{"role": "user", "content": "hi"}]


def completion(**fields) -> dict:
    return {"model": "tiny", "prompt": "Hello", **fields}


def chat(**fields) -> dict:
    return {"model": "tiny", "messages": USER, **fields}


def error_of(parse, body) -> ApiError:
    with pytest.raises(ApiError) as info:
        parse(body, LIMITS)
    return info.value


def test_completion_maps_every_field_to_sampling_params():
    spec = parse_completion(completion(
        n=2, stream=True, stream_options={"include_usage": True}, stop=["\n", "END"], max_tokens=20,
        temperature=0.5, top_p=0.9, presence_penalty=0.5, frequency_penalty=-0.5, logit_bias={"7": 5, "12": -100},
        seed=42, top_k=40, min_p=0.05, repetition_penalty=1.1, min_tokens=3, ignore_eos=True,
        stop_token_ids=[2, 3], logprobs=5, user="someone", unknown_field={"x": 1}, cache_salt="tenant-a"),
        LIMITS)
    assert spec.params == SamplingParams(
        temperature=0.5, top_k=40, top_p=0.9, min_p=0.05, repetition_penalty=1.1, presence_penalty=0.5,
        frequency_penalty=-0.5, logit_bias={7: 5.0, 12: -100.0}, seed=42, max_tokens=20, min_tokens=3,
        stop_token_ids=[2, 3], ignore_eos=True, logprobs=5)
    assert (spec.n, spec.stream, spec.include_usage, spec.stop) == (2, True, True, ("\n", "END"))
    assert (spec.prompt, spec.max_tokens, spec.logprobs, spec.cache_salt) == ("Hello", 20, 5, "tenant-a")
    assert spec.model == "tiny" and not spec.is_chat


def test_completion_defaults():
    spec = parse_completion({"prompt": "x"}, LIMITS)
    assert spec.params == SamplingParams(max_tokens=128)  # a stand-in until the prompt is tokenized
    assert (spec.n, spec.stream, spec.include_usage, spec.stop, spec.max_tokens, spec.logprobs) == \
        (1, False, False, (), None, None)
    assert spec.model == "tiny"  # no model: the served one


@pytest.mark.parametrize("prompt, expected", [
    ("text", "text"),
    ([1, 2, 3], [1, 2, 3]),
    (["one string"], "one string"),
    ([[4, 5]], [4, 5]),
])
def test_completion_prompt_forms(prompt, expected):
    assert parse_completion(completion(prompt=prompt), LIMITS).prompt == expected


@pytest.mark.parametrize("prompt, words", [
    (["a", "b"], "one prompt per request"),
    ([[1], [2]], "one prompt per request"),
    ([], "non-empty"),
    (None, "non-empty"),
    (7, "non-empty"),
    ([1, 1000], "outside the vocabulary"),
    ([1, "x"], "list of token ids"),
    ([1, True], "list of token ids"),
])
def test_completion_bad_prompts(prompt, words):
    e = error_of(parse_completion, completion(prompt=prompt))
    assert (e.status, e.param, e.type) == (400, "prompt", "invalid_request_error")
    assert words in e.message


BOUNDS = [
    # (field, value, param)
    ("n", 17, "n"), ("n", 0, "n"), ("n", "2", "n"), ("n", 1.5, "n"),
    ("max_tokens", 0, "max_tokens"), ("max_tokens", 129, "max_tokens"), ("max_tokens", "5", "max_tokens"),
    ("temperature", -0.1, "temperature"), ("temperature", 100.5, "temperature"), ("temperature", "hot", "temperature"),
    ("temperature", True, "temperature"),
    ("top_p", 0.0, "top_p"), ("top_p", 1.5, "top_p"),
    ("top_k", -2, "top_k"), ("top_k", 1001, "top_k"),
    ("min_p", 1.5, "min_p"), ("repetition_penalty", 0.0, "repetition_penalty"),
    ("repetition_penalty", 11, "repetition_penalty"),
    ("presence_penalty", 2.5, "presence_penalty"), ("frequency_penalty", -2.5, "frequency_penalty"),
    ("seed", 1 << 64, "seed"), ("seed", "7", "seed"),
    ("min_tokens", -1, "min_tokens"), ("ignore_eos", "yes", "ignore_eos"),
    ("stop_token_ids", [1000], "stop_token_ids"), ("stop_token_ids", list(range(65)), "stop_token_ids"),
    ("stop_token_ids", "2", "stop_token_ids"),
    ("stop", ["s"] * 17, "stop"), ("stop", "x" * 257, "stop"), ("stop", [1], "stop"), ("stop", 5, "stop"),
    ("logit_bias", {str(i): 1 for i in range(1025)}, "logit_bias"), ("logit_bias", {"1000": 1}, "logit_bias"),
    ("logit_bias", {"abc": 1}, "logit_bias"), ("logit_bias", {"5": 101}, "logit_bias"),
    ("logit_bias", {"5": "big"}, "logit_bias"), ("logit_bias", [1, 2], "logit_bias"),
    ("stream", "true", "stream"), ("stream_options", "usage", "stream_options"),
    ("cache_salt", "s" * 257, "cache_salt"), ("cache_salt", 5, "cache_salt"),
    ("model", 5, "model"),
]


@pytest.mark.parametrize("field, value, param", BOUNDS)
def test_completion_bounds(field, value, param):
    e = error_of(parse_completion, completion(**{field: value}))
    assert (e.status, e.param, e.type) == (400, param, "invalid_request_error")


@pytest.mark.parametrize("field, value, param", BOUNDS)
def test_chat_bounds(field, value, param):
    e = error_of(parse_chat, chat(**{field: value}))
    assert (e.status, e.param, e.type) == (400, param, "invalid_request_error")


@pytest.mark.parametrize("field, value, param", [
    ("logprobs", 21, "logprobs"), ("logprobs", -1, "logprobs"), ("logprobs", True, "logprobs"),
    ("echo", True, "echo"), ("suffix", "tail", "suffix"), ("best_of", 3, "best_of"),
])
def test_completion_only_bounds(field, value, param):
    e = error_of(parse_completion, completion(**{field: value}))
    assert (e.status, e.param) == (400, param)


def test_completion_min_tokens_over_max_tokens():
    e = error_of(parse_completion, completion(max_tokens=4, min_tokens=5))
    assert (e.status, e.param) == (400, "min_tokens")


def test_wrong_model_is_404():
    for parse, body in ((parse_completion, completion(model="gpt-4")), (parse_chat, chat(model="gpt-4"))):
        e = error_of(parse, body)
        assert (e.status, e.code, e.param) == (404, "model_not_found", "model")
        assert e.body() == {"error": {"message": "The model `gpt-4` does not exist.",
                                      "type": "invalid_request_error", "param": "model", "code": "model_not_found"}}


def test_body_must_be_an_object():
    for parse in (parse_completion, parse_chat):
        for body in ([1, 2], "text", None, 3):
            assert error_of(parse, body).status == 400


def test_chat_maps_logprobs_and_max_completion_tokens():
    spec = parse_chat(chat(logprobs=True, top_logprobs=3, max_completion_tokens=7, max_tokens=99, seed=1), LIMITS)
    assert (spec.logprobs, spec.params.logprobs, spec.max_tokens, spec.params.max_tokens) == (3, 3, 7, 7)
    assert spec.params.seed == 1 and spec.is_chat
    assert parse_chat(chat(logprobs=True), LIMITS).logprobs == 0
    assert parse_chat(chat(logprobs=False), LIMITS).logprobs is None
    assert parse_chat(chat(max_tokens=9), LIMITS).max_tokens == 9


@pytest.mark.parametrize("fields, param", [
    ({"top_logprobs": 21, "logprobs": True}, "top_logprobs"),
    ({"top_logprobs": 2}, "top_logprobs"),  # without logprobs: true
    ({"logprobs": 1}, "logprobs"),  # chat logprobs is a boolean
    ({"max_completion_tokens": 129}, "max_completion_tokens"),
    ({"max_completion_tokens": 0}, "max_completion_tokens"),
])
def test_chat_only_bounds(fields, param):
    e = error_of(parse_chat, chat(**fields))
    assert (e.status, e.param) == (400, param)


def test_chat_messages_roles_and_content_parts():
    messages = [
        {"role": "system", "content": "Be brief."},
        {"role": "developer", "content": "Really brief."},
        {"role": "user", "content": [{"type": "text", "text": "a"}, {"type": "text", "text": "b"}], "name": "bob"},
        {"role": "assistant", "content": None, "tool_calls": [{"id": "c1", "type": "function",
                                                             "function": {"name": "f", "arguments": "{}"}}]},
        {"role": "tool", "content": "42", "tool_call_id": "c1"},
    ]
    spec = parse_chat({"messages": messages, "tools": [], "tool_choice": "none"}, LIMITS)  # tools asked for nothing
    assert spec.messages == [
        {"role": "system", "content": "Be brief."},
        {"role": "system", "content": "Really brief."},
        {"role": "user", "content": "a\nb", "name": "bob"},
        {"role": "assistant", "content": None, "tool_calls": messages[3]["tool_calls"]},
        {"role": "tool", "content": "42", "tool_call_id": "c1"},
    ]


@pytest.mark.parametrize("messages, param", [
    ([], "messages"),
    ("hi", "messages"),
    (None, "messages"),
    ([{"role": "wizard", "content": "x"}], "messages[0].role"),
    (["hi"], "messages[0]"),
    ([{"role": "user"}], "messages[0].content"),
    ([{"role": "user", "content": 5}], "messages[0].content"),
    ([{"role": "user", "content": "x"}, {"role": "user", "content": [{"type": "image_url", "image_url": {}}]}],
     "messages[1].content"),
    ([{"role": "user", "content": "x"}] * (MAX_MESSAGES + 1), "messages"),
    ([{"role": "user", "content": "x" * (MAX_CHAT_CHARS // 2)}] * 2 + [{"role": "user", "content": "x"}],
     "messages"),
])
def test_chat_bad_messages(messages, param):
    e = error_of(parse_chat, {"messages": messages})
    assert (e.status, e.param) == (400, param)


def test_chat_tools_must_be_objects():
    e = error_of(parse_chat, chat(tools=["f"]))
    assert (e.status, e.param) == (400, "tools")


def test_resolve_max_tokens():
    spec = parse_completion(completion(), LIMITS)
    assert resolve_max_tokens(spec, 100, 128).max_tokens == 28  # the rest of the window
    spec = parse_completion(completion(), LIMITS)
    assert resolve_max_tokens(spec, 100, 128, default=16).max_tokens == 16
    spec = parse_completion(completion(max_tokens=28), LIMITS)
    assert resolve_max_tokens(spec, 100, 128).max_tokens == 28
    assert spec.params.max_tokens == 28


def test_context_length_exceeded():
    spec = parse_completion(completion(max_tokens=29), LIMITS)
    with pytest.raises(ApiError) as info:
        resolve_max_tokens(spec, 100, 128)
    e = info.value
    assert (e.status, e.code, e.param, e.type) == (400, "context_length_exceeded", "prompt", "invalid_request_error")
    assert "maximum context length is 128 tokens" in e.message and "129 tokens" in e.message
    spec = parse_chat(chat(), LIMITS)
    with pytest.raises(ApiError) as info:
        resolve_max_tokens(spec, 128, 128)
    assert (info.value.code, info.value.param) == ("context_length_exceeded", "messages")


def test_min_tokens_over_the_room_left():
    spec = parse_completion(completion(min_tokens=50), LIMITS)
    with pytest.raises(ApiError) as info:
        resolve_max_tokens(spec, 100, 128)
    assert (info.value.status, info.value.param) == (400, "min_tokens")


@pytest.mark.parametrize("parse, body", [(parse_completion, completion), (parse_chat, chat)])
def test_stream_options_without_stream_is_a_400(parse, body):
    for unstreamed in ({}, {"stream": False}, {"stream": None}):
        for options in ({"include_usage": True}, {"include_usage": False}, {}):
            e = error_of(parse, body(stream_options=options, **unstreamed))
            assert (e.status, e.param, e.type) == (400, "stream_options", "invalid_request_error")
            assert e.message == "'stream_options' is only allowed when 'stream' is true"
    assert not parse(body(stream_options=None), LIMITS).include_usage  # null: not given
    assert parse(body(stream=True, stream_options={"include_usage": True}), LIMITS).include_usage


def test_stop_strings_deduplicated_and_empty_dropped():
    assert parse_completion(completion(stop=["a", "", "a", "b"]), LIMITS).stop == ("a", "b")
    assert parse_completion(completion(stop="x"), LIMITS).stop == ("x",)
    assert parse_completion(completion(stop=None), LIMITS).stop == ()


def test_null_means_default():
    spec = parse_completion(completion(temperature=None, n=None, stop=None, seed=None, logit_bias=None), LIMITS)
    assert (spec.params.temperature, spec.n, spec.params.seed, spec.params.logit_bias) == (1.0, 1, None, {})


def test_integral_floats_are_integers():
    assert parse_completion(completion(max_tokens=5.0, n=2.0), LIMITS).max_tokens == 5


# ---------------------------------------------------------------------------------------------
# Features that are not built yet: a 400 that says so, not silence

TOOL = {"type": "function", "function": {"name": "f", "parameters": {"type": "object"}}}


@pytest.mark.parametrize("field, value", [
    ("functions", [{"name": "f"}]),
    ("function_call", "auto"),
])
def test_chat_refuses_features_not_built(field, value):
    e = error_of(parse_chat, chat(**{field: value}))
    assert (e.status, e.param, e.type, e.code) == (400, field, "invalid_request_error", "unsupported_parameter")
    assert f"'{field}' is not supported yet" in e.message


@pytest.mark.parametrize("fields, kind", [
    ({"response_format": {"type": "text"}}, ""),
    ({"response_format": {"type": "json_object"}}, "json"),
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "object"}}}},
     "json_schema"),
    ({"structured_outputs": {"regex": "[a-z]+"}}, "regex"),
    ({"structured_outputs": {"choice": ["yes", "no"]}}, "ebnf"),
    ({"guided_json": '{"type": "integer"}'}, "json_schema"),
    ({"guided_regex": "[0-9]{3}"}, "regex"),
    ({"guided_choice": ["a", "b\"c"]}, "ebnf"),
    ({"guided_grammar": 'root ::= "x"'}, "ebnf"),
    ({"structured_outputs": {"json": {"type": "object"}, "whitespace_pattern": r"[\n ]*",
                             "disable_any_whitespace": True}}, "json_schema"),
    ({"guided_json": {"type": "object"}, "guided_whitespace_pattern": " ?"}, "json_schema"),
])
def test_structured_outputs_become_one_grammar(fields, kind):
    for parse, body in ((parse_completion, completion(**fields)), (parse_chat, chat(**fields))):
        assert parse(body, LIMITS).params.grammar_kind == kind


@pytest.mark.parametrize("fields, param", [
    ({"response_format": {"type": "xml"}}, "response_format.type"),
    ({"response_format": "text"}, "response_format"),
    ({"response_format": {"type": "json_schema", "json_schema": {"schema": {"type": "objekt"}}}},
     "response_format.json_schema.schema"),
    ({"guided_json": "{not json"}, "guided_json"),
    ({"guided_regex": "(unclosed"}, "guided_regex"),
    ({"guided_choice": []}, "guided_choice"),
    ({"guided_grammar": "no rules"}, "guided_grammar"),
    ({"structured_outputs": {"regex": "a", "choice": ["a"]}}, "structured_outputs"),
    ({"guided_regex": "a", "response_format": {"type": "json_object"}}, "guided_regex"),
    ({"guided_json": {"type": "object"}, "guided_whitespace_pattern": "[ ]+"}, "guided_whitespace_pattern"),
    ({"structured_outputs": {"json": {}, "whitespace_pattern": "("}}, "structured_outputs.whitespace_pattern"),
])
def test_bad_structured_outputs_are_400s_naming_the_field(fields, param):
    e = error_of(parse_completion, completion(**fields))
    assert (e.status, e.param) == (400, param), e.message


def test_values_that_ask_for_nothing_are_accepted():
    spec = parse_chat(chat(response_format={"type": "text"}, tools=[], tool_choice="none", functions=[],
                           function_call="none", parallel_tool_calls=False), LIMITS)
    assert spec.messages == USER
    parse_completion(completion(response_format=None, echo=False, suffix=""), LIMITS)


def test_tokenize_still_renders_tools():
    spec = parse_tokenize({"messages": USER, "tools": [TOOL]}, LIMITS)
    assert spec.tools == [TOOL] and spec.messages == USER


# ---------------------------------------------------------------------------------------------
# Bodies that are not JSON or not Unicode

def test_lone_surrogates_are_a_400_naming_the_field():
    raw = rb'{"model": "tiny", "messages": [{"role": "user", "content": "hi \\ud800 \\ud800 \ud800"}]}'
    with pytest.raises(ApiError) as info:
        decode_body(raw)
    assert (info.value.status, info.value.param) == (400, "messages[0].content")
    assert "invalid Unicode" in info.value.message
    for raw, param in ((rb'{"prompt": "\udfff"}', "prompt"), (rb'{"\ud800": 1}', None), (rb'"\ud800"', None),
                       (rb'{"stop": ["a", "\uDBFF"]}', "stop[1]")):
        with pytest.raises(ApiError) as info:
            decode_body(raw)
        assert (info.value.status, info.value.param) == (400, param)


def test_valid_escapes_and_utf8_pass():
    text = "emoji \U0001F600 and \\ud800 as text"
    raw = json.dumps({"prompt": text}).encode()  # ensure_ascii: the emoji as a surrogate pair
    assert rb"\ud83d\ude00" in raw
    assert decode_body(raw) == {"prompt": text}
    assert decode_body('{"prompt": "ünï"}'.encode()) == {"prompt": "ünï"}
    for bad, message in ((b"{", "not valid JSON"), (b"[" * 100_000, "not valid JSON"),
                         (b"\xff\xfe{", "not valid UTF-8"),
                         (b'{"prompt": "\xed\xa0\x80"}', "not valid UTF-8")):  # a surrogate encoded in UTF-8
        with pytest.raises(ApiError) as info:
            decode_body(bad)
        assert (info.value.status, info.value.message) == (400, f"the request body is {message}")


# ---------------------------------------------------------------------------------------------
# The published schemas say what the parsers accept

SCHEMAS = request_schemas(LIMITS)
# Bounds a JSON Schema cannot state: a token id as an object key, and min_tokens against max_tokens.
NOT_IN_SCHEMA = {("logit_bias", "1000"), ("logit_bias", "abc")}


def schema_errors(name: str, body) -> list:
    return list(jsonschema.Draft202012Validator(SCHEMAS[name]).iter_errors(body))


@pytest.mark.parametrize("field, value, param", BOUNDS)
def test_schema_refuses_what_the_parser_refuses(field, value, param):
    if field == "logit_bias" and isinstance(value, dict) and len(value) == 1 and \
            (field, next(iter(value))) in NOT_IN_SCHEMA:
        pytest.skip("not expressible in JSON Schema")
    assert schema_errors("CompletionRequest", completion(**{field: value}))
    assert schema_errors("ChatCompletionRequest", chat(**{field: value}))


@pytest.mark.parametrize("body", [
    completion(), completion(prompt=[1, 2], n=2, stop=["a"], logit_bias={"5": -3}, stream=True,
                             stream_options={"include_usage": True}, seed=-5, max_tokens=None, logprobs=3),
    completion(prompt=["one"]), completion(prompt=[[1, 2]]), completion(temperature=0, top_k=-1, user="u"),
])
def test_schema_accepts_what_the_completion_parser_accepts(body):
    parse_completion(body, LIMITS)
    assert schema_errors("CompletionRequest", body) == []


def test_schema_of_chat_and_refused_fields():
    ok = chat(messages=[{"role": "user", "content": [{"type": "text", "text": "a"}]},
                        {"role": "assistant", "content": None, "tool_calls": [{"id": "1"}]}],
              logprobs=True, top_logprobs=2, max_completion_tokens=5, response_format={"type": "text"}, tools=[])
    parse_chat(ok, LIMITS)
    assert schema_errors("ChatCompletionRequest", ok) == []
    for field, value in (("functions", [{"name": "f"}]), ("function_call", "auto")):
        assert schema_errors("ChatCompletionRequest", chat(**{field: value})), field
    assert not schema_errors("ChatCompletionRequest", chat(response_format={"type": "json_object"}))
    assert schema_errors("ChatCompletionRequest", {"model": "tiny"})  # messages are required
    assert schema_errors("CompletionRequest", {"model": "other", "prompt": "x"})  # only the served model
    assert schema_errors("DetokenizeRequest", {"tokens": [1, 1000]}) and not schema_errors("DetokenizeRequest",
                                                                                          {"tokens": [1, 999]})
