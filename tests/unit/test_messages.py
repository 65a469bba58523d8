"""Wire messages: exact round trips, strict rejection of bad input, counting, no pickle."""

from __future__ import annotations

import ast
import dataclasses
from dataclasses import dataclass
from pathlib import Path

import msgpack
import numpy as np
import pytest

from shared.errors import BadRequest, MessageError, Overloaded, ServiceError, ServiceUnavailable
from shared.messages import (AbortRequest, Finish, GatewayHeartbeat, GenerateRequest, KvEvents, KvSnapshot, RouteReply,
                             TokenBatch, TokenDelta, TokenLogprobs, WireSamplingParams, WorkerHeartbeat)
from shared.sampling_params import SamplingParams
from shared.wire import (DEFAULT_MAX_BYTES, DecodeCounter, Message, decode, encode, message_types, pack_ids,
                         register, safe_decode, unpack_ids)

ROOT = Path(__file__).resolve().parents[2]


def sampling(**overrides) -> WireSamplingParams:
    params = SamplingParams(temperature=0.7, top_k=40, top_p=0.9, min_p=0.05, repetition_penalty=1.1,
                            presence_penalty=0.5, frequency_penalty=-0.5, logit_bias={7: -100.0, 42: 2.5},
                            seed=1234, max_tokens=256, min_tokens=2, stop_token_ids=[2, 128009],
                            ignore_eos=True, logprobs=5)
    return dataclasses.replace(WireSamplingParams.from_params(params), **overrides)


def generate_request(**overrides) -> GenerateRequest:
    fields = dict(request_id="chatcmpl-abc123", model="llama-3.1-8b", prompt_ids=pack_ids([128000, 9906, 11, 1917]),
                  sampling=sampling(), reply_to="inferno.gateway.gw-1.tokens", session_id="sess-9",
                  cache_salt="tenant-a", arrival_time=1731974400.25, gateway_id="gw-1", worker_id="worker-3")
    fields.update(overrides)
    return GenerateRequest(**fields)


def token_delta(**overrides) -> TokenDelta:
    fields = dict(request_id="chatcmpl-abc123", token_ids=pack_ids([791, 128009]), logprobs=[-0.25, -1.5],
                  top_ids=[pack_ids([791, 578]), pack_ids([128009, 13])], top_lps=[[-0.25, -2.0], [-1.5, -1.75]],
                  finish_reason="stop", error=None, prompt_tokens=4, cached_tokens=0, completion_tokens=2,
                  stop_token_id=128009)
    fields.update(overrides)
    return TokenDelta(**fields)


HASH_A, HASH_B = bytes(range(16)), bytes(range(16, 32))

SAMPLES: dict[type, list[Message]] = {
    WireSamplingParams: [sampling(), sampling(seed=None, logprobs=None, logit_bias={}, stop_token_ids=[])],
    GenerateRequest: [generate_request(),
                      generate_request(session_id=None, cache_salt="", arrival_time=0.0, gateway_id="", worker_id="")],
    RouteReply: [RouteReply.accepted("worker-3"),
                 RouteReply.rejected(429, "rate_limit_exceeded", "all workers are full", retry_after=1.5)],
    AbortRequest: [AbortRequest(request_ids=["a", "b"], reason="client disconnected"), AbortRequest(request_ids=[])],
    TokenDelta: [token_delta(), TokenDelta(request_id="r", token_ids=pack_ids([5]), completion_tokens=1),
                 TokenDelta(request_id="r", finish_reason="error", error="CUDA out of memory")],
    Finish: [Finish(index=0, reason="stop", stop_token_id=2), Finish(index=3, reason="error", error="boom")],
    TokenLogprobs: [TokenLogprobs(index=1, logprobs=[-0.5]),
                    TokenLogprobs(index=0, logprobs=[-0.5], top_ids=[pack_ids([3, 4])], top_lps=[[-0.5, -1.0]])],
    TokenBatch: [TokenBatch.of("worker-3", [token_delta(), TokenDelta(request_id="r2")]),
                 TokenBatch.of("worker-3", [])],
    GatewayHeartbeat: [GatewayHeartbeat(gateway_id="gw-1", inbox="inferno.gateway.gw-1.tokens", in_flight=32)],
    WorkerHeartbeat: [WorkerHeartbeat(worker_id="worker-3", role="decode", model="llama-3.1-8b", ready=True,
                                      draining=False, generate_subject="inferno.worker.worker-3.generate",
                                      abort_subject="inferno.worker.worker-3.abort", timestamp=1731974400.5, seq=17,
                                      num_running=12, num_waiting=3, queued_prefill_tokens=900,
                                      active_decode_tokens=4096, kv_usage=0.375, num_free_blocks=2500,
                                      num_total_blocks=4000, block_size=16, prefix_cache_hits=512,
                                      prefix_cache_queries=2048, max_model_len=8192),
                      WorkerHeartbeat(worker_id="w", role="mixed", model="m", ready=False, draining=True,
                                      generate_subject="g", abort_subject="a", timestamp=0.0, seq=0)],
    KvEvents: [KvEvents(worker_id="worker-3", seq=5, stored=[HASH_A, HASH_B], removed=[HASH_B], cleared=True),
               KvEvents(worker_id="worker-3", seq=6)],
    KvSnapshot: [KvSnapshot(worker_id="worker-3", seq=6, part=0, parts=2, blocks=HASH_A + HASH_B),
                 KvSnapshot(worker_id="worker-3", seq=6, part=1, parts=2, blocks=b"")],
}


