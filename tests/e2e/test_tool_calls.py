"""Tool calling through the whole stack (issue 34): a forced call (`required`, a named function)
is drawn under its schema, so its arguments always parse and fit `parameters`; the answer carries
`message.tool_calls` and finish_reason "tool_calls", streamed as OpenAI streams them; a tool round
trip goes back through the chat template; bad tool input is a 400 naming the field."""

from __future__ import annotations

import json

import jsonschema
import openai
import pytest

from services.gateway.tool_calls import ToolSpec, parse_answer
from tests.e2e.conftest import MODEL_NAME

WEATHER = {"type": "object", "properties": {"city": {"enum": ["Paris", "Oslo"]},
                                            "days": {"type": "integer", "minimum": 1, "maximum": 7}},
           "required": ["city", "days"], "additionalProperties": False}
CLOCK = {"type": "object", "properties": {"zone": {"type": "string", "pattern": "^[A-Z]{3}$"}},
         "required": ["zone"], "additionalProperties": False}
TOOLS = [{"type": "function", "function": {"name": "get_weather", "description": "Weather", "parameters": WEATHER}},
         {"type": "function", "function": {"name": "get_time", "parameters": CLOCK}}]
SCHEMAS = {"get_weather": WEATHER, "get_time": CLOCK}
ASK = [{"role": "user", "content": "Weather in Paris?"}]


def client(stack) -> openai.OpenAI:
    return openai.OpenAI(base_url=stack.url + "/v1", api_key="unused", max_retries=0, timeout=60)


def valid(call) -> None:
    assert call.type == "function" and call.id.startswith("call_")
    jsonschema.validate(json.loads(call.function.arguments), SCHEMAS[call.function.name])


def test_a_named_or_required_call_always_fits_its_schema(stack):
    c = client(stack)
    for seed in range(4):
        r = c.chat.completions.create(model=MODEL_NAME, messages=ASK, tools=TOOLS, max_tokens=64, seed=seed,
                                      tool_choice={"type": "function", "function": {"name": "get_weather"}})
        (call,) = r.choices[0].message.tool_calls
        assert call.function.name == "get_weather" and r.choices[0].finish_reason == "tool_calls"
        valid(call)
        r = c.chat.completions.create(model=MODEL_NAME, messages=ASK, tools=TOOLS, max_tokens=128, seed=seed,
                                      tool_choice="required", parallel_tool_calls=False)
        (call,) = r.choices[0].message.tool_calls
        valid(call)


def test_streamed_calls_and_a_round_trip(stack):
    c = client(stack)
    stream = c.chat.completions.create(model=MODEL_NAME, messages=ASK, tools=TOOLS, max_tokens=64, stream=True,
                                       tool_choice={"type": "function", "function": {"name": "get_time"}})
    deltas = [ch.choices[0] for ch in stream if ch.choices]
    calls = [d.delta.tool_calls[0] for d in deltas if d.delta.tool_calls]
    first, rest = calls[0], calls[1:]
    assert (first.index, first.type, first.function.name, first.function.arguments) == (0, "function", "get_time", "")
    assert first.id.startswith("call_") and all(d.id is None and d.function.name is None for d in rest)
    arguments = "".join(d.function.arguments for d in rest)
    jsonschema.validate(json.loads(arguments), CLOCK)
    assert deltas[-1].finish_reason == "tool_calls"
    history = ASK + [{"role": "assistant", "content": None, "tool_calls": [
        {"id": first.id, "type": "function", "function": {"name": "get_time", "arguments": arguments}}]},
        {"role": "tool", "tool_call_id": first.id, "content": "12:00"}]
    r = c.chat.completions.create(model=MODEL_NAME, messages=history, tools=TOOLS, tool_choice="none", max_tokens=8)
    assert r.choices[0].message.tool_calls is None and r.choices[0].finish_reason in ("stop", "length")


@pytest.mark.parametrize("extra, param", [
    ({"tool_choice": {"type": "function", "function": {"name": "nope"}}}, "tool_choice"),
    ({"tools": [{"type": "function", "function": {"name": "f", "parameters": {"type": "objekt"}}}]},
     "tools[0].function.parameters"),
    ({"tool_choice": "required", "response_format": {"type": "json_object"}}, "response_format"),
    ({"tool_choice": "sometimes"}, "tool_choice"),
])
def test_bad_tool_input_is_a_400_naming_the_field(stack, extra, param):
    body = {"tools": TOOLS, **extra}
    with pytest.raises(openai.BadRequestError) as info:
        client(stack).chat.completions.create(model=MODEL_NAME, messages=ASK, max_tokens=4, **body)
    assert info.value.body["param"] == param


def test_the_families_parsers_read_calls_and_leave_text():
    spec = ToolSpec("auto", tuple(TOOLS))
    content, calls = parse_answer('Sure.<tool_call>\n{"name": "get_time", "arguments": {"zone": "UTC"}}\n'
                                  '</tool_call>', spec, "hermes")
    assert content == "Sure." and calls[0]["function"] == {"name": "get_time", "arguments": '{"zone": "UTC"}'}
    _, calls = parse_answer('{"name": "get_weather", "parameters": {"city": "Oslo", "days": 2}}', spec, "llama3_json")
    assert json.loads(calls[0]["function"]["arguments"]) == {"city": "Oslo", "days": 2}
    _, calls = parse_answer('[TOOL_CALLS][{"name": "get_time", "arguments": {"zone": "CET"}}]', spec, "mistral")
    assert calls[0]["function"]["name"] == "get_time"
    assert parse_answer("no call here", spec, "hermes") == ("no call here", [])
    assert parse_answer('<tool_call>{"name": "unknown", "arguments": {}}</tool_call>', spec, "hermes")[1] == []
