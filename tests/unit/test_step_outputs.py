"""A step's outputs as columns (StepOutputs) and the TokenBatches packed from them."""

from __future__ import annotations

from services.worker.engine.step_outputs import RequestOutput, StepOutputs
from services.worker.step_loop import Rejected
from services.worker.token_batches import token_batches
from shared.messages import TokenBatch
from shared.wire import decode, encode, unpack_ids


def outputs() -> list[RequestOutput]:
    return [
        RequestOutput("a", [11], 5, 0, 1),
        RequestOutput("b", [12], 7, 4, 3, finish_reason="stop", stop_token_id=12),
        RequestOutput("c", [], 9, 0, 0, finish_reason="error", error="boom"),  # a failed row: no token
        RequestOutput("d", [14], 3, 0, 2, logprobs=[-0.5], top_logprobs=[[(14, -0.5), (15, -1.5)]]),
    ]


def as_tuples(outs) -> list[tuple]:
    return [(o.request_id, o.new_token_ids, o.num_prompt_tokens, o.num_cached_tokens, o.num_output_tokens,
             o.finish_reason, o.error, o.stop_token_id, o.logprobs) for o in outs]


def test_columns_round_trip_and_special_rows():
    step = StepOutputs.of(outputs())
    assert len(step) == 4 and step and not StepOutputs()
    assert step.token_ids.tolist() == [11, 12, 14] and step.token_counts.tolist() == [1, 1, 0, 1]
    assert sorted(step.special) == [1, 2, 3]  # ends, failures and logprobs keep their whole output
    assert as_tuples(step) == as_tuples(outputs())
    assert as_tuples([step[3], step[-4]]) == as_tuples([outputs()[3], outputs()[0]])
    assert step.any_finished and step.any_tokens
    assert [o.request_id for o in step.ended()] == ["b", "c"]


def test_join_and_take_keep_rows_and_tokens_aligned():
    first, second = StepOutputs.of(outputs()[:2]), StepOutputs.of(outputs()[2:])
    joined = StepOutputs.join([first, second])
    assert as_tuples(joined) == as_tuples(outputs())
    picked = joined.take([3, 2, 0])
    assert as_tuples(picked) == as_tuples([outputs()[i] for i in (3, 2, 0)])
    assert sorted(picked.special) == [0, 1]


def test_one_gateway_gets_the_columns_as_they_are():
    step = StepOutputs.of(outputs())
    [(subject, batch)] = token_batches("w0", step, ["gw.1"] * 4)
    assert subject == "gw.1"
    batch = decode(TokenBatch, encode(batch))
    assert batch.request_ids == ["a", "b", "c", "d"]
    assert unpack_ids(batch.token_counts) == [1, 1, 0, 1] and unpack_ids(batch.token_ids) == [11, 12, 14]
    assert unpack_ids(batch.prompt_tokens) == [5, 7, 9, 3] and unpack_ids(batch.cached_tokens) == [0, 4, 0, 0]
    assert unpack_ids(batch.completion_tokens) == [1, 3, 0, 2]
    assert [(f.index, f.reason, f.error, f.stop_token_id) for f in batch.finishes] == [
        (1, "stop", None, 12), (2, "error", "boom", None)]
    [lp] = batch.logprobs
    assert lp.index == 3 and lp.logprobs == [-0.5] and unpack_ids(lp.top_ids[0]) == [14, 15]


def test_rows_split_by_gateway_and_unrouted_rows_dropped():
    step = StepOutputs.of(outputs())
    batches = dict(token_batches("w0", step, ["gw.1", "gw.2", "", "gw.1"]))
    assert sorted(batches) == ["gw.1", "gw.2"]
    one, two = batches["gw.1"], batches["gw.2"]
    assert one.request_ids == ["a", "d"] and unpack_ids(one.token_ids) == [11, 14]
    assert [lp.index for lp in one.logprobs] == [1] and not one.finishes
    assert two.request_ids == ["b"] and [(f.index, f.reason) for f in two.finishes] == [(0, "stop")]


def test_rejected_adds_get_an_error_each_at_their_gateway():
    rejected = [Rejected("x", "gw.1", "too long"), Rejected("y", "gw.2", "bad"), Rejected("z", "gw.1", "worse")]
    batches = dict(token_batches("w0", rejected, [r.reply_to for r in rejected]))
    assert batches["gw.1"].request_ids == ["x", "z"] and batches["gw.2"].request_ids == ["y"]
    assert [(f.index, f.reason, f.error) for f in batches["gw.1"].finishes] == [(0, "error", "too long"),
                                                                                (1, "error", "worse")]
    assert token_batches("w0", StepOutputs(), []) == []