def raw(msg: Message) -> dict:
    """The message's wire map, for tests that tamper with it."""
    return msgpack.unpackb(encode(msg), raw=False, strict_map_key=False)


def pack(d) -> bytes:
    return msgpack.packb(d, use_bin_type=True)


def reject(cls, d_or_bytes, reason: str, match: str | None = None) -> MessageError:
    data = d_or_bytes if isinstance(d_or_bytes, bytes) else pack(d_or_bytes)
    with pytest.raises(MessageError, match=match) as info:
        decode(cls, data)
    assert info.value.reason == reason
    assert info.value.type_tag == cls.TYPE
    return info.value


# --- round trips -------------------------------------------------------------------------------


def test_every_message_class_has_samples():
    assert set(message_types()) >= set(SAMPLES)
    assert set(SAMPLES) == {c for c in message_types() if c.__module__ == "shared.messages"}


@pytest.mark.parametrize("msg", [m for ms in SAMPLES.values() for m in ms], ids=lambda m: type(m).__name__)
def test_round_trip_is_exact(msg):
    back = decode(type(msg), encode(msg))
    assert back == msg
    assert type(back) is type(msg)
    for f in dataclasses.fields(msg):  # same values and same types, field by field
        assert type(getattr(back, f.name)) is type(getattr(msg, f.name)), f.name


def test_wire_map_layout():
    d = raw(RouteReply.accepted("worker-3"))
    assert d == {"t": "route_reply", "v": 1, "ok": True, "worker_id": "worker-3"}  # defaults left out
    d = raw(TokenDelta(request_id="r", token_ids=pack_ids([1, 256]), completion_tokens=2))
    assert d == {"t": "token_delta", "v": 1, "request_id": "r", "token_ids": b"\x01\x00\x00\x00\x00\x01\x00\x00",
                 "completion_tokens": 2}
    nested = raw(generate_request())["sampling"]
    assert "t" not in nested and nested["logit_bias"] == {7: -100.0, 42: 2.5}


def test_sampling_params_conversion_is_lossless():
    assert {f.name for f in dataclasses.fields(WireSamplingParams)} == \
        {f.name for f in dataclasses.fields(SamplingParams)}
    params = sampling().to_params()
    assert params == SamplingParams(temperature=0.7, top_k=40, top_p=0.9, min_p=0.05, repetition_penalty=1.1,
                                    presence_penalty=0.5, frequency_penalty=-0.5, logit_bias={7: -100.0, 42: 2.5},
                                    seed=1234, max_tokens=256, min_tokens=2, stop_token_ids=[2, 128009],
                                    ignore_eos=True, logprobs=5)
    params.validate(vocab_size=128256)
    params.stop_token_ids.append(1)  # a fresh copy, not the message's list
    assert sampling().stop_token_ids == [2, 128009]
    decoded = decode(GenerateRequest, encode(generate_request())).sampling.to_params()
    assert decoded == sampling().to_params()


def test_generate_request_helpers():
    req = generate_request(worker_id="")
    assert req.prompt_token_ids == [128000, 9906, 11, 1917]
    assert req.num_prompt_tokens == 4
    fwd = req.forwarded_to("worker-7")
    assert fwd.worker_id == "worker-7" and req.worker_id == "" and fwd.request_id == req.request_id


def test_token_delta_helpers():
    d = token_delta()
    assert d.token_id_list == [791, 128009] and d.num_tokens == 2 and d.finished
    assert not TokenDelta(request_id="r").finished


