"""Prefill/decode disaggregation through the whole stack: the scheduler pairs a prefill and a decode
worker, the prefill worker streams the first token and pushes the prompt's KV over UCXX (loopback),
the decode worker goes on. Answers must equal an aggregated worker's, and every worker's KV blocks
must come back."""

from __future__ import annotations

import time

import pytest

from shared.messages import WorkerHeartbeat
from tests.e2e.conftest import MODEL_NAME, TEST_DEVICE, heartbeats, metrics, start_stack

pytest.importorskip("ucxx", reason="UCXX (ucxx-cu12) moves the KV pages")

PROMPTS = ["Hi", "The quick brown fox jumps over the lazy dog. " * 3,
           "A longer prompt that spans several KV blocks of sixteen tokens each, with a partial last block "
           "at the end of it all, so the hand-off moves whole pages and one partly filled page. " * 2]


@pytest.fixture(scope="module")
def aggregated(tiny_model, tmp_path_factory):
    s = start_stack(tmp_path_factory.mktemp("agg"), tiny_model)
    yield s
    s.stop()


@pytest.fixture(scope="module", params=[1, 2], ids=["1P+1D", "1P+2D"])
def pd_stack(request, tiny_model, tmp_path_factory):
    # Every prompt is prefilled remotely (threshold 1, no weighing by time), so each request is handed off.
    # Heartbeats may wait seconds on a 2-core machine running three workers flat out (20 hand-offs
    # at once below): a worker is gone after 10 s here, not 3 (the fault tests keep the defaults).
    # With two decode workers the pages go through host staging buffers on both sides (as they do
    # where UCX would move GPU memory over TCP), so every test below checks that path too.
    s = start_stack(tmp_path_factory.mktemp("pd"), tiny_model, workers=0, prefill_workers=1,
                    decode_workers=request.param,
                    scheduler_args=("--disagg-min-prefill-tokens", "1", "--no-disagg-by-time", "--heartbeat-ttl", "10"),
                    gateway_args=("--heartbeat-ttl", "10"),
                    worker_args=("--handoff-staging", "host") if request.param == 2 else ())
    yield s
    s.stop()


def client(stack):
    from openai import OpenAI

    return OpenAI(base_url=stack.url + "/v1", api_key="unused", max_retries=0, timeout=60)


def completion(stack, prompt, **kw):
    r = client(stack).completions.create(model=MODEL_NAME, prompt=prompt, max_tokens=24, temperature=0,
                                         logprobs=1, **kw)
    return r


def wait_blocks_free(stack, timeout: float = 10.0) -> dict[str, WorkerHeartbeat]:
    deadline = time.monotonic() + timeout
    while True:
        hbs = heartbeats(stack)
        if hbs and all(hb.num_free_blocks == hb.num_total_blocks and hb.num_running == 0 for hb in hbs.values()):
            return hbs
        if time.monotonic() > deadline:
            raise AssertionError({w: (hb.num_free_blocks, hb.num_total_blocks, hb.num_running)
                                  for w, hb in hbs.items()})


def test_completions_equal_the_aggregated_worker(pd_stack, aggregated):
    for prompt in PROMPTS:
        ours, ref = completion(pd_stack, prompt), completion(aggregated, prompt)
        assert ours.choices[0].text == ref.choices[0].text
        assert ours.usage.prompt_tokens == ref.usage.prompt_tokens
        assert ours.usage.completion_tokens == ref.usage.completion_tokens == 24
        a, b = ours.choices[0].logprobs.token_logprobs, ref.choices[0].logprobs.token_logprobs
        assert max(abs(x - y) for x, y in zip(a, b)) < 1e-4
    hbs = wait_blocks_free(pd_stack)
    assert hbs["prefill-0"].kv_handoffs >= len(PROMPTS)
    assert sum(hb.kv_handoffs for w, hb in hbs.items() if w.startswith("decode")) >= len(PROMPTS)
    assert hbs["prefill-0"].kv_handoff_bytes > 0
    # The decode worker reserved the blocks at the scheduler's prepare and said so: the pages went
    # straight there with the offer in the frame (no NATS round trip). Its "ready" races the tiny
    # model's prefill (milliseconds), and on a loaded 2-core machine the prefill can win for more
    # than one prompt (seen at b138d2c and since; all three once, at 27fe323), so the direct path is
    # asserted to work, not to win every race: a few more prompts until it has (the offer round trip
    # served the others, as the hand-off counts above show).
    for extra in range(8):
        if hbs["prefill-0"].kv_handoffs_direct >= 1:
            break
        completion(pd_stack, PROMPTS[extra % len(PROMPTS)])
        hbs = wait_blocks_free(pd_stack)
    assert hbs["prefill-0"].kv_handoffs_direct >= 1
    # GPU workers of one host copy the pages over CUDA IPC, every time; CPU workers send them over UCXX.
    ipc = hbs["prefill-0"].kv_handoffs_ipc
    assert ipc == hbs["prefill-0"].kv_handoffs if TEST_DEVICE.startswith("cuda") else ipc == 0
    # ... and on the direct path the prefill worker writes them into the decode worker's slot itself.
    pushed = hbs["prefill-0"].kv_handoffs_pushed
    assert pushed >= 1 if TEST_DEVICE.startswith("cuda") else pushed == 0


