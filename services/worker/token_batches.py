"""Packs one step's outputs into one columnar TokenBatch per gateway inbox."""

from __future__ import annotations

from array import array
from itertools import chain
from operator import attrgetter

from services.worker.step_loop import Rejected
from shared.messages import Finish, TokenBatch, TokenLogprobs
from shared.wire import pack_ids

# Columns are read with C-level maps over the step's outputs: one pass per column instead of a
# Python call and six appends per request (a thousand requests per step on a GPU).
_RID = attrgetter("request_id")
_NEW = attrgetter("new_token_ids")
_PROMPT = attrgetter("num_prompt_tokens")
_CACHED = attrgetter("num_cached_tokens")
_DONE = attrgetter("num_output_tokens")
_FINISH = attrgetter("finish_reason")
_LOGPROBS = attrgetter("logprobs")


def _batch(worker_id: str, outs: list) -> TokenBatch:
    """The columns of RequestOutputs (Rejected ones come in batches of their own)."""
    new = list(map(_NEW, outs))
    finishes = []
    if any(map(_FINISH, outs)):
        finishes = [Finish(index=i, reason=o.finish_reason, error=o.error, stop_token_id=o.stop_token_id)
                    for i, o in enumerate(outs) if o.finish_reason is not None]
    logprobs = []
    if any(lp is not None for lp in map(_LOGPROBS, outs)):
        logprobs = [_logprobs(i, o) for i, o in enumerate(outs) if o.logprobs is not None]
    return TokenBatch(worker_id=worker_id, request_ids=list(map(_RID, outs)),
                      token_counts=array("i", map(len, new)).tobytes(),
                      token_ids=array("i", chain.from_iterable(new)).tobytes(),
                      prompt_tokens=array("i", map(_PROMPT, outs)).tobytes(),
                      cached_tokens=array("i", map(_CACHED, outs)).tobytes(),
                      completion_tokens=array("i", map(_DONE, outs)).tobytes(),
                      finishes=finishes, logprobs=logprobs)


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
                      finishes=[Finish(index=i, reason="error", error=o.message) for i, o in enumerate(outs)])


def token_batches(worker_id: str, outputs, routes: dict[str, str]) -> list[tuple[str, TokenBatch]]:
    """outputs: RequestOutput or Rejected items; routes: request id → gateway inbox subject."""
    if not outputs:
        return []
    first = outputs[0]
    if type(first) is not Rejected and len(routes) == len(outputs):
        subjects = set(routes.values())
        if len(subjects) == 1 and all(subjects):  # one gateway: the common case, no grouping pass
            return [(subjects.pop(), _batch(worker_id, outputs))]
    groups: dict[str, list] = {}
    for out in outputs:
        subject = out.reply_to if type(out) is Rejected else routes.get(out.request_id)
        if not subject:
            continue
        group = groups.get(subject)
        if group is None:
            groups[subject] = [out]
        else:
            group.append(out)
    batches = []
    for subject, outs in groups.items():
        rejected = [o for o in outs if type(o) is Rejected]
        if rejected:
            batches.append((subject, _rejected_batch(worker_id, rejected)))
            outs = [o for o in outs if type(o) is not Rejected]
        if outs:
            batches.append((subject, _batch(worker_id, outs)))
    return batches
