"""Structured output on the worker: a request's grammar compiled against this model's vocabulary
(xgrammar: bench/grammar_ab.py chose it), off the step loop and cached by its text; one matcher
per request, which the sampler asks for the next token's bitmask and tells every drawn token.

The vocabulary's description (xgrammar's TokenizerInfo: ~1 s for 128k tokens) is built at the first
constrained request, on a thread; a compile runs on a thread too, and a request waits for it before
it is queued, so no step ever waits for a compile. A compile over `timeout` seconds fails the request
alone (the thread finishes it in the background; the cache keeps the result for the next one).
"""

from __future__ import annotations

import asyncio
import threading
from concurrent.futures import ThreadPoolExecutor

import structlog

log = structlog.get_logger("worker.grammar")

COMPILE_THREADS = 2
# The body field a grammar of each kind came from (vLLM's names for regex and EBNF; OpenAI's for JSON).
PARAMS = {"json_schema": "response_format", "json": "response_format", "regex": "structured_outputs.regex",
          "ebnf": "structured_outputs.grammar", "structural_tag": "tools"}


class GrammarError(ValueError):
    """The grammar does not compile (or not in time): the request gets a 400 naming `param`."""

    def __init__(self, message: str, param: str = "response_format"):
        super().__init__(message)
        self.param = param


class Matcher:
    """One request's place in its grammar (`raw`: xgrammar's matcher, which the engine's
    GrammarMask fills bitmasks from in batches). `also`: a bitmask row of tokens allowed at all,
    ANDed into every mask (JSON's: no token with a raw control character)."""

    __slots__ = ("raw", "also", "_encode")

    def __init__(self, compiled, also=None, encode=None):
        import xgrammar as xgr

        self.raw = xgr.GrammarMatcher(compiled)
        self.also = also
        self._encode = encode  # text -> token ids, for jump-forward drafts

    def draft(self, limit: int) -> list[int]:
        """Jump-forward: the tokens of the text the grammar forces from here (a fixed key, `": "`,
        a closing brace), at most `limit`, each one the grammar allows in turn. The engine checks
        them against the model's own draws in one forward (engine/drafts.py), so the answer stays that of
        token-by-token decoding; the matcher is left where it was."""
        if limit <= 0 or self._encode is None:
            return []
        text = self.raw.find_jump_forward_string()
        return self.allowed_prefix(self._encode(text)[:limit]) if text else []

    def allowed_prefix(self, tokens: list[int]) -> list[int]:
        """The longest start of `tokens` the grammar allows from here, one after the other (a
        draft's tokens the grammar forbids are never checked); the matcher is left where it was."""
        ids = []
        for token in tokens:
            if not self.raw.accept_token(token):
                break
            ids.append(token)
        if ids:
            self.raw.rollback(len(ids))
        return ids

    def accept(self, token: int) -> bool:
        return self.raw.accept_token(token)

    @property
    def terminated(self) -> bool:
        return self.raw.is_terminated()


class Grammars:
    """The compiler of one served model."""

    def __init__(self, tokenizer_source: str, vocab_size: int, eos_token_ids, timeout: float = 10.0):
        self.tokenizer_source, self.vocab_size = tokenizer_source, vocab_size
        self.eos_token_ids = list(eos_token_ids)
        self.timeout = timeout
        self._compiler = None
        self._encode = None  # the vocabulary's tokenizer, for jump-forward drafts
        self._no_control = None  # the bitmask row of tokens without a byte below 0x20
        self._lock = threading.Lock()
        self._pool = ThreadPoolExecutor(COMPILE_THREADS, thread_name_prefix="grammar")

    def _compiler_now(self):
        with self._lock:
            if self._compiler is None:
                import xgrammar as xgr
                from transformers import PreTrainedTokenizerFast

                from shared.tokenizer import Tokenizer

                backend = Tokenizer.from_path(self.tokenizer_source)._tok
                self._encode = lambda text: backend.encode(text, add_special_tokens=False).ids
                info = xgr.TokenizerInfo.from_huggingface(PreTrainedTokenizerFast(tokenizer_object=backend),
                                                          vocab_size=self.vocab_size,
                                                          stop_token_ids=self.eos_token_ids or None)
                self._compiler = xgr.GrammarCompiler(info, cache_enabled=True)
                self._no_control = _without_control_bytes(info.decoded_vocab, self.vocab_size)
            return self._compiler

    def _compile(self, kind: str, text: str):
        c = self._compiler_now()
        try:
            if kind == "json_schema":
                return c.compile_json_schema(text, any_whitespace=False)
            if kind == "json":
                return c.compile_builtin_json_grammar()
            if kind == "regex":
                return c.compile_regex(text)
            if kind == "ebnf":
                return c.compile_grammar(text)
            if kind == "structural_tag":  # tool calls' auto: free text, calls held to their schemas
                return c.compile_structural_tag(text)
        except Exception as e:  # xgrammar raises its own types (RuntimeError, ValueError) with the reason
            raise GrammarError(f"the {kind.replace('_', ' ')} does not compile: {e}", PARAMS[kind]) from None
        raise GrammarError(f"unknown grammar kind {kind!r}", "grammar_kind")

    async def matcher(self, kind: str, text: str) -> Matcher:
        """A new matcher for this grammar, compiled on a thread; GrammarError when it cannot be."""
        loop = asyncio.get_running_loop()
        future = loop.run_in_executor(self._pool, self._compile, kind, text)
        try:
            compiled = await asyncio.wait_for(asyncio.shield(future), self.timeout)
        except asyncio.TimeoutError:
            raise GrammarError(f"the grammar took longer than {self.timeout:g} s to compile "
                               "(--grammar-compile-timeout)", PARAMS.get(kind, "response_format")) from None
        # Compact JSON never holds a raw control character (a string escapes it), but xgrammar's
        # bounded strings admit one ([^"\\\r\n]{0,n}): json.loads refused such an answer.
        return Matcher(compiled, self._no_control if kind in ("json_schema", "json") else None, self._encode)

    def close(self) -> None:
        self._pool.shutdown(wait=False, cancel_futures=True)


def _without_control_bytes(decoded_vocab: list[bytes], vocab_size: int):
    """A bitmask row (xgrammar's layout: bit i of word i // 32) allowing every token but those whose
    bytes hold one below 0x20."""
    import torch
    import xgrammar as xgr

    row = xgr.allocate_token_bitmask(1, vocab_size)[0]  # all allowed
    bad = [i for i, b in enumerate(decoded_vocab) if i < vocab_size and any(c < 0x20 for c in b)]
    if bad:
        ids = torch.tensor(bad, dtype=torch.int64)
        words = torch.zeros(row.shape[0], dtype=torch.int64)
        words.index_add_(0, ids // 32, torch.ones_like(ids) << (ids % 32))
        row &= ~_as_int32(words)
    return row


def _as_int32(words):
    """int64 words of 32 bits each as int32 (two's complement), the bitmask's dtype."""
    import torch

    return torch.where(words >= 1 << 31, words - (1 << 32), words).to(torch.int32)
