"""The batcher's limits: token budget per step, running-set size, context length, chunk cap."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True, slots=True, kw_only=True)
class SchedulerConfig:
    max_model_len: int  # longest sequence (prompt + output) a request may reach
    max_num_batched_tokens: int = 2048  # token budget of one step
    max_num_seqs: int = 256  # most requests running at once
    long_prefill_token_threshold: int = 0  # most tokens one request takes in a step; 0 = no cap
    # Most prompt tokens of all requests together in a step (SGLang's --chunked-prefill-size); 0 = the
    # step budget. Decodes do not count: a decode worker's local prefills then add a bounded chunk to
    # its steps, so its inter-token latency stays near a decode step's.
    chunked_prefill_size: int = 0
    enable_prefix_caching: bool = True
    # Pipeline parallelism: steps in flight at once, each request in at most one of them, so
    # the running set splits into this many micro-batches that keep every stage busy.
    micro_batches: int = 1

    def __post_init__(self) -> None:
        for name in ("max_model_len", "max_num_batched_tokens", "max_num_seqs"):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                raise ValueError(f"SchedulerConfig.{name} must be a positive integer, got {value!r}")
        for name in ("long_prefill_token_threshold", "chunked_prefill_size"):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value < 0:
                raise ValueError(f"SchedulerConfig.{name} must be an integer >= 0 (0 = no limit), got {value!r}")
        if not isinstance(self.micro_batches, int) or self.micro_batches < 1:
            raise ValueError(f"SchedulerConfig.micro_batches must be a positive integer, got {self.micro_batches!r}")
        if self.max_model_len < 2:
            raise ValueError(f"SchedulerConfig.max_model_len must be at least 2 (one prompt token "
                             f"and one output token), got {self.max_model_len}")

    @property
    def prefill_budget(self) -> int:
        """Most prompt tokens in one step."""
        return min(self.chunked_prefill_size or self.max_num_batched_tokens, self.max_num_batched_tokens)

    @property
    def max_tokens_per_request_step(self) -> int:
        """Most tokens one request may take in a step."""
        return self.long_prefill_token_threshold or self.max_num_batched_tokens
