"""Incremental detokenization and stop strings."""

from __future__ import annotations

import itertools
import random
from pathlib import Path

import pytest

from inferno.tools import make_model as mm
from shared.detokenizer import ByteLevelDetokenizer, IncrementalDetokenizer, StopStringMatcher
from shared.tokenizer import Tokenizer


@pytest.fixture(scope="module")
def tok(tmp_path_factory) -> Tokenizer:
    d: Path = mm.write_model(tmp_path_factory.mktemp("detok") / "tiny", preset="tiny")
    return Tokenizer.from_dir(d)


@pytest.fixture(scope="module")
def model_vocab(tok) -> int:
    return (tok.vocab_size + 63) // 64 * 64  # the model's padded vocabulary, as make_model writes it


def _stream(tok, ids, skip=True, tail=(), rng=None, fast=False, as_ints=False):
    """Push ids (one at a time, or in random batches; as_ints: each a bare int, the streaming hot
    path) and return the list of deltas, flush included."""
    d = (ByteLevelDetokenizer(tok, skip_special_tokens=skip) if fast
         else IncrementalDetokenizer(tok, prompt_token_ids_tail=tail, skip_special_tokens=skip))
    deltas = []
    i = 0
    while i < len(ids):
        n = rng.randint(1, 4) if rng else 1
        deltas.append(d.push(ids[i]) if as_ints else d.push(ids[i:i + n]))
        i += 1 if as_ints else n
    deltas.append(d.flush())
    return deltas


TEXTS = [
    "Hello, world! This is a plain ASCII sentence.",
    "émoji 😀👍🏽🎉 and CJK 日本語の文章 中文字符 한국어 mixed with ASCII.",
    "🚀🚀🚀❤️‍🔥👨‍👩‍👧‍👦",
    "Ελληνικά, русский, עברית, العربية, हिन्दी, ไทย",
    "def f(x):\n    return x ** 2  # ünïcödé\n",
    "\u00e9\u0301 combining, \u200b zero width, \ufeff bom",
    "𝔘𝔫𝔦𝔠𝔬𝔡𝔢 𝕞𝕒𝕥𝕙 𐍈 𓀀",
]


@pytest.mark.parametrize("text", TEXTS)
def test_text_round_trips_without_replacement_chars(tok, text):
    ids = tok.encode(text, add_special_tokens=False)
    assert len(ids) > 1
    deltas = _stream(tok, ids)
    assert "".join(deltas) == text
    assert all("\ufffd" not in d for d in deltas)
    # Multi-byte characters really are split across tokens here, so the hold-back was exercised.
    if any(ord(c) > 0x7FF for c in text):
        assert any(len(tok.token_bytes(i).decode("utf-8", errors="ignore")) == 0 for i in ids)


@pytest.mark.parametrize("fast", [False, True], ids=["windowed", "byte_level"])
@pytest.mark.parametrize("text", TEXTS)
def test_each_delta_is_emitted_as_soon_as_complete(tok, text, fast):
    """Whenever the bytes so far end on a character boundary, all of the text is out; otherwise
    only the tokens holding the incomplete character are held back."""
    ids = tok.encode(text, add_special_tokens=False)
    d = ByteLevelDetokenizer(tok) if fast else IncrementalDetokenizer(tok)
    emitted = ""
    data = b""
    for i in ids:
        emitted += d.push(i)
        data += tok.token_bytes(i)
        try:
            assert emitted == data.decode("utf-8")
            assert not d.has_pending
        except UnicodeDecodeError:
            assert data.decode("utf-8", errors="ignore").startswith(emitted)
            assert "\ufffd" not in emitted and d.has_pending
    assert d.flush() == ""


@pytest.mark.parametrize("fast", [False, True], ids=["windowed", "byte_level"])
@pytest.mark.parametrize("skip", [True, False], ids=["skip_special", "keep_special"])
@pytest.mark.parametrize("seed", range(8))
def test_random_token_sequences_match_full_decode(tok, model_vocab, seed, skip, fast):
    rng = random.Random(seed)
    special = sorted(tok.all_special_ids)
    for _ in range(20):
        n = rng.randint(0, 60)
        ids = []
        for _ in range(n):
            r = rng.random()
            if r < 0.05:
                ids.append(rng.choice(special))
            elif r < 0.08:
                ids.append(rng.randrange(tok.vocab_size, model_vocab + 1))  # unknown, padded-vocab id
            elif r < 0.5:
                ids.append(rng.randrange(0, 256))  # single bytes: lots of broken UTF-8
            else:
                ids.append(rng.randrange(0, tok.vocab_size))
        expected = tok.decode(ids, skip_special_tokens=skip)
        assert "".join(_stream(tok, ids, skip=skip, fast=fast)) == expected
        assert "".join(_stream(tok, ids, skip=skip, rng=rng, fast=fast)) == expected
        assert _stream(tok, ids, skip=skip, fast=fast, as_ints=True) == _stream(tok, ids, skip=skip, fast=fast)


