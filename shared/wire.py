"""MessagePack codec for typed NATS messages: registration, strict decoding, counting bad input.

A message class is a frozen, slotted dataclass that subclasses `Message`, names a `TYPE` tag and a
`VERSION` (the major version) and is decorated with `@register`. On the wire it is a MessagePack
map {"t": TYPE, "v": VERSION, <field>: <value>, ...}; nested message dataclasses are plain maps of
their fields (the outer message's version covers them). The encoder leaves out fields that equal
their default, so a default must never change within a major version.

Decoding rules (the same for every subject):
- the payload must be at most `MAX_BYTES` (1 MiB by default, the NATS default max_payload);
- it must be a MessagePack map whose "t" equals the class's TYPE and whose "v" equals its VERSION;
  a different major version is rejected, never guessed at;
- every field without a default must be present; a field with a default may be absent (it then
  takes its default; that is also how a field is added without a major version bump), and fields
  the class does not know are ignored, so an older reader accepts a newer writer's message;
- every present field must have exactly its declared type: int (not bool), float (an int is
  accepted and converted), str, bool, bytes (with length rules for `PackedIds` and `BlockHash`),
  list[...], dict[int, float], `X | None`, and nested message classes;
- the class's `_check()` then verifies invariants across fields.
Any violation raises `MessageError`; `safe_decode` turns that into a logged, counted `None`.

Token ids never travel as MessagePack lists: `pack_ids` packs them as little-endian int32 bytes.
"""

from __future__ import annotations

import dataclasses
import numbers
import struct
import sys
import time
import types
import typing
from array import array
from typing import Annotated, Any, Callable, ClassVar, TypeVar, get_args, get_origin, get_type_hints

import msgpack

from shared.errors import MessageError
from shared.logging import get_logger

DEFAULT_MAX_BYTES = 1 << 20

log = get_logger(__name__)


class ByteLen:
    """Length rule for a bytes field, attached with typing.Annotated."""

    __slots__ = ("multiple", "exact")

    def __init__(self, *, multiple: int = 1, exact: int | None = None):
        self.multiple = multiple
        self.exact = exact

    def __repr__(self) -> str:
        return f"ByteLen(multiple={self.multiple}, exact={self.exact})"


PackedIds = Annotated[bytes, ByteLen(multiple=4)]  # little-endian int32 token ids, see pack_ids()
BlockHash = Annotated[bytes, ByteLen(exact=16)]  # shared.block_hash digests


class Message:
    """Base of every wire message; subclasses are `@register`ed frozen slotted dataclasses."""

    __slots__ = ()
    TYPE: ClassVar[str] = ""
    VERSION: ClassVar[int] = 1
    MAX_BYTES: ClassVar[int] = DEFAULT_MAX_BYTES

    def _check(self) -> None:
        """Invariants across fields, verified on decode; raise MessageError when broken."""


M = TypeVar("M", bound=Message)


class _Bad(Exception):
    """A field failed its check; `path` grows as the exception climbs out of nested values."""

    def __init__(self, message: str, path: list[str] | None = None):
        super().__init__(message)
        self.message = message
        self.path = path if path is not None else []


Checker = Callable[[Any], Any]


class _Field:
    __slots__ = ("name", "type", "check", "required", "default", "factory")

    def __init__(self, name: str, tp: Any, check: Checker, required: bool, default: Any, factory: Any):
        self.name = name
        self.type = tp
        self.check = check
        self.required = required
        self.default = default
        self.factory = factory


class _Spec:
    __slots__ = ("cls", "tag", "version", "max_bytes", "fields", "decode_fields", "fill_map")

    def __init__(self, cls: type, fields: list[_Field]):
        self.cls = cls
        self.tag: str = cls.TYPE
        self.version: int = cls.VERSION
        self.max_bytes: int = cls.MAX_BYTES
        self.fields = tuple(fields)
        self.decode_fields: Callable[[dict], Any] = _gen_decoder(cls, self.fields)
        self.fill_map: Callable[[Any, dict], dict] = _gen_encoder(cls, self.fields)


_SPECS: dict[type, _Spec] = {}
_TAGS: dict[str, type] = {}


