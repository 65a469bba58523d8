"""The request bodies of every route: their fields (each one validates and describes itself, see
fields.py), the typed specs they become, and their JSON Schemas for /openapi.json.

Numeric ranges of the sampling parameters live in shared/sampling_params.py (RANGES): the
fields publish them and SamplingParams.validate checks them. Unknown fields are ignored;
fields of features that are not built yet are refused with a 400 (fields.Refused).
"""

from __future__ import annotations

import dataclasses
import json
import re
from dataclasses import dataclass
from typing import Any

from services.gateway.errors import context_length_exceeded, from_sampling_error, invalid, model_not_found
from services.gateway.fields import (Boolean, Field, Integer, Limits, Number, Refused, String, TokenIds,
                                     finite_number, number_schema, object_schema, read_fields, token_ids,
                                     token_ids_schema)
from services.gateway.structured import FIELDS as STRUCTURED_FIELDS, JsonValue, grammar_of
from services.gateway.tool_calls import ToolSpec, tool_spec
from shared.sampling_params import (LOGIT_BIAS_RANGE, MAX_LOGIT_BIAS, MAX_SEED, MAX_STOP_STRING_CHARS,
                                    MAX_STOP_STRINGS, MAX_STOP_TOKEN_IDS, MAX_TOP_LOGPROBS, MIN_SEED, RANGES,
                                    SamplingParams, SamplingParamsError)

__all__ = ["Limits", "GenerationSpec", "TokenizeSpec", "decode_body", "parse_completion", "parse_chat",
           "parse_tokenize", "parse_detokenize", "resolve_max_tokens", "request_schemas"]

MAX_MESSAGES = 1024
MAX_CHAT_CHARS = 1 << 20  # text characters over all messages of one chat request
MAX_PROMPT_CHARS = 1 << 20
MAX_TOOLS = 128
MAX_CACHE_SALT_CHARS = 256
CHAT_ROLES = ("system", "developer", "user", "assistant", "tool")


@dataclass(slots=True)
class GenerationSpec:
    """One validated request of either endpoint; the prompt is tokenized later, off the event loop."""

    model: str
    n: int
    stream: bool
    include_usage: bool
    stop: tuple[str, ...]
    params: SamplingParams  # validated; max_tokens final only after resolve_max_tokens()
    max_tokens: int | None  # as requested; None: the rest of the context window
    logprobs: int | None  # alternatives per token (0..20); None: no logprobs
    skip_special_tokens: bool
    cache_salt: str
    prompt: str | list[int] | None = None  # completions
    messages: list[dict] | None = None  # chat
    add_generation_prompt: bool = True
    tool_spec: ToolSpec = ToolSpec()  # chat: the tools the template renders and how calls are read

    @property
    def is_chat(self) -> bool:
        return self.messages is not None


@dataclass(slots=True)
class TokenizeSpec:
    """What /tokenize renders: a prompt, or chat messages (with tools) through the chat template."""

    prompt: str | list[int] | None = None
    messages: list[dict] | None = None
    tools: list[dict] | None = None
    add_generation_prompt: bool = True

    @property
    def is_chat(self) -> bool:
        return self.messages is not None


# ---------------------------------------------------------------------------------------------
# The body itself

_SURROGATE_ESCAPE = re.compile(rb"\\u[dD][89a-fA-F]")


def decode_body(raw: bytes) -> Any:
    """The body as JSON; a 400 when it is not UTF-8 JSON or holds a string that is not Unicode (a
    lone surrogate, which JSON's \\u escapes can write and nothing downstream can encode)."""
    body = _fast_loads(raw)
    if body is _NOT_PARSED:
        body = _strict_loads(raw)
    if _SURROGATE_ESCAPE.search(raw):  # rare: only then can a string hold a surrogate
        where = _first_surrogate(body)
        if where is not None:
            raise invalid(f"'{where or 'body'}' holds invalid Unicode (a lone surrogate)", param=where or None)
    return body


_NOT_PARSED = object()

