"""Packs one step's outputs into one columnar TokenBatch per gateway inbox."""

from __future__ import annotations

from array import array

from services.worker.step_loop import Rejected
from shared.messages import Finish, TokenBatch, TokenLogprobs
from shared.wire import pack_ids


class _Columns:
    __slots__ = ("rids", "counts", "ids", "prompt", "cached", "done", "finishes", "logprobs")

    def __init__(self) -> None:
        self.rids: list[str] = []
        self.counts, self.ids = array("i"), array("i")
        self.prompt, self.cached, self.done = array("i"), array("i"), array("i")
        self.finishes: list[Finish] = []
        self.logprobs: list[TokenLogprobs] = []

    def add(self, out) -> None:
        i = len(self.rids)
        self.rids.append(out.request_id)
        if isinstance(out, Rejected):
            self.counts.append(0)
            self.prompt.append(0)
            self.cached.append(0)
            self.done.append(0)
            self.finishes.append(Finish(index=i, reason="error", error=out.message))
            return
        self.counts.append(len(out.new_token_ids))
        self.ids.extend(out.new_token_ids)
        self.prompt.append(out.num_prompt_tokens)
        self.cached.append(out.num_cached_tokens)
        self.done.append(out.num_output_tokens)
        if out.finish_reason is not None:
            self.finishes.append(Finish(index=i, reason=out.finish_reason, error=out.error,
                                        stop_token_id=out.stop_token_id))
        if out.logprobs is not None:
            top_ids = top_lps = None
            if out.top_logprobs is not None:
                top_ids = [pack_ids([t for t, _ in alts]) for alts in out.top_logprobs]
                top_lps = [[lp for _, lp in alts] for alts in out.top_logprobs]
            self.logprobs.append(TokenLogprobs(index=i, logprobs=out.logprobs, top_ids=top_ids, top_lps=top_lps))

    def batch(self, worker_id: str) -> TokenBatch:
        return TokenBatch(worker_id=worker_id, request_ids=self.rids, token_counts=self.counts.tobytes(),
                          token_ids=self.ids.tobytes(), prompt_tokens=self.prompt.tobytes(),
                          cached_tokens=self.cached.tobytes(), completion_tokens=self.done.tobytes(),
                          finishes=self.finishes, logprobs=self.logprobs)


def token_batches(worker_id: str, outputs, routes: dict[str, str]) -> list[tuple[str, TokenBatch]]:
    """outputs: RequestOutput or Rejected items; routes: request id → gateway inbox subject."""
    groups: dict[str, _Columns] = {}
    for out in outputs:
        subject = out.reply_to if isinstance(out, Rejected) else routes.get(out.request_id)
        if not subject:
            continue
        cols = groups.get(subject)
        if cols is None:
            cols = groups[subject] = _Columns()
        cols.add(out)
    return [(subject, cols.batch(worker_id)) for subject, cols in groups.items()]