def register(cls: type[M]) -> type[M]:
    """Class decorator: check the message class's shape and generate its encoder and decoder."""
    if not (isinstance(cls, type) and issubclass(cls, Message)):
        raise TypeError(f"{cls!r} must subclass shared.wire.Message")
    if not dataclasses.is_dataclass(cls):
        raise TypeError(f"{cls.__name__} must be a dataclass (apply @dataclass before @register)")
    params = cls.__dataclass_params__  # type: ignore[attr-defined]
    if not params.frozen or "__slots__" not in cls.__dict__:
        raise TypeError(f"{cls.__name__} must be @dataclass(slots=True, frozen=True)")
    if hasattr(cls, "__post_init__"):
        raise TypeError(f"{cls.__name__}: decoding does not call __init__; put invariants in _check()")
    if not isinstance(cls.TYPE, str) or not cls.TYPE:
        raise TypeError(f"{cls.__name__} needs a TYPE tag")
    if not isinstance(cls.VERSION, int) or isinstance(cls.VERSION, bool) or cls.VERSION < 1:
        raise TypeError(f"{cls.__name__}.VERSION must be a positive int")
    if cls.TYPE in _TAGS and _TAGS[cls.TYPE].__qualname__ != cls.__qualname__:
        raise TypeError(f"TYPE tag {cls.TYPE!r} is already used by {_TAGS[cls.TYPE].__name__}")
    hints = get_type_hints(cls, include_extras=True)
    fields = []
    for f in dataclasses.fields(cls):
        if f.name in ("t", "v"):
            raise TypeError(f"{cls.__name__}: field names 't' and 'v' are reserved")
        factory = None if f.default_factory is dataclasses.MISSING else f.default_factory
        required = f.default is dataclasses.MISSING and factory is None
        tp = hints[f.name]
        fields.append(_Field(f.name, tp, _compile(tp, f"{cls.__name__}.{f.name}"), required,
                             None if f.default is dataclasses.MISSING else f.default, factory))
    _SPECS[cls] = _Spec(cls, fields)
    _TAGS[cls.TYPE] = cls
    return cls


def message_types() -> tuple[type[Message], ...]:
    """Every registered message class, in registration order."""
    return tuple(_SPECS)


# ---------------------------------------------------------------------------------------------
# Field checkers: each takes a decoded MessagePack value and returns the typed value or raises _Bad.

def _short(value: Any, limit: int = 40) -> str:
    """repr() cut short: error messages (and so logs) never echo a large hostile value in full."""
    text = repr(value)
    return text if len(text) <= limit else text[:limit] + "..."


def _mismatch(expected: str, value: Any) -> _Bad:
    return _Bad(f"expected {expected}, got {type(value).__name__}")


def _check_int(v: Any) -> int:
    if type(v) is int:
        return v
    raise _mismatch("int", v)


def _check_float(v: Any) -> float:
    t = type(v)
    if t is float:
        return v
    if t is int:
        return float(v)
    raise _mismatch("float", v)


def _check_str(v: Any) -> str:
    if type(v) is str:
        return v
    raise _mismatch("str", v)


def _check_bool(v: Any) -> bool:
    if type(v) is bool:
        return v
    raise _mismatch("bool", v)


def _check_bytes(v: Any) -> bytes:
    if type(v) is bytes:
        return v
    raise _mismatch("bytes", v)


_SCALARS: dict[Any, Checker] = {
    int: _check_int, float: _check_float, str: _check_str, bool: _check_bool, bytes: _check_bytes,
}


