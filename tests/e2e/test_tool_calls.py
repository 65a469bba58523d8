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


def _streamed(spec: ToolSpec, parser: str, text: str, seed: int) -> tuple[str, list[tuple[str, str]]]:
    """(content, [(name, arguments)]) of text fed to a CallStream in random pieces."""
    import random

    from services.gateway.tool_calls import CallStream

    rng, stream, events, i = random.Random(seed), CallStream(spec, parser), [], 0
    while i < len(text):
        k = rng.randint(1, 9)
        events += stream.feed(text[i:i + k])
        i += k
    events += stream.end()
    calls: list[list[str]] = []
    for kind, part in events:
        if kind == "call":
            calls.append([part, ""])
        elif kind == "args":
            calls[-1][1] += part
    return "".join(p for kind, p in events if kind == "content"), [tuple(c) for c in calls]


@pytest.mark.parametrize("mode, parser, text", [
    ("auto", "hermes", 'Sure.<tool_call>\n{"name": "get_time", "arguments": {"zone": "U}T\\"C"}}\n</tool_call> and '
             '<tool_call>\n{"name": "nope", "arguments": {}}\n</tool_call><tool_call>\n{"name": "get_weather", '
             '"arguments": {"city": "Oslo", "days": [1, {"b": 2}]}}\n</tool_call> bye <tool'),
    ("auto", "llama3_json", '{"name": "get_weather", "parameters": {"city": "Oslo", "days": 2}}'),
    ("required", "hermes", '[{"name":"get_time","parameters":{"zone":"x]"}},{"name":"get_weather","parameters":{}}]'),
    ("named", "hermes", '{"city":"Paris","days":3}'),
])
def test_streamed_calls_are_the_answers_calls_in_any_pieces(mode, parser, text):
    spec = ToolSpec(mode, tuple(TOOLS), name="get_weather" if mode == "named" else "")
    content, calls = parse_answer(text, spec, parser)
    for seed in range(6):
        s_content, s_calls = _streamed(spec, parser, text, seed)
        assert [(n, json.loads(a)) for n, a in s_calls] == [
            (c["function"]["name"], json.loads(c["function"]["arguments"])) for c in calls]
        assert s_content.strip() == (content or "").strip()


@pytest.mark.parametrize("parser, opening", [("hermes", "Let me look.<tool_call>"), ("llama3_json", '{"name": ')])
def test_auto_calls_are_held_to_their_schemas_once_the_tag_opens(tiny_model, parser, opening):
    """The structural tag of an auto answer: free text, then after the family's opening only a known
    name and arguments of its schema. Random walks through what the grammar allows always end in
    calls that parse and validate."""
    import asyncio
    import random

    import xgrammar as xgr

    from services.worker.engine.model_config import ModelConfig
    from services.worker.grammar import Grammars
    from shared.tokenizer import Tokenizer

    tok = Tokenizer.from_path(tiny_model)
    vocab = ModelConfig.from_path(tiny_model).vocab_size
    eos = json.loads((tiny_model / "generation_config.json").read_text())["eos_token_id"]
    grammars = Grammars(str(tiny_model), vocab, eos if isinstance(eos, list) else [eos])
    spec = ToolSpec("auto", tuple(TOOLS))
    kind, text = spec.auto_grammar(parser)
    mask = xgr.allocate_token_bitmask(1, vocab)
    for seed in range(8):
        rng = random.Random(seed)
        matcher = asyncio.run(grammars.matcher(kind, text))
        prefix = tok.encode(opening)
        assert all(matcher.accept(t) for t in prefix)
        out = list(prefix)
        # Until the call is closed: the free text after it is the model's business.
        while not parse_answer(tok.decode(out), spec, parser)[1] and len(out) < 300:
            matcher.raw.fill_next_token_bitmask(mask)
            bits = mask[0].tolist()
            allowed = [i for i in range(vocab) if (bits[i // 32] >> (i % 32)) & 1]
            t = rng.choice(allowed)
            assert matcher.accept(t)
            out.append(t)
        _, calls = parse_answer(tok.decode(out), spec, parser)
        assert calls, tok.decode(out)
        for c in calls:
            jsonschema.validate(json.loads(c["function"]["arguments"]), SCHEMAS[c["function"]["name"]])
    grammars.close()


def test_an_auto_answer_streams_its_text_as_it_comes(stack):
    """auto runs under the family's structural tag; text outside a call streams token by token (the
    random model writes no call) and equals the answer of the same request unstreamed."""
    c = client(stack)
    kw = dict(model=MODEL_NAME, messages=ASK, tools=TOOLS, max_tokens=24, temperature=0)
    whole = c.chat.completions.create(**kw).choices[0]
    deltas = [ch.choices[0] for ch in c.chat.completions.create(stream=True, **kw) if ch.choices]
    parts = [d.delta.content for d in deltas if d.delta.content]
    assert len(parts) > 3 and "".join(parts) == whole.message.content
    assert deltas[-1].finish_reason == whole.finish_reason == "length"
