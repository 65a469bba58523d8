"""What a benchmark run sends: its configuration, the synthetic prompts and the arrival schedule."""

from __future__ import annotations

import math
import random
from dataclasses import dataclass, field

ENDPOINTS = ("completions", "chat")
PROMPT_MODES = ("tokens", "text")
# Token ids below this are left out of random prompts: tokenizers keep BOS/EOS/pad and other
# special tokens at the low end, and a random EOS in a prompt would change what is measured.
MIN_TOKEN_ID = 10
MAX_REQUESTS = 1_000_000

# Common English words that most BPE vocabularies hold as one token each (with the leading
# space), so a text prompt of n words is close to n tokens.
WORDS = tuple("""
the of and to in is was for on that with as by at from his her they this which be or an had
not but are were have one all their there been has would when who will more no if out so said
what up its about into than them can only other new some could time these two may then do first
any my now such like our over man me even most made after also did many before must through back
years where much your way well down should because each just those people how too little state
good very make world still own see men work long get here between both life being under never day
same another know while last might us great old year off come since against go came right used
take three house use during without again place around however home small found thought went say
part once general high upon school every does got united left number course war until always away
something fact though water less public put think almost hand enough far took head yet government
system better set told nothing night end why called given find going look asked later knew point
""".split())


def parse_range(text: str) -> tuple[int, int]:
    """'100:340' -> (100, 340), both ends included; '128' -> (128, 128)."""
    lo, sep, hi = text.partition(":")
    try:
        lo_i = int(lo)
        hi_i = int(hi) if sep else lo_i
    except ValueError:
        raise ValueError(f"length range {text!r} is not N or LO:HI") from None
    if not 1 <= lo_i <= hi_i:
        raise ValueError(f"length range {text!r} must satisfy 1 <= LO <= HI")
    return lo_i, hi_i


@dataclass(frozen=True, slots=True)
class SessionConfig:
    """Workload W4: multi-turn chat sessions that share one system prompt (lengths in words)."""

    sessions: int
    turns: int = 8
    system_len: int = 4000
    user_len: tuple[int, int] = (50, 150)
    affinity: bool = False  # send x-session-affinity: <seed>-<session index> on every turn

    def __post_init__(self) -> None:
        if not 1 <= self.sessions <= MAX_REQUESTS:
            raise ValueError(f"sessions must be in [1, {MAX_REQUESTS}]")
        if not 1 <= self.turns <= MAX_REQUESTS // self.sessions:
            raise ValueError(f"turns must be at least 1 and sessions x turns at most {MAX_REQUESTS}")
        if self.system_len < 1:
            raise ValueError("system_len must be at least 1 word")
        lo, hi = self.user_len
        if not 1 <= lo <= hi:
            raise ValueError(f"user_len must satisfy 1 <= low <= high, got {(lo, hi)}")


