"""The worker's step thread: owns the engine, takes commands from a queue, hands outputs back.

The model never waits on the network and the event loop never waits on the model: NATS
handlers only enqueue, and outputs cross back through a callback the service makes thread-safe.
"""

from __future__ import annotations

import queue
import threading
import time
from dataclasses import dataclass
from itertools import repeat
from typing import Any, Callable

import structlog

from services.worker.engine.cuda_device import bind_thread
from services.worker.prefill_rate import PrefillRate
from services.worker.step_trace import StepTrace
from shared import hop_trace
from shared.sampling_params import SamplingParams

log = structlog.get_logger("worker.step_loop")

STATS_INTERVAL = 0.2  # seconds between load snapshots while busy
# Background work (a CUDA graph capture, ~50 ms for the 8B shape) starts a moment after the loop
# does (the requests that waited for a model to load come first), then runs whenever nothing else
# is to do, and while requests run at most once per BACKGROUND_PERIOD: they never wait long on it.
BACKGROUND_GRACE = 0.2
BACKGROUND_PERIOD = 0.2
FINISH_STATS_GAP = 0.01  # ... but a step that finished requests refreshes it sooner


@dataclass(slots=True)
class AddCommand:
    request_id: str
    prompt_token_ids: list[int]
    params: SamplingParams
    reply_to: str
    cache_salt: bytes = b""
    handoff: bool = False  # a prefill worker's request: stop after the first token, hand the KV on
    matcher: Any = None  # its grammar's matcher (services/worker/grammar.py), compiled before it came
    resume: tuple[int, int] | None = None  # (first token, seed) drawn by a prefill worker whose KV never came


@dataclass(slots=True)
class ReserveCommand:
    """Hold blocks for a request another worker prefills; `reply` gets the ImportReservation, None
    (no room before `deadline`, a time.monotonic()) or an error message, on the step thread. A
    request that does not fit yet waits for blocks to free, retried after every step."""

    request_id: str
    prompt_token_ids: list[int]
    params: SamplingParams
    cache_salt: bytes
    deadline: float
    reply: Callable[[object], None]
    matcher: Any = None  # a structured output's grammar matcher (services/worker/grammar.py), fresh


@dataclass(slots=True)
class ImportCommand:
    """The reserved request's pages have arrived: write them in and decode on, sending to reply_to."""

    request_id: str
    reply_to: str
    first_token: int
    seed: int
    num_cached_tokens: int


@dataclass(slots=True)
class InsertCachedCommand:
    """Pages fetched from the cluster KV store, to become cached blocks before `AddCommand`s need them."""

    hashes: list[bytes]
    pages: object  # host bytes (numpy uint8) of len(hashes) pages


@dataclass(slots=True)
class AbortCommand:
    request_ids: list[str]


@dataclass(slots=True)
class Rejected:
    """An add that the engine refused (bad parameters, a prompt that can never fit)."""

    request_id: str
    reply_to: str
    message: str
    param: str | None = None  # the body field at fault, when the request's own input is (a 400)


