"""Tool calling on /v1/chat/completions: `tools` and `tool_choice` as OpenAI takes them, the grammar
that enforces a forced call, and the parse of the model's answer into `message.tool_calls`.

- `tool_choice: "none"` (or no tools): the template does not see the tools; the answer is text.
- `"auto"` (the default with tools): the template renders the tools and the model writes text or
  calls in its family's syntax, which the family's parser reads (`hermes`: <tool_call>{"name",
  "arguments"}</tool_call>, Qwen 2.5/3 and SmolLM3; `llama3_json`: {"name", "parameters"} as the
  whole answer; `mistral`: [TOOL_CALLS][{"name", "arguments"}]); the parser is named by the
  gateway's --tool-call-parser, or found in the chat template. For hermes and llama3_json the
  draw runs under a structural tag (xgrammar's triggered tags): text is free until the model writes
  the family's opening (`<tool_call>`, `{"name": `), and from there the grammar holds it to a
  known function's name and its `parameters` schema. Mistral's opening is a control token, which
  the grammar's text cannot hold: its calls are read, not enforced.
- `"required"` and a named function: the draw is constrained by a JSON-Schema grammar (the named
  function's `parameters`, or an array of {"name", "parameters"} over every tool), so the
  arguments always parse and fit their schema, whatever the family.

Streamed, a call goes out as its tokens arrive wherever its syntax is the grammar's (named,
required, hermes' and llama3_json's auto: CallStream); mistral's auto answers are read at the end.
"""

from __future__ import annotations

import json
import re
import uuid
from dataclasses import dataclass
from typing import Any

from services.gateway.errors import invalid
from services.gateway.structured import checked_schema

NAME = re.compile(r"^[A-Za-z0-9_.-]{1,64}$")
PARSERS = ("hermes", "llama3_json", "mistral")
# Per family with an enforced auto syntax: (trigger, a call's opening with {name} in it, its end,
# whether the call ends the answer: Llama 3's is the whole answer, which its parser reads).
TAGS = {"hermes": ("<tool_call>", '<tool_call>\n{{"name": "{name}", "arguments": ', "}\n</tool_call>", False),
        "llama3_json": ('{"name": ', '{{"name": "{name}", "parameters": ', "}", True)}


@dataclass(slots=True, frozen=True)
class ToolSpec:
    """What a request asks of tools: mode "" (none), "auto", "required" or "named"."""

    mode: str = ""
    tools: tuple[dict, ...] = ()
    name: str = ""  # the named function
    parallel: bool = True

    def grammar(self) -> tuple[str, str]:
        """The (kind, text) grammar a forced call is drawn under; ("", "") for none or auto."""
        params = {t["function"]["name"]: t["function"].get("parameters") or {"type": "object"} for t in self.tools}
        if self.mode == "named":
            return "json_schema", json.dumps(params[self.name], separators=(",", ":"))
        if self.mode == "required":
            call = {"anyOf": [{"type": "object", "properties": {"name": {"const": n}, "parameters": p},
                               "required": ["name", "parameters"], "additionalProperties": False}
                              for n, p in params.items()]}
            array = {"type": "array", "items": call, "minItems": 1}
            if not self.parallel:
                array["maxItems"] = 1
            return "json_schema", json.dumps(array, separators=(",", ":"))
        return "", ""

    def auto_grammar(self, parser: str) -> tuple[str, str]:
        """An auto answer's grammar: free text, and from the family's opening on, a call to one of
        the tools with arguments of its schema (xgrammar's structural tag); ("", "") for none."""
        if self.mode != "auto" or parser not in TAGS:
            return "", ""
        trigger, begin, end, only = TAGS[parser]
        tags = [{"type": "tag", "begin": begin.format(name=t["function"]["name"]),
                 "content": {"type": "json_schema", "json_schema": t["function"].get("parameters") or {"type": "object"}},
                 "end": end} for t in self.tools]
        tag = {"type": "structural_tag", "format": {"type": "triggered_tags", "triggers": [trigger], "tags": tags,
                                                    "at_least_one": False,
                                                    "stop_after_first": only or not self.parallel}}
        return "structural_tag", json.dumps(tag, separators=(",", ":"))

    def streams(self, parser: str) -> bool:
        """Whether calls can go out as their tokens arrive (CallStream reads this syntax)."""
        return self.mode in ("named", "required") or (self.mode == "auto" and parser in _MARKS)


