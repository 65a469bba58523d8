"""The gateway inbox (TokenRouter, DeltaInbox) and the Pump that consumes a request's deltas."""

from __future__ import annotations

import asyncio
from pathlib import Path

import pytest

from services.gateway.gateway import Gateway
from services.gateway.completions import CompletionFormat
from services.gateway.generation import Generation
from services.gateway.pump import Pump
from services.gateway.schemas import parse_completion
from services.gateway.token_router import DeltaInbox, RequestStream, StreamFailed, TokenRouter
from inferno.tools import make_model as mm
from services.worker.engine.model_config import ModelConfig
from shared.config import GatewayConfig
from shared.messages import TokenBatch, TokenDelta
from shared.tokenizer import Tokenizer
from shared.wire import pack_ids

PROMPT = [5, 6, 7]


def delta(rid: str, ids: list[int], finish: str | None = None, error: str | None = None, done: int = 0) -> TokenDelta:
    return TokenDelta(request_id=rid, token_ids=pack_ids(ids), finish_reason=finish, error=error,
                      prompt_tokens=len(PROMPT), cached_tokens=1, completion_tokens=done)


def batch(*items: TokenDelta) -> TokenBatch:
    return TokenBatch.of("w-1", list(items))


class Recorder:
    """A consumer that records each hand-over as (request id or failure message) lists."""

    def __init__(self) -> None:
        self.calls: list[list[str]] = []

    def __call__(self, items: list) -> None:
        self.calls.append([i.message if isinstance(i, StreamFailed) else i.request_id for i in items])


# ---------------------------------------------------------------------------------------------
# TokenRouter and DeltaInbox

def test_inbox_holds_items_until_a_consumer_is_attached():
    inbox = DeltaInbox()
    inbox.put("a")
    assert inbox.add("b") is False  # no consumer: nothing to deliver
    assert len(inbox) == 2
    got = []
    inbox.attach(got.append)
    assert got == [["a", "b"]] and len(inbox) == 0
    inbox.put("c")
    assert got == [["a", "b"], ["c"]]
    inbox.detach()
    inbox.put("d")
    assert got == [["a", "b"], ["c"]] and len(inbox) == 1


async def test_router_hands_over_each_request_once_per_burst_in_order():
    router = TokenRouter()
    a = router.open(["a-0", "a-1"])
    b = router.open(["b-0"])
    router.on_batch(batch(delta("a-0", [11]), delta("b-0", [12]), delta("a-1", [13])))  # before attach
    ra, rb = Recorder(), Recorder()
    a.inbox.attach(ra)
    b.inbox.attach(rb)
    assert ra.calls == [["a-0", "a-1"]] and rb.calls == [["b-0"]]
    router.on_batch(batch(delta("a-1", [14]), delta("b-0", [15]), delta("zz", [16]), delta("a-0", [17])))
    assert ra.calls == [["a-0", "a-1"]]  # handed over once the current burst has been read
    await asyncio.sleep(0)
    assert ra.calls == [["a-0", "a-1"], ["a-1", "a-0"]]  # both choices of a in one hand-over
    assert rb.calls == [["b-0"], ["b-0"]]
    assert router.unknown_deltas == 1


async def test_router_coalesces_the_batches_of_one_burst():
    """Steps that queued up while the gateway was busy go to each request in one hand-over."""
    router = TokenRouter()
    a, b = router.open(["a-0"]), router.open(["b-0"])
    ra, rb = Recorder(), Recorder()
    a.inbox.attach(ra)
    b.inbox.attach(rb)
    router.on_batch(batch(delta("a-0", [1]), delta("b-0", [1])))
    router.on_batch(batch(delta("a-0", [2])))
    router.on_batch(batch(delta("b-0", [2]), delta("a-0", [3])))
    await asyncio.sleep(0)
    assert ra.calls == [["a-0"] * 3] and rb.calls == [["b-0"] * 2]
    router.on_batch(batch(delta("a-0", [4])))
    await asyncio.sleep(0)
    assert ra.calls == [["a-0"] * 3, ["a-0"]] and rb.calls == [["b-0"] * 2]


