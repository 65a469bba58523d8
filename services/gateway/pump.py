"""One request's deltas through its choices as the inbox hands them over: state, metrics, bytes out."""

from __future__ import annotations

import asyncio
import time
from typing import TYPE_CHECKING

from services.gateway.choice import FAILED, ChoiceState, ChoiceUpdate
from services.gateway.token_router import DeltaInbox, StreamFailed

if TYPE_CHECKING:
    from services.gateway.gateway import Gateway
    from services.gateway.generation import Generation
    from services.gateway.response_format import ResponseFormat
    from services.gateway.streaming import ChunkSink


def note_arrival(metrics, gen: Generation, choice: ChoiceState, now: float) -> None:
    """A token of `choice` arrived at `now`: the request's first (TTFT) or the gap since the choice's last (ITL)."""
    if gen.first_token_at is None:
        gen.first_token_at = now
        metrics.time_to_first_token.observe(now - gen.arrival)
    elif choice.last_arrival:
        metrics.inter_token_latency.observe(now - choice.last_arrival)
    choice.last_arrival = now


def apply_deltas(gw: Gateway, gen: Generation, items: list) -> tuple[list[tuple[ChoiceState, ChoiceUpdate]],
                                                                    StreamFailed | None]:
    """Run deltas through their choices (and the latency metrics); stop at the first failure."""
    now = time.monotonic()
    metrics = gw.metrics
    by_id = gen.by_id
    out = []
    for item in items:
        if type(item) is StreamFailed:
            return out, item
        choice = by_id.get(item.request_id)
        if choice is None:
            continue
        update = choice.apply(item)
        if update is None:
            continue
        if item.token_ids:
            note_arrival(metrics, gen, choice, now)
        if update.finish_reason is not None:
            if update.finish_reason in FAILED:
                if choice.error_param:  # e.g. a grammar the worker could not compile: the request's fault
                    return out, StreamFailed(400, f"'{choice.error_param}': {choice.error}", "invalid_request_error")
                return out, StreamFailed(500, choice.error or "generation failed", "server_error")
            gen.finish_choice(choice)
        out.append((choice, update))
    return out, None


class Pump:
    """Consumes one request's deltas synchronously, inside the inbox's hand-over: a streamed
    request's chunks go to its sink (the socket) at once and a collected one's into its choices; the handler
    task sleeps on `done` and wakes once, at the end (or when the client has gone)."""

    __slots__ = ("gw", "gen", "fmt", "writer", "done", "failure", "tail", "plain", "inbox", "interval", "held")

    def __init__(self, gw: Gateway, gen: Generation, fmt: ResponseFormat, writer: ChunkSink | None = None):
        self.gw = gw
        self.gen = gen
        self.fmt = fmt
        self.writer = writer  # None: the answer is one JSON body, built once every choice has ended
        self.done: asyncio.Future = asyncio.get_running_loop().create_future()
        self.failure: StreamFailed | None = None
        self.tail = b""  # the chunks of the last hand-over: the handler writes them with the stream's end
        # A stream of one choice with no stop strings or logprobs takes its plain tokens as ids
        # (tokens()) once its first token, which brings the prompt and cache counters, went through feed().
        choices = gen.choices
        self.plain = (choices[0] if writer is not None and len(choices) == 1 and choices[0].matcher is None
                      and not choices[0].want_logprobs and fmt.tools is None else None)
        self.inbox: DeltaInbox | None = None
        # --stream-interval: plain tokens go out in one event per `interval` tokens (SGLang's
        # stream_interval): a socket write and a JSON chunk per token are most of the gateway's
        # CPU per token. `held` is the text of the tokens not written yet; the next feed() (the
        # end, a failure) writes it first.
        self.interval = gw.cfg.stream_interval
        self.held = ""

    async def run(self, inbox: DeltaInbox) -> None:
        """Consume until every choice has ended, the request failed or the client went away."""
        self.inbox = inbox
        inbox.attach(self.feed)
        try:
            await self.done
        finally:
            inbox.detach()

    def tokens(self, ids: list[int]) -> None:
        """The inbox's hand-over of plain tokens (mid-stream, no end, no logprobs) of the one choice:
        what apply_deltas and ChoiceState.apply do for such a delta, without the objects (the prompt
        and cache counters, the same in every delta of a worker, came with the first)."""
        done = self.done
        if done.done():
            return
        try:
            choice = self.plain
            if choice.finish_reason is not None:
                return  # ended here (a failure) while these were on their way
            gen = self.gen
            metrics = self.gw.metrics
            now = time.monotonic()
            detok = choice.detok
            text_chunk = self.fmt.text_chunk
            index = choice.index
            data = b""
            interval = self.interval
            held = self.held
            for token in ids:
                note_arrival(metrics, gen, choice, now)
                choice.num_tokens += 1
                held += detok.push(token)
                if held and choice.num_tokens % interval == 0:
                    data += text_chunk(index, held)
                    held = ""
            self.held = held
            if data and not self.writer.send(data):
                done.set_result(None)  # the client went away: writer.closed tells the handler
        except Exception as e:  # a bug in one request must not stop the inbox of the others
            if not done.done():
                done.set_exception(e)

    def feed(self, items: list) -> None:
        """The inbox's hand-over: this request's deltas from one burst of TokenBatches (one step, or
        several when the gateway fell behind), possibly ending with a StreamFailed."""
        done = self.done
        if done.done():
            return
        try:
            gen = self.gen
            updates, failure = apply_deltas(self.gw, gen, items)
            fmt = self.fmt
            writer = self.writer
            data = b""
            if self.held:  # plain tokens held back by --stream-interval go out before what follows them
                data = fmt.text_chunk(self.plain.index, self.held)
                self.held = ""
            if writer is None:
                for choice, update in updates:
                    fmt.collect(choice, update)
            else:
                for choice, update in updates:
                    chunk = fmt.chunk(choice, update)
                    if chunk is not None:
                        data += chunk  # every event of the hand-over goes out in one write
            if failure is not None or not gen.unfinished:
                self.failure = failure
                self.tail = data
                done.set_result(None)
            elif data and not writer.send(data):
                done.set_result(None)  # the client went away: writer.closed tells the handler
            elif self.plain is not None and self.plain.num_tokens:
                self.inbox.take_tokens(self.tokens)
        except Exception as e:  # a bug in one request must not stop the inbox of the others
            if not done.done():
                done.set_exception(e)