try:  # orjson parses a body (a prompt of token ids above all) several times faster than json
    import orjson

    _LONG_NUMBER = re.compile(rb"\d{19}")  # orjson reads integers past 64 bits as floats; json keeps them

    def _fast_loads(raw: bytes) -> Any:
        """The body through orjson, or _NOT_PARSED for anything it refuses (bad UTF-8, NaN, infinity,
        deep nesting) or would read differently (huge integers): the standard path then decides,
        with its own errors, so the answers to bad input do not depend on whether orjson is installed."""
        if _LONG_NUMBER.search(raw):
            return _NOT_PARSED
        try:
            return orjson.loads(raw)
        except orjson.JSONDecodeError:
            return _NOT_PARSED
except ImportError:  # pragma: no cover - depends on the environment
    def _fast_loads(raw: bytes) -> Any:
        return _NOT_PARSED


def _strict_loads(raw: bytes) -> Any:
    try:
        text = raw.decode()  # strict: json.loads(bytes) would let encoded surrogates through
    except UnicodeDecodeError:
        raise invalid("the request body is not valid UTF-8") from None
    try:
        body = json.loads(text)
    except (ValueError, RecursionError):
        raise invalid("the request body is not valid JSON") from None
    return body


def _first_surrogate(body: Any) -> str | None:
    """The path of the first string (or key) that is not valid Unicode, or None."""
    stack: list[tuple[Any, str]] = [(body, "")]
    while stack:
        value, path = stack.pop()
        if isinstance(value, str):
            if not is_unicode(value):
                return path
        elif isinstance(value, dict):
            for k, v in value.items():
                if not is_unicode(k):
                    return path
                stack.append((v, f"{path}.{k}" if path else k))
        elif isinstance(value, list):
            stack.extend((v, f"{path}[{i}]") for i, v in enumerate(value))
    return None


def is_unicode(s: str) -> bool:
    if s.isascii():
        return True
    try:
        s.encode()
    except UnicodeEncodeError:
        return False
    return True


def _object_for_model(body: Any, limits: Limits) -> None:
    if not isinstance(body, dict):
        raise invalid("the request body must be a JSON object")
    MODEL.read(body, limits)


# ---------------------------------------------------------------------------------------------
# Fields of these bodies

class Model(Field):
    __slots__ = ()

    def convert(self, v: Any, limits: Limits) -> str:
        if not isinstance(v, str):
            raise self.fail("'model' must be a string")
        if v != limits.model_name:
            raise model_not_found(v[:256])
        return v

    def value_schema(self, limits: Limits) -> dict:
        return {"type": "string", "enum": list(limits.model_names or (limits.model_name,))}


class Stop(Field):
    __slots__ = ()

    def convert(self, v: Any, limits: Limits) -> tuple[str, ...]:
        items = [v] if isinstance(v, str) else v
        if not isinstance(items, list) or not all(isinstance(s, str) for s in items):
            raise self.fail("'stop' must be a string or a list of strings")
        if len(items) > MAX_STOP_STRINGS:
            raise self.fail(f"'stop' may hold at most {MAX_STOP_STRINGS} strings")
        if any(len(s) > MAX_STOP_STRING_CHARS for s in items):
            raise self.fail(f"each stop string may hold at most {MAX_STOP_STRING_CHARS} characters")
        return tuple(dict.fromkeys(s for s in items if s))

    def value_schema(self, limits: Limits) -> dict:
        one = {"type": "string", "maxLength": MAX_STOP_STRING_CHARS}
        return {"anyOf": [one, {"type": "array", "items": one, "maxItems": MAX_STOP_STRINGS}]}


class LogitBias(Field):
    __slots__ = ()

    def convert(self, v: Any, limits: Limits) -> dict[int, float]:
        if not isinstance(v, dict):
            raise self.fail("'logit_bias' must be an object mapping token ids to biases")
        if len(v) > MAX_LOGIT_BIAS:  # before converting anything
            raise self.fail(f"'logit_bias' may hold at most {MAX_LOGIT_BIAS} entries")
        out: dict[int, float] = {}
        for key, bias in v.items():
            try:
                token_id = int(key)  # JSON object keys are strings: "50256"
            except (TypeError, ValueError):
                raise self.fail(f"'logit_bias' key {key[:32]!r} is not a token id") from None
            value = finite_number(bias)
            if value is None:
                raise self.fail(f"'logit_bias' value for {key[:32]!r} must be a number")
            out[token_id] = value
        return out

    def value_schema(self, limits: Limits) -> dict:
        return {"type": "object", "maxProperties": MAX_LOGIT_BIAS, "propertyNames": {"pattern": "^[0-9]{1,9}$"},
                "additionalProperties": number_schema(LOGIT_BIAS_RANGE)}


