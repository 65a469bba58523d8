"""SseWriter and the streamed Pump on a real aiohttp server, read back as raw HTTP bytes (so that
each HTTP chunk, i.e. each socket write of the gateway, is visible)."""

from __future__ import annotations

import asyncio
import json
from pathlib import Path

import pytest
from aiohttp import web

from services.gateway.app import bound_port
from services.gateway.chat import ChatFormat
from services.gateway.gateway import Gateway
from services.gateway.generation import Generation
from services.gateway.pump import Pump
from services.gateway.schemas import parse_chat
from services.gateway.sse import SseWriter
from services.gateway.streaming import DONE, ChunkFrame
from services.gateway.token_router import StreamFailed
from inferno.tools import make_model as mm
from services.worker.engine.model_config import ModelConfig
from shared.config import GatewayConfig
from shared.messages import TokenBatch, TokenDelta
from shared.tokenizer import Tokenizer
from shared.wire import pack_ids


class RawResponse:
    """A raw HTTP/1.x client on one connection: the status line, the headers, then the body."""

    def __init__(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter):
        self.reader = reader
        self.writer = writer
        self.headers: dict[str, str] = {}

    @classmethod
    async def get(cls, port: int, path: str, version: str = "1.1") -> RawResponse:
        reader, writer = await asyncio.open_connection("127.0.0.1", port)
        writer.write(f"GET {path} HTTP/{version}\r\nHost: test\r\n\r\n".encode())
        r = cls(reader, writer)
        head = await asyncio.wait_for(reader.readuntil(b"\r\n\r\n"), 5)
        lines = head.decode().split("\r\n")
        assert lines[0].startswith(f"HTTP/{version} 200"), lines[0]
        r.headers = {k.lower(): v.strip() for k, _, v in (line.partition(":") for line in lines[1:] if line)}
        return r

    async def chunk(self) -> bytes:
        """The next HTTP chunk's payload (b"" for the terminating one)."""
        size = int((await asyncio.wait_for(self.reader.readuntil(b"\r\n"), 5))[:-2], 16)
        data = await asyncio.wait_for(self.reader.readexactly(size + 2), 5)
        assert data[-2:] == b"\r\n"
        return data[:-2]

    def close(self) -> None:
        self.writer.close()


async def serve(handler) -> tuple[web.AppRunner, int]:
    app = web.Application()
    app.router.add_get("/s", handler)
    # No handler cancellation: a gone client must be noticed by the writer itself.
    runner = web.AppRunner(app, handler_cancellation=False, access_log=None, shutdown_timeout=1)
    await runner.setup()
    await web.TCPSite(runner, "127.0.0.1", 0).start()
    return runner, bound_port(runner)


async def test_each_send_is_one_http_chunk_and_empty_sends_write_nothing():
    async def handler(request):
        w = SseWriter(request)
        await w.open()
        assert w.chunked
        assert w.send(b"data: 1\n\n")
        assert w.send(b"")  # would be the terminating chunk: nothing is written
        assert w.send(b"data: 2\n\ndata: 3\n\n")
        await w.finish(b"data: 4\n\n")
        return w.response

    runner, port = await serve(handler)
    try:
        r = await RawResponse.get(port, "/s")
        assert r.headers["content-type"] == "text/event-stream"
        assert r.headers["transfer-encoding"] == "chunked"
        assert [await r.chunk() for _ in range(4)] == [b"data: 1\n\n", b"data: 2\n\ndata: 3\n\n", b"data: 4\n\n" + DONE,
                                                       b""]
        r.close()
    finally:
        await runner.cleanup()


async def test_fail_ends_the_stream_with_an_error_event_then_done():
    async def handler(request):
        w = SseWriter(request)
        await w.open()
        await w.fail(b"data: 1\n\n", StreamFailed(503, "worker w-1 stopped responding"))
        return w.response

    runner, port = await serve(handler)
    try:
        r = await RawResponse.get(port, "/s")
        assert await r.chunk() == (b'data: 1\n\ndata: {"error":{"message":"worker w-1 stopped responding",'
                                   b'"type":"service_unavailable","param":null,"code":503}}\n\n' + DONE)
        assert await r.chunk() == b""
        r.close()
    finally:
        await runner.cleanup()


async def test_http10_gets_a_bare_body_ended_by_close():
    async def handler(request):
        w = SseWriter(request)
        await w.open()
        assert not w.chunked
        w.send(b"data: 1\n\n")
        await w.finish()
        return w.response

    runner, port = await serve(handler)
    try:
        r = await RawResponse.get(port, "/s", version="1.0")
        assert "transfer-encoding" not in r.headers
        assert await asyncio.wait_for(r.reader.read(), 5) == b"data: 1\n\n" + DONE  # read() ends at close
        r.close()
    finally:
        await runner.cleanup()


async def test_send_reports_a_client_that_went_away():
    gone = asyncio.Event()
    result: list[bool] = []

    async def handler(request):
        w = SseWriter(request)
        await w.open()
        await gone.wait()
        for _ in range(200):  # the first writes after a close may still be accepted by the kernel
            if not w.send(b"data: x\n\n"):
                break
            await asyncio.sleep(0.01)
        result.append(w.closed)
        await w.finish()  # no error once closed
        return w.response

    runner, port = await serve(handler)
    try:
        r = await RawResponse.get(port, "/s")
        r.close()
        await r.writer.wait_closed()
        gone.set()
        for _ in range(500):
            if result:
                break
            await asyncio.sleep(0.01)
        assert result == [True]
    finally:
        await runner.cleanup()


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory) -> Path:
    return mm.write_model(tmp_path_factory.mktemp("sse") / "tiny", preset="tiny")