@dataclass(frozen=True)
class BenchConfig:
    """One benchmark run. Defaults are workload W2 of the design handbook."""

    base_url: str = "http://127.0.0.1:8000"
    model: str | None = None  # None: the first id of GET /v1/models
    endpoint: str = "completions"
    api_key: str | None = None
    num_requests: int = 1000
    input_len: tuple[int, int] = (100, 340)
    output_len: tuple[int, int] = (100, 300)
    concurrency: int | None = None  # None: no cap on requests in flight
    request_rate: float = math.inf  # requests/s of a Poisson process; inf: all at once
    seed: int = 0
    prompt_mode: str = "tokens"
    vocab_size: int = 1000
    ignore_eos: bool = True
    temperature: float | None = 0.0  # None: left to the server
    timeout: float = 600.0  # seconds per request, connect to last byte
    max_duration: float = 3600.0  # seconds for the whole run; unfinished requests then fail
    pids: dict[str, int] = field(default_factory=dict)  # service name -> pid, for CPU cost
    save_requests: bool = False
    sessions: SessionConfig | None = None  # W4 instead of independent requests (chat endpoint only)
    processes: int = 1  # client processes sending the requests (shards.py): one tops out near a core
    # JSON schemas: request i is answered under schemas[i % len] (response_format json_schema).
    schemas: tuple[dict, ...] = ()

    def __post_init__(self) -> None:
        if not self.base_url.startswith(("http://", "https://")):
            raise ValueError(f"base_url must be http:// or https://, got {self.base_url!r}")
        if self.endpoint not in ENDPOINTS:
            raise ValueError(f"endpoint must be one of {ENDPOINTS}, got {self.endpoint!r}")
        if self.prompt_mode not in PROMPT_MODES:
            raise ValueError(f"prompt_mode must be one of {PROMPT_MODES}, got {self.prompt_mode!r}")
        if self.endpoint == "chat" and self.prompt_mode == "tokens":
            raise ValueError("the chat endpoint takes text messages: use prompt_mode 'text'")
        if not 1 <= self.num_requests <= MAX_REQUESTS:
            raise ValueError(f"num_requests must be in [1, {MAX_REQUESTS}]")
        for name in ("input_len", "output_len"):
            lo, hi = getattr(self, name)
            if not 1 <= lo <= hi:
                raise ValueError(f"{name} must satisfy 1 <= low <= high, got {(lo, hi)}")
        if self.concurrency is not None and self.concurrency < 1:
            raise ValueError("concurrency must be at least 1 (or None for no cap)")
        if not 1 <= self.processes <= 64:
            raise ValueError("processes must be in [1, 64]")
        if self.processes > 1 and self.sessions is not None:
            raise ValueError("a session workload (W4) runs in one client process")
        if not self.request_rate > 0:
            raise ValueError("request_rate must be > 0 (inf sends everything at once)")
        if self.prompt_mode == "tokens" and self.vocab_size <= MIN_TOKEN_ID:
            raise ValueError(f"vocab_size must exceed {MIN_TOKEN_ID}")
        if not (0 < self.timeout < math.inf and 0 < self.max_duration < math.inf):
            raise ValueError("timeout and max_duration must be finite and positive")
        for name, pid in self.pids.items():
            if not isinstance(pid, int) or isinstance(pid, bool) or pid <= 0:
                raise ValueError(f"pid of {name!r} must be a positive int, got {pid!r}")
        if self.sessions is not None:
            if self.endpoint != "chat":
                raise ValueError("a session workload runs on the chat endpoint")
            if not math.isinf(self.request_rate):
                raise ValueError("a session workload sends each turn when the previous one ends: "
                                 "request_rate must be inf")


@dataclass(frozen=True, slots=True)
class WorkItem:
    index: int
    prompt: list[int] | str
    input_len: int  # exact for token prompts, a word count for text prompts
    output_len: int  # sent as max_tokens (and min_tokens with ignore_eos)


def seeded_rng(seed: int, stream: str) -> random.Random:
    # One generator per purpose, so the arrival schedule of a seed does not depend on the
    # prompt mode or the lengths, and a sweep sends the same prompts at every rate.
    return random.Random(f"inferno-loadgen:{stream}:{seed}")


def random_words(rng: random.Random, n: int) -> str:
    """n words of WORDS, one space apart: close to n tokens for most tokenizers."""
    return " ".join(rng.choice(WORDS) for _ in range(n))


def build_workload(cfg: BenchConfig) -> list[WorkItem]:
    """The requests of a run, the same for the same seed."""
    len_rng, prompt_rng = seeded_rng(cfg.seed, "lengths"), seeded_rng(cfg.seed, "prompts")
    items = []
    for index in range(cfg.num_requests):
        n_in = len_rng.randint(*cfg.input_len)
        n_out = len_rng.randint(*cfg.output_len)
        if cfg.prompt_mode == "tokens":
            prompt: list[int] | str = [prompt_rng.randrange(MIN_TOKEN_ID, cfg.vocab_size) for _ in range(n_in)]
        else:
            prompt = random_words(prompt_rng, n_in)
        items.append(WorkItem(index, prompt, n_in, n_out))
    return items


def arrival_offsets(num_requests: int, request_rate: float, seed: int) -> list[float]:
    """Send times in seconds after the first request: a Poisson process, or all zero for inf."""
    if math.isinf(request_rate):
        return [0.0] * num_requests
    rng = seeded_rng(seed, "arrivals")
    offsets, t = [], 0.0
    for _ in range(num_requests):
        offsets.append(t)
        t += rng.expovariate(request_rate)
    return offsets