def test_streamed_chat_with_n_equals_the_aggregated_worker(pd_stack, aggregated):
    def run(stack):
        stream = client(stack).chat.completions.create(
            model=MODEL_NAME, messages=[{"role": "user", "content": PROMPTS[2]}], max_tokens=20, temperature=0,
            n=2, stream=True, stream_options={"include_usage": True})
        texts = {0: "", 1: ""}
        usage = None
        for chunk in stream:
            for c in chunk.choices:
                texts[c.index] += c.delta.content or ""
            usage = chunk.usage or usage
        return texts, usage

    (ours, usage), (ref, ref_usage) = run(pd_stack), run(aggregated)
    assert ours == ref and ours[0] == ours[1]
    assert usage.completion_tokens == ref_usage.completion_tokens == 40
    wait_blocks_free(pd_stack)


def test_seeded_sampling_equals_the_aggregated_worker(pd_stack, aggregated):
    kw = dict(temperature=0.9, top_p=0.95, seed=7)
    ours = client(pd_stack).completions.create(model=MODEL_NAME, prompt=PROMPTS[1], max_tokens=16, **kw)
    ref = client(aggregated).completions.create(model=MODEL_NAME, prompt=PROMPTS[1], max_tokens=16, **kw)
    assert ours.choices[0].text == ref.choices[0].text


@pytest.fixture(scope="module")
def refusing_stack(tiny_model, tmp_path_factory):
    # The decode worker's pages are another size (blocks of 32 tokens against 16): it refuses every offer.
    s = start_stack(tmp_path_factory.mktemp("pd-refused"), tiny_model, workers=0, prefill_workers=1, decode_workers=1,
                    scheduler_args=("--disagg-min-prefill-tokens", "1", "--no-disagg-by-time", "--heartbeat-ttl", "10"),
                    gateway_args=("--heartbeat-ttl", "10"), decode_worker_args=("--block-size", "32"))
    yield s
    s.stop()


def test_a_refused_hand_off_is_computed_at_the_decode_worker(refusing_stack, aggregated):
    """A hand-off that fails costs time, not the answer: the decode worker computes the prompt's KV
    itself and goes on from the first token the prefill worker drew (and the gateway has), with the
    same seeded draws, as one worker answers."""
    for prompt in PROMPTS:
        ours, ref = completion(refusing_stack, prompt), completion(aggregated, prompt)
        assert ours.choices[0].text == ref.choices[0].text
        assert ours.usage.completion_tokens == ref.usage.completion_tokens == 24
        a, b = ours.choices[0].logprobs.token_logprobs, ref.choices[0].logprobs.token_logprobs
        assert max(abs(x - y) for x, y in zip(a, b)) < 1e-4
    kw = dict(temperature=0.9, top_p=0.95, seed=7, max_tokens=16)
    ours = client(refusing_stack).completions.create(model=MODEL_NAME, prompt=PROMPTS[1], **kw)
    ref = client(aggregated).completions.create(model=MODEL_NAME, prompt=PROMPTS[1], **kw)
    assert ours.choices[0].text == ref.choices[0].text
    hbs = wait_blocks_free(refusing_stack)
    decode = next(hb for w, hb in hbs.items() if w.startswith("decode"))
    assert hbs["prefill-0"].kv_handoffs == decode.kv_handoffs == 0
    assert hbs["prefill-0"].kv_handoffs_recomputed == decode.kv_handoffs_recomputed == len(PROMPTS) + 1
    deadline = time.monotonic() + 5  # /metrics has them with the prefill worker's next heartbeat
    while metrics(refusing_stack).get("inferno:kv_handoffs_recomputed_total") != len(PROMPTS) + 1:
        assert time.monotonic() < deadline, metrics(refusing_stack)
        time.sleep(0.2)


