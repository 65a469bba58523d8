"""Turns the step's logits into tokens: logits processors per request, then one batched draw."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from services.worker.engine.grammar_mask import GrammarMask
from services.worker.engine.ops import TorchOps
from services.worker.engine.request import Request
from services.worker.engine.sampler_warmup import Warmup, draw_exact
from services.worker.kernels.sampling import launches_needed


@dataclass(slots=True)
class SampleResult:
    token_ids: list[int]
    logprobs: list[float] | None  # of the chosen token, per row; None when no row asked
    top_ids: list[list[int]] | None
    top_logprobs: list[list[float]] | None


@dataclass(slots=True)
class PendingSample:
    """A step's draw, still on its way to the host. `token_ids` stays on the device so the
    next step can feed the tokens back before the host has seen them."""

    token_ids: torch.Tensor  # [rows] int64 on the device
    host_ids: torch.Tensor  # [rows] int64, pinned on CUDA: filled by an asynchronous copy
    done: torch.cuda.Event | None  # recorded after the copies; None on the CPU
    logprobs: tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None = None  # chosen, top ids, top lp (host)

    def result(self) -> SampleResult:
        if self.done is not None:
            self.done.synchronize()  # a blocking event: the thread sleeps and frees the GIL
        ids = self.host_ids.tolist()
        if self.logprobs is None:
            return SampleResult(ids, None, None, None)
        chosen, top_ids, top_lp = self.logprobs
        return SampleResult(ids, chosen.tolist(), top_ids.tolist(), top_lp.tolist())


# Rows whose log-probabilities are made at once (fp32, as vLLM's): in one piece, 1,024 rows of a 128k
# vocabulary made 1 GB of temporaries (the widened copy and log_softmax's output), which the KV
# sizing's dry run reserves for the largest step (gpu_memory.py).
LOGPROB_ROWS = 256


def log_probs(logits: torch.Tensor, token_ids: torch.Tensor, k: int) -> tuple[torch.Tensor, ...]:
    """(each row's chosen token's log-probability, the top k ids, their log-probabilities), made
    LOGPROB_ROWS rows at a time."""
    parts = []
    for start in range(0, max(logits.shape[0], 1), LOGPROB_ROWS):  # one part even for no rows
        logp = torch.log_softmax(logits[start:start + LOGPROB_ROWS].float(), dim=-1)
        chosen = logp.gather(1, token_ids[start:start + LOGPROB_ROWS].view(-1, 1)).squeeze(1)
        top_lp, top_ids = logp.topk(k, dim=-1) if k > 0 else (logp[:, :0], logp[:, :0].long())
        parts.append((chosen, top_ids, top_lp))
    if len(parts) == 1:
        return parts[0]
    return tuple(torch.cat(column) for column in zip(*parts))


class Sampler:
    """Per-request parameters inside one batch.

    Order (as vLLM): logit_bias, min_tokens (hide stop ids), repetition / presence / frequency
    penalties, then temperature, top-k, top-p, min-p and the seeded draw in one kernel.
    Logprobs are those of the raw model distribution.
    """

    def __init__(self, ops: TorchOps, vocab_size: int, device: torch.device, max_rows: int = 256,
                 logits_dtype: torch.dtype = torch.float32):
        self.ops = ops
        self.logits_dtype = logits_dtype  # the model's: what compute_logits returns
        self.vocab_size = vocab_size
        self.device = device
        self._cuda = device.type == "cuda"
        # The step's one device→host copy lands in pinned memory; a blocking event lets the CPU
        # sleep (not spin) until it is there, leaving the GIL to the service's event loop. Two
        # of each: while one step's tokens are read, the next step's copy may be queued.
        self._ids_host = [torch.empty(max_rows, dtype=torch.int64, pin_memory=self._cuda) for _ in range(2)]
        self._events = [torch.cuda.Event(blocking=True) for _ in range(2)] if self._cuda else None
        self._turn = 0
        self._max_rows = max_rows
        self._grammar_mask: GrammarMask | None = None  # made at the first constrained draw
        self._warming: Warmup | None = None  # the kernels' warm-up (sampler_warmup.py)
        self.grammar_timing = False  # GrammarMask.timing (the step trace's)

    def grammar_mask(self) -> GrammarMask:
        if self._grammar_mask is None:
            self._grammar_mask = GrammarMask(self.vocab_size, self.device, self._max_rows, self.grammar_timing)
        return self._grammar_mask

    def grammar_seconds(self) -> tuple[float, float]:
        """The grammar masks' host fill and GPU wait so far (with grammar_timing), in seconds."""
        mask = self._grammar_mask
        if mask is None:
            return 0.0, 0.0
        mask.read_waits()
        return mask.fill_seconds, mask.wait_seconds

    def __call__(self, logits: torch.Tensor, requests: list[Request], plain: bool = False,
                 constrained: bool = False, logits_ready=None, draft_rows=None) -> PendingSample:
        """Queue the draw for `requests` (one per logits row); nothing waits for the device.
        `plain`: every request is Request.plain (greedy, nothing else), known without reading them.
        `constrained`: some hold a grammar's matcher, whose mask applies first (in place: the log-
        probabilities are those of the constrained draw, as vLLM's); `logits_ready` times its wait.
        `draft_rows`: (request, place in its jump-forward draft) per logits row, when some request
        checks a draft: row j of a draft is drawn as token-by-token decoding would draw it after
        the draft's first j tokens (that grammar state, that seeded counter)."""
        if plain:
            return self._pending(logits.argmax(dim=-1), None)
        places = None
        if draft_rows is not None:
            requests, places = [r for r, _ in draft_rows], [j for _, j in draft_rows]
        if constrained:
            rows = [row for row, r in enumerate(requests) if r.matcher is not None]
            if rows:
                self.grammar_mask().apply(logits, requests, rows, logits_ready, places)
        params = [r.sampling_params for r in requests]
        raw = logits
        if self._needs_processing(requests):
            logits = self._process(logits.to(torch.float32, copy=True), requests, places)  # penalties in fp32, as vLLM
        if all(p.temperature == 0.0 for p in params):
            token_ids = logits.argmax(dim=-1)  # greedy batch: no sampling kernel, no parameter upload
        else:
            token_ids = self._sample(logits, requests, places)

        k = max((p.logprobs for p in params if p.logprobs is not None), default=None)
        logprobs = None
        if k is not None:
            logprobs = tuple(self._host_copy(t) for t in log_probs(raw, token_ids, k))
        return self._pending(token_ids, logprobs)

    def _warmup(self, max_rows: int) -> Warmup:
        """The draws at every batch size that needs a kernel variant of its own (dummy logits, the
        parameters' dtypes as in serving), so that no step compiles one (seconds) mid-serving: run
        now (warm_up) or on a thread (warm_up_later). sampler_warmup.py says why."""
        rows = self.ops.sample_warm_rows(self.vocab_size, max_rows, self.device)
        return Warmup(self._draw_kernel, rows, self.logits_dtype, self.vocab_size, self.device)

    def warm_up(self, max_rows: int) -> int:
        """Every kernel variant compiled now; returns how many draws that took."""
        warm = self._warmup(max_rows)
        self._warming = warm
        return warm.run()

    def warm_up_later(self, max_rows: int) -> Warmup:
        """The kernel variants to compile on a thread, once start_warm_up() is called (after the CUDA
        graphs are captured: no launch of its then breaks a capture); every draw is sample_ref's
        until they are compiled."""
        self._warming = self._warmup(max_rows)
        return self._warming

    def start_warm_up(self) -> None:
        """The thread of warm_up_later's variants, if it is not running yet."""
        warm = self._warming
        if warm is not None and not warm.ready and not warm.started:
            warm.start()

    def warm_reserve_bytes(self) -> int:
        """Device bytes a pending warm-up will hold beside the steps (0: none pending)."""
        warm = self._warming
        return warm.reserve_bytes() if warm is not None and not warm.ready else 0

    @property
    def kernels_ready(self) -> bool:
        """Whether draws take the kernels (their variants compiled), else sample_ref (exact, slower)."""
        return self._warming is None or self._warming.ready

    def close(self) -> None:
        """Stop a warm-up under way: its model is going (engine.close)."""
        if self._warming is not None and self._warming.started:
            self._warming.stop()

    def wait_warm(self, timeout: float | None = None) -> bool:
        """Until the kernels are compiled (their thread started now if it was not); whether they are."""
        self.start_warm_up()
        return self._warming is None or self._warming.wait(timeout)

    def _sample(self, logits: torch.Tensor, requests: list[Request], places: list[int] | None = None) -> torch.Tensor:
        params = [r.sampling_params for r in requests]
        offsets = ([r.next_output_index for r in requests] if places is None else
                   [r.next_output_index - r.draft_len + j for r, j in zip(requests, places)])
        return self._draw(logits, [[p.temperature for p in params], [p.top_p for p in params],
                                   [p.min_p for p in params]],
                          [[p.top_k for p in params], [r.seed for r in requests], offsets])

    def _draw(self, logits: torch.Tensor, float_rows: list[list[float]], int_rows: list[list[int]]) -> torch.Tensor:
        """float_rows: temperature, top_p, min_p; int_rows: top_k, seed, offset; one column a row."""
        if not self.kernels_ready:
            floats, ints = self._upload(float_rows, int_rows)
            return draw_exact(logits, floats[0], ints[0], floats[1], floats[2], ints[1], ints[2])
        return self._draw_kernel(logits, float_rows, int_rows)

    def _upload(self, float_rows: list[list[float]], int_rows: list[list[int]]) -> tuple[torch.Tensor, torch.Tensor]:
        floats = torch.tensor(float_rows, dtype=torch.float32)
        ints = torch.tensor(int_rows, dtype=torch.int64)
        if self.device.type == "cuda":
            floats = floats.pin_memory().to(self.device, non_blocking=True)
            ints = ints.pin_memory().to(self.device, non_blocking=True)
        return floats, ints

    def _draw_kernel(self, logits: torch.Tensor, float_rows: list[list[float]],
                     int_rows: list[list[int]]) -> torch.Tensor:
        # The kernels' launches for rows this batch has none of are skipped: the chunked chain's (rows with
        # top-p or min-p and no top-k, sampling_chain.py), the second read's (rows with top-k).
        chain, second_read = launches_needed(float_rows[0], int_rows[0], float_rows[1], float_rows[2],
                                             self.vocab_size)
        floats, ints = self._upload(float_rows, int_rows)
        # Logits of another type than the model's (widened for penalties) compile kernel variants of
        # their own: one launch shape for every batch size keeps them to one set (warm_up).
        return self.ops.sample(logits, floats[0], ints[0].to(torch.int32), floats[1], floats[2], ints[1], ints[2],
                               chain=chain, second_read=second_read, one_shape=logits.dtype != self.logits_dtype)

    def _host_copy(self, t: torch.Tensor) -> torch.Tensor:
        if not self._cuda:
            return t
        host = torch.empty(t.shape, dtype=t.dtype, pin_memory=True)
        host.copy_(t, non_blocking=True)
        return host

    def _pending(self, token_ids: torch.Tensor, logprobs) -> PendingSample:
        if not self._cuda:
            return PendingSample(token_ids, token_ids, None, logprobs)
        n, turn = token_ids.shape[0], self._turn
        self._turn ^= 1
        if n > self._ids_host[turn].shape[0]:
            self._ids_host[turn] = torch.empty(n, dtype=torch.int64, pin_memory=True)
        host = self._ids_host[turn][:n]
        host.copy_(token_ids, non_blocking=True)
        event = self._events[turn]
        event.record()
        return PendingSample(token_ids, host, event, logprobs)

    @staticmethod
    def _needs_processing(requests: list[Request]) -> bool:
        for r in requests:
            if r.processes_logits or (r.min_tokens_masked and r.next_output_index < r.min_tokens_masked):
                return True
        return False

    def _process(self, logits: torch.Tensor, requests: list[Request], places: list[int] | None = None) -> torch.Tensor:
        """Row by row for the rare requests that use these knobs; the common case skips it all.
        `places`: a row's place j in its request's draft, whose history then ends at the draft's
        first j tokens (the penalties and min_tokens of token-by-token decoding at that place)."""
        for row, r in enumerate(requests):
            p = r.sampling_params
            known, index = r.all_token_ids, r.next_output_index
            if places is not None and r.draft_len:
                back = r.draft_len - places[row]
                known, index = known[:len(known) - back], index - back
            if p.logit_bias:
                ids = torch.tensor(list(p.logit_bias.keys()), dtype=torch.long, device=logits.device)
                bias = torch.tensor(list(p.logit_bias.values()), dtype=logits.dtype, device=logits.device)
                logits[row].index_add_(0, ids, bias)
            if index < r.min_tokens_masked:
                logits[row, torch.tensor(sorted(r.stop_ids), device=logits.device)] = float("-inf")
            if p.repetition_penalty != 1.0:
                seen = torch.tensor(sorted(set(known)), dtype=torch.long, device=logits.device)
                vals = logits[row, seen]
                logits[row, seen] = torch.where(vals > 0, vals / p.repetition_penalty,
                                                vals * p.repetition_penalty)
            if p.presence_penalty or p.frequency_penalty:
                out = known[r.num_prompt_tokens:]
                if out:
                    ids, counts = torch.tensor(out, dtype=torch.long, device=logits.device).unique(
                        return_counts=True)
                    logits[row, ids] -= p.presence_penalty + p.frequency_penalty * counts.to(logits.dtype)
        return logits
