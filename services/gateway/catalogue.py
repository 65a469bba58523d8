"""The models one gateway serves, by name: each one's tokenizer, limits, token texts and tool-call
syntax. The first is the default: a body without "model" asks for it."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Iterator, Sequence

from services.gateway.errors import model_not_found
from services.gateway.fields import Limits
from services.gateway.logprobs import TokenTexts
from services.gateway.tool_calls import parser_for
from services.worker.engine.model_config import ModelConfig
from shared.tokenizer import Tokenizer


def default_name(model_dir: str) -> str:
    """The id a model is served under when none is given: its directory's name (a .gguf file's
    without .gguf, as a worker names it, so that the two agree)."""
    return Path(model_dir).resolve().name.removesuffix(".gguf")


@dataclass(frozen=True, slots=True)
class ServedModel:
    """One served model: what reading, tokenizing and answering its requests needs."""

    name: str
    model_dir: str  # where its tokenizer and config were read, on this gateway's file system
    tokenizer: Tokenizer
    limits: Limits
    texts: TokenTexts  # its tokens' texts and bytes, for logprobs
    tool_parser: str  # the syntax its tool calls are written in (tool_calls.py)

    @classmethod
    def of(cls, name: str, model_dir: str, tokenizer: Tokenizer, *, max_model_len: int, vocab_size: int,
           max_n: int, tool_call_parser: str) -> ServedModel:
        """A model whose tokenizer and config are already read."""
        limits = Limits(name, max_model_len, vocab_size, max_n)
        return cls(name, model_dir, tokenizer, limits, TokenTexts(tokenizer),
                   parser_for(tool_call_parser, template_text(tokenizer)))

    @classmethod
    def load(cls, name: str, model_dir: str, *, max_n: int, tool_call_parser: str) -> ServedModel:
        """Read a model directory (or .gguf file). Blocking, seconds for a large vocabulary: off the
        event loop. Raises OSError or ValueError when it cannot be served."""
        tokenizer = Tokenizer.from_path(model_dir)
        tokenizer.warm_token_tables()  # every token's bytes and text before serving: no misses mid-stream
        cfg = ModelConfig.from_path(model_dir)
        return cls.of(name, model_dir, tokenizer, max_model_len=cfg.max_model_len, vocab_size=cfg.vocab_size,
                      max_n=max_n, tool_call_parser=tool_call_parser)


def template_text(tokenizer: Tokenizer) -> str:
    """The chat templates' text, where a tool-call syntax can be recognised ("" without one)."""
    return "\n".join(getattr(tokenizer, "chat_templates", {}).values())


class Catalogue:
    """The served models by name. Models are added (at start, or when a worker announces one) and
    never removed: a name once served stays valid for the requests that hold it."""

    __slots__ = ("default", "_by_name")

    def __init__(self, models: Sequence[ServedModel]):
        if not models:
            raise ValueError("a gateway serves at least one model")
        self.default = models[0]
        self._by_name: dict[str, ServedModel] = {}
        for model in models:
            self.add(model)

    def add(self, model: ServedModel) -> None:
        if model.name in self._by_name:
            raise ValueError(f"the model {model.name!r} is served already")
        self._by_name[model.name] = model

    def get(self, name: str) -> ServedModel:
        """The model of this id; a 404 model_not_found when none is served under it."""
        model = self._by_name.get(name)
        if model is None:
            raise model_not_found(name[:256])
        return model

    def of_body(self, body: Any) -> ServedModel:
        """The model a decoded request body asks for, read before the body is parsed (against that
        model's limits). A body that is not an object, or whose "model" is not a string, gets the
        default: its parse then answers with the 400 that names what is wrong."""
        name = body.get("model") if type(body) is dict else None
        if type(name) is not str:
            return self.default
        return self.get(name)

    def doc_limits(self) -> Limits:
        """Limits for the OpenAPI document: every id, and the largest bounds of any model (each
        request is still held to its own model's)."""
        models = self._by_name.values()
        return dataclasses.replace(self.default.limits, model_names=tuple(self._by_name),
                                   max_model_len=max(m.limits.max_model_len for m in models),
                                   vocab_size=max(m.limits.vocab_size for m in models))

    def __contains__(self, name: object) -> bool:
        return name in self._by_name

    def __iter__(self) -> Iterator[ServedModel]:
        return iter(list(self._by_name.values()))  # a copy: a model may be added while a caller iterates

    def __len__(self) -> int:
        return len(self._by_name)