def test_structured_output_with_n_is_handed_off_and_equals_the_aggregated_worker(pd_stack, aggregated):
    """The prefill worker draws the first token of each choice under the schema; each decode side
    compiles it too, and its matcher goes on from that token (engine.complete_import)."""
    import json

    import jsonschema

    schema = {"type": "object", "properties": {"ok": {"type": "boolean"}, "tag": {"enum": ["red", "green"]}},
              "required": ["ok", "tag"], "additionalProperties": False}
    kw = dict(model=MODEL_NAME, messages=[{"role": "user", "content": PROMPTS[2]}], max_tokens=60, n=2,
              temperature=0.9, seed=11, response_format={"type": "json_schema",
                                                         "json_schema": {"name": "r", "schema": schema}})
    before = wait_blocks_free(pd_stack)["prefill-0"].kv_handoffs
    ours, ref = client(pd_stack).chat.completions.create(**kw), client(aggregated).chat.completions.create(**kw)
    assert [c.message.content for c in ours.choices] == [c.message.content for c in ref.choices]
    for c in ours.choices:
        assert c.finish_reason == "stop"
        jsonschema.validate(json.loads(c.message.content), schema)
    deadline = time.monotonic() + 10  # the heartbeat that counts them may come after the answers
    while wait_blocks_free(pd_stack)["prefill-0"].kv_handoffs < before + 2:
        assert time.monotonic() < deadline, "the choices were not handed off"
        time.sleep(0.2)


def test_a_client_that_leaves_mid_stream_frees_both_sides(pd_stack):
    stream = client(pd_stack).completions.create(model=MODEL_NAME, prompt=PROMPTS[2], max_tokens=1500,
                                                 temperature=0, stream=True, extra_body={"ignore_eos": True})
    for i, _ in enumerate(stream):
        if i == 5:
            break
    stream.close()
    wait_blocks_free(pd_stack, timeout=15)


def test_a_request_that_ends_with_its_first_token_releases_the_decode_reservation(pd_stack):
    r = client(pd_stack).completions.create(model=MODEL_NAME, prompt=PROMPTS[2], max_tokens=1, temperature=0)
    assert r.usage.completion_tokens == 1 and r.choices[0].finish_reason == "length"
    wait_blocks_free(pd_stack)  # the decode worker reserved blocks when the scheduler paired it


def test_metrics_count_hand_offs_and_their_median_time(pd_stack):
    """By now the module's requests were handed off: /metrics counts them, with a median time."""
    deadline = time.monotonic() + 5  # the counts come with the prefill worker's heartbeats
    while True:
        m = metrics(pd_stack)
        if m.get("inferno:kv_handoffs_total", 0) > 0 or time.monotonic() > deadline:
            break
        time.sleep(0.2)
    assert m["inferno:kv_handoffs_total"] > 0 and 0 < m["inferno:kv_handoff_seconds_p50"] < 5
    hbs = heartbeats(pd_stack)
    staged = {hb.role: hb.kv_handoffs_staged for hb in hbs.values() if hb.role == "prefill"}
    if len(hbs) == 3:  # 1P+2D: every hand-off went through the host staging buffers
        assert staged["prefill"] > 0 and staged["prefill"] == sum(
            hb.kv_handoffs for hb in hbs.values() if hb.role == "prefill")
        assert sum(hb.kv_handoffs_staged for hb in hbs.values() if hb.role == "decode") > 0
    else:
        assert staged["prefill"] == 0