def test_route_reply_errors():
    RouteReply.accepted("w").raise_for_error()
    cases = [(429, Overloaded), (503, ServiceUnavailable), (400, BadRequest), (500, ServiceError)]
    for status, cls in cases:
        with pytest.raises(cls) as info:
            RouteReply.rejected(status, "some_type", "nope", retry_after=2.0).raise_for_error()
        assert info.value.status == status
        assert info.value.error_type == "some_type"
        assert info.value.retry_after == 2.0
        assert str(info.value) == "nope"


# --- packed ids --------------------------------------------------------------------------------


def test_pack_ids_is_little_endian_int32():
    assert pack_ids([1, 256, -1]) == b"\x01\x00\x00\x00\x00\x01\x00\x00\xff\xff\xff\xff"
    assert pack_ids([]) == b""
    ids = [0, 1, 128255, 2**31 - 1]
    assert unpack_ids(pack_ids(ids)) == ids
    assert pack_ids(np.array(ids, dtype=np.int64)) == pack_ids(ids)
    assert pack_ids(np.array(ids, dtype=np.int32)) == pack_ids(ids)
    assert np.frombuffer(pack_ids(ids), dtype="<i4").tolist() == ids


def test_unpack_ids_rejects_ragged_bytes():
    with pytest.raises(MessageError):
        unpack_ids(b"\x01\x00\x00")


# --- strict decoding ---------------------------------------------------------------------------


def test_missing_required_field():
    d = raw(generate_request())
    del d["request_id"]
    err = reject(GenerateRequest, d, "field", "GenerateRequest.request_id: missing required field")
    assert "request_id" in str(err)
    d = raw(generate_request())
    del d["sampling"]["temperature"]
    reject(GenerateRequest, d, "field", r"GenerateRequest\.sampling\.temperature: missing")


def test_absent_defaulted_field_takes_its_default():
    d = raw(generate_request())
    del d["session_id"], d["worker_id"]
    req = decode(GenerateRequest, pack(d))
    assert req.session_id is None and req.worker_id == ""


def test_wrong_field_types():
    for field, value in [("request_id", 5), ("request_id", None), ("prompt_ids", [1, 2]), ("prompt_ids", "abcd"),
                         ("arrival_time", "now"), ("session_id", 3), ("sampling", [1, 2])]:
        d = raw(generate_request())
        d[field] = value
        reject(GenerateRequest, d, "field", f"GenerateRequest.{field}: expected")


def test_bool_is_not_an_int_and_int_is_a_float():
    d = raw(generate_request())
    d["sampling"]["top_k"] = True
    reject(GenerateRequest, d, "field", r"sampling\.top_k: expected int, got bool")
    d = raw(generate_request())
    d["sampling"]["ignore_eos"] = 1
    reject(GenerateRequest, d, "field", r"sampling\.ignore_eos: expected bool, got int")
    d = raw(generate_request())
    d["sampling"]["temperature"] = 1
    d["arrival_time"] = 17
    req = decode(GenerateRequest, pack(d))
    assert req.sampling.temperature == 1.0 and type(req.sampling.temperature) is float
    assert type(req.arrival_time) is float


def test_nested_list_element_path():
    d = raw(SAMPLES[TokenBatch][0])
    d["request_ids"][1] = 42
    reject(TokenBatch, d, "field", r"TokenBatch\.request_ids\[1\]: expected str, got int")
    d = raw(SAMPLES[TokenBatch][0])
    d["logprobs"][0]["logprobs"][1] = "x"
    reject(TokenBatch, d, "field", r"logprobs\[0\]\.logprobs\[1\]: expected float")
    d = raw(SAMPLES[TokenBatch][0])
    d["finishes"] = {"a": 1}
    reject(TokenBatch, d, "field", r"TokenBatch\.finishes: expected list")


def test_token_batch_columns_must_agree():
    d = raw(SAMPLES[TokenBatch][0])
    d["token_counts"] = pack_ids([5, 0])  # more tokens than token_ids holds
    reject(TokenBatch, d, "field", "sum\\(token_counts\\)")
    d = raw(SAMPLES[TokenBatch][0])
    d["cached_tokens"] = pack_ids([1])
    reject(TokenBatch, d, "field", "cached_tokens needs one entry per request")
    d = raw(SAMPLES[TokenBatch][0])
    d["finishes"] = [{"t": "finish", "v": 1, "index": 7, "reason": "stop"}]
    reject(TokenBatch, d, "field", "outside the batch")


