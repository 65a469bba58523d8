"""Per-request sampling parameters and their bounds: the one place where limits are checked."""

from __future__ import annotations

from dataclasses import dataclass, field

# Bounds shared by the gateway (HTTP validation) and the engine (defence in depth).
MAX_N = 16
MAX_TOP_LOGPROBS = 20
MAX_STOP_STRINGS = 16
MAX_STOP_STRING_CHARS = 256
MAX_STOP_TOKEN_IDS = 64
MAX_LOGIT_BIAS = 1024
MAX_TOKENS_LIMIT = 1 << 20
MIN_SEED = -(1 << 63)
MAX_SEED = (1 << 64) - 1


@dataclass(frozen=True, slots=True)
class Range:
    """A closed interval [lo, hi], or (lo, hi] when lo_open."""

    lo: float
    hi: float
    lo_open: bool = False

    def __contains__(self, value: float) -> bool:
        return (self.lo < value if self.lo_open else self.lo <= value) and value <= self.hi

    def __str__(self) -> str:
        return f"{'(' if self.lo_open else '['}{self.lo:g}, {self.hi:g}]"


# The float parameters' ranges: checked by validate() and published in the gateway's OpenAPI schema.
RANGES = {
    "temperature": Range(0.0, 100.0),
    "top_p": Range(0.0, 1.0, lo_open=True),
    "min_p": Range(0.0, 1.0),
    "repetition_penalty": Range(0.0, 10.0, lo_open=True),
    "presence_penalty": Range(-2.0, 2.0),
    "frequency_penalty": Range(-2.0, 2.0),
}
LOGIT_BIAS_RANGE = Range(-100.0, 100.0)


GRAMMAR_KINDS = ("json_schema", "json", "regex", "ebnf", "structural_tag")


class SamplingParamsError(ValueError):
    """A parameter is out of bounds; `param` names it for the OpenAI error body."""

    def __init__(self, param: str, message: str):
        super().__init__(message)
        self.param = param


@dataclass(slots=True)
class SamplingParams:
    temperature: float = 1.0
    top_k: int = 0  # 0 = off
    top_p: float = 1.0
    min_p: float = 0.0
    repetition_penalty: float = 1.0
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    logit_bias: dict[int, float] = field(default_factory=dict)
    seed: int | None = None
    max_tokens: int = 16
    min_tokens: int = 0
    stop_token_ids: list[int] = field(default_factory=list)
    ignore_eos: bool = False
    logprobs: int | None = None  # None = off; k >= 0 = chosen token plus k alternatives
    # Structured output: the sampler draws only tokens this grammar allows (services/worker/grammar.py).
    grammar_kind: str = ""  # "" (none) or one of GRAMMAR_KINDS
    grammar: str = ""  # json_schema: the schema's JSON; regex; ebnf (root rule "root"); json: unused
    speculative: bool = True  # False: never drafted for (the worker's --speculative-config), an extension

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0 or self.top_k == 1

    def validate(self, vocab_size: int | None = None) -> "SamplingParams":
        """Raise SamplingParamsError naming the first bad field; return self for chaining."""

        def check(ok: bool, param: str, message: str) -> None:
            if not ok:
                raise SamplingParamsError(param, message)

        for name, bounds in RANGES.items():
            check(getattr(self, name) in bounds, name, f"{name} must be in {bounds}")
        check(0 <= self.top_k <= (vocab_size or 1 << 30) or self.top_k == -1, "top_k",
              "top_k must be -1, 0 or a positive count")
        if self.top_k == -1:
            self.top_k = 0
        check(len(self.logit_bias) <= MAX_LOGIT_BIAS, "logit_bias",
              f"logit_bias may hold at most {MAX_LOGIT_BIAS} entries")
        for token_id, bias in self.logit_bias.items():
            check(isinstance(token_id, int) and 0 <= token_id < (vocab_size or 1 << 31),
                  "logit_bias", f"logit_bias token id {token_id} is outside the vocabulary")
            check(bias in LOGIT_BIAS_RANGE, "logit_bias", f"logit_bias values must be in {LOGIT_BIAS_RANGE}")
        check(self.seed is None or MIN_SEED <= self.seed <= MAX_SEED, "seed", "seed must fit in 64 bits")
        check(self.grammar_kind in ("", *GRAMMAR_KINDS), "grammar_kind",
              f"grammar_kind must be one of {GRAMMAR_KINDS} or empty")
        check(bool(self.grammar) or self.grammar_kind in ("", "json"), "grammar", "the grammar's text is empty")
        check(1 <= self.max_tokens <= MAX_TOKENS_LIMIT, "max_tokens", "max_tokens must be at least 1")
        check(0 <= self.min_tokens <= self.max_tokens, "min_tokens", "min_tokens must be in [0, max_tokens]")
        check(len(self.stop_token_ids) <= MAX_STOP_TOKEN_IDS, "stop_token_ids",
              f"at most {MAX_STOP_TOKEN_IDS} stop token ids")
        for token_id in self.stop_token_ids:
            check(0 <= token_id < (vocab_size or 1 << 31), "stop_token_ids",
                  f"stop token id {token_id} is outside the vocabulary")
        check(self.logprobs is None or 0 <= self.logprobs <= MAX_TOP_LOGPROBS, "logprobs",
              f"logprobs must be in [0, {MAX_TOP_LOGPROBS}]")
        return self