def tool_spec(tools: list[dict] | None, tool_choice: Any, parallel: bool, has_grammar: bool) -> ToolSpec:
    """The request's ToolSpec, or a 400 naming the field at fault."""
    if not tools:
        if tool_choice not in (None, "none"):
            raise invalid("'tool_choice' needs 'tools'", param="tool_choice")
        return ToolSpec()
    names = []
    for i, t in enumerate(tools):
        f = t.get("function")
        if t.get("type", "function") != "function" or not isinstance(f, dict):
            raise invalid(f"'tools[{i}]' must be {{\"type\": \"function\", \"function\": {{...}}}}", param=f"tools[{i}]")
        name = f.get("name")
        if not isinstance(name, str) or not NAME.match(name):
            raise invalid(f"'tools[{i}].function.name' must be 1-64 letters, digits, '_', '.' or '-'",
                          param=f"tools[{i}].function.name")
        _check_parameters(f.get("parameters"), f"tools[{i}].function.parameters")
        names.append(name)
    if len(set(names)) != len(names):
        raise invalid("'tools' names a function twice", param="tools")
    choice = "auto" if tool_choice is None else tool_choice
    if choice == "none":
        return ToolSpec()
    if choice in ("auto", "required"):
        mode, name = choice, ""
    elif (isinstance(choice, dict) and choice.get("type") == "function" and isinstance(choice.get("function"), dict)
          and isinstance(choice["function"].get("name"), str)):
        mode, name = "named", choice["function"]["name"]
        if name not in names:
            raise invalid(f"'tool_choice' names {name!r}, which is not in 'tools'", param="tool_choice")
    else:
        raise invalid("'tool_choice' must be 'none', 'auto', 'required' or "
                      "{\"type\": \"function\", \"function\": {\"name\": ...}}", param="tool_choice")
    if mode != "auto" and has_grammar:
        raise invalid("a structured output cannot go with a forced tool call ('tool_choice')",
                      param="response_format")
    return ToolSpec(mode, tuple(tools), name, parallel)


def _check_parameters(schema: Any, param: str) -> None:
    if schema is None:
        return
    if not isinstance(schema, dict):
        raise invalid(f"'{param}' must be a JSON Schema object", param=param)
    checked_schema(schema, param)


def parser_for(flag: str, chat_template: str) -> str:
    """The tool-call syntax of the served model: --tool-call-parser, else the template's own."""
    if flag and flag != "auto":
        return flag
    if "[TOOL_CALLS]" in chat_template:
        return "mistral"
    if "<|python_tag|>" in chat_template or "ipython" in chat_template:
        return "llama3_json"
    return "hermes"


def new_call_id() -> str:
    return f"call_{uuid.uuid4().hex[:24]}"


def new_call(name: str, arguments: Any) -> dict:
    args = arguments if isinstance(arguments, str) else json.dumps(arguments, ensure_ascii=False)
    return {"id": new_call_id(), "type": "function", "function": {"name": name, "arguments": args}}


def parse_answer(text: str, spec: ToolSpec, parser: str) -> tuple[str | None, list[dict]]:
    """(content, tool_calls) of a finished answer."""
    if spec.mode == "named":
        return None, [new_call(spec.name, text)]
    if spec.mode == "required":
        try:
            items = json.loads(text)
        except ValueError:  # cut by max_tokens: no call to give
            return text, []
        return None, [new_call(c["name"], c["parameters"]) for c in items]
    calls: list[dict] = []
    if parser == "hermes":
        for m in re.finditer(r"<tool_call>\s*(.*?)\s*</tool_call>", text, re.S):
            calls += _calls(m.group(1))
        content = re.sub(r"<tool_call>.*?</tool_call>", "", text, flags=re.S).strip() if calls else text
    elif parser == "llama3_json":
        body = text.strip().removeprefix("<|python_tag|>")
        for part in body.split(";") if body.startswith("{") else []:
            calls += _calls(part)
        content = None if calls else text
    else:  # mistral
        head, sep, tail = text.partition("[TOOL_CALLS]")
        calls = _calls(tail) if sep else []
        content = head.strip() if calls else text
    known = {t["function"]["name"] for t in spec.tools}
    calls = [c for c in calls if c["function"]["name"] in known]
    return (content or None) if calls else text, calls


def _calls(text: str) -> list[dict]:
    """Calls from one JSON object or array of {"name", "arguments" | "parameters"}; [] if it is not one."""
    try:
        data = json.loads(text)
    except ValueError:
        return []
    out = []
    for item in data if isinstance(data, list) else [data]:
        if isinstance(item, dict) and isinstance(item.get("name"), str):
            out.append(new_call(item["name"], item.get("arguments", item.get("parameters", {}))))
    return out


_HEAD = re.compile(r'\s*\{\s*"name"\s*:\s*"((?:[^"\\]|\\.)*)"\s*,\s*"(?:arguments|parameters)"\s*:\s*')
# Per family: (what opens a call, whether that opening is the call's own JSON, what closes it).
_MARKS = {"hermes": ("<tool_call>", False, "</tool_call>"), "llama3_json": ('{"name"', True, "}")}
MAX_HEAD_CHARS = 512  # a call's opening longer than this is not one: its text goes out as content