class StreamOptions(Field):
    """{"include_usage": bool}: read as that boolean."""

    __slots__ = ()

    def convert(self, v: Any, limits: Limits) -> bool:
        if not isinstance(v, dict):
            raise self.fail("'stream_options' must be an object")
        return INCLUDE_USAGE.read(v, limits)

    def value_schema(self, limits: Limits) -> dict:
        return object_schema([INCLUDE_USAGE], limits)


class Prompt(Field):
    """A string or token ids, alone or as a one-element list (one prompt per request)."""

    __slots__ = ()

    def convert(self, p: Any, limits: Limits) -> str | list[int]:
        if isinstance(p, list) and p and isinstance(p[0], (str, list)):
            if len(p) != 1:
                raise self.fail("only one prompt per request is supported: send one request per prompt")
            p = p[0]
        if isinstance(p, str):
            if len(p) > MAX_PROMPT_CHARS:
                raise self.fail(f"'prompt' may hold at most {MAX_PROMPT_CHARS} characters")
            return p
        if isinstance(p, list) and p:
            return token_ids(p, "prompt", limits.vocab_size, limits.max_model_len)
        raise self.fail("'prompt' must be a non-empty string or a non-empty list of token ids")

    def value_schema(self, limits: Limits) -> dict:
        text = {"type": "string", "maxLength": MAX_PROMPT_CHARS}
        ids = token_ids_schema(limits, limits.max_model_len, 1)
        return {"anyOf": [text, ids, {"type": "array", "items": text, "minItems": 1, "maxItems": 1},
                          {"type": "array", "items": ids, "minItems": 1, "maxItems": 1}]}


_TEXT_PART = {"type": "object", "properties": {"type": {"const": "text"}, "text": {"type": "string"}},
              "required": ["type", "text"]}


class Messages(Field):
    """Chat messages, normalised for the chat template: content as one string (text parts joined
    by newlines), "developer" as "system", only the keys templates read."""

    __slots__ = ()

    def convert(self, messages: Any, limits: Limits) -> list[dict]:
        if not isinstance(messages, list) or not messages:
            raise self.fail("'messages' must be a non-empty list")
        if len(messages) > MAX_MESSAGES:
            raise self.fail(f"'messages' may hold at most {MAX_MESSAGES} messages")
        out: list[dict] = []
        total = 0
        for i, m in enumerate(messages):
            where = f"messages[{i}]"
            if not isinstance(m, dict):
                raise invalid(f"'{where}' must be an object", param=where)
            role = m.get("role")
            if role not in CHAT_ROLES:
                raise invalid(f"'{where}.role' must be one of {', '.join(CHAT_ROLES)}", param=f"{where}.role")
            content, chars = _content(m.get("content"), f"{where}.content")
            if content is None and not (role == "assistant" and m.get("tool_calls")):
                raise invalid(f"'{where}.content' is required", param=f"{where}.content")
            total += chars
            if total > MAX_CHAT_CHARS:
                raise self.fail(f"'messages' may hold at most {MAX_CHAT_CHARS} characters in all")
            # Templates rarely know "developer": it is OpenAI's new name for the system role.
            msg: dict = {"role": "system" if role == "developer" else role, "content": content}
            for key in ("name", "tool_call_id"):
                if isinstance(m.get(key), str):
                    msg[key] = m[key]
            if isinstance(m.get("tool_calls"), list):
                msg["tool_calls"] = m["tool_calls"]  # bounded by the body size; rendered by the template
            out.append(msg)
        return out

    def value_schema(self, limits: Limits) -> dict:
        message = {"type": "object", "required": ["role"], "properties": {
            "role": {"enum": list(CHAT_ROLES)},
            "content": {"anyOf": [{"type": "string"}, {"type": "array", "items": _TEXT_PART}, {"type": "null"}],
                        "description": "Required, except in an assistant message with tool_calls."},
            "name": {"type": "string"},
            "tool_call_id": {"type": "string"},
            "tool_calls": {"type": "array", "items": {"type": "object"}}},
            "anyOf": [{"required": ["content"], "properties": {"content": {"type": ["string", "array"]}}},
                      {"required": ["tool_calls"], "properties": {"role": {"const": "assistant"},
                                                                  "tool_calls": {"minItems": 1}}}]}
        return {"type": "array", "items": message, "minItems": 1, "maxItems": MAX_MESSAGES,
                "description": f"At most {MAX_CHAT_CHARS} characters of text in all."}


