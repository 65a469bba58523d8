"""Tool calling on /v1/chat/completions: `tools` and `tool_choice` as OpenAI takes them, the grammar
that enforces a forced call, and the parse of the model's answer into `message.tool_calls`.

- `tool_choice: "none"` (or no tools): the template does not see the tools; the answer is text.
- `"auto"` (the default with tools): the template renders the tools and the model writes text or
  calls in its family's syntax, which the family's parser reads (`hermes`: <tool_call>{"name",
  "arguments"}</tool_call>, Qwen 2.5/3 and SmolLM3; `llama3_json`: {"name", "parameters"} as the
  whole answer; `mistral`: [TOOL_CALLS][{"name", "arguments"}]); the parser is named by the
  gateway's --tool-call-parser, or found in the chat template.
- `"required"` and a named function: the draw is constrained by a JSON-Schema grammar (the named
  function's `parameters`, or an array of {"name", "parameters"} over every tool), so the
  arguments always parse and fit their schema, whatever the family.
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


def new_call(name: str, arguments: Any) -> dict:
    args = arguments if isinstance(arguments, str) else json.dumps(arguments, ensure_ascii=False)
    return {"id": f"call_{uuid.uuid4().hex[:24]}", "type": "function", "function": {"name": name, "arguments": args}}


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