class CallStream:
    """One streamed answer read into content and calls as its text arrives, for the syntaxes the
    grammar enforces (ToolSpec.streams). feed() and end() return events: ("content", text),
    ("call", name) when a call's name is known, ("args", fragment) for its arguments' JSON text."""

    def __init__(self, spec: ToolSpec, parser: str):
        self.known = {t["function"]["name"] for t in spec.tools}
        self.mode = spec.mode
        self.open, self.open_is_json, self.close = _MARKS.get(parser, _MARKS["hermes"])
        self.buf = ""
        # text: hermes content; open: a list's "["; head: a call's opening; args: its arguments;
        # tail: what closes a call; done: nothing more is read
        self.state = {"named": "args", "required": "open"}.get(spec.mode, "text")
        self.skip = False  # the current call names no known function: it is dropped (parse_answer's rule)
        self.depth, self.in_string, self.escaped, self.started = 0, False, False, False
        self.calls = 0
        self._first = spec.name if spec.mode == "named" else None

    def feed(self, text: str) -> list[tuple[str, str]]:
        out: list[tuple[str, str]] = []
        if self._first is not None:
            out.append(("call", self._first))
            self.calls, self._first = 1, None
        self.buf += text
        while self.buf and self._step(out):
            pass
        return out

    def end(self) -> list[tuple[str, str]]:
        """What the answer's end releases: held-back content (a partial opening that never came)."""
        out = self.feed("")
        if self.state == "text" and self.buf:
            out.append(("content", self.buf))
        self.buf = ""
        return out

    def _step(self, out: list) -> bool:
        """Consume what can be consumed now; False when more text is needed."""
        state, buf = self.state, self.buf
        if state == "text":
            at = buf.find(self.open)
            if at < 0:
                keep = _partial_suffix(buf, self.open)
                if len(buf) > keep:
                    out.append(("content", buf[:len(buf) - keep]))
                self.buf = buf[len(buf) - keep:]
                return False
            if at:
                out.append(("content", buf[:at]))
            self.buf, self.state = buf[at + (0 if self.open_is_json else len(self.open)):], "head"
            return True
        if state == "open":
            stripped = buf.lstrip()
            if not stripped:
                return False
            self.buf, self.state = (stripped[1:], "head") if stripped[0] == "[" else ("", "done")
            return True
        if state == "head":
            m = _HEAD.match(buf)
            if m is None:
                if len(buf) > MAX_HEAD_CHARS:  # not a call after all
                    out.append(("content", ("" if self.open_is_json else self.open) + buf))
                    self.buf, self.state = "", "text"
                return False
            name = m.group(1)
            self.skip = name not in self.known
            if not self.skip:
                out.append(("call", name))
                self.calls += 1
            self.buf, self.state = buf[m.end():], "args"
            self.depth, self.in_string, self.escaped, self.started = 0, False, False, False
            return True
        if state == "args":
            if not self.started:
                buf = self.buf = buf.lstrip()
                if not buf:
                    return False
            n = self._value_end(buf)
            if not self.skip and n:
                out.append(("args", buf[:n]))
            self.buf = buf[n:]
            if not self.started or self.depth or self.mode == "named":
                return False
            self.state = "tail"
            return True
        if state == "tail":
            return self._tail(buf)
        self.buf = ""  # done: past the call list's end there is nothing to read
        return False

    def _value_end(self, buf: str) -> int:
        """How much of buf belongs to the arguments' JSON value (an object or array: to its close)."""
        for i, ch in enumerate(buf):
            if self.in_string:
                if self.escaped:
                    self.escaped = False
                elif ch == "\\":
                    self.escaped = True
                elif ch == '"':
                    self.in_string = False
            elif ch == '"':
                self.in_string = True
            elif ch in "{[":
                self.depth += 1
                self.started = True
            elif ch in "}]":
                self.depth -= 1
                if self.depth == 0:
                    return i + 1
            elif not self.started and not ch.isspace():
                self.started = True  # a scalar: it ends at the call's close, which the tail reads
                if self.mode != "named":
                    return self._scalar_end(buf, i)
        return len(buf)

    def _scalar_end(self, buf: str, start: int) -> int:
        for i in range(start, len(buf)):
            if buf[i] in ",}]" or buf[i].isspace():
                return i
        return len(buf)

    def _tail(self, buf: str) -> bool:
        stripped = buf.lstrip()
        if not stripped:
            return False
        if self.mode == "required":  # },  or  }]
            rest = stripped[1:].lstrip() if stripped[0] == "}" else stripped
            if not rest:
                return False
            self.buf, self.state = rest[1:], ("head" if rest[0] == "," else "done")
            return True
        at = stripped.find(self.close)
        if at < 0:
            return False
        self.buf, self.state = stripped[at + len(self.close):], "text"
        return True


def _partial_suffix(text: str, marker: str) -> int:
    """Length of the longest end of `text` that begins `marker` (held back: it may be its start)."""
    for k in range(min(len(marker) - 1, len(text)), 0, -1):
        if marker.startswith(text[-k:]):
            return k
    return 0
