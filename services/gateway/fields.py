"""Request-body fields: each reads its value from a JSON body (or raises a 400 naming it) and
describes what it accepts as JSON Schema, so /openapi.json comes from the code that validates.

null means "not given", as OpenAI clients send it: the schema of every optional field admits null.
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass
from typing import Any, Callable, Sequence

from services.gateway.errors import ApiError, invalid
from shared.sampling_params import Range


@dataclass(frozen=True, slots=True)
class Limits:
    """What the served model allows."""

    model_name: str
    max_model_len: int
    vocab_size: int
    max_n: int = 16
    # Every id the gateway serves, for the OpenAPI document's enum (empty: model_name alone). A request
    # is read against its own model's Limits, which need no other names.
    model_names: tuple[str, ...] = ()


Bound = int | Callable[[Limits], int] | None  # a number, or one that depends on the served model


def _bound(b: Bound, limits: Limits) -> int | None:
    return b(limits) if callable(b) else b


def nullable(schema: dict) -> dict:
    """The schema that also admits null."""
    t = schema.get("type")
    if isinstance(t, str):
        s = {**schema, "type": [t, "null"]}
        if "enum" in s:
            s["enum"] = [*s["enum"], None]
        return s
    return {"anyOf": [schema, {"type": "null"}]}


class Field:
    """One key of a request body: optional (absent or null gives the default) or required."""

    __slots__ = ("name", "default", "doc", "required")

    def __init__(self, name: str, default: Any = None, doc: str = "", *, required: bool = False):
        self.name = name
        self.default = default
        self.doc = doc
        self.required = required

    def read(self, body: dict, limits: Limits) -> Any:
        v = body.get(self.name)
        if v is None and not self.required:
            return self.default
        return self.convert(v, limits)

    def convert(self, v: Any, limits: Limits) -> Any:
        """The field's value (None only for a missing required field); a 400 when not acceptable."""
        raise NotImplementedError

    def value_schema(self, limits: Limits) -> dict:
        raise NotImplementedError

    def schema(self, limits: Limits) -> dict:
        s = self.value_schema(limits)
        if not self.required:
            s = nullable(s)
        if self.doc:
            s["description"] = self.doc
        return s

    def fail(self, message: str) -> ApiError:
        return invalid(message, param=self.name)


class Number(Field):
    """A finite number. Its range (shared with SamplingParams.validate, which checks it) is published."""

    __slots__ = ("range",)

    def __init__(self, name: str, default: float, range: Range | None = None, doc: str = ""):
        super().__init__(name, default, doc)
        self.range = range

    def convert(self, v: Any, limits: Limits) -> float:
        f = finite_number(v)
        if f is None:
            raise self.fail(f"'{self.name}' must be a finite number")
        return f

    def value_schema(self, limits: Limits) -> dict:
        return number_schema(self.range)


def finite_number(v: Any) -> float | None:
    """v as a float when it is a finite JSON number, else None."""
    if isinstance(v, bool) or not isinstance(v, (int, float)):
        return None
    try:
        f = float(v)
    except OverflowError:  # an integer past the float range
        return None
    return f if math.isfinite(f) else None


def number_schema(bounds: Range | None) -> dict:
    s: dict = {"type": "number"}
    if bounds is not None:
        s["exclusiveMinimum" if bounds.lo_open else "minimum"] = bounds.lo
        s["maximum"] = bounds.hi
    return s


class Integer(Field):
    """An integer within [lo, hi] (2.0 counts as 2)."""

    __slots__ = ("lo", "hi")

    def __init__(self, name: str, default: Any, lo: Bound = None, hi: Bound = None, doc: str = ""):
        super().__init__(name, default, doc)
        self.lo = lo
        self.hi = hi

    def convert(self, v: Any, limits: Limits) -> int:
        if isinstance(v, float) and v.is_integer():
            v = int(v)
        if isinstance(v, bool) or not isinstance(v, int):
            raise self.fail(f"'{self.name}' must be an integer")
        lo, hi = _bound(self.lo, limits), _bound(self.hi, limits)
        if (lo is not None and v < lo) or (hi is not None and v > hi):
            raise self.fail(f"'{self.name}' must be in [{lo}, {hi}], got {v}" if hi is not None else
                            f"'{self.name}' must be at least {lo}, got {v}")
        return v

    def value_schema(self, limits: Limits) -> dict:
        s: dict = {"type": "integer"}
        lo, hi = _bound(self.lo, limits), _bound(self.hi, limits)
        if lo is not None:
            s["minimum"] = lo
        if hi is not None:
            s["maximum"] = hi
        return s


