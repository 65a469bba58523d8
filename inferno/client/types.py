"""The answers as typed objects with attribute access, shaped like the openai package's types."""

from __future__ import annotations

import dataclasses
import types
import typing
from dataclasses import dataclass, field
from typing import Any, Iterator, TypeVar, Union

T = TypeVar("T", bound="ApiObject")

_HINTS: dict[type, dict[str, Any]] = {}


class ApiObject:
    """Built from an answer's JSON: unknown keys are ignored, missing ones take their defaults."""

    @classmethod
    def from_dict(cls: type[T], data: dict) -> T:
        hints = _HINTS.get(cls)
        if hints is None:
            hints = _HINTS[cls] = typing.get_type_hints(cls)
        kwargs = {f.name: _convert(hints[f.name], data[f.name]) for f in dataclasses.fields(cls) if f.name in data}
        return cls(**kwargs)

    def to_dict(self) -> dict:
        return dataclasses.asdict(self)


def _convert(tp: Any, value: Any) -> Any:
    if value is None:
        return None
    origin = typing.get_origin(tp)
    if origin in (Union, types.UnionType):
        inner = [a for a in typing.get_args(tp) if a is not type(None)]
        return _convert(inner[0], value) if len(inner) == 1 else value
    if origin is list and isinstance(value, list):
        (item,) = typing.get_args(tp)
        return [_convert(item, v) for v in value]
    if isinstance(tp, type) and issubclass(tp, ApiObject) and isinstance(value, dict):
        return tp.from_dict(value)
    return value


# -- usage and log-probabilities ------------------------------------------------------------------

@dataclass(slots=True)
class PromptTokensDetails(ApiObject):
    cached_tokens: int = 0


@dataclass(slots=True)
class CompletionTokensDetails(ApiObject):
    accepted_prediction_tokens: int = 0  # drafted tokens the model confirmed (speculation, jump-forward)
    rejected_prediction_tokens: int = 0


@dataclass(slots=True)
class CompletionUsage(ApiObject):
    prompt_tokens: int = 0
    completion_tokens: int = 0
    total_tokens: int = 0
    prompt_tokens_details: PromptTokensDetails | None = None
    completion_tokens_details: CompletionTokensDetails | None = None


@dataclass(slots=True)
class TopLogprob(ApiObject):
    token: str = ""
    logprob: float = 0.0
    bytes: list[int] | None = None


@dataclass(slots=True)
class ChatCompletionTokenLogprob(ApiObject):
    token: str = ""
    logprob: float = 0.0
    bytes: list[int] | None = None
    top_logprobs: list[TopLogprob] = field(default_factory=list)


@dataclass(slots=True)
class ChoiceLogprobs(ApiObject):
    content: list[ChatCompletionTokenLogprob] | None = None


@dataclass(slots=True)
class Logprobs(ApiObject):
    """The completions endpoint's log-probabilities."""

    tokens: list[str] = field(default_factory=list)
    token_logprobs: list[float] = field(default_factory=list)
    top_logprobs: list[dict[str, float]] = field(default_factory=list)
    text_offset: list[int] = field(default_factory=list)


# -- chat completions -----------------------------------------------------------------------------

@dataclass(slots=True)
class Function(ApiObject):
    name: str = ""
    arguments: str = ""  # JSON text, as the model wrote it


@dataclass(slots=True)
class ChatCompletionMessageToolCall(ApiObject):
    id: str = ""
    type: str = "function"
    function: Function = field(default_factory=Function)


@dataclass(slots=True)
class ChatCompletionMessage(ApiObject):
    role: str = "assistant"
    content: str | None = None
    tool_calls: list[ChatCompletionMessageToolCall] | None = None
    parsed: Any = None  # chat.completions.parse: the content as the response_format's type


@dataclass(slots=True)
class Choice(ApiObject):
    index: int = 0
    message: ChatCompletionMessage = field(default_factory=ChatCompletionMessage)
    finish_reason: str | None = None
    logprobs: ChoiceLogprobs | None = None


@dataclass(slots=True)
class ChatCompletion(ApiObject):
    id: str = ""
    object: str = "chat.completion"
    created: int = 0
    model: str = ""
    choices: list[Choice] = field(default_factory=list)
    usage: CompletionUsage | None = None


@dataclass(slots=True)
class ChoiceDeltaToolCallFunction(ApiObject):
    name: str | None = None
    arguments: str | None = None


@dataclass(slots=True)
class ChoiceDeltaToolCall(ApiObject):
    index: int = 0
    id: str | None = None
    type: str | None = None
    function: ChoiceDeltaToolCallFunction | None = None


@dataclass(slots=True)
class ChoiceDelta(ApiObject):
    role: str | None = None
    content: str | None = None
    tool_calls: list[ChoiceDeltaToolCall] | None = None


@dataclass(slots=True)
class ChunkChoice(ApiObject):
    index: int = 0
    delta: ChoiceDelta = field(default_factory=ChoiceDelta)
    finish_reason: str | None = None
    logprobs: ChoiceLogprobs | None = None


@dataclass(slots=True)
class ChatCompletionChunk(ApiObject):
    id: str = ""
    object: str = "chat.completion.chunk"
    created: int = 0
    model: str = ""
    choices: list[ChunkChoice] = field(default_factory=list)
    usage: CompletionUsage | None = None  # only on the last chunk, with stream_options.include_usage


# -- completions ----------------------------------------------------------------------------------

@dataclass(slots=True)
class CompletionChoice(ApiObject):
    index: int = 0
    text: str = ""
    finish_reason: str | None = None
    logprobs: Logprobs | None = None


@dataclass(slots=True)
class Completion(ApiObject):
    """A completions answer, and each chunk of a streamed one."""

    id: str = ""
    object: str = "text_completion"
    created: int = 0
    model: str = ""
    choices: list[CompletionChoice] = field(default_factory=list)
    usage: CompletionUsage | None = None


# -- models ---------------------------------------------------------------------------------------

@dataclass(slots=True)
class Model(ApiObject):
    id: str = ""
    object: str = "model"
    created: int = 0
    owned_by: str = ""
    root: str | None = None
    max_model_len: int | None = None


@dataclass(slots=True)
class ModelList(ApiObject):
    object: str = "list"
    data: list[Model] = field(default_factory=list)

    def __iter__(self) -> Iterator[Model]:
        return iter(self.data)
