"""Validation of OpenAI completions and chat bodies into typed request specs, with every field bounded.

Types are checked here; numeric bounds of sampling parameters are checked by
SamplingParams.validate (the one place that knows them). Unknown fields are ignored.
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass
from typing import Any

from services.gateway.errors import context_length_exceeded, from_sampling_error, invalid, model_not_found
from shared.sampling_params import (MAX_LOGIT_BIAS, MAX_STOP_STRING_CHARS, MAX_STOP_STRINGS, MAX_STOP_TOKEN_IDS,
                                    MAX_TOP_LOGPROBS, SamplingParams, SamplingParamsError)

MAX_MESSAGES = 1024
MAX_CHAT_CHARS = 1 << 20  # text characters over all messages of one chat request
MAX_PROMPT_CHARS = 1 << 20
MAX_TOOLS = 128
MAX_CACHE_SALT_CHARS = 256
CHAT_ROLES = ("system", "developer", "user", "assistant", "tool")


@dataclass(frozen=True, slots=True)
class Limits:
    """What the served model allows."""

    model_name: str
    max_model_len: int
    vocab_size: int
    max_n: int = 16


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
    tools: list[dict] | None = None  # chat: passed to the chat template
    add_generation_prompt: bool = True

    @property
    def is_chat(self) -> bool:
        return self.messages is not None


# ---------------------------------------------------------------------------------------------
# Field readers: each takes the body and a key, returns the typed value or the default, or raises
# a 400 naming the field. null means "not given", as OpenAI clients send it.

def _number(body: dict, key: str, default: float) -> float:
    v = body.get(key)
    if v is None:
        return default
    if isinstance(v, bool) or not isinstance(v, (int, float)) or not math.isfinite(v):
        raise invalid(f"'{key}' must be a finite number", param=key)
    return float(v)


def _int(body: dict, key: str, default: Any, lo: int | None = None, hi: int | None = None) -> Any:
    v = body.get(key)
    if v is None:
        return default
    if isinstance(v, float) and v.is_integer():
        v = int(v)
    if isinstance(v, bool) or not isinstance(v, int):
        raise invalid(f"'{key}' must be an integer", param=key)
    if (lo is not None and v < lo) or (hi is not None and v > hi):
        raise invalid(f"'{key}' must be in [{lo}, {hi}], got {v}" if hi is not None else
                      f"'{key}' must be at least {lo}, got {v}", param=key)
    return v


def _bool(body: dict, key: str, default: bool) -> bool:
    v = body.get(key)
    if v is None:
        return default
    if not isinstance(v, bool):
        raise invalid(f"'{key}' must be a boolean", param=key)
    return v


def _str(body: dict, key: str, default: str, max_chars: int) -> str:
    v = body.get(key)
    if v is None:
        return default
    if not isinstance(v, str):
        raise invalid(f"'{key}' must be a string", param=key)
    if len(v) > max_chars:
        raise invalid(f"'{key}' may hold at most {max_chars} characters", param=key)
    return v


def _stop(body: dict) -> tuple[str, ...]:
    v = body.get("stop")
    if v is None:
        return ()
    items = [v] if isinstance(v, str) else v
    if not isinstance(items, list) or not all(isinstance(s, str) for s in items):
        raise invalid("'stop' must be a string or a list of strings", param="stop")
    if len(items) > MAX_STOP_STRINGS:
        raise invalid(f"'stop' may hold at most {MAX_STOP_STRINGS} strings", param="stop")
    if any(len(s) > MAX_STOP_STRING_CHARS for s in items):
        raise invalid(f"each stop string may hold at most {MAX_STOP_STRING_CHARS} characters", param="stop")
    return tuple(dict.fromkeys(s for s in items if s))


def _logit_bias(body: dict) -> dict[int, float]:
    v = body.get("logit_bias")
    if v is None:
        return {}
    if not isinstance(v, dict):
        raise invalid("'logit_bias' must be an object mapping token ids to biases", param="logit_bias")
    if len(v) > MAX_LOGIT_BIAS:  # before converting anything
        raise invalid(f"'logit_bias' may hold at most {MAX_LOGIT_BIAS} entries", param="logit_bias")
    out: dict[int, float] = {}
    for key, bias in v.items():
        try:
            token_id = int(key)  # JSON object keys are strings: "50256"
        except (TypeError, ValueError):
            raise invalid(f"'logit_bias' key {key!r} is not a token id", param="logit_bias") from None
        if isinstance(bias, bool) or not isinstance(bias, (int, float)) or not math.isfinite(bias):
            raise invalid(f"'logit_bias' value for {key!r} must be a number", param="logit_bias")
        out[token_id] = float(bias)
    return out


def _token_ids(value: Any, param: str, vocab_size: int, max_len: int) -> list[int]:
    if not isinstance(value, list) or not all(type(t) is int for t in value):
        raise invalid(f"'{param}' must be a list of token ids", param=param)
    if len(value) > max_len:
        raise invalid(f"'{param}' may hold at most {max_len} token ids", param=param)
    if any(not 0 <= t < vocab_size for t in value):
        raise invalid(f"'{param}' holds a token id outside the vocabulary (size {vocab_size})", param=param)
    return value


def _object_for_model(body: Any, limits: Limits) -> None:
    """A JSON object whose optional 'model' names the served model."""
    if not isinstance(body, dict):
        raise invalid("the request body must be a JSON object")
    model = body.get("model")
    if model is not None and not isinstance(model, str):
        raise invalid("'model' must be a string", param="model")
    if model is not None and model != limits.model_name:
        raise model_not_found(model[:256])


def _common(body: Any, limits: Limits, max_tokens_key: str) -> dict:
    """The fields both endpoints share, as keyword arguments of GenerationSpec."""
    _object_for_model(body, limits)
    n = _int(body, "n", 1, 1, limits.max_n)
    stream = _bool(body, "stream", False)
    options = body.get("stream_options")
    if options is not None and not isinstance(options, dict):
        raise invalid("'stream_options' must be an object", param="stream_options")
    include_usage = _bool(options or {}, "include_usage", False)
    max_tokens = _int(body, max_tokens_key, None, 1, limits.max_model_len)
    stop_ids = body.get("stop_token_ids")
    params = SamplingParams(
        temperature=_number(body, "temperature", 1.0),
        top_k=_int(body, "top_k", 0),
        top_p=_number(body, "top_p", 1.0),
        min_p=_number(body, "min_p", 0.0),
        repetition_penalty=_number(body, "repetition_penalty", 1.0),
        presence_penalty=_number(body, "presence_penalty", 0.0),
        frequency_penalty=_number(body, "frequency_penalty", 0.0),
        logit_bias=_logit_bias(body),
        seed=_int(body, "seed", None),
        # A stand-in until the prompt length is known (resolve_max_tokens); bounds it meanwhile.
        max_tokens=max_tokens if max_tokens is not None else limits.max_model_len,
        min_tokens=_int(body, "min_tokens", 0),
        stop_token_ids=[] if stop_ids is None else _token_ids(stop_ids, "stop_token_ids", limits.vocab_size,
                                                              MAX_STOP_TOKEN_IDS),
        ignore_eos=_bool(body, "ignore_eos", False),
    )
    return dict(model=limits.model_name, n=n, stream=stream, include_usage=include_usage and stream,
                stop=_stop(body), params=params, max_tokens=max_tokens, logprobs=None,
                skip_special_tokens=_bool(body, "skip_special_tokens", True),
                cache_salt=_str(body, "cache_salt", "", MAX_CACHE_SALT_CHARS))


def _finish(kwargs: dict, limits: Limits) -> GenerationSpec:
    spec = GenerationSpec(**kwargs)
    spec.params.logprobs = spec.logprobs
    try:
        spec.params.validate(limits.vocab_size)
    except SamplingParamsError as e:
        raise from_sampling_error(e) from None
    return spec


# ---------------------------------------------------------------------------------------------
# /v1/completions

def _prompt(body: dict, limits: Limits) -> str | list[int]:
    p = body.get("prompt")
    if isinstance(p, list) and p and isinstance(p[0], (str, list)):
        if len(p) != 1:
            raise invalid("only one prompt per request is supported: send one request per prompt", param="prompt")
        p = p[0]
    if isinstance(p, str):
        if len(p) > MAX_PROMPT_CHARS:
            raise invalid(f"'prompt' may hold at most {MAX_PROMPT_CHARS} characters", param="prompt")
        return p
    if isinstance(p, list) and p:
        return _token_ids(p, "prompt", limits.vocab_size, limits.max_model_len)
    raise invalid("'prompt' must be a non-empty string or a non-empty list of token ids", param="prompt")


def parse_completion(body: Any, limits: Limits) -> GenerationSpec:
    kwargs = _common(body, limits, "max_tokens")
    kwargs["prompt"] = _prompt(body, limits)
    kwargs["logprobs"] = _int(body, "logprobs", None, 0, MAX_TOP_LOGPROBS)
    if _bool(body, "echo", False):
        raise invalid("'echo' is not supported", param="echo")
    if body.get("suffix"):
        raise invalid("'suffix' is not supported", param="suffix")
    best_of = _int(body, "best_of", None, 1, limits.max_n)
    if best_of is not None and best_of != kwargs["n"]:
        raise invalid("'best_of' other than 'n' is not supported", param="best_of")
    return _finish(kwargs, limits)


# ---------------------------------------------------------------------------------------------
# /v1/chat/completions

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


def _messages(body: dict) -> list[dict]:
    messages = body.get("messages")
    if not isinstance(messages, list) or not messages:
        raise invalid("'messages' must be a non-empty list", param="messages")
    if len(messages) > MAX_MESSAGES:
        raise invalid(f"'messages' may hold at most {MAX_MESSAGES} messages", param="messages")
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
            raise invalid(f"'messages' may hold at most {MAX_CHAT_CHARS} characters in all", param="messages")
        # Templates rarely know "developer": it is OpenAI's new name for the system role.
        msg: dict = {"role": "system" if role == "developer" else role, "content": content}
        for key in ("name", "tool_call_id"):
            if isinstance(m.get(key), str):
                msg[key] = m[key]
        if isinstance(m.get("tool_calls"), list):
            msg["tool_calls"] = m["tool_calls"]  # bounded by the body size; rendered by the template
        out.append(msg)
    return out


def _tools(body: dict) -> list[dict] | None:
    tools = body.get("tools")
    if tools is None:
        return None
    if not isinstance(tools, list) or not all(isinstance(t, dict) for t in tools):
        raise invalid("'tools' must be a list of objects", param="tools")
    if len(tools) > MAX_TOOLS:
        raise invalid(f"'tools' may hold at most {MAX_TOOLS} entries", param="tools")
    return tools or None


def parse_chat(body: Any, limits: Limits) -> GenerationSpec:
    key = "max_completion_tokens" if isinstance(body, dict) and body.get("max_completion_tokens") is not None \
        else "max_tokens"
    kwargs = _common(body, limits, key)
    kwargs["messages"] = _messages(body)
    kwargs["tools"] = _tools(body)
    kwargs["add_generation_prompt"] = _bool(body, "add_generation_prompt", True)
    want = _bool(body, "logprobs", False)
    top = _int(body, "top_logprobs", None, 0, MAX_TOP_LOGPROBS)
    if top is not None and not want:
        raise invalid("'top_logprobs' needs 'logprobs': true", param="top_logprobs")
    kwargs["logprobs"] = (top or 0) if want else None
    return _finish(kwargs, limits)


# ---------------------------------------------------------------------------------------------
# /tokenize and /detokenize (vLLM's tokenizer endpoints)

@dataclass(slots=True)
class TokenizeSpec:
    """What Gateway.tokenize reads: a prompt, or chat messages rendered by the chat template."""

    prompt: str | list[int] | None = None
    messages: list[dict] | None = None
    tools: list[dict] | None = None
    add_generation_prompt: bool = True

    @property
    def is_chat(self) -> bool:
        return self.messages is not None


def parse_tokenize(body: Any, limits: Limits) -> TokenizeSpec:
    _object_for_model(body, limits)
    if "messages" in body:
        return TokenizeSpec(messages=_messages(body), tools=_tools(body),
                            add_generation_prompt=_bool(body, "add_generation_prompt", True))
    return TokenizeSpec(prompt=_prompt(body, limits))


def parse_detokenize(body: Any, limits: Limits) -> list[int]:
    _object_for_model(body, limits)
    return _token_ids(body.get("tokens"), "tokens", limits.vocab_size, limits.max_model_len)


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