def test_decode_workers_queue_hand_offs_until_blocks_free(pd_stack):
    """More prompts at once than the decode workers' pools hold: offers wait for blocks (admission
    by free KV) instead of failing."""
    import concurrent.futures

    def one(i):
        return client(pd_stack).completions.create(
            model=MODEL_NAME, prompt=f"request {i}: " + PROMPTS[1], max_tokens=400, temperature=0,
            extra_body={"ignore_eos": True}).usage.completion_tokens

    with concurrent.futures.ThreadPoolExecutor(20) as pool:
        assert list(pool.map(one, range(20))) == [400] * 20  # 20 × 32 blocks > the decode pools' 256 each
    wait_blocks_free(pd_stack)


# ---------------------------------------------------------------------------- faults


def stream_until_killed(stack, victim: str, prompt: str, kill_after_chunks: int):
    """Streams a long completion and SIGKILLs `victim` after some chunks; returns (outcome, seconds
    from the kill to the end of the stream)."""
    import openai

    c = client(stack)
    killed_at = None
    try:
        for i, _ in enumerate(c.completions.create(model=MODEL_NAME, prompt=prompt, max_tokens=1500, temperature=0,
                                                   stream=True, extra_body={"ignore_eos": True})):
            if i == kill_after_chunks:
                stack.child(victim).proc.kill()
                killed_at = time.monotonic()
        outcome = "ok"
    except (openai.APIError, openai.APIConnectionError) as e:
        outcome = f"error: {type(e).__name__}"
    return outcome, time.monotonic() - (killed_at or time.monotonic())


@pytest.fixture
def fault_stack(tiny_model, tmp_path):
    s = start_stack(tmp_path, tiny_model, workers=0, prefill_workers=2, decode_workers=2,
                    scheduler_args=("--disagg-min-prefill-tokens", "1", "--no-disagg-by-time", "--heartbeat-ttl", "1.5"),
                    worker_args=("--handoff-timeout", "3"))
    yield s
    s.stop()


def test_killed_decode_worker_ends_its_request_cleanly_and_the_rest_serve(fault_stack):
    outcome, seconds = None, None
    # The decode worker holding the stream is the one with a running request once tokens flow.
    import openai

    c = client(fault_stack)
    stream = c.completions.create(model=MODEL_NAME, prompt=PROMPTS[1], max_tokens=1500, temperature=0,
                                  stream=True, extra_body={"ignore_eos": True})
    try:
        for i, _ in enumerate(stream):
            if i == 10:
                busy = [w for w, hb in heartbeats(fault_stack, 0.8).items() if w.startswith("decode") and hb.num_running]
                assert len(busy) == 1, busy
                fault_stack.child(busy[0]).proc.kill()
                killed_at = time.monotonic()
        outcome = "ok"
    except (openai.APIError, openai.APIConnectionError) as e:
        outcome = f"error: {type(e).__name__}"
    seconds = time.monotonic() - killed_at
    assert outcome.startswith("error") and seconds < 5, (outcome, seconds)
    # The other decode worker takes the next requests; nothing is left held anywhere.
    assert completion(fault_stack, PROMPTS[2]).usage.completion_tokens == 24
    hbs = wait_blocks_free(fault_stack, timeout=15)
    assert busy[0] not in hbs or time.monotonic() - hbs[busy[0]].timestamp > 1


def test_killed_prefill_workers_end_or_hand_off_within_5_s(fault_stack):
    """Both prefill workers die right after the first token: the request was either handed off (it
    completes) or it fails cleanly; later requests are prefilled by the decode workers themselves."""
    import openai

    c = client(fault_stack)
    killed_at = None
    try:
        for i, _ in enumerate(c.completions.create(model=MODEL_NAME, prompt=PROMPTS[2] * 3, max_tokens=300,
                                                   temperature=0, stream=True, extra_body={"ignore_eos": True})):
            if i == 0:
                for name in ("prefill-0", "prefill-1"):
                    fault_stack.child(name).proc.kill()
                killed_at = time.monotonic()
        outcome = "ok"
    except (openai.APIError, openai.APIConnectionError) as e:
        outcome = f"error: {type(e).__name__}"
    assert outcome == "ok" or time.monotonic() - killed_at < 5, outcome
    time.sleep(2)  # the scheduler drops the silent prefill workers (TTL 1.5 s)
    for prompt in PROMPTS:
        assert completion(fault_stack, prompt).usage.completion_tokens == 24
    hbs = wait_blocks_free(fault_stack, timeout=15)
    assert not any(w.startswith("prefill") for w in hbs)