def _content(content: Any, where: str) -> tuple[str | None, int]:
    """A message's content as one string (text parts joined by newlines), and its length."""
    if content is None or isinstance(content, str):
        return content, len(content or "")
    if not isinstance(content, list):
        raise invalid(f"'{where}' must be a string or a list of content parts", param=where)
    texts = []
    for part in content:
        if not isinstance(part, dict) or part.get("type") != "text" or not isinstance(part.get("text"), str):
            raise invalid(f"'{where}' parts must be {{\"type\": \"text\", \"text\": ...}}: only text is supported",
                          param=where)
        texts.append(part["text"])
    text = "\n".join(texts)
    return text, len(text)


class Tools(Field):
    """Tool definitions, for /tokenize (the chat template renders them)."""

    __slots__ = ()

    def convert(self, tools: Any, limits: Limits) -> list[dict] | None:
        if not isinstance(tools, list) or not all(isinstance(t, dict) for t in tools):
            raise self.fail("'tools' must be a list of objects")
        if len(tools) > MAX_TOOLS:
            raise self.fail(f"'tools' may hold at most {MAX_TOOLS} entries")
        return tools or None

    def value_schema(self, limits: Limits) -> dict:
        return {"type": "array", "items": {"type": "object"}, "maxItems": MAX_TOOLS}


def _sampling(name: str, default: float, doc: str) -> Number:
    return Number(name, default, RANGES[name], doc)


MODEL = Model("model", doc="The id of a served model (GET /v1/models; default: the first).")
INCLUDE_USAGE = Boolean("include_usage", False, "Send a last chunk with the usage of the whole request.")
N = Integer("n", 1, 1, lambda limits: limits.max_n, "Choices to generate.")
STREAM = Boolean("stream", False, "Answer with server-sent events.")
STREAM_OPTIONS = StreamOptions("stream_options", None, "Only with 'stream': true.")  # None: not given
STOP = Stop("stop", (), "Strings that end a choice (not included in its text).")
MAX_TOKENS = Integer("max_tokens", None, 1, lambda limits: limits.max_model_len,
                     "Most tokens to generate (default: the rest of the context window).")
MAX_COMPLETION_TOKENS = Integer("max_completion_tokens", None, 1, lambda limits: limits.max_model_len,
                                "OpenAI's newer name for max_tokens (wins when both are given).")
SKIP_SPECIAL_TOKENS = Boolean("skip_special_tokens", True)
CACHE_SALT = String("cache_salt", "", MAX_CACHE_SALT_CHARS, "Folded into the prefix-cache keys.")

SAMPLING: tuple[Field, ...] = (
    _sampling("temperature", 1.0, "0 is greedy."),
    Integer("top_k", 0, -1, lambda limits: limits.vocab_size, "0 or -1: off."),
    _sampling("top_p", 1.0, ""),
    _sampling("min_p", 0.0, ""),
    _sampling("repetition_penalty", 1.0, ""),
    _sampling("presence_penalty", 0.0, ""),
    _sampling("frequency_penalty", 0.0, ""),
    LogitBias("logit_bias", {}, "Token id (as a string) to a bias added to its logit."),
    Integer("seed", None, MIN_SEED, MAX_SEED, "Sampling seed (choice i uses seed + i)."),
    Integer("min_tokens", 0, 0, None, "Tokens to generate before a stop token may end a choice."),
    TokenIds("stop_token_ids", MAX_STOP_TOKEN_IDS, doc="Tokens that end a choice, besides the model's eos."),
    Boolean("ignore_eos", False, "Keep generating past the model's eos token."),
    Boolean("speculative", True, "False: no speculative drafts for this request (the worker's --speculative-config)."),
)
COMMON: tuple[Field, ...] = (MODEL, N, STREAM, STREAM_OPTIONS, STOP, *SAMPLING, SKIP_SPECIAL_TOKENS, CACHE_SALT,
                             *STRUCTURED_FIELDS)

