"""Log-probabilities in the two OpenAI shapes: chat `content` entries and the completions arrays."""

from __future__ import annotations

from shared.tokenizer import Tokenizer
from shared.wire import unpack_ids

_FLOOR = -9999.0  # -inf is not JSON; OpenAI clients expect a number (vLLM clamps the same way)


def _lp(x: float) -> float:
    return x if x >= _FLOOR else _FLOOR  # also maps NaN to the floor


class TokenTexts:
    """Per-token text and bytes, cached: the same few thousand ids come back again and again."""

    __slots__ = ("tokenizer", "_text", "_bytes")

    def __init__(self, tokenizer: Tokenizer):
        self.tokenizer = tokenizer
        self._text: dict[int, str] = {}  # bounded by the vocabulary
        self._bytes: dict[int, list[int]] = {}

    def text(self, token_id: int) -> str:
        t = self._text.get(token_id)
        if t is None:
            t = self._text[token_id] = self.tokenizer.token_text(token_id)
        return t

    def bytes(self, token_id: int) -> list[int]:
        b = self._bytes.get(token_id)
        if b is None:
            b = self._bytes[token_id] = list(self.tokenizer.token_bytes(token_id))
        return b


def chat_entries(texts: TokenTexts, ids: list[int], lps: list[float], top_ids: list[bytes] | None,
                 top_lps: list[list[float]] | None) -> list[dict]:
    """choices[].logprobs.content entries for these tokens."""
    out = []
    for i, (tid, lp) in enumerate(zip(ids, lps)):
        tops = []
        if top_ids is not None and top_lps is not None:
            tops = [{"token": texts.text(a), "logprob": _lp(b), "bytes": texts.bytes(a)}
                    for a, b in zip(unpack_ids(top_ids[i]), top_lps[i])]
        out.append({"token": texts.text(tid), "logprob": _lp(lp), "bytes": texts.bytes(tid), "top_logprobs": tops})
    return out


class CompletionLogprobs:
    """The completions `logprobs` object of one choice, grown token by token."""

    __slots__ = ("tokens", "token_logprobs", "top_logprobs", "text_offset", "_offset")

    def __init__(self) -> None:
        self.tokens: list[str] = []
        self.token_logprobs: list[float] = []
        self.top_logprobs: list[dict[str, float]] = []
        self.text_offset: list[int] = []
        self._offset = 0

    def add(self, texts: TokenTexts, ids: list[int], lps: list[float], top_ids: list[bytes] | None,
            top_lps: list[list[float]] | None) -> dict:
        """Append these tokens; return the object for just them (a stream chunk's logprobs)."""
        start = len(self.tokens)
        for i, (tid, lp) in enumerate(zip(ids, lps)):
            text = texts.text(tid)
            self.tokens.append(text)
            self.token_logprobs.append(_lp(lp))
            tops: dict[str, float] = {}
            if top_ids is not None and top_lps is not None:
                for a, b in zip(unpack_ids(top_ids[i]), top_lps[i]):
                    tops.setdefault(texts.text(a), _lp(b))
            self.top_logprobs.append(tops)
            self.text_offset.append(self._offset)
            self._offset += len(text)
        return {"tokens": self.tokens[start:], "token_logprobs": self.token_logprobs[start:],
                "top_logprobs": self.top_logprobs[start:], "text_offset": self.text_offset[start:]}

    def as_dict(self) -> dict:
        return {"tokens": self.tokens, "token_logprobs": self.token_logprobs, "top_logprobs": self.top_logprobs,
                "text_offset": self.text_offset}
