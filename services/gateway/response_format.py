"""What differs between the generation endpoints: the shapes of their choices, chunks and bodies."""

from __future__ import annotations

from typing import TYPE_CHECKING

from services.gateway.streaming import json_str

if TYPE_CHECKING:
    from services.gateway.choice import ChoiceState, ChoiceUpdate
    from services.gateway.logprobs import TokenTexts
    from services.gateway.streaming import ChunkFrame


class ResponseFormat:
    """One request's format (chat.py, completions.py): a format object serves one request."""

    object = ""
    chunk_object = ""
    id_prefix = ""
    text_tail = b""  # what follows the text's JSON string in a per-token chunk
    tools = None  # chat: (ToolSpec, parser) when the answer is read for tool calls (chat.py)

    def __init__(self, texts: TokenTexts, want_logprobs: bool):
        self.texts = texts
        self.want_logprobs = want_logprobs
        self.frame: ChunkFrame | None = None
        self.heads: list[bytes] = []  # per choice: the per-token chunk up to the text's JSON string

    def begin(self, frame: ChunkFrame, choices: list[ChoiceState]) -> bytes:
        """Start a stream: keep its frame, build the per-choice byte templates of the per-token
        chunk, and return the events sent before any token."""
        raise NotImplementedError

    def chunk(self, choice: ChoiceState, update: ChoiceUpdate) -> bytes | None:
        """The SSE event for one update of a stream, or None when there is nothing to send yet."""
        raise NotImplementedError

    def text_chunk(self, index: int, text: str) -> bytes:
        """The per-token chunk of choice `index` (text, no end, no logprobs): a byte template filled
        with the JSON string, no dict, no encoder."""
        return self.heads[index] + json_str(text) + self.text_tail

    def collect(self, choice: ChoiceState, update: ChoiceUpdate) -> None:
        raise NotImplementedError

    def final_choice(self, choice: ChoiceState) -> dict:
        raise NotImplementedError