def test_token_batch_items_give_back_each_delta():
    first = token_delta()
    batch = decode(TokenBatch, encode(TokenBatch.of("w", [first, TokenDelta(request_id="r2")])))
    a, b = batch.items
    for name in ("request_id", "token_ids", "logprobs", "top_ids", "top_lps", "finish_reason", "error",
                 "prompt_tokens", "cached_tokens", "completion_tokens", "stop_token_id"):
        assert getattr(a, name) == getattr(first, name), name
    assert b.request_id == "r2" and b.token_ids == b"" and b.finish_reason is None


def test_logit_bias_keys_must_be_ints():
    d = raw(generate_request())
    d["sampling"]["logit_bias"] = {"7": 1.0}
    reject(GenerateRequest, d, "field", r"sampling\.logit_bias\['7'\]: expected int")
    d["sampling"]["logit_bias"] = {7: "big"}
    reject(GenerateRequest, d, "field", r"logit_bias\[7\]: expected float")


def test_byte_length_rules():
    d = raw(generate_request())
    d["prompt_ids"] = b"\x01\x00\x00"
    reject(GenerateRequest, d, "field", "prompt_ids: length 3 is not a multiple of 4")
    d = raw(SAMPLES[KvEvents][0])
    d["stored"][1] = b"short"
    reject(KvEvents, d, "field", r"KvEvents\.stored\[1\]: expected 16 bytes, got 5")


def test_invariants_across_fields():
    bad = [
        (GenerateRequest, {"prompt_ids": b""}, "at least one token"),
        (GenerateRequest, {"request_id": ""}, "request_id"),
        (TokenDelta, {"logprobs": [-0.1]}, "one entry per token"),
        (TokenDelta, {"top_lps": None}, "come together"),
        (TokenDelta, {"top_lps": [[-0.25], [-1.5, -1.75]]}, "equal lengths"),
        (TokenDelta, {"finish_reason": "done"}, "finish_reason"),
        (TokenDelta, {"completion_tokens": -1}, "negative"),
        (WorkerHeartbeat, {"role": "boss"}, "role"),
        (WorkerHeartbeat, {"kv_usage": 1.5}, "kv_usage"),
        (RouteReply, {"ok": True, "error_status": 503}, "ok reply"),
        (RouteReply, {"ok": False, "error_status": 0}, "HTTP error status"),
    ]
    for cls, changes, match in bad:
        d = raw(SAMPLES[cls][0])
        d.update(changes)
        reject(cls, d, "field", match)


def test_unknown_fields_are_ignored():
    d = raw(generate_request())
    d["priority"] = 3
    d["sampling"]["mirostat"] = {"tau": 5.0}
    assert decode(GenerateRequest, pack(d)) == generate_request()


def test_wrong_tag():
    reject(GenerateRequest, encode(RouteReply.accepted("w")), "type", "expected type tag 'generate_request'")
    d = raw(generate_request())
    del d["t"]
    reject(GenerateRequest, d, "type")
    d["t"] = 7
    reject(GenerateRequest, d, "type")


def test_unknown_version():
    for v in (2, 0, None, "1", True, 1.0):
        d = raw(generate_request())
        d["v"] = v
        reject(GenerateRequest, d, "version", "unsupported version")
    d = raw(generate_request())
    del d["v"]
    reject(GenerateRequest, d, "version")


@pytest.mark.parametrize("data", [
    b"", b"\xc1", b"garbage\xff\xfe", b"\x92\x01\x02",  # empty, reserved byte, junk, an array
    pack("a string"), pack(None),
    pack({"t": "generate_request"}) + b"\x00",  # trailing bytes
    b"\x81\xa1t\xa2\xff\xfe",  # a str that is not UTF-8
])
def test_not_a_message_map(data):
    reject(GenerateRequest, data, "malformed")


def test_payload_must_be_bytes():
    with pytest.raises(MessageError) as info:
        decode(GenerateRequest, "text")  # type: ignore[arg-type]
    assert info.value.reason == "malformed"