def _compile(tp: Any, where: str) -> Checker:
    origin = get_origin(tp)
    if tp in _SCALARS:
        return _SCALARS[tp]
    if origin is Annotated:
        base, *meta = get_args(tp)
        rules = [m for m in meta if isinstance(m, ByteLen)]
        if base is not bytes or len(rules) != 1:
            raise TypeError(f"{where}: only Annotated[bytes, ByteLen(...)] is supported")
        return _bytes_len_checker(rules[0])
    if origin in (typing.Union, types.UnionType):
        args = get_args(tp)
        others = [a for a in args if a is not type(None)]
        if len(args) != 2 or len(others) != 1:
            raise TypeError(f"{where}: only `X | None` unions are supported")
        inner = _compile(others[0], where)

        def check_optional(v: Any) -> Any:
            return None if v is None else inner(v)
        return check_optional
    if origin is list:
        (elem,) = get_args(tp)
        return _list_checker(_compile(elem, where), _type_name(elem))
    if origin is dict:
        key, val = get_args(tp)
        return _dict_checker(_compile(key, where), _compile(val, where))
    if isinstance(tp, type) and tp in _SPECS:
        spec = _SPECS[tp]

        def check_nested(v: Any) -> Any:
            if type(v) is not dict:
                raise _mismatch(f"a {spec.cls.__name__} map", v)
            return spec.decode_fields(v)
        return check_nested
    if isinstance(tp, type) and issubclass(tp, Message):
        raise TypeError(f"{where}: nested {tp.__name__} must be registered first")
    raise TypeError(f"{where}: unsupported field type {tp!r}")


def _type_name(tp: Any) -> str:
    return getattr(tp, "__name__", None) or str(tp)


def _bytes_len_checker(rule: ByteLen) -> Checker:
    multiple, exact = rule.multiple, rule.exact

    def check_bytes_len(v: Any) -> bytes:
        if type(v) is not bytes:
            raise _mismatch("bytes", v)
        n = len(v)
        if exact is not None and n != exact:
            raise _Bad(f"expected {exact} bytes, got {n}")
        if n % multiple:
            raise _Bad(f"length {n} is not a multiple of {multiple}")
        return v
    return check_bytes_len


def _list_checker(inner: Checker, elem_name: str) -> Checker:
    exact = {_check_int: int, _check_float: float, _check_str: str, _check_bool: bool,
             _check_bytes: bytes}.get(inner)

    def check_list(v: Any) -> list:
        if type(v) is not list:
            raise _mismatch(f"list[{elem_name}]", v)
        if exact is not None:  # fast path: nothing to convert (ints among floats take the slow path)
            for x in v:
                if type(x) is not exact:
                    break
            else:
                return v
        out = []
        for i, x in enumerate(v):
            try:
                out.append(inner(x))
            except _Bad as e:
                e.path.insert(0, f"[{i}]")
                raise
        return out
    return check_list


def _dict_checker(check_key: Checker, check_val: Checker) -> Checker:
    def check_dict(v: Any) -> dict:
        if type(v) is not dict:
            raise _mismatch("map", v)
        out = {}
        for k, x in v.items():
            try:
                out[check_key(k)] = check_val(x)
            except _Bad as e:
                e.path.insert(0, f"[{_short(k)}]")
                raise
        return out
    return check_dict


# ---------------------------------------------------------------------------------------------
# Generated per-class code. Decoding is on every service's hot path (a TokenBatch per step per
# gateway), so each class gets a straight-line decoder, as dataclasses does for __init__: inline
# exact-type tests for the common case, the general checkers only on the slow path.

_MISSING = object()
_EXACT = {int: "int", str: "str", bool: "bool", bytes: "bytes", float: "float"}


def _fast_test(tp: Any) -> str | None:
    """A Python expression true when `v` is already a valid `tp` value, or None if there is none."""
    if tp in _EXACT:
        return f"type(v) is {_EXACT[tp]}"
    origin = get_origin(tp)
    if origin is Annotated:
        rule = next(m for m in get_args(tp)[1:] if isinstance(m, ByteLen))
        if rule.exact is not None:
            return f"type(v) is bytes and len(v) == {rule.exact}"
        return f"type(v) is bytes and not len(v) % {rule.multiple}"
    if origin in (typing.Union, types.UnionType):
        inner = _fast_test(next(a for a in get_args(tp) if a is not type(None)))
        return None if inner is None else f"v is None or ({inner})"
    return None