PROMPT = Prompt("prompt", required=True, doc="Text or token ids; one prompt per request.")
COMPLETION_FIELDS: tuple[Field, ...] = (
    *COMMON, PROMPT, MAX_TOKENS,
    Integer("logprobs", None, 0, MAX_TOP_LOGPROBS, "Log-probabilities of the chosen and this many other tokens."),
    Refused("echo", False, "echoing the prompt is not built"),
    Refused("suffix", "", "insertion is not built"),
    Integer("best_of", None, 1, lambda limits: limits.max_n, "Only equal to n is supported."),
)

MESSAGES = Messages("messages", required=True)
ADD_GENERATION_PROMPT = Boolean("add_generation_prompt", True, "End the rendered chat with the assistant's turn.")
CHAT_FIELDS: tuple[Field, ...] = (
    *COMMON, MESSAGES, MAX_TOKENS, MAX_COMPLETION_TOKENS,
    Boolean("logprobs", False, "Return the log-probabilities of the chosen tokens."),
    Integer("top_logprobs", None, 0, MAX_TOP_LOGPROBS, "Alternatives per token (needs logprobs: true)."),
    ADD_GENERATION_PROMPT,
    Tools("tools", None, "Functions the model may call: [{\"type\": \"function\", \"function\": "
                         "{\"name\", \"description\", \"parameters\"}}]."),
    JsonValue("tool_choice", (str, dict), "'none', 'auto' (the default with tools), 'required', or "
                                         "{\"type\": \"function\", \"function\": {\"name\": ...}}."),
    Boolean("parallel_tool_calls", True, "With 'required': more than one call may come."),
    Refused("functions", [], "function calls are not built"),
    Refused("function_call", "none", "function calls are not built"),
)

TOKENIZE_PROMPT_FIELDS: tuple[Field, ...] = (MODEL, PROMPT)
TOKENIZE_CHAT_FIELDS: tuple[Field, ...] = (MODEL, MESSAGES, Tools("tools"), ADD_GENERATION_PROMPT)
DETOKENIZE_FIELDS: tuple[Field, ...] = (MODEL, TokenIds("tokens", lambda limits: limits.max_model_len,
                                                        required=True))


def request_schemas(limits: Limits) -> dict[str, dict]:
    """The JSON Schema of every request body, by name (components/schemas of the OpenAPI document)."""
    return {
        "CompletionRequest": object_schema(COMPLETION_FIELDS, limits, "An OpenAI completions request."),
        "ChatCompletionRequest": object_schema(CHAT_FIELDS, limits, "An OpenAI chat completions request."),
        "TokenizeRequest": {"anyOf": [object_schema(TOKENIZE_PROMPT_FIELDS, limits),
                                      object_schema(TOKENIZE_CHAT_FIELDS, limits)],
                            "description": "A prompt, or chat messages rendered by the chat template."},
        "DetokenizeRequest": object_schema(DETOKENIZE_FIELDS, limits),
    }


# ---------------------------------------------------------------------------------------------
# Bodies → specs

