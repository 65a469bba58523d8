"""Grammars and drafts in the engine's step: a constrained request's matcher taking the drawn
tokens, and drafts (jump-forward's forced tokens, speculation's n-gram lookups) appended after a
step and checked by the next one, which draws a row after each drafted token (the sampler's
draft_rows) and keeps what token-by-token decoding would have drawn."""

from __future__ import annotations

import structlog

from services.worker.engine.grammar_mask import accept_tokens
from services.worker.engine.request import Request, RequestStatus
from services.worker.engine.sampler import SampleResult
from services.worker.engine.speculative import SpeculativeConfig, ngram_draft

log = structlog.get_logger("worker.engine")


def advance_matchers(reqs: list[Request], tokens: list[int]) -> None:
    """Each constrained row's grammar takes its drawn token (the sampler drew only allowed ones), in
    one call into xgrammar for the batch (a thousand rows a step on a GPU)."""
    rows = [i for i, r in enumerate(reqs) if r.matcher is not None]
    if not rows:
        return
    if any(type(tokens[i]) is list for i in rows):  # jump-forward rows: several tokens each
        for i in rows:
            for token in tokens[i] if type(tokens[i]) is list else (tokens[i],):
                m = reqs[i].matcher
                if not m.accept(token) and not m.terminated:
                    log.warning("grammar refused a drawn token", request_id=reqs[i].request_id, token=token)
        return
    matchers = [reqs[i].matcher for i in rows]
    accepted = accept_tokens(matchers, [tokens[i] for i in rows])
    for m, row, ok in zip(matchers, rows, accepted):
        # A terminated matcher's row was a request that ended in the step before: its token is dropped.
        if not ok and not m.terminated:
            log.warning("grammar refused a drawn token", request_id=reqs[row].request_id, token=tokens[row])


def constrain(request: Request, matcher, jump_forward: bool = False) -> None:
    """Each of the request's draws is masked by its grammar's matcher (grammar_mask.py), which takes
    every drawn token. `jump_forward`: it drafts the tokens its grammar forces (make_drafts):
    a draft is checked against draws, so its next step waits for its last token (no overlap)."""
    request.matcher = matcher
    request.plain = False
    if jump_forward:
        request.jump_forward = request.needs_token_history = True
    # The answer ends where its grammar does (xgrammar's end is the model's eos), whatever
    # ignore_eos and min_tokens say: past it nothing is allowed, and before it eos is not.
    request.stop_ids = request.stop_ids | frozenset(request.eos_token_ids)
    request.min_tokens_masked = 0


def checked_drafts(draft_rows: list, result: SampleResult) -> tuple[SampleResult, dict[str, list[int]]]:
    """One entry a sampling request again: a drafting request's rows become the tokens of its draft
    that its draws confirmed, then the first draw that differed (or the one after the draft),
    exactly what token-by-token decoding would have drawn; the others' rows are theirs. So are the
    log-probabilities: a list of the kept tokens' rows for a drafting request. Also returns, by
    draft method, [drafts checked, their tokens, the tokens confirmed]."""
    ids, rows, i, counts = [], [], 0, {}
    while i < len(draft_rows):
        r = draft_rows[i][0]
        k = 0  # the draft's length when the step was planned: its rows after the first
        while i + k + 1 < len(draft_rows) and draft_rows[i + k + 1][0] is r:
            k += 1
        if not k:
            ids.append(result.token_ids[i])
            rows.append(i)
        elif r.draft_len != k:  # dropped since (a preemption): only the first draw follows what it knows
            ids.append([result.token_ids[i]])
            rows.append([i])
        else:
            draws, draft = result.token_ids[i:i + k + 1], r.all_token_ids[-k:]
            a = next((j for j in range(k) if draws[j] != draft[j]), k)
            ids.append(draft[:a] + [draws[a]])
            rows.append(list(range(i, i + a + 1)))
            c = counts.setdefault(r.draft_method, [0, 0, 0])
            c[0], c[1], c[2] = c[0] + 1, c[1] + k, c[2] + a
            r.drafted_tokens += k
            r.accepted_tokens += a
        i += k + 1

    def pick(column):
        if column is None:
            return None
        return [[column[j] for j in row] if type(row) is list else column[row] for row in rows]

    return SampleResult(ids, pick(result.logprobs), pick(result.top_ids), pick(result.top_logprobs)), counts


def make_drafts(reqs: list[Request], spec: SpeculativeConfig | None, jump_forward: int, max_model_len: int,
                drafter=None) -> None:
    """Each running drafting request appends its draft: the tokens its grammar forces next
    (jump-forward, at most `jump_forward`), else speculation's (`spec`, when on): the n-gram prompt
    lookup's, or `drafter`'s (a model's: model_drafter.py, one batch for every request), cut to what
    its grammar allows. The next step computes them and checks them against the model's draws
    (checked_drafts)."""
    running = RequestStatus.RUNNING
    by_model: list[tuple[Request, int]] = []
    for r in reqs:
        # A token still in flight (speculation just turned on) comes first: no draft before it.
        if (r.status is not running or r.draft_len or r.num_pending_tokens
                or not (r.jump_forward or (r.speculates and spec is not None))):
            continue
        room = min(r.token_limit, max_model_len) - len(r.all_token_ids) - 1
        draft = r.matcher.draft(min(room, jump_forward)) if r.jump_forward else []
        method = "jump_forward"
        if not draft and r.speculates and spec is not None:
            k = min(room, spec.num_speculative_tokens)
            if drafter is not None:
                by_model.append((r, k))
                continue
            draft = ngram_draft(r.all_token_ids, k, spec.prompt_lookup_min, spec.prompt_lookup_max)
            method = "ngram"
        _append(r, draft, method)
    if by_model:
        for (r, _), draft in zip(by_model, drafter.propose(by_model)):
            _append(r, draft, drafter.method)


def _append(r: Request, draft: list[int], method: str) -> None:
    if draft and method != "jump_forward" and r.matcher is not None:
        draft = r.matcher.allowed_prefix(draft)
    if draft:
        r.all_token_ids.extend(draft)
        r.draft_len, r.draft_method = len(draft), method