def _gen_decoder(cls: type, fields: tuple[_Field, ...]) -> Callable[[dict], Any]:
    def slow(v: Any, i: int) -> Any:
        f = fields[i]
        if v is _MISSING:
            if f.required:
                raise _Bad("missing required field", [f.name])
            return f.factory() if f.factory is not None else f.default
        try:
            return f.check(v)
        except _Bad as e:
            e.path.insert(0, f.name)
            raise

    ns: dict[str, Any] = {"_new": object.__new__, "_cls": cls, "_MISSING": _MISSING, "_slow": slow,
                          "_Bad": _Bad, "MessageError": MessageError}
    lines = ["def decode_fields(d):", "    get = d.get", "    o = _new(_cls)"]
    for i, f in enumerate(fields):
        slot = next(k.__dict__[f.name] for k in cls.__mro__ if f.name in k.__dict__)
        ns[f"_set{i}"] = slot.__set__  # the slot itself, past the frozen __setattr__
        none_default = not f.required and f.factory is None and f.default is None
        lines.append(f"    v = get({f.name!r})" if none_default else f"    v = get({f.name!r}, _MISSING)")
        test = _fast_test(f.type)
        if test is not None:
            lines.append(f"    if not ({test}): v = _slow(v, {i})")
        elif none_default:
            lines.append(f"    if v is not None: v = _slow(v, {i})")
        else:
            lines.append(f"    v = _slow(v, {i})")
        lines.append(f"    _set{i}(o, v)")
    if cls._check is not Message._check:
        lines += ["    try:", "        o._check()", "    except (MessageError, TypeError, ValueError) as e:",
                  "        raise _Bad(str(e)) from None"]
    lines.append("    return o")
    exec("\n".join(lines), ns)
    return ns["decode_fields"]


def _gen_encoder(cls: type, fields: tuple[_Field, ...]) -> Callable[[Any, dict], dict]:
    """Fields equal to their default are left out (the decoder restores them): smaller, faster maps."""
    ns: dict[str, Any] = {}
    lines = ["def fill_map(o, d):"]
    for i, f in enumerate(fields):
        if f.required:
            lines.append(f"    d[{f.name!r}] = o.{f.name}")
            continue
        lines.append(f"    v = o.{f.name}")
        if f.factory is None and f.default is None:
            lines.append(f"    if v is not None: d[{f.name!r}] = v")
        else:
            ns[f"_default{i}"] = f.factory() if f.factory is not None else f.default
            lines.append(f"    if v != _default{i}: d[{f.name!r}] = v")
    lines.append("    return d")
    exec("\n".join(lines), ns)
    return ns["fill_map"]


def _format_path(path: list[str]) -> str:
    return "".join(seg if seg.startswith("[") else "." + seg for seg in path)


# ---------------------------------------------------------------------------------------------
# Encode / decode


def _default(obj: Any) -> Any:
    spec = _SPECS.get(type(obj))
    if spec is not None:  # a nested message: a plain map of its fields
        return spec.fill_map(obj, {})
    if isinstance(obj, (bytearray, memoryview)):
        return bytes(obj)
    if isinstance(obj, numbers.Integral):  # numpy integers
        return int(obj)
    if isinstance(obj, numbers.Real):  # numpy floats
        return float(obj)
    raise TypeError(f"cannot encode a {type(obj).__name__} in a wire message")


def _spec_of(cls: type) -> _Spec:
    spec = _SPECS.get(cls)
    if spec is None:
        raise TypeError(f"{cls!r} is not a registered wire message")
    return spec


def encode(msg: Message) -> bytes:
    """Pack a registered message; raise MessageError(reason="size") when it exceeds its limit."""
    spec = _spec_of(type(msg))
    d = spec.fill_map(msg, {"t": spec.tag, "v": spec.version})
    data = msgpack.packb(d, use_bin_type=True, default=_default)
    if len(data) > spec.max_bytes:
        raise MessageError(f"{spec.cls.__name__} is {len(data)} bytes, over the limit of {spec.max_bytes}",
                           "size", spec.tag)
    return data


