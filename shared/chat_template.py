"""Render a Hugging Face chat template (Jinja2) exactly as transformers' apply_chat_template does.

The environment mirrors transformers.utils.chat_template_utils: an ImmutableSandboxedEnvironment
with trim_blocks and lstrip_blocks, the loopcontrols extension, a `tojson` filter that does not
escape HTML and takes indent/separators/sort_keys, and the globals `raise_exception`,
`strftime_now`, `dict` and a `namespace` that refuses underscore attributes. Messages are
normalised the same way first: keys whose value is None are dropped (OpenAI clients send
`content: null` beside tool calls), and everything the template sees is rebuilt from plain JSON
types. The tokenizer's named special tokens (bos_token, eos_token, ...) are template variables.

A template that raises (`raise_exception`, a syntax error, an undefined operation, ...) gives a
ChatTemplateError, a ValueError whose message says what went wrong.
"""

from __future__ import annotations

import dataclasses
import json
from collections.abc import Mapping
from datetime import datetime
from functools import lru_cache
from typing import Any

import jinja2
import jinja2.ext
import jinja2.nodes
import jinja2.utils
from jinja2.sandbox import ImmutableSandboxedEnvironment


class ChatTemplateError(ValueError):
    """The chat template cannot be compiled or raised while rendering."""


def _raise_exception(message):
    raise jinja2.exceptions.TemplateError(message)


def _tojson(x, ensure_ascii=False, indent=None, separators=None, sort_keys=False):
    # transformers' override: Jinja's own tojson escapes HTML characters and takes no options.
    return json.dumps(x, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)


def _strftime_now(format):
    return datetime.now().strftime(format)


class _TemplateDict:
    """`dict(...)` for templates, without exposing the dict type itself."""

    def __call__(self, *args, **kwargs):
        return dict(*args, **kwargs)

    def fromkeys(self, *args, **kwargs):
        return dict.fromkeys(*args, **kwargs)


class _TemplateNamespace(jinja2.utils.Namespace):
    """A jinja namespace that refuses underscore-prefixed attributes."""

    def __init__(*args, **kwargs):
        self, args = args[0], args[1:]
        attrs = dict(*args, **kwargs)
        for name in attrs:
            _TemplateNamespace._check_name(name)
        jinja2.utils.Namespace.__init__(self, attrs)

    def __setitem__(self, name, value):
        _TemplateNamespace._check_name(name)
        jinja2.utils.Namespace.__setitem__(self, name, value)

    @staticmethod
    def _check_name(name):
        if isinstance(name, str) and name.startswith("_"):
            raise jinja2.exceptions.SecurityError(
                f"Chat templates cannot store underscore-prefixed attributes on a namespace, but got {name!r}.")


class _GenerationTag(jinja2.ext.Extension):
    """Accept transformers' `{% generation %}...{% endgeneration %}` marker and render its body."""

    tags = {"generation"}

    def parse(self, parser):
        lineno = next(parser.stream).lineno
        body = parser.parse_statements(["name:endgeneration"], drop_needle=True)
        return jinja2.nodes.CallBlock(self.call_method("_render"), [], [], body).set_lineno(lineno)

    def _render(self, caller):
        return caller()


@lru_cache(maxsize=32)
def compile_chat_template(template: str) -> jinja2.Template:
    """Compile once per distinct template string."""
    env = ImmutableSandboxedEnvironment(
        trim_blocks=True, lstrip_blocks=True, extensions=[_GenerationTag, jinja2.ext.loopcontrols])
    env.filters["tojson"] = _tojson
    env.globals["raise_exception"] = _raise_exception
    env.globals["strftime_now"] = _strftime_now
    env.globals["dict"] = _TemplateDict()
    env.globals["namespace"] = _TemplateNamespace
    try:
        return env.from_string(template)
    except jinja2.exceptions.TemplateSyntaxError as e:
        raise ChatTemplateError(f"chat template does not compile (line {e.lineno}): {e.message}") from e


def plain_template_data(value: Any) -> Any:
    """Rebuild a value from plain JSON types, as transformers does before rendering."""
    if value is None or type(value) in (str, int, float, bool):
        return value
    if isinstance(value, str):
        return str.__str__(value)
    if isinstance(value, int):
        return int.__int__(value)
    if isinstance(value, float):
        return float.__float__(value)
    if isinstance(value, Mapping):
        return {plain_template_data(k): plain_template_data(v) for k, v in value.items()}
    if isinstance(value, list):
        return [plain_template_data(v) for v in value]
    if isinstance(value, tuple):
        return tuple(plain_template_data(v) for v in value)
    if hasattr(value, "item") and callable(value.item) and type(value).__module__ == "numpy":
        return plain_template_data(value.item())
    if dataclasses.is_dataclass(value) and not isinstance(value, type):
        return {f.name: plain_template_data(getattr(value, f.name)) for f in dataclasses.fields(value)}
    if callable(getattr(value, "model_dump", None)):
        return plain_template_data(value.model_dump())
    return f"<{type(value).__name__}>"


def _normalise_messages(messages) -> list[dict]:
    if isinstance(messages, (str, bytes)) or not hasattr(messages, "__iter__"):
        raise ChatTemplateError("messages must be a list of {'role': ..., 'content': ...} dicts")
    messages = list(messages)
    if not messages:
        raise ChatTemplateError("cannot apply the chat template to an empty conversation")
    out = []
    for i, message in enumerate(messages):
        message = plain_template_data(message)
        if not isinstance(message, dict):
            raise ChatTemplateError(f"message {i} is not a dict: {message!r}")
        out.append({k: v for k, v in message.items() if v is not None})
    return out


def render_chat_template(
    template: str,
    messages,
    add_generation_prompt: bool = False,
    tools: list[dict] | None = None,
    documents: list[dict] | None = None,
    special_tokens: Mapping[str, str] | None = None,
    **kwargs,
) -> str:
    """The rendered prompt text, identical to
    `AutoTokenizer.apply_chat_template(messages, tokenize=False, ...)`.

    special_tokens: the tokenizer's named special tokens (bos_token, eos_token, ...); keyword
    arguments with the same names override them, as in transformers.
    """
    compiled = compile_chat_template(template)
    chat = _normalise_messages(messages)
    if tools is not None:
        if not isinstance(tools, (list, tuple)) or not all(isinstance(t, Mapping) for t in tools):
            raise ChatTemplateError("tools must be a list of JSON-schema dicts")
    if documents is not None:
        if not isinstance(documents, (list, tuple)) or not all(isinstance(d, Mapping) for d in documents):
            raise ChatTemplateError("documents must be a list of dicts")
    variables = {**dict(special_tokens or {}), **kwargs}
    try:
        return compiled.render(
            messages=chat,
            tools=plain_template_data(list(tools) if tools is not None else None),
            documents=plain_template_data(list(documents) if documents is not None else None),
            add_generation_prompt=add_generation_prompt,
            **plain_template_data(variables),
        )
    except jinja2.exceptions.TemplateError as e:
        raise ChatTemplateError(f"chat template error: {e.message or e}") from e
    except (TypeError, ValueError, KeyError, IndexError, AttributeError, ArithmeticError) as e:
        raise ChatTemplateError(f"chat template failed on these messages: {type(e).__name__}: {e}") from e
