"""The gateway's byte-level chunk encoders: exactly the bytes json.dumps gives for the same objects."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from services.gateway.chat import ChatFormat
from services.gateway.choice import ChoiceState, ChoiceUpdate
from services.gateway.completions import CompletionFormat
from services.gateway.logprobs import TokenTexts
from services.gateway.streaming import DONE, ChunkFrame, json_finish, json_str
from inferno.tools import make_model as mm
from shared.tokenizer import Tokenizer
from shared.wire import pack_ids

TEXTS = [
    "",
    " hello",
    'say "hi"',
    "back\\slash \\n not a newline",
    "line\nbreak\r\ttab\b\f",
    "".join(chr(c) for c in range(0x20)),  # every control character
    "\x7f del, \u2028 line separator, \u2029 paragraph separator",
    "café naïve — ünïcödé",
    "中文字符和日本語のテキスト",
    "emoji 🙂👍🏽 and a flag 🇫🇷",
    "</script><!-- html -->",
    "\ufffd replacement char",
]
RESPONSE_ID = "cmpl-0123456789abcdef0123456789abcdef"
CREATED = 1_700_000_000
MODEL = 'my "model" ü'


def expected(obj: dict) -> bytes:
    """The reference: an SSE event holding compact, UTF-8 (not ASCII-escaped) JSON."""
    return b"data: " + json.dumps(obj, ensure_ascii=False, separators=(",", ":")).encode() + b"\n\n"


def envelope(obj: str, choices: list[dict]) -> dict:
    return {"id": RESPONSE_ID, "object": obj, "created": CREATED, "model": MODEL, "choices": choices}


@pytest.fixture(scope="module")
def tok(tmp_path_factory) -> Tokenizer:
    d: Path = mm.write_model(tmp_path_factory.mktemp("chunks") / "tiny", preset="tiny")
    return Tokenizer.from_dir(d)


@pytest.fixture
def choices(tok) -> list[ChoiceState]:
    return [ChoiceState(i, f"r-{i}", tok, [], (), False) for i in range(3)]


@pytest.mark.parametrize("text", TEXTS)
def test_json_str_is_json_dumps(text):
    assert json_str(text) == json.dumps(text, ensure_ascii=False).encode()
    assert json.loads(json_str(text)) == text


@pytest.mark.parametrize("reason", [None, "stop", "length", 'odd "reason"'])
def test_json_finish_is_json_dumps(reason):
    assert json_finish(reason) == json.dumps(reason).encode()


@pytest.mark.parametrize("text", TEXTS)
@pytest.mark.parametrize("finish", [None, "stop", "length"])
def test_completion_chunk_bytes(tok, choices, text, finish):
    fmt = CompletionFormat(TokenTexts(tok), False)
    assert fmt.begin(ChunkFrame(RESPONSE_ID, "text_completion", CREATED, MODEL), choices) == b""
    for c in choices:
        got = fmt.chunk(c, ChoiceUpdate(text, finish))
        if not text and finish is None:
            assert got is None  # nothing to send yet
            continue
        assert got == expected(envelope("text_completion", [
            {"index": c.index, "text": text, "logprobs": None, "finish_reason": finish}]))


@pytest.mark.parametrize("text", TEXTS)
@pytest.mark.parametrize("finish", [None, "stop", "length"])
def test_chat_chunk_bytes(tok, choices, text, finish):
    fmt = ChatFormat(TokenTexts(tok), False)
    fmt.begin(ChunkFrame(RESPONSE_ID, "chat.completion.chunk", CREATED, MODEL), choices)
    for c in choices:
        got = fmt.chunk(c, ChoiceUpdate(text, finish))
        if not text and finish is None:
            assert got is None
            continue
        delta = {"content": text} if text else {}  # an empty delta with the finish reason
        assert got == expected(envelope("chat.completion.chunk", [
            {"index": c.index, "delta": delta, "logprobs": None, "finish_reason": finish}]))


def test_chat_opening_chunks(tok, choices):
    fmt = ChatFormat(TokenTexts(tok), False)
    opening = fmt.begin(ChunkFrame(RESPONSE_ID, "chat.completion.chunk", CREATED, MODEL), choices)
    assert opening == b"".join(expected(envelope("chat.completion.chunk", [
        {"index": i, "delta": {"role": "assistant", "content": ""}, "logprobs": None, "finish_reason": None}]))
        for i in range(3))


def test_logprob_chunks(tok, choices):
    texts = TokenTexts(tok)
    ids = tok.encode(" hello world", add_special_tokens=False)[:2]
    tops = [pack_ids([ids[0], ids[1]]), pack_ids([ids[1]])]
    update = ChoiceUpdate(" hi", None, ids, [-0.25, -1.5], tops, [[-0.25, -2.0], [-1.5]])
    c = choices[1]

    chat = ChatFormat(texts, True)
    chat.begin(ChunkFrame(RESPONSE_ID, "chat.completion.chunk", CREATED, MODEL), choices)
    entries = [{"token": texts.text(t), "logprob": lp, "bytes": texts.bytes(t),
                "top_logprobs": [{"token": texts.text(a), "logprob": b, "bytes": texts.bytes(a)}
                                 for a, b in zip(alts, alps)]}
               for t, lp, alts, alps in zip(ids, [-0.25, -1.5], [[ids[0], ids[1]], [ids[1]]], [[-0.25, -2.0], [-1.5]])]
    assert chat.chunk(c, update) == expected(envelope("chat.completion.chunk", [
        {"index": 1, "delta": {"content": " hi"}, "logprobs": {"content": entries}, "finish_reason": None}]))

    cmpl = CompletionFormat(texts, True)
    cmpl.begin(ChunkFrame(RESPONSE_ID, "text_completion", CREATED, MODEL), choices)
    t0, t1 = texts.text(ids[0]), texts.text(ids[1])
    top0 = {t0: -0.25}
    top0.setdefault(t1, -2.0)
    lp = {"tokens": [t0, t1], "token_logprobs": [-0.25, -1.5], "top_logprobs": [top0, {t1: -1.5}],
          "text_offset": [0, len(t0)]}
    assert cmpl.chunk(c, update) == expected(envelope("text_completion", [
        {"index": 1, "text": " hi", "logprobs": lp, "finish_reason": None}]))


def test_usage_chunk_and_done():
    frame = ChunkFrame(RESPONSE_ID, "text_completion", CREATED, MODEL)
    usage = {"prompt_tokens": 3, "completion_tokens": 5, "total_tokens": 8,
             "prompt_tokens_details": {"cached_tokens": 1}}
    assert frame.usage_chunk(usage) == expected({**envelope("text_completion", []), "usage": usage})
    assert DONE == b"data: [DONE]\n\n"