def _spec(v: dict[str, Any], limits: Limits, max_tokens: int | None, logprobs: int | None,
          **prompt: Any) -> GenerationSpec:
    params = SamplingParams(
        temperature=v["temperature"], top_k=v["top_k"], top_p=v["top_p"], min_p=v["min_p"],
        repetition_penalty=v["repetition_penalty"], presence_penalty=v["presence_penalty"],
        frequency_penalty=v["frequency_penalty"], logit_bias=v["logit_bias"], seed=v["seed"],
        # A stand-in until the prompt length is known (resolve_max_tokens); bounds it meanwhile.
        max_tokens=max_tokens if max_tokens is not None else limits.max_model_len,
        min_tokens=v["min_tokens"], stop_token_ids=v["stop_token_ids"] or [], ignore_eos=v["ignore_eos"],
        logprobs=logprobs, speculative=v["speculative"])
    params.grammar_kind, params.grammar = grammar_of(v)
    try:
        params.validate(limits.vocab_size)
    except SamplingParamsError as e:
        raise from_sampling_error(e) from None
    if v["stream_options"] is not None and not v["stream"]:  # as OpenAI and vLLM answer
        raise invalid("'stream_options' is only allowed when 'stream' is true", param="stream_options")
    return GenerationSpec(model=limits.model_name, n=v["n"], stream=v["stream"],
                          include_usage=bool(v["stream_options"]), stop=v["stop"], params=params,
                          max_tokens=max_tokens, logprobs=logprobs, skip_special_tokens=v["skip_special_tokens"],
                          cache_salt=v["cache_salt"], **prompt)


def parse_completion(body: Any, limits: Limits) -> GenerationSpec:
    _object_for_model(body, limits)
    v = read_fields(body, COMPLETION_FIELDS, limits)
    if v["best_of"] is not None and v["best_of"] != v["n"]:
        raise invalid("'best_of' other than 'n' is not supported", param="best_of")
    return _spec(v, limits, v["max_tokens"], v["logprobs"], prompt=v["prompt"])


def parse_chat(body: Any, limits: Limits) -> GenerationSpec:
    _object_for_model(body, limits)
    v = read_fields(body, CHAT_FIELDS, limits)
    max_tokens = v["max_completion_tokens"] if v["max_completion_tokens"] is not None else v["max_tokens"]
    if v["top_logprobs"] is not None and not v["logprobs"]:
        raise invalid("'top_logprobs' needs 'logprobs': true", param="top_logprobs")
    logprobs = (v["top_logprobs"] or 0) if v["logprobs"] else None
    spec = _spec(v, limits, max_tokens, logprobs, messages=v["messages"],
                 add_generation_prompt=v["add_generation_prompt"])
    spec.tool_spec = tool_spec(v["tools"], v["tool_choice"], v["parallel_tool_calls"], bool(spec.params.grammar_kind))
    if spec.tool_spec.mode in ("named", "required"):  # the call is drawn under its schema
        spec.params.grammar_kind, spec.params.grammar = spec.tool_spec.grammar()
    return spec


def parse_tokenize(body: Any, limits: Limits) -> TokenizeSpec:
    _object_for_model(body, limits)
    if "messages" in body:
        v = read_fields(body, TOKENIZE_CHAT_FIELDS, limits)
        return TokenizeSpec(messages=v["messages"], tools=v["tools"],
                            add_generation_prompt=v["add_generation_prompt"])
    return TokenizeSpec(prompt=PROMPT.read(body, limits))


def parse_detokenize(body: Any, limits: Limits) -> list[int]:
    _object_for_model(body, limits)
    return read_fields(body, DETOKENIZE_FIELDS, limits)["tokens"]


# ---------------------------------------------------------------------------------------------

def resolve_max_tokens(spec: GenerationSpec, num_prompt_tokens: int, max_model_len: int,
                       default: int | None = None) -> SamplingParams:
    """Fix max_tokens once the prompt length is known; 400 context_length_exceeded when it cannot fit."""
    param = "messages" if spec.is_chat else "prompt"
    room = max_model_len - num_prompt_tokens
    if spec.max_tokens is None:
        if room < 1:
            raise context_length_exceeded(max_model_len, num_prompt_tokens, None, param)
        max_tokens = room if default is None else min(default, room)
    else:
        if spec.max_tokens > room:
            raise context_length_exceeded(max_model_len, num_prompt_tokens, spec.max_tokens, param)
        max_tokens = spec.max_tokens
    params = dataclasses.replace(spec.params, max_tokens=max_tokens)
    if params.min_tokens > max_tokens:
        raise invalid(f"'min_tokens' ({params.min_tokens}) exceeds the {max_tokens} tokens left for the completion",
                      param="min_tokens")
    spec.params = params
    return params