class Tokens:
    """A consumer that records the tokens of each delta, in the order handed over."""

    def __init__(self) -> None:
        self.tokens: list[int] = []

    def __call__(self, items: list) -> None:
        self.tokens += [t for i in items for t in i.token_id_list]


def handed_off() -> tuple[TokenRouter, RequestStream, Tokens]:
    """A router with one request routed to prefill-0, its tokens recorded."""
    router = TokenRouter()
    a = router.open(["a-0"])
    router.assign(a, "a-0", "prefill-0")
    rec = Tokens()
    a.inbox.attach(rec)
    return router, a, rec


async def test_a_decode_workers_tokens_wait_for_the_prefill_workers_first_token():
    """Disaggregated: the prefill worker streams the first token and the decode worker the rest, on
    two NATS connections, so the second token can come first (seen on the 2-core VM as a streamed
    choice whose text began with its second token). It waits for the first, then follows it."""
    router, a, rec = handed_off()
    router.on_batch(TokenBatch.of("decode-0", [delta("a-0", [21], done=2)]))
    router.on_batch(TokenBatch.of("decode-0", [delta("a-0", [22], done=3)]))
    await asyncio.sleep(0)
    assert rec.tokens == []
    router.on_batch(TokenBatch.of("prefill-0", [delta("a-0", [20], done=1)]))
    await asyncio.sleep(0)
    assert rec.tokens == [20, 21, 22] and a.workers["a-0"] == "decode-0"
    router.on_batch(TokenBatch.of("decode-0", [delta("a-0", [23], done=4)]))
    await asyncio.sleep(0)
    assert rec.tokens == [20, 21, 22, 23]


async def test_held_tokens_go_out_when_the_first_token_never_comes(monkeypatch):
    """A prefill worker that died with the first token unsent must not hang the stream."""
    monkeypatch.setattr("services.gateway.token_router.HOLD_S", 0.05)
    router, a, rec = handed_off()
    router.on_batch(TokenBatch.of("decode-0", [delta("a-0", [21], done=2)]))
    await asyncio.sleep(0.1)
    assert rec.tokens == [21]
    router.on_batch(TokenBatch.of("decode-0", [delta("a-0", [22], done=3, finish="length")]))
    await asyncio.sleep(0)
    assert rec.tokens == [21, 22]


async def test_router_release_and_close():
    router = TokenRouter()
    a = router.open(["a-0", "a-1"])
    rec = Recorder()
    a.inbox.attach(rec)
    router.release("a-0")
    router.on_batch(batch(delta("a-0", [1]), delta("a-1", [2])))
    await asyncio.sleep(0)
    assert rec.calls == [["a-1"]] and router.unknown_deltas == 1 and router.in_flight == 1
    router.close(a)
    router.on_batch(batch(delta("a-1", [3])))
    await asyncio.sleep(0)
    assert rec.calls == [["a-1"]] and router.unknown_deltas == 2 and router.in_flight == 0


async def test_router_fail_hands_over_at_once_after_the_pending_deltas():
    router = TokenRouter()
    a = router.open(["a-0"])
    rec = Recorder()
    a.inbox.attach(rec)
    router.on_batch(batch(delta("a-0", [1])))
    router.fail(a, StreamFailed(503, "first"))
    router.fail(a, StreamFailed(504, "second"))  # only the first failure is reported
    assert rec.calls == [["a-0", "first"]] and a.failed
    await asyncio.sleep(0)
    assert rec.calls == [["a-0", "first"]]


# ---------------------------------------------------------------------------------------------
# Pump (the non-streamed mode; the streamed one is in test_gateway_sse.py)

@pytest.fixture(scope="module")
def model_dir(tmp_path_factory) -> Path:
    return mm.write_model(tmp_path_factory.mktemp("inbox") / "tiny", preset="tiny")


@pytest.fixture(scope="module")
def tok(model_dir) -> Tokenizer:
    return Tokenizer.from_dir(model_dir)


@pytest.fixture
async def gw(model_dir, tok):
    mc = ModelConfig.from_dir(model_dir)
    gw = Gateway(GatewayConfig(model_name="tiny", model_dir=str(model_dir)), tok, max_model_len=mc.max_model_len,
                 vocab_size=mc.vocab_size)
    yield gw
    await gw.close()