def pump_handler(gw, gen, fmt):
    """What serving._stream does, without the routing: open the stream, pump it, end it."""
    async def handler(request):
        w = SseWriter(request)
        await w.open()
        assert w.send(fmt.begin(ChunkFrame(gen.response_id, "chat.completion.chunk", 123, "tiny"), gen.choices))
        pump = Pump(gw, gen, fmt, w)
        await pump.run(gen.stream.inbox)
        await w.finish(pump.tail)
        return w.response
    return handler


async def test_pump_writes_the_choices_of_one_burst_in_one_chunk(model_dir):
    tok = Tokenizer.from_dir(model_dir)
    mc = ModelConfig.from_dir(model_dir)
    gw = Gateway(GatewayConfig(model_name="tiny", model_dir=str(model_dir)), tok, max_model_len=mc.max_model_len,
                 vocab_size=mc.vocab_size)
    spec = parse_chat({"model": "tiny", "messages": [{"role": "user", "content": "hi"}], "n": 2, "max_tokens": 8,
                       "stream": True}, gw.limits)
    gen = Generation(gw, "chatcmpl-x", spec, [5, 6, 7], None, 0.0)
    gen.stream = gw.router.open(gen.request_ids)
    fmt = ChatFormat(gw.texts, False)

    handler = pump_handler(gw, gen, fmt)

    def emit(i: int, text: str, finish: str | None = None) -> None:
        ids = tok.encode(text, add_special_tokens=False)
        assert tok.decode(ids) == text
        gw.router.on_batch(TokenBatch.of("w-1", [
            TokenDelta(request_id=f"chatcmpl-x-{c}", token_ids=pack_ids(ids), finish_reason=finish, prompt_tokens=3,
                       completion_tokens=i) for c in (1, 0)]))

    def events(chunk: bytes) -> list[dict]:
        assert chunk.startswith(b"data: ") and chunk.endswith(b"\n\n")
        return [json.loads(e) for e in chunk[6:-2].split(b"\n\ndata: ")]

    runner, port = await serve(handler)
    try:
        r = await RawResponse.get(port, "/s")
        opening = events(await r.chunk())
        assert [e["choices"][0]["delta"] for e in opening] == [{"role": "assistant", "content": ""}] * 2
        emit(1, " Hello")
        step = events(await r.chunk())  # both choices' events in one write, in the batch's order
        assert [(e["choices"][0]["index"], e["choices"][0]["delta"], e["choices"][0]["finish_reason"])
                for e in step] == [(1, {"content": " Hello"}, None), (0, {"content": " Hello"}, None)]
        assert all(e["id"] == "chatcmpl-x" and e["object"] == "chat.completion.chunk" for e in step)
        emit(2, " big")
        emit(3, " world", "length")  # the same burst (the gateway fell behind): one write for both steps
        last = await r.chunk()
        assert last.endswith(b"\n\n" + DONE)
        assert [(e["choices"][0]["index"], e["choices"][0]["delta"], e["choices"][0]["finish_reason"])
                for e in events(last[:-len(DONE)])] == [(1, {"content": " big"}, None), (0, {"content": " big"}, None),
                                                         (1, {"content": " world"}, "length"),
                                                         (0, {"content": " world"}, "length")]
        assert await r.chunk() == b""
        r.close()
    finally:
        await runner.cleanup()
        await gw.close()


async def test_stream_interval_writes_plain_tokens_in_groups_and_the_rest_at_the_end(model_dir):
    """--stream-interval 3: the first token goes out at once, then one event per three tokens (one
    write), and tokens still held when the request ends go out before its last event."""
    tok = Tokenizer.from_dir(model_dir)
    mc = ModelConfig.from_dir(model_dir)
    gw = Gateway(GatewayConfig(model_name="tiny", model_dir=str(model_dir), stream_interval=3), tok,
                 max_model_len=mc.max_model_len, vocab_size=mc.vocab_size)
    spec = parse_chat({"model": "tiny", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 8,
                       "stream": True}, gw.limits)
    gen = Generation(gw, "chatcmpl-y", spec, [5, 6, 7], None, 0.0)
    gen.stream = gw.router.open(gen.request_ids)
    fmt = ChatFormat(gw.texts, False)
    (rid,) = gen.request_ids

    handler = pump_handler(gw, gen, fmt)

    ids = [t for t in range(100, 400) if tok.decode([t]).isascii() and tok.decode([t]).strip()][:6]
    words = [tok.decode([t]) for t in ids]
    assert len(ids) == 6 and tok.decode(ids) == "".join(words)

    def emit(i: int, finish: str | None = None) -> None:
        gw.router.on_batch(TokenBatch.of("w-1", [TokenDelta(
            request_id=rid, token_ids=pack_ids([ids[i - 1]]), finish_reason=finish, prompt_tokens=3,
            completion_tokens=i)]))

    def texts(chunk: bytes) -> list[str]:
        return [json.loads(e)["choices"][0]["delta"].get("content") for e in chunk[6:-2].split(b"\n\ndata: ")]

    runner, port = await serve(handler)
    try:
        r = await RawResponse.get(port, "/s")
        await r.chunk()  # the opening event
        emit(1)
        assert texts(await r.chunk()) == [words[0]]  # the first token at once
        for i in (2, 3, 4):
            emit(i)
            await asyncio.sleep(0.02)  # each its own hand-over
        assert texts(await r.chunk()) == [words[1] + words[2]]  # tokens 2-3, at the stream's third token
        emit(5)
        await asyncio.sleep(0.02)
        emit(6, "length")  # tokens 4-5 were held: they go out first, then the last event
        last = await r.chunk()
        assert last.endswith(b"\n\n" + DONE)
        assert texts(last[:-len(DONE)]) == [words[3] + words[4], words[5]]
        r.close()
    finally:
        await runner.cleanup()
        await gw.close()
