"""Streaming text out of streaming token ids, and OpenAI stop strings over streaming text.

IncrementalDetokenizer turns token ids into text deltas whose concatenation equals decoding all
the ids at once. A character whose UTF-8 bytes are split over several byte-level tokens is held
back until it is complete (never a U+FFFD for a sequence that is merely incomplete). This is the
usual prefix/read-offset technique: decode a short window of recent tokens twice, with and without
the new ones, and emit the difference once it does not end in U+FFFD. The window keeps a few
tokens of context, which SentencePiece-style decoders need to place leading spaces.

StopStringMatcher applies stop strings to the text deltas: it holds back the longest tail that
could still grow into a stop string, so a stop string spread over many tokens is caught, and
neither it nor anything after it is ever emitted (OpenAI semantics).
"""

from __future__ import annotations

import codecs
from typing import Iterable, Sequence

REPLACEMENT_CHAR = "\ufffd"
_CONTEXT_TOKENS = 5  # prompt tokens kept as decoding context for the first output token
_TRIM_AT = 1024  # drop consumed tokens from the front once this many have piled up


class IncrementalDetokenizer:
    """Feed output token ids as they are sampled; get the newly stable text.

    tokenizer: anything with `decode(ids, skip_special_tokens=...) -> str` (shared.tokenizer.Tokenizer).
    prompt_token_ids_tail: the last few prompt token ids (more than 5 are ignored); they give
    the first output tokens their decoding context and are never emitted themselves.
    """

    __slots__ = ("_tokenizer", "_skip", "_tokens", "_prefix_offset", "_read_offset", "_prefix_text",
                 "_num_output_tokens")

    def __init__(self, tokenizer, prompt_token_ids_tail: Sequence[int] = (), skip_special_tokens: bool = True):
        self._tokenizer = tokenizer
        self._skip = skip_special_tokens
        tail = list(prompt_token_ids_tail)[-_CONTEXT_TOKENS:]
        self._tokens: list[int] = tail
        self._prefix_offset = 0
        self._read_offset = len(tail)
        self._prefix_text = self._decode(0, len(tail)) if tail else ""
        self._num_output_tokens = 0

    def _decode(self, start: int, end: int | None = None) -> str:
        return self._tokenizer.decode(self._tokens[start:end], skip_special_tokens=self._skip)

    def push(self, token_ids: int | Iterable[int]) -> str:
        """Append one or more token ids; return the text that became stable (possibly "")."""
        if isinstance(token_ids, int):
            token_ids = (token_ids,)
        out = []
        for tid in token_ids:
            self._tokens.append(int(tid))
            self._num_output_tokens += 1
            delta = self._step()
            if delta:
                out.append(delta)
        if self._prefix_offset > _TRIM_AT:
            del self._tokens[:self._prefix_offset]
            self._read_offset -= self._prefix_offset
            self._prefix_offset = 0
        return "".join(out)

    def _step(self) -> str:
        new_text = self._decode(self._prefix_offset)
        prefix_text = self._prefix_text
        if len(new_text) > len(prefix_text) and not new_text.endswith(REPLACEMENT_CHAR):
            delta = new_text[len(prefix_text):]
            # The window now starts where the emitted text used to end.
            self._prefix_offset = self._read_offset
            self._read_offset = len(self._tokens)
            self._prefix_text = self._decode(self._prefix_offset, self._read_offset)
            return delta
        return ""

    def flush(self) -> str:
        """The text still held back (an incomplete character at the very end comes out as U+FFFD,
        as in a full decode). Later pushes start afresh, without context."""
        new_text = self._decode(self._prefix_offset)
        delta = new_text[len(self._prefix_text):] if len(new_text) > len(self._prefix_text) else ""
        self._tokens = []
        self._prefix_offset = self._read_offset = 0
        self._prefix_text = ""
        return delta

    @property
    def num_output_tokens(self) -> int:
        return self._num_output_tokens

    @property
    def has_pending(self) -> bool:
        """Whether some pushed tokens have not produced their text yet."""
        return self._read_offset < len(self._tokens)