def decode(cls: type[M], data: bytes) -> M:
    """Strictly decode `data` as a `cls` message (rules in the module docstring); raise MessageError."""
    spec = _spec_of(cls)
    name, tag = cls.__name__, spec.tag
    if not isinstance(data, (bytes, bytearray, memoryview)):
        raise MessageError(f"{name}: payload is a {type(data).__name__}, not bytes", "malformed", tag)
    if len(data) > spec.max_bytes:
        raise MessageError(f"{name}: {len(data)} bytes exceeds the limit of {spec.max_bytes}", "size", tag)
    try:
        d = msgpack.unpackb(data, raw=False, strict_map_key=False, use_list=True)
    except Exception as e:  # msgpack raises several types (ExtraData, ValueError, UnicodeDecodeError, ...)
        raise MessageError(f"{name}: not valid MessagePack ({type(e).__name__}: {str(e)[:120]})", "malformed",
                           tag) from None
    if type(d) is not dict:
        raise MessageError(f"{name}: expected a map, got {type(d).__name__}", "malformed", tag)
    t = d.get("t")
    if type(t) is not str or t != tag:
        raise MessageError(f"{name}: expected type tag {tag!r}, got {_short(t)}", "type", tag)
    v = d.get("v")
    if type(v) is not int or v != spec.version:
        raise MessageError(f"{name}: unsupported version {_short(v)} (this reader speaks {spec.version})",
                           "version", tag)
    try:
        return spec.decode_fields(d)
    except _Bad as e:
        raise MessageError(f"{name}{_format_path(e.path)}: {e.message}", "field", tag) from None


class DecodeCounter:
    """Counts messages that failed to decode, by (type tag, reason), and logs them at a bounded rate.

    `on_bad(type_tag, reason)` is the metrics hook (e.g. a Prometheus counter's labels().inc()).
    """

    __slots__ = ("total", "counts", "on_bad", "log_interval", "_last_log", "_suppressed")

    def __init__(self, on_bad: Callable[[str, str], None] | None = None, log_interval: float = 1.0):
        self.total = 0
        self.counts: dict[tuple[str, str], int] = {}
        self.on_bad = on_bad
        self.log_interval = log_interval
        self._last_log = float("-inf")
        self._suppressed = 0

    def record(self, err: MessageError, subject: str = "") -> None:
        self.total += 1
        key = (err.type_tag, err.reason)
        self.counts[key] = self.counts.get(key, 0) + 1
        if self.on_bad is not None:
            try:
                self.on_bad(err.type_tag, err.reason)
            except Exception:
                log.exception("decode_counter_hook_failed")
        now = time.monotonic()
        if now - self._last_log >= self.log_interval:
            log.warning("bad_message", type=err.type_tag, reason=err.reason, subject=subject,
                        error=str(err), suppressed=self._suppressed, total=self.total)
            self._last_log = now
            self._suppressed = 0
        else:
            self._suppressed += 1

    def count(self, type_tag: str | None = None, reason: str | None = None) -> int:
        return sum(n for (t, r), n in self.counts.items()
                   if (type_tag is None or t == type_tag) and (reason is None or r == reason))


def safe_decode(cls: type[M], data: bytes, counter: DecodeCounter, subject: str = "") -> M | None:
    """decode(), except that a bad message is logged and counted and None is returned."""
    try:
        return decode(cls, data)
    except MessageError as e:
        counter.record(e, subject)
        return None


# ---------------------------------------------------------------------------------------------
# Packed token ids

if array("i").itemsize != 4:  # pragma: no cover - every platform we run on has a 4-byte C int
    raise ImportError("array('i') must be 4 bytes wide")
_BIG_ENDIAN = sys.byteorder == "big"


_INT32 = struct.Struct("<i")


def pack_ids(ids: Any) -> bytes:
    """Token ids (a sequence of ints or a numpy integer array) as little-endian int32 bytes."""
    if hasattr(ids, "astype"):  # numpy: no per-element Python work
        return ids.astype("<i4", copy=False).tobytes()
    if len(ids) == 1:  # one token per step is the common case
        return _INT32.pack(ids[0])
    a = array("i", ids)
    if _BIG_ENDIAN:  # pragma: no cover
        a.byteswap()
    return a.tobytes()


def unpack_ids(data: bytes) -> list[int]:
    """The inverse of pack_ids; raise MessageError when the length is not a multiple of 4."""
    return unpack_ids_array(data).tolist()


def unpack_ids_array(data: bytes) -> array:
    """Like unpack_ids but returns an array('i') (cheap to hand to numpy with np.frombuffer)."""
    if len(data) % 4:
        raise MessageError(f"packed token ids: {len(data)} bytes is not a multiple of 4")
    a = array("i")
    a.frombytes(data)
    if _BIG_ENDIAN:  # pragma: no cover
        a.byteswap()
    return a
