"""One choice of a request at the gateway: token deltas in, stable text out, stop strings applied."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Sequence

from shared.detokenizer import StopStringMatcher, make_detokenizer
from shared.messages import TokenDelta
from shared.tokenizer import Tokenizer
from shared.wire import unpack_ids

FAILED = ("abort", "error")  # finish reasons that end a request with an error, not an answer


@dataclass(slots=True)
class ChoiceUpdate:
    """What one TokenDelta changed: new text (possibly ""), the tokens when logprobs are on."""

    text: str
    finish_reason: str | None
    token_ids: list[int] | None = None  # only with logprobs
    logprobs: list[float] | None = None
    top_ids: list[bytes] | None = None
    top_lps: list[list[float]] | None = None


class ChoiceState:
    __slots__ = ("index", "request_id", "detok", "matcher", "want_logprobs", "num_tokens", "cached_tokens",
                 "prompt_tokens", "finish_reason", "error", "error_param", "stopped_here", "last_arrival", "parts",
                 "logprobs", "drafted_tokens", "accepted_tokens")

    def __init__(self, index: int, request_id: str, tokenizer: Tokenizer, prompt_tail: Sequence[int],
                 stop: Sequence[str], want_logprobs: bool, skip_special_tokens: bool = True):
        self.index = index
        self.request_id = request_id
        self.detok = make_detokenizer(tokenizer, prompt_tail, skip_special_tokens=skip_special_tokens)
        self.matcher = StopStringMatcher(stop) if stop else None
        self.want_logprobs = want_logprobs
        self.num_tokens = 0
        self.cached_tokens = 0
        self.prompt_tokens = 0
        self.finish_reason: str | None = None
        self.error: str | None = None
        self.error_param: str | None = None  # set when the failure was the request's own input's
        self.stopped_here = False  # a stop string ended it: the worker has not finished and must be told
        self.last_arrival = 0.0
        self.parts: list[str] = []  # the whole text, for a non-streaming answer
        self.logprobs: Any = None  # the format's accumulator, for a non-streaming answer
        self.drafted_tokens = self.accepted_tokens = 0  # its drafts' tokens, from the worker at its end

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None

    def apply(self, d: TokenDelta) -> ChoiceUpdate | None:
        """Consume one delta; None once the choice has finished (late deltas after a stop string)."""
        if self.finish_reason is not None:
            return None
        if d.cached_tokens > self.cached_tokens:
            self.cached_tokens = d.cached_tokens
        if d.prompt_tokens:
            self.prompt_tokens = d.prompt_tokens
        raw = d.token_ids
        finish = d.finish_reason
        if finish is not None and d.drafted_tokens:
            self.drafted_tokens, self.accepted_tokens = d.drafted_tokens, d.accepted_tokens
        if len(raw) == 4 and finish is None and self.matcher is None and not self.want_logprobs:
            # The per-token path: one token mid-stream, no stop token, stop string or logprobs to mind.
            self.num_tokens += 1
            return ChoiceUpdate(self.detok.push(int.from_bytes(raw, "little", signed=True)), None)
        ids = unpack_ids(raw)
        self.num_tokens += len(ids)
        if finish in FAILED:
            self.finish_reason = finish
            self.error = d.error or ("the worker aborted the request" if finish == "abort" else "generation failed")
            self.error_param = d.error_param
            return ChoiceUpdate("", finish)
        # The eos/stop token that ended generation is counted but never shown as text.
        text_ids = ids[:-1] if d.stop_token_id is not None and ids and ids[-1] == d.stop_token_id else ids
        text = self.detok.push(text_ids) if text_ids else ""
        if finish is not None:
            text += self.detok.flush()
        if self.matcher is not None:
            text, matched = self.matcher.feed(text)
            if matched:
                self.stopped_here = finish is None
                finish = "stop"
            elif finish is not None:
                text += self.matcher.flush()
        self.finish_reason = finish
        if self.want_logprobs and d.logprobs is not None:
            return ChoiceUpdate(text, finish, ids, d.logprobs, d.top_ids, d.top_lps)
        return ChoiceUpdate(text, finish)