def test_size_limits():
    big = b"\x00" * (DEFAULT_MAX_BYTES + 1)
    reject(TokenBatch, big, "size", "exceeds the limit")
    too_long = generate_request(prompt_ids=pack_ids(range(DEFAULT_MAX_BYTES // 4)))
    with pytest.raises(MessageError) as info:
        encode(too_long)
    assert info.value.reason == "size"
    fits = generate_request(prompt_ids=pack_ids(range(128 * 1024)))  # a 128k-token prompt fits
    assert decode(GenerateRequest, encode(fits)).num_prompt_tokens == 128 * 1024


# --- safe_decode and the counter ---------------------------------------------------------------


def test_safe_decode_counts_and_returns_none():
    seen: list[tuple[str, str]] = []
    counter = DecodeCounter(on_bad=lambda tag, reason: seen.append((tag, reason)))
    good = SAMPLES[TokenBatch][0]
    assert safe_decode(TokenBatch, encode(good), counter) == good
    assert counter.total == 0
    assert safe_decode(TokenBatch, b"\xc1", counter, subject="x.y") is None
    assert safe_decode(TokenBatch, encode(RouteReply.accepted("w")), counter) is None
    d = raw(good)
    d["v"] = 9
    assert safe_decode(TokenBatch, pack(d), counter) is None
    assert safe_decode(TokenBatch, b"\x00" * (DEFAULT_MAX_BYTES + 1), counter) is None
    assert counter.total == 4
    assert counter.count(reason="malformed") == 1
    assert counter.count(type_tag="token_batch") == 4
    assert counter.counts == {("token_batch", "malformed"): 1, ("token_batch", "type"): 1,
                              ("token_batch", "version"): 1, ("token_batch", "size"): 1}
    assert seen == [("token_batch", "malformed"), ("token_batch", "type"), ("token_batch", "version"),
                    ("token_batch", "size")]


def test_a_failing_metrics_hook_does_not_escape():
    counter = DecodeCounter(on_bad=lambda tag, reason: 1 / 0)
    assert safe_decode(AbortRequest, b"junk", counter) is None
    assert counter.total == 1


# --- registration rules ------------------------------------------------------------------------


def test_registration_rejects_bad_classes():
    with pytest.raises(TypeError, match="frozen"):
        @register
        @dataclass(slots=True)
        class Mutable(Message):
            TYPE = "test_mutable"
            x: int

    with pytest.raises(TypeError, match="already used"):
        @register
        @dataclass(slots=True, frozen=True)
        class Clash(Message):
            TYPE = "generate_request"
            x: int

    with pytest.raises(TypeError, match="unsupported field type"):
        @register
        @dataclass(slots=True, frozen=True)
        class Odd(Message):
            TYPE = "test_odd"
            x: set[int]

    with pytest.raises(TypeError, match="reserved"):
        @register
        @dataclass(slots=True, frozen=True)
        class Reserved(Message):
            TYPE = "test_reserved"
            t: int


def test_inherited_fields_round_trip():
    @register
    @dataclass(slots=True, frozen=True, kw_only=True)
    class Base(Message):
        TYPE = "test_base"
        a: int

    @register
    @dataclass(slots=True, frozen=True, kw_only=True)
    class Derived(Base):
        TYPE = "test_derived"
        b: str = "x"

    msg = Derived(a=3, b="y")
    assert decode(Derived, encode(msg)) == msg
    assert decode(Derived, pack({"t": "test_derived", "v": 1, "a": 4})) == Derived(a=4)


def test_error_messages_do_not_echo_large_values():
    d = raw(generate_request())
    d["t"] = "x" * 100_000
    assert len(str(reject(GenerateRequest, d, "type"))) < 200
    d = raw(generate_request())
    d["sampling"]["logit_bias"] = {"k" * 100_000: 1.0}
    assert len(str(reject(GenerateRequest, d, "field"))) < 200


def test_encode_rejects_unregistered_values():
    @dataclass(slots=True, frozen=True)
    class Plain:
        x: int

    with pytest.raises(TypeError):
        encode(Plain(1))  # type: ignore[arg-type]
    with pytest.raises(TypeError):
        encode(AbortRequest(request_ids=[object()]))  # type: ignore[list-item]


# --- no pickle on any path ---------------------------------------------------------------------

FORBIDDEN = {"pickle", "cPickle", "_pickle", "dill", "cloudpickle", "marshal", "shelve"}


def test_no_pickle_import_anywhere():
    offenders = []
    for path in [*sorted((ROOT / "shared").rglob("*.py")), *sorted((ROOT / "services").rglob("*.py"))]:
        for node in ast.walk(ast.parse(path.read_text(), filename=str(path))):
            if isinstance(node, ast.Import):
                names = [a.name.split(".")[0] for a in node.names]
            elif isinstance(node, ast.ImportFrom):
                names = [(node.module or "").split(".")[0]]
            else:
                continue
            offenders += [f"{path.relative_to(ROOT)}:{node.lineno} imports {n}" for n in names if n in FORBIDDEN]
    assert offenders == []
