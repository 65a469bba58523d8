"""Packs one step's outputs into one columnar TokenBatch per gateway inbox."""

from __future__ import annotations

from array import array

from services.worker.engine.step_outputs import StepOutputs
from services.worker.step_loop import Rejected
from shared.messages import Finish, TokenBatch, TokenLogprobs
from shared.wire import pack_ids


def _batch(worker_id: str, outs: StepOutputs) -> TokenBatch:
    """The step's columns as they are; ends and logprobs from the few rows that have them."""
    special = sorted(outs.special.items())
    finishes = [Finish(index=i, reason=o.finish_reason, error=o.error, stop_token_id=o.stop_token_id,
                       drafted_tokens=o.drafted_tokens, accepted_tokens=o.accepted_tokens)
                for i, o in special if o.finish_reason is not None]
    logprobs = [_logprobs(i, o) for i, o in special if o.logprobs is not None]
    return TokenBatch(worker_id=worker_id, request_ids=outs.request_ids,
                      token_counts=outs.token_counts.tobytes(), token_ids=outs.token_ids.tobytes(),
                      prompt_tokens=outs.num_prompt_tokens.tobytes(), cached_tokens=outs.num_cached_tokens.tobytes(),
                      completion_tokens=outs.num_output_tokens.tobytes(), finishes=finishes, logprobs=logprobs)


def _logprobs(i: int, out) -> TokenLogprobs:
    top_ids = top_lps = None
    if out.top_logprobs is not None:
        top_ids = [pack_ids([t for t, _ in alts]) for alts in out.top_logprobs]
        top_lps = [[lp for _, lp in alts] for alts in out.top_logprobs]
    return TokenLogprobs(index=i, logprobs=out.logprobs, top_ids=top_ids, top_lps=top_lps)


def _rejected_batch(worker_id: str, outs: list[Rejected]) -> TokenBatch:
    zeros = array("i", bytes(4 * len(outs))).tobytes()
    return TokenBatch(worker_id=worker_id, request_ids=[o.request_id for o in outs], token_counts=zeros,
                      token_ids=b"", prompt_tokens=zeros, cached_tokens=zeros, completion_tokens=zeros,
                      finishes=[Finish(index=i, reason="error", error=o.message, param=o.param)
                                for i, o in enumerate(outs)])


def _groups(routes: list[str]) -> dict[str, list[int]]:
    """Row numbers by gateway inbox; rows without one (aborted) are left out."""
    groups: dict[str, list[int]] = {}
    for i, subject in enumerate(routes):
        if subject:
            groups.setdefault(subject, []).append(i)
    return groups


def token_batches(worker_id: str, outputs: StepOutputs | list[Rejected],
                  routes: list[str]) -> list[tuple[str, TokenBatch]]:
    """outputs: a step's StepOutputs, or a list of Rejected adds; routes: each row's gateway inbox
    subject ("" for a request no longer routed)."""
    if not outputs:
        return []
    if isinstance(outputs, list):  # rejected adds
        return [(subject, _rejected_batch(worker_id, [outputs[i] for i in rows]))
                for subject, rows in _groups(routes).items()]
    first = routes[0]
    if first and routes.count(first) == len(routes):  # one gateway: the common case, no grouping pass
        return [(first, _batch(worker_id, outputs))]
    return [(subject, _batch(worker_id, outputs.take(rows))) for subject, rows in _groups(routes).items()]