class Boolean(Field):
    __slots__ = ()

    def convert(self, v: Any, limits: Limits) -> bool:
        if not isinstance(v, bool):
            raise self.fail(f"'{self.name}' must be a boolean")
        return v

    def value_schema(self, limits: Limits) -> dict:
        return {"type": "boolean"}


class String(Field):
    __slots__ = ("max_chars",)

    def __init__(self, name: str, default: Any, max_chars: int, doc: str = ""):
        super().__init__(name, default, doc)
        self.max_chars = max_chars

    def convert(self, v: Any, limits: Limits) -> str:
        if not isinstance(v, str):
            raise self.fail(f"'{self.name}' must be a string")
        if len(v) > self.max_chars:
            raise self.fail(f"'{self.name}' may hold at most {self.max_chars} characters")
        return v

    def value_schema(self, limits: Limits) -> dict:
        return {"type": "string", "maxLength": self.max_chars}


class TokenIds(Field):
    """A list of token ids of the served vocabulary."""

    __slots__ = ("max_len", "min_len")

    def __init__(self, name: str, max_len: Bound, min_len: int = 0, doc: str = "", *, required: bool = False):
        super().__init__(name, None, doc, required=required)
        self.max_len = max_len
        self.min_len = min_len

    def convert(self, v: Any, limits: Limits) -> list[int]:
        return token_ids(v, self.name, limits.vocab_size, _bound(self.max_len, limits), self.min_len)

    def value_schema(self, limits: Limits) -> dict:
        return token_ids_schema(limits, _bound(self.max_len, limits), self.min_len)


def token_ids(value: Any, param: str, vocab_size: int, max_len: int, min_len: int = 0) -> list[int]:
    """The token ids of a JSON list (integral floats such as 5.0 count as integers, as JSON Schema says)."""
    if not isinstance(value, list) or len(value) < min_len:
        raise invalid(f"'{param}' must be a {'non-empty ' if min_len else ''}list of token ids", param=param)
    if not all(type(t) is int for t in value):
        if not all(type(t) is int or (type(t) is float and t.is_integer()) for t in value):
            raise invalid(f"'{param}' must be a {'non-empty ' if min_len else ''}list of token ids", param=param)
        value = [int(t) for t in value]
    if len(value) > max_len:
        raise invalid(f"'{param}' may hold at most {max_len} token ids", param=param)
    if any(not 0 <= t < vocab_size for t in value):
        raise invalid(f"'{param}' holds a token id outside the vocabulary (size {vocab_size})", param=param)
    return value


def token_ids_schema(limits: Limits, max_len: int, min_len: int = 0) -> dict:
    s: dict = {"type": "array", "items": {"type": "integer", "minimum": 0, "maximum": limits.vocab_size - 1},
               "maxItems": max_len}
    if min_len:
        s["minItems"] = min_len
    return s


class Refused(Field):
    """A field for a feature that is not built yet: null, or a value that asks for nothing (`allowed`),
    is accepted; anything else gets a 400 that says so, instead of being silently ignored."""

    __slots__ = ("allowed", "allowed_text", "why")

    def __init__(self, name: str, allowed: Any, why: str):
        self.allowed = allowed
        self.allowed_text = json.dumps(allowed)
        self.why = why
        super().__init__(name, None, f"Not supported yet ({why}): only {self.allowed_text} or null is accepted.")

    def convert(self, v: Any, limits: Limits) -> None:
        if v != self.allowed or type(v) is not type(self.allowed):
            raise ApiError(400, f"'{self.name}' is not supported yet ({self.why}): send {self.allowed_text} "
                                "or leave it out", param=self.name, code="unsupported_parameter")
        return None

    def value_schema(self, limits: Limits) -> dict:
        return {"const": self.allowed}


# ---------------------------------------------------------------------------------------------

def read_fields(body: dict, fields: Sequence[Field], limits: Limits) -> dict[str, Any]:
    """Every field's value by name, in the order given (the first bad one raises)."""
    return {f.name: f.read(body, limits) for f in fields}


def object_schema(fields: Sequence[Field], limits: Limits, doc: str = "") -> dict:
    """The JSON Schema of a body made of these fields; other keys are allowed (and ignored)."""
    s: dict = {"type": "object", "properties": {f.name: f.schema(limits) for f in fields}}
    required = [f.name for f in fields if f.required]
    if required:
        s["required"] = required
    if doc:
        s["description"] = doc
    return s