class ByteLevelDetokenizer:
    """The fast path for byte-level BPE (Llama 3, Qwen, GPT-style): each token is a fixed byte
    string, so text is an incremental UTF-8 decode of the concatenated bytes — no window, no
    second decode, about a microsecond per token. Same contract as IncrementalDetokenizer."""

    __slots__ = ("_bytes_of", "_text_of", "_special", "_skip", "_utf8", "_num_output_tokens", "_pending")

    def __init__(self, tokenizer, skip_special_tokens: bool = True):
        self._bytes_of = tokenizer.cached_token_bytes
        self._text_of = tokenizer.cached_token_text
        self._special = tokenizer.all_special_ids
        self._skip = skip_special_tokens
        self._utf8 = codecs.getincrementaldecoder("utf-8")("replace")
        self._num_output_tokens = 0
        self._pending = False  # the UTF-8 decoder holds the start of a character

    def push(self, token_ids: int | Iterable[int]) -> str:
        if type(token_ids) is int:  # one token per step: the streaming hot path
            self._num_output_tokens += 1
            if self._skip and token_ids in self._special:
                return ""
            text = None if self._pending else self._text_of(token_ids)
            if text is None:
                text = self._utf8.decode(self._bytes_of(token_ids))
                self._pending = bool(self._utf8.getstate()[0])
            return text
        out = []
        for tid in token_ids:
            self._num_output_tokens += 1
            if self._skip and tid in self._special:
                continue
            text = None if self._pending else self._text_of(tid)
            if text is None:  # part of a multi-byte character: the incremental decoder's job
                text = self._utf8.decode(self._bytes_of(tid))
                self._pending = bool(self._utf8.getstate()[0])
            if text:
                out.append(text)
        return out[0] if len(out) == 1 else "".join(out)

    def flush(self) -> str:
        self._pending = False
        return self._utf8.decode(b"", final=True)

    @property
    def num_output_tokens(self) -> int:
        return self._num_output_tokens

    @property
    def has_pending(self) -> bool:
        return self._pending


def make_detokenizer(tokenizer, prompt_token_ids_tail: Sequence[int] = (), skip_special_tokens: bool = True):
    """The byte-level fast path where the tokenizer allows it, else the windowed decoder."""
    if getattr(tokenizer, "is_byte_level", False):
        return ByteLevelDetokenizer(tokenizer, skip_special_tokens)
    return IncrementalDetokenizer(tokenizer, prompt_token_ids_tail, skip_special_tokens)


class StopStringMatcher:
    """Apply OpenAI stop strings to streamed text.

    `feed(delta)` returns (text_safe_to_emit, matched). Once a stop string appears, the text before
    it is returned with matched=True, and every later call returns ("", True). Where several stop
    strings occur, the one that is complete first wins (the smallest end position; on a tie, the
    longer), so the result does not depend on how the text was cut into deltas.
    `flush()` at the end of generation returns what is still held back.
    """

    __slots__ = ("stops", "_max_len", "_first_chars", "_held", "_matched", "_matched_stop")

    def __init__(self, stops: Iterable[str] | None):
        uniq = []
        for s in stops or ():
            if not isinstance(s, str):
                raise TypeError(f"stop strings must be str, got {type(s).__name__}")
            if s and s not in uniq:
                uniq.append(s)
        self.stops: tuple[str, ...] = tuple(uniq)
        self._max_len = max((len(s) for s in self.stops), default=0)
        self._first_chars = frozenset(s[0] for s in self.stops)
        self._held = ""
        self._matched = False
        self._matched_stop: str | None = None

    @property
    def matched(self) -> bool:
        return self._matched

    @property
    def matched_stop(self) -> str | None:
        """The stop string that ended the text."""
        return self._matched_stop

    def feed(self, delta: str) -> tuple[str, bool]:
        if self._matched:
            return "", True
        if not self.stops:
            return delta, False
        buf = self._held + delta
        if not buf:
            return "", False
        # The stop string that completes first (smallest end; on a tie the longer one), which is
        # what checking after every character would find, however the text was cut into deltas.
        # Text emitted earlier cannot hold the start of one: every tail that could begin a stop
        # string was held back.
        best = best_end = -1
        best_stop = None
        for s in self.stops:
            i = buf.find(s)
            if i == -1:
                continue
            end = i + len(s)
            if best == -1 or end < best_end or (end == best_end and i < best):
                best, best_end, best_stop = i, end, s
        if best != -1:
            self._matched = True
            self._matched_stop = best_stop
            self._held = ""
            return buf[:best], True
        hold = self._hold_length(buf)
        if hold:
            self._held = buf[-hold:]
            return buf[:-hold], False
        self._held = ""
        return buf, False

    # An alias, so both streaming helpers read alike.
    push = feed

    def _hold_length(self, buf: str) -> int:
        """Length of the longest tail of buf that is a proper prefix of some stop string."""
        n = len(buf)
        for k in range(min(n, self._max_len - 1), 0, -1):
            if buf[n - k] not in self._first_chars:
                continue
            tail = buf[n - k:]
            for s in self.stops:
                if len(s) > k and s.startswith(tail):
                    return k
        return 0

    def flush(self) -> str:
        """Generation ended without a stop string: release the held-back text."""
        if self._matched:
            return ""
        held, self._held = self._held, ""
        return held