def generation(gw: Gateway, rid: str, n: int = 1, max_tokens: int = 16) -> Generation:
    spec = parse_completion({"model": "tiny", "prompt": PROMPT, "n": n, "max_tokens": max_tokens}, gw.limits)
    gen = Generation(gw, rid, spec, PROMPT, None, 0.0)
    gen.stream = gw.router.open(gen.request_ids)  # as Generation.start does before routing
    return gen


async def test_pump_collects_n_choices_from_shared_batches(gw, tok):
    ids = tok.encode("Hello world, this is a test.", add_special_tokens=False)
    gen = generation(gw, "cmpl-x", n=2)
    fmt = CompletionFormat(gw.texts, False)
    pump = Pump(gw, gen, fmt)
    run = asyncio.ensure_future(pump.run(gen.stream.inbox))
    await asyncio.sleep(0)
    for i, t in enumerate(ids):
        last = i + 1 == len(ids)
        gw.router.on_batch(batch(delta("cmpl-x-1", [t], "length" if last else None, done=i + 1),
                                 delta("cmpl-x-0", [t], "stop" if last else None, done=i + 1)))
    await asyncio.wait_for(run, 1)
    assert pump.failure is None and gen.unfinished == 0
    want = tok.decode(ids)
    assert [fmt.final_choice(c) for c in gen.choices] == [
        {"index": 0, "text": want, "logprobs": None, "finish_reason": "stop"},
        {"index": 1, "text": want, "logprobs": None, "finish_reason": "length"}]
    assert [c.num_tokens for c in gen.choices] == [len(ids), len(ids)]
    assert gw.metrics.time_to_first_token.count == 1
    assert gw.metrics.inter_token_latency.count == 2 * (len(ids) - 1)
    assert len(gen.stream.inbox) == 0


async def test_pump_ends_on_a_stream_failure(gw):
    gen = generation(gw, "cmpl-f")
    pump = Pump(gw, gen, CompletionFormat(gw.texts, False))
    run = asyncio.ensure_future(pump.run(gen.stream.inbox))
    await asyncio.sleep(0)
    gw.router.on_batch(batch(delta("cmpl-f-0", [40], done=1)))
    failure = StreamFailed(503, "worker w-1 stopped responding")
    gw.router.fail(gen.stream, failure)
    await asyncio.wait_for(run, 1)
    assert pump.failure is failure and gen.unfinished == 1


async def test_pump_turns_a_worker_error_into_a_500(gw):
    gen = generation(gw, "cmpl-e")
    pump = Pump(gw, gen, CompletionFormat(gw.texts, False))
    gen.stream.inbox.put(delta("cmpl-e-0", [40], "error", error="CUDA out of memory", done=1))  # before run
    await asyncio.wait_for(pump.run(gen.stream.inbox), 1)
    assert pump.failure == StreamFailed(500, "CUDA out of memory", "server_error")


class BrokenFormat(CompletionFormat):
    def collect(self, choice, update):
        raise ValueError("a bug in one request")


async def test_a_failing_pump_does_not_stop_the_other_requests_of_a_batch(gw, tok):
    ids = tok.encode("Hello world", add_special_tokens=False)
    bad, good = generation(gw, "cmpl-bad"), generation(gw, "cmpl-good")
    bad_pump = Pump(gw, bad, BrokenFormat(gw.texts, False))
    good_fmt = CompletionFormat(gw.texts, False)
    good_pump = Pump(gw, good, good_fmt)
    runs = [asyncio.ensure_future(p.run(g.stream.inbox)) for p, g in ((bad_pump, bad), (good_pump, good))]
    await asyncio.sleep(0)
    for i, t in enumerate(ids):
        finish = "length" if i + 1 == len(ids) else None
        gw.router.on_batch(batch(delta("cmpl-bad-0", [t], finish, done=i + 1),
                                 delta("cmpl-good-0", [t], finish, done=i + 1)))
    with pytest.raises(ValueError, match="a bug in one request"):
        await asyncio.wait_for(runs[0], 1)
    await asyncio.wait_for(runs[1], 1)
    assert good_fmt.final_choice(good.choices[0])["text"] == tok.decode(ids)