class StepLoop(threading.Thread):
    def __init__(self, engine, on_outputs: Callable[[object, list[str], bool], None], eos_token_ids=(),
                 on_kv_events: Callable[[list, list], None] | None = None,
                 on_handoff: Callable[[object], None] | None = None):
        super().__init__(name="step-loop", daemon=True)
        self.engine = engine
        self.on_outputs = on_outputs
        self.on_kv_events = on_kv_events
        self.on_handoff = on_handoff
        self.on_step: Callable[[int, float], None] | None = None  # (tokens computed, seconds), step thread
        # Work for the step thread between steps, a little per turn, until it returns False (the
        # CUDA graphs a model left to capture after it became ready).
        self.background: Callable[[], bool] | None = None
        self.block_manager = getattr(engine, "block_manager", None)
        self.eos_token_ids = tuple(eos_token_ids)
        self.commands: queue.SimpleQueue = queue.SimpleQueue()
        self.reply_to: dict[str, str] = {}  # request id -> gateway inbox, owned by this thread
        self.stats = engine.stats()
        self._stats_at = 0.0
        # Cumulative, for the heartbeat (`inferno top` rates them): steps, their seconds on this thread,
        # the tokens they computed and the tokens they produced.
        self.steps_done = 0
        self.busy_seconds = 0.0
        self.computed_tokens = 0
        self.output_tokens = 0
        self.prefill_rate = PrefillRate()
        self._last_end = 0.0  # when the last step ended, or the thread last found work after idling
        self._stopping = threading.Event()
        self._waiting_reserves: list[ReserveCommand] = []
        self.trace = StepTrace.from_env()
        sampler = getattr(engine, "sampler", None)
        if self.trace is not None and sampler is not None:
            sampler.grammar_timing = True
        self._mask_seconds = (0.0, 0.0)  # the grammar masks' fill and wait totals at the last trace

    def submit(self, command) -> None:
        self.commands.put(command)

    def stop(self) -> None:
        self._stopping.set()
        self.commands.put(None)

    def run(self) -> None:
        bind_thread(getattr(self.engine, "device", None))  # the emitter has none
        background_due = time.monotonic() + BACKGROUND_GRACE
        while not self._stopping.is_set():
            if self.background is not None and time.monotonic() >= background_due:
                if not self._run_background():
                    self.background = None
                busy = self.engine.has_unfinished()
                background_due = time.monotonic() + (BACKGROUND_PERIOD if busy else 0.0)
            idle = not self.engine.has_unfinished()
            if idle:
                self._refresh_stats(force=True)
            # Reservations waiting for blocks are retried every few ms while nothing runs.
            timeout = 0.005 if self._waiting_reserves else 0.5
            if self.background is not None:
                timeout = max(0.0, min(timeout, background_due - time.monotonic()))
            rejected = self._drain(block=idle, timeout=timeout)
            if idle:  # a step after idling is timed from here, not from the last one
                self._last_end = time.perf_counter()
            if rejected:
                self.on_outputs(rejected, [r.reply_to for r in rejected], False)
            if self._waiting_reserves:
                self._retry_reserves()
            if not self.engine.has_unfinished():
                continue
            started = time.perf_counter()
            try:
                outputs = self.engine.step()
            except Exception:  # the engine already fails bad steps; this is a last line of defence
                log.exception("step failed")
                continue
            ended = time.perf_counter()
            elapsed = ended - started
            self.steps_done += 1
            self.busy_seconds += elapsed
            computed = getattr(self.engine, "last_step_tokens", 0)
            self.computed_tokens += computed
            # Timed from the last step's end, not this call's start: with overlapped steps a call
            # waits only for what is left of the step before, and the host's work between calls
            # (outputs, commands) overlaps the GPU's.
            self.prefill_rate.add(computed - getattr(self.engine, "last_step_rows", 0), ended - self._last_end)
            self._last_end = ended
            self.output_tokens += len(getattr(outputs, "token_ids", ()))
            if self.on_step is not None:
                self.on_step(computed, elapsed)
            if self.trace is not None:
                self._trace_step(time.perf_counter() - started)
            self.hand_over(outputs)
            if self.trace is not None and not self.engine.has_unfinished():
                self.trace.flush()
        self.stats = self.engine.stats()
        if self.trace is not None:
            self.trace.flush()

    def _trace_step(self, seconds: float) -> None:
        engine = self.engine
        sampler = getattr(engine, "sampler", None)
        fill = wait = 0.0
        if sampler is not None:
            totals = sampler.grammar_seconds()
            fill, wait = (now - before for now, before in zip(totals, self._mask_seconds))
            self._mask_seconds = totals
        self.trace.record(seconds, getattr(engine, "last_step_tokens", 0), getattr(engine, "last_step_rows", 0),
                          len(self.reply_to), fill, wait)

    def hand_over(self, outputs) -> None:
        """A step's outputs (StepOutputs, and the KV events and hand-offs behind them) to the service,
        with each row's gateway inbox."""
        reply_to = self.reply_to
        routes = list(map(reply_to.get, outputs.request_ids, repeat("")))
        ended = outputs.ended()
        finished = bool(ended)
        handoffs = []
        for o in ended:
            reply_to.pop(o.request_id, None)
            if o.handoff is not None:
                handoffs.append(o)
        # A finish frees load the scheduler should see at once (the service sends it).
        self._refresh_stats(force=finished and time.monotonic() - self._stats_at >= FINISH_STATS_GAP)
        # KV events first: the service sends them ahead of the tokens that end a request.
        if self.on_kv_events and self.block_manager is not None:
            stored, removed = self.block_manager.take_events()
            if stored or removed:
                self.on_kv_events(stored, removed)
        if outputs:
            self.on_outputs(outputs, routes, finished)
        # After the outputs: the first token reaches the gateway before the KV moves on.
        for o in handoffs:
            if self.on_handoff is not None:
                self.on_handoff(o)

    def _run_background(self) -> bool:
        try:
            return self.background()
        except Exception:  # an optimisation that failed: serving goes on without it
            log.exception("background work failed")
            return False

    def _drain(self, block: bool, timeout: float = 0.5) -> list[Rejected]:
        rejected: list[Rejected] = []
        try:
            command = self.commands.get(timeout=timeout) if block else self.commands.get_nowait()
        except queue.Empty:
            return rejected
        while command is not None:
            if isinstance(command, AddCommand):
                try:
                    if command.resume is not None:
                        self.engine.add_resumed(command.request_id, command.prompt_token_ids, command.params,
                                                *command.resume, self.eos_token_ids, command.cache_salt,
                                                matcher=command.matcher)
                    else:
                        self.engine.add_request(command.request_id, command.prompt_token_ids, command.params,
                                                self.eos_token_ids, command.cache_salt, handoff=command.handoff,
                                                matcher=command.matcher)
                    self.reply_to[command.request_id] = command.reply_to
                    if hop_trace.TRACE is not None:
                        hop_trace.TRACE.mark(command.request_id, "wk_added")
                except ValueError as e:
                    rejected.append(Rejected(command.request_id, command.reply_to, str(e)))
                except Exception as e:  # a bug fails this request; it must not end the step thread (and the serving)
                    log.exception("add_request failed", request_id=command.request_id)
                    rejected.append(Rejected(command.request_id, command.reply_to, f"internal error: {e}"))
            elif isinstance(command, ReserveCommand):
                self._reserve(command)
            elif isinstance(command, ImportCommand):
                c = command
                try:
                    self.engine.complete_import(c.request_id, c.first_token, c.seed, c.num_cached_tokens)
                    self.reply_to[c.request_id] = c.reply_to
                except KeyError:  # cancelled (aborted or expired) before its pages arrived
                    pass
                except ValueError as e:
                    rejected.append(Rejected(c.request_id, c.reply_to, str(e)))
            elif isinstance(command, InsertCachedCommand):
                self._insert_cached(command)
            elif isinstance(command, AbortCommand):
                for rid in command.request_ids:
                    self.engine.abort(rid)
                    self.reply_to.pop(rid, None)
                    self._waiting_reserves = [c for c in self._waiting_reserves if c.request_id != rid]
            try:
                command = self.commands.get_nowait()
            except queue.Empty:
                command = None
        self._refresh_stats(force=True)
        return rejected

    def _insert_cached(self, c: InsertCachedCommand) -> None:
        import torch

        from services.worker.engine.kv_pages import page_shape

        pool = self.engine.kv_cache.pool
        shape = (len(c.hashes), *page_shape(self.engine.kv_cache))
        try:
            pages = torch.from_numpy(c.pages).view(pool.dtype).view(shape)
            self.engine.insert_cached(c.hashes, pages)
        except (RuntimeError, ValueError) as e:  # pages of another shape: recompute instead
            log.warning("fetched pages unusable", error=str(e))

    def _reserve(self, c: ReserveCommand) -> bool:
        """Try one reservation; True when it was answered (held, refused, or out of time)."""
        try:
            result = self.engine.reserve_import(c.request_id, c.prompt_token_ids, c.params, self.eos_token_ids,
                                                c.cache_salt, c.matcher)
        except ValueError as e:
            result = str(e)
        if result is None and time.monotonic() < c.deadline:
            if c not in self._waiting_reserves:
                self._waiting_reserves.append(c)
            return False
        c.reply(result)
        return True

    def _retry_reserves(self) -> None:
        """Admission by free KV: waiting reservations, oldest first, as blocks come free."""
        waiting, self._waiting_reserves = self._waiting_reserves, []
        for i, c in enumerate(waiting):
            if not self._reserve(c):
                # FIFO: the ones behind a request that does not fit keep waiting too.
                self._waiting_reserves = [c] + [x for x in waiting[i + 1:] if not self._expire(x)]
                return

    @staticmethod
    def _expire(c: ReserveCommand) -> bool:
        if time.monotonic() >= c.deadline:
            c.reply(None)
            return True
        return False

    def _refresh_stats(self, force: bool = False) -> None:
        """The load snapshot heartbeats read; a few times a second is plenty, and each costs
        a pass over the requests."""
        now = time.monotonic()
        if force or now - self._stats_at >= STATS_INTERVAL:
            self.stats = self.engine.stats()
            self._stats_at = now
