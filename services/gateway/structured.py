"""Structured outputs in a request body, as one grammar for the worker's sampler.

OpenAI's `response_format` ({"type": "json_object"} or {"type": "json_schema", "json_schema":
{"name", "schema", "strict"}}), vLLM's `structured_outputs` ({"json" | "regex" | "choice" |
"grammar": ...}, with `whitespace_pattern` and `disable_any_whitespace` beside) and its older
`guided_json`, `guided_regex`, `guided_choice`, `guided_grammar`, `guided_whitespace_pattern` become
(kind, text): kind one of shared.sampling_params.GRAMMAR_KINDS. What can be checked without
the model's vocabulary is checked here, each failure a 400 naming its field: a schema must be one
(its meta-schema), a regex must parse. The worker compiles the grammar against its vocabulary
(services/worker/grammar.py).
"""

from __future__ import annotations

import json
import re
from typing import Any

from services.gateway.errors import ApiError, invalid
from services.gateway.fields import Field, Limits

MAX_GRAMMAR_CHARS = 1 << 16  # a schema, regex or grammar's text; beyond it is not an answer's shape
MAX_CHOICES = 256
CHECKED_SCHEMAS = 1024  # schema texts known to pass their meta-schema, kept in order of arrival
_CHECKED: dict[str, None] = {}


class JsonValue(Field):
    """A field whose value is JSON of the types given (the structured-output fields)."""

    __slots__ = ("types",)

    def __init__(self, name: str, types: tuple[type, ...], doc: str = ""):
        self.types = types
        super().__init__(name, None, doc)

    def convert(self, v: Any, limits: Limits) -> Any:
        if not isinstance(v, self.types):
            names = " or ".join({dict: "an object", str: "a string", list: "a list"}[t] for t in self.types)
            raise self.fail(f"'{self.name}' must be {names}")
        return v

    def value_schema(self, limits: Limits) -> dict:
        names = {dict: "object", str: "string", list: "array"}
        return {"type": [names[t] for t in self.types]} if len(self.types) > 1 else {"type": names[self.types[0]]}


FIELDS: tuple[Field, ...] = (
    JsonValue("response_format", (dict,), "{\"type\": \"text\" | \"json_object\" | \"json_schema\", "
                                          "\"json_schema\": {\"name\", \"schema\", \"strict\"}}"),
    JsonValue("structured_outputs", (dict,), "vLLM's: one of {\"json\": schema, \"regex\", \"choice\", \"grammar\"}."),
    JsonValue("guided_json", (dict, str), "vLLM's older name for structured_outputs.json."),
    JsonValue("guided_regex", (str,), "vLLM's older name for structured_outputs.regex."),
    JsonValue("guided_choice", (list,), "vLLM's older name for structured_outputs.choice."),
    JsonValue("guided_grammar", (str,), "vLLM's older name for structured_outputs.grammar (EBNF)."),
    JsonValue("guided_whitespace_pattern", (str,), "vLLM's older name for structured_outputs.whitespace_pattern."),
)


def grammar_of(v: dict[str, Any]) -> tuple[str, str]:
    """(kind, text) of the body's structured-output fields (read_fields' values); ("", "") for none.
    More than one of them is a 400: which one would win is not the caller's guess to make."""
    found: list[tuple[str, str, str]] = []  # (param, kind, text)
    rf = v.get("response_format")
    if rf is not None:
        got = _response_format(rf)
        if got is not None:
            found.append(("response_format", *got))
    so = v.get("structured_outputs")
    for param, pattern in (("structured_outputs.whitespace_pattern", (so or {}).get("whitespace_pattern")),
                           ("guided_whitespace_pattern", v.get("guided_whitespace_pattern"))):
        if pattern is not None:
            _check_whitespace(param, pattern)
    if so is not None:
        keys = [k for k in ("json", "regex", "choice", "grammar") if so.get(k) is not None]
        if len(keys) != 1:
            raise invalid("'structured_outputs' needs exactly one of json, regex, choice, grammar",
                          param="structured_outputs")
        found.append(_vllm(f"structured_outputs.{keys[0]}", keys[0], so[keys[0]]))
    for key in ("json", "regex", "choice", "grammar"):
        if v.get(f"guided_{key}") is not None:
            found.append(_vllm(f"guided_{key}", key, v[f"guided_{key}"]))
    if not found:
        return "", ""
    if len(found) > 1:
        raise invalid(f"give one of {', '.join(p for p, _, _ in found)}, not several", param=found[1][0])
    param, kind, text = found[0]
    if len(text) > MAX_GRAMMAR_CHARS:
        raise invalid(f"'{param}' is longer than {MAX_GRAMMAR_CHARS} characters", param=param)
    return kind, text


