"""Disaggregated routing: the prefill worker that goes with a chosen decode worker, if any should.

A request's decode side is chosen as always (session, prefix overlap, load). A remote prefill then
pays only when the decode worker is a `decode` one and the prompt's uncached part is long enough
to be worth moving KV for (Dynamo's conditional disaggregation), and — with a queue bound — the
cheapest prefill worker is not that far behind; otherwise the decode worker prefills it itself.
Among prefill workers of the model the cheapest wins: uncached prompt tokens on it plus its
queued prefill, ties to fewer waiting requests, then the smaller id.

With `by_time`, the decode worker also prefills a prompt itself when its first token comes clearly
sooner that way (LOCAL_MARGIN): each side's queued prompt tokens and this prompt over the prompt
tokens a second it reports (the decode worker's in chunks beside its decodes,
services/worker/prefill_rate.py), plus the prefill worker's recent hand-off time. A token bound
alone sent every prompt to a prefill worker behind a slow link (hand-offs of 0.7-2.4 s over TCP
between two H200s: 13 of 100 long prompts timed out; none with this, 2026-11-29). The margin is
there because a local prefill also slows the decode worker's own decodes. Off by default: over CUDA
IPC it still raised the TTFT p99, 252 against 187 ms with the token bound alone, and a prompt it
kept local (2,986 tokens in a burst) took 279 ms against 172 remote: the decode worker's reported
rate looks optimistic (its step calls' seconds, overlapped, are shorter than its steps).
"""

from __future__ import annotations

from collections.abc import Sequence

from services.scheduler.registry import WorkerState
from services.scheduler.kv_index import KvIndex
from services.scheduler.router import Choice, prefix_hits, request_cost, store_hint, usable
from shared.messages import GenerateRequest

PREFILL_ROLE = "prefill"
LOCAL_MARGIN = 2.0  # a decode worker's own prefill must promise the first token this many times sooner


def choose_prefill(live: Sequence[WorkerState], decode: Choice, req: GenerateRequest,
                   min_prefill_tokens: int, max_queue_tokens: int = 0, store: KvIndex | None = None,
                   by_time: bool = False) -> Choice | None:
    """The prefill worker for this request, or None when its decode worker should prefill it.
    max_queue_tokens (0: no bound): when even the cheapest prefill worker has more tokens than this
    still to work through, the request's first token comes sooner from its decode worker (one
    prefill GPU behind two decode-bound ones was the TTFT p99 cost of the split: 252 against 148 ms
    with 10 long prompts a second on two H100s, 2026-11-27)."""
    if decode.worker.role != "decode":
        return None
    if req.num_prompt_tokens - decode.cached_tokens < max(min_prefill_tokens, 1):
        return None
    pool = [w for w in live if w.role == PREFILL_ROLE and w.model == req.model and w.accepts_work
            and (not w.heartbeat.max_model_len or req.num_prompt_tokens < w.heartbeat.max_model_len)]
    if not pool:
        return None
    own, in_store = prefix_hits(pool, req, store)
    cached = usable(pool, own, in_store)
    n = req.num_prompt_tokens
    keys = [(request_cost(n, c, w.load_tokens), w.num_waiting, w.worker_id) for w, c in zip(pool, cached)]
    best = min(range(len(pool)), key=keys.__getitem__)
    if max_queue_tokens and pool[best].load_tokens > max_queue_tokens:
        return None
    if by_time and sooner_at_decode(decode, pool[best], keys[best][0], n - decode.cached_tokens):
        return None
    return Choice(pool[best], cached[best], keys[best][0], store_tokens=store_hint(in_store[best], store))


def sooner_at_decode(decode: Choice, prefill: WorkerState, remote_tokens: int, local_tokens: int) -> bool:
    """Whether the decode worker's own prefill gives the first token sooner than the prefill worker's
    and the hand-off: `remote_tokens` are the prefill worker's queue and this prompt's uncached part
    there, `local_tokens` the uncached part at the decode worker. Unknown rates (no prompt computed
    yet on one side) leave it to the prefill worker."""
    d, p = decode.worker, prefill.heartbeat
    local_rate, remote_rate = d.heartbeat.prefill_tokens_per_s, p.prefill_tokens_per_s
    if local_rate <= 0 or remote_rate <= 0:
        return False
    local = (d.heartbeat.queued_prefill_tokens + d.local_prefill_tokens + local_tokens) / local_rate
    remote = remote_tokens / remote_rate + p.kv_handoff_p50_ms / 1e3
    return LOCAL_MARGIN * local < remote