def test_prompt_tail_gives_context_but_is_not_emitted(tok):
    prompt = tok.encode("The answer is", add_special_tokens=True)
    out = tok.encode(" forty-two 😀 日本", add_special_tokens=False)
    deltas = _stream(tok, out, tail=prompt)
    assert "".join(deltas) == tok.decode(out) == " forty-two 😀 日本"
    deltas = _stream(tok, out, tail=prompt[-1:], skip=False)
    assert "".join(deltas) == " forty-two 😀 日本"


def test_incomplete_character_at_the_end_is_flushed_as_replacement(tok):
    ids = tok.encode("ok 😀", add_special_tokens=False)
    d = IncrementalDetokenizer(tok)
    text = d.push(ids[:-1])
    assert "\ufffd" not in text and d.has_pending
    rest = d.flush()
    assert rest.endswith("\ufffd") and text + rest == tok.decode(ids[:-1])
    assert not d.has_pending
    # After a flush the detokenizer starts afresh.
    assert d.push(tok.encode("more", add_special_tokens=False)) + d.flush() == "more"


def test_long_stream_trims_its_buffer(tok):
    ids = tok.encode("abc " * 2000, add_special_tokens=False)
    d = IncrementalDetokenizer(tok)
    out = "".join(d.push(i) for i in ids) + d.flush()
    assert out == "abc " * 2000
    assert d.num_output_tokens == len(ids)


# ------------------------------------------------------------------ stop strings


def _run_stop(stops, pieces):
    m = StopStringMatcher(stops)
    out = []
    matched = False
    for piece in pieces:
        text, matched_now = m.feed(piece)
        assert not (matched and text), "text emitted after a match"
        out.append(text)
        matched = matched or matched_now
    if not matched:
        out.append(m.flush())
    return "".join(out), matched


def _reference(stops, text):
    """Check after every character: the first stop string to be complete ends the text."""
    for end in range(len(text) + 1):
        hits = [end - len(s) for s in stops if s and text[:end].endswith(s)]
        if hits:
            return text[:min(hits)], True
    return text, False


def _splits(text, max_cuts=3):
    """Every way of cutting text into at most max_cuts + 1 pieces (empty pieces included)."""
    n = len(text)
    for k in range(max_cuts + 1):
        for cuts in itertools.combinations_with_replacement(range(n + 1), k):
            bounds = (0, *cuts, n)
            yield [text[a:b] for a, b in zip(bounds, bounds[1:])]


@pytest.mark.parametrize("text,stops", [
    ("Hello world. STOP here and more", ["STOP"]),
    ("abc\n\nUser: hi", ["\n\nUser:"]),
    ("aaab", ["aab"]),  # the held prefix must restart correctly
    ("ababac", ["abac"]),
    ("no stop in this one", ["xyz", "stop!"]),
    ("x<|eot|>y", ["<|eot|>", "y"]),  # the first to complete wins
    ("caab", ["caab", "a"]),  # ... even when another starts earlier
    ("xabcd", ["bc", "abc"]),  # on a tie, the longer
    ("stop at start", ["stop"]),
    ("emoji 😀 stop 😀 end", ["😀 end", "p 😀"]),
    ("tail is a prefix: STO", ["STOP"]),
])
def test_stop_string_split_every_way(text, stops):
    expected = _reference(stops, text)
    for pieces in _splits(text, max_cuts=2 if len(text) > 20 else 3):
        assert _run_stop(stops, pieces) == expected, pieces


def test_stop_strings_random_against_reference():
    rng = random.Random(0)
    for _ in range(3000):
        text = "".join(rng.choice("abc") for _ in range(rng.randint(0, 14)))
        stops = ["".join(rng.choice("abc") for _ in range(rng.randint(1, 4))) for _ in range(rng.randint(1, 3))]
        pieces = []
        i = 0
        while i < len(text):
            n = rng.randint(0, 4)
            pieces.append(text[i:i + n])
            i += n
        assert _run_stop(stops, pieces) == _reference(stops, text), (text, stops, pieces)


def test_holds_back_only_what_could_start_a_stop():
    m = StopStringMatcher(["world", "xyz"])
    assert m.feed("hello wor") == ("hello ", False)
    assert m.feed("ld peace") == ("", True)
    assert m.matched and m.matched_stop == "world"
    assert m.feed("more") == ("", True) and m.flush() == ""

    m = StopStringMatcher(["world"])
    assert m.feed("hello wo") == ("hello ", False)
    assert m.feed("rm") == ("worm", False)  # no longer a prefix: released at once
    assert m.feed("w") == ("", False)
    assert m.flush() == "w"


def test_no_stops_passes_text_through():
    m = StopStringMatcher([])
    assert m.feed("anything") == ("anything", False)
    assert m.flush() == ""
    m = StopStringMatcher(["", "", "a"])  # empty and duplicate stops are ignored
    assert m.stops == ("a",)
    with pytest.raises(TypeError):
        StopStringMatcher([1])


def test_detokenizer_and_stop_matcher_together(tok):
    text = "The result is 42.\n\nUser: next question 😀"
    ids = tok.encode(text, add_special_tokens=False)
    d = IncrementalDetokenizer(tok)
    m = StopStringMatcher(["\n\nUser:"])
    out = []
    for i in ids:
        piece, matched = m.feed(d.push(i))
        out.append(piece)
        if matched:
            break
    assert "".join(out) == "The result is 42."