def _check_whitespace(param: str, pattern: Any) -> None:
    """JSON comes compact (no whitespace between tokens; vLLM's disable_any_whitespace): a pattern
    that admits no whitespace at all is one compact JSON cannot follow, hence a 400."""
    if not isinstance(pattern, str):
        raise invalid(f"'{param}' must be a string", param=param)
    try:
        empty_ok = re.fullmatch(pattern, "") is not None
    except re.error as e:
        raise invalid(f"'{param}' does not parse as a regular expression: {e}", param=param) from None
    if not empty_ok:
        raise invalid(f"'{param}' must admit empty whitespace: JSON answers come compact", param=param)


def _response_format(rf: dict) -> tuple[str, str] | None:
    t = rf.get("type")
    if t == "text":
        return None
    if t == "json_object":
        return "json", ""
    if t == "json_schema":
        js = rf.get("json_schema")
        if not isinstance(js, dict) or not isinstance(js.get("schema", {}), dict):
            raise invalid("'response_format.json_schema' must be an object with a 'schema' object",
                          param="response_format.json_schema")
        schema = js.get("schema")
        if schema is None:  # OpenAI allows a schema-less json_schema: any JSON object
            return "json", ""
        return "json_schema", checked_schema(schema, "response_format.json_schema.schema")
    raise invalid("'response_format.type' must be 'text', 'json_object' or 'json_schema'",
                  param="response_format.type")


def _vllm(param: str, key: str, value: Any) -> tuple[str, str, str]:
    if key == "json":
        if isinstance(value, str):
            try:
                value = json.loads(value)
            except ValueError:
                raise invalid(f"'{param}' is not valid JSON", param=param) from None
        if not isinstance(value, dict):
            raise invalid(f"'{param}' must be a JSON Schema object", param=param)
        return param, "json_schema", checked_schema(value, param)
    if key == "regex":
        if not isinstance(value, str) or not value:
            raise invalid(f"'{param}' must be a non-empty string", param=param)
        try:
            re.compile(value)
        except re.error as e:
            raise invalid(f"'{param}' does not parse as a regular expression: {e}", param=param) from None
        return param, "regex", value
    if key == "choice":
        if (not isinstance(value, list) or not value or len(value) > MAX_CHOICES
                or not all(isinstance(c, str) and c for c in value)):
            raise invalid(f"'{param}' must be a list of 1 to {MAX_CHOICES} non-empty strings", param=param)
        return param, "ebnf", "root ::= " + " | ".join(json.dumps(c) for c in dict.fromkeys(value))
    if not isinstance(value, str) or "::=" not in value:
        raise invalid(f"'{param}' must be an EBNF grammar (rules 'name ::= ...', starting at 'root')", param=param)
    return param, "ebnf", value


def checked_schema(schema: dict, param: str) -> str:
    """The schema's JSON text, once it is a JSON Schema by its meta-schema. The check (~2 ms of the
    event loop for a W2 schema) is made once per text: clients send the same few schemas again and
    again, and W2 under one schema spent half the gateway's CPU on it."""
    import jsonschema

    text = json.dumps(schema, separators=(",", ":"))
    if text in _CHECKED:
        return text
    try:
        jsonschema.validators.validator_for(schema).check_schema(schema)
    except jsonschema.SchemaError as e:
        where = "/".join(str(p) for p in e.absolute_path)
        raise ApiError(400, f"'{param}' is not a valid JSON Schema{f' at {where}' if where else ''}: {e.message}",
                       param=param, code="invalid_json_schema") from None
    if len(_CHECKED) >= CHECKED_SCHEMAS:
        _CHECKED.pop(next(iter(_CHECKED)))  # the oldest
    _CHECKED[text] = None
    return text
