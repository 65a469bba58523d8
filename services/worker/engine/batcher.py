"""Continuous batching under a per-step token budget: which requests run, how many tokens each."""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field

from services.worker.engine.block_manager import BlockManager
from services.worker.engine.request import Request, RequestStatus
from services.worker.engine.scheduler_config import SchedulerConfig

__all__ = ["Batcher", "BatchPlan", "RequestRejected", "ScheduledRequest", "SchedulerConfig"]


class RequestRejected(ValueError):
    """The request could never run on this worker, not even alone."""


@dataclass(slots=True)
class ScheduledRequest:
    request: Request
    num_new_tokens: int  # tokens all_token_ids[start:start + num_new_tokens] are computed this step
    start: int  # the first position computed (num_computed_tokens + tokens still in flight)
    samples: bool  # the chunk reaches the last known token, so a token is sampled after it
    pending_input: bool = False  # the input is the token the step in flight samples (on the device)
    # Rows the step draws for it: 1, or 1 + its jump-forward draft (each draft token is checked
    # against the draw before it); 0 when it does not sample.
    num_logits: int = 1


def drop_draft(request: Request) -> None:
    """Forget the request's jump-forward draft (its tokens were never drawn)."""
    if request.draft_len:
        del request.all_token_ids[-request.draft_len:]
        request.draft_len = 0


@dataclass(slots=True)
class BatchPlan:
    """One step's batch. `scheduled` is the batch's token layout order: the running requests
    first, in admission order (decodes and continuing prefill chunks mixed), then the requests
    admitted this step."""

    scheduled: list[ScheduledRequest] = field(default_factory=list)
    preempted: list[Request] = field(default_factory=list)
    num_batched_tokens: int = 0
    sampling: list[Request] = field(default_factory=list)  # the requests of the rows that sample, in order
    plain: bool = False  # every unfinished request is Request.plain: the draw is one argmax
    handoffs: bool = False  # some unfinished request hands its KV on after its first token
    # Per row of the draw, the request and its place in its jump-forward draft (0: the token after
    # what it knows); None when no request checks a draft this step (one row a sampling request).
    draft_rows: list[tuple[Request, int]] | None = None

    @property
    def is_empty(self) -> bool:
        return not self.scheduled


class Batcher:
    """Each step, every request's computed tokens catch up with its known tokens as far as the
    token budget allows. Prefill, chunked prefill, prefix hits, decode and recompute after
    preemption all follow from that one rule (vLLM v1's scheduler, much reduced).

    Not thread-safe: the step loop's thread owns it.
    """

    def __init__(self, config: SchedulerConfig, block_manager: BlockManager):
        if config.enable_prefix_caching != block_manager.enable_prefix_caching:
            raise ValueError(
                f"SchedulerConfig.enable_prefix_caching ({config.enable_prefix_caching}) disagrees "
                f"with the BlockManager's ({block_manager.enable_prefix_caching})")
        self.config = config
        self.block_manager = block_manager
        self._requests: dict[str, Request] = {}  # every unfinished request
        self._waiting: deque[Request] = deque()
        self._running: list[Request] = []  # in admission order: the last is preempted first
        self._reserved: dict[str, Request] = {}  # blocks held for KV arriving from another worker
        # Unfinished requests that are not Request.plain, and that hand off: a step asks these
        # counts, not each of its thousand rows.
        self._num_not_plain = 0
        self._num_handoff = 0
        self.num_constrained = 0  # unfinished requests with a grammar (their matchers take each token)
        self.num_drafting = 0  # unfinished requests that may carry a draft (jump-forward, n-gram)
        self.num_preemptions_total = 0

    # ------------------------------------------------------------------ requests in and out

    def add_request(self, request: Request) -> None:
        """Queue a request, or raise RequestRejected if it could never run even alone."""
        self._check_fits(request)
        self._track(request)
        self._waiting.append(request)

    def _track(self, request: Request) -> None:
        self._requests[request.request_id] = request
        self._num_not_plain += not request.plain
        self._num_handoff += request.handoff
        self.num_constrained += request.matcher is not None
        self.num_drafting += request.jump_forward or request.speculates

    def _untrack(self, request: Request) -> None:
        del self._requests[request.request_id]
        self._num_not_plain -= not request.plain
        self._num_handoff -= request.handoff
        self.num_constrained -= request.matcher is not None
        self.num_drafting -= request.jump_forward or request.speculates

    def _check_fits(self, request: Request) -> None:
        cfg, bm = self.config, self.block_manager
        rid = request.request_id
        if rid in self._requests or rid in self._reserved:
            raise RequestRejected(f"request {rid!r}: a request with this id is already queued")
        num_prompt = request.num_prompt_tokens
        if num_prompt == 0:
            raise RequestRejected(f"request {rid!r}: the prompt is empty")
        if num_prompt + 1 > cfg.max_model_len:
            raise RequestRejected(
                f"request {rid!r}: the prompt has {num_prompt} tokens; with at least 1 output "
                f"token that exceeds the maximum context length of {cfg.max_model_len} tokens")
        # The last sampled token is never fed back, so its KV is never stored.
        max_len = min(num_prompt + request.sampling_params.max_tokens, cfg.max_model_len)
        blocks_needed = -(-(max_len - 1) // bm.block_size)
        if blocks_needed > bm.num_total_blocks:
            raise RequestRejected(
                f"request {rid!r}: {num_prompt} prompt tokens + up to "
                f"{max_len - num_prompt} output tokens need {blocks_needed} KV blocks of "
                f"{bm.block_size} tokens, but the KV cache holds only {bm.num_total_blocks} blocks")

    # ------------------------------------------------------------------ KV from elsewhere

    def reserve(self, request: Request) -> int | None:
        """Blocks for the prompt of a request whose KV another worker computes. Returns how many
        leading blocks this worker already caches (those need not be sent), or None when it does
        not fit now. RequestRejected if it never could."""
        self._check_fits(request)
        if len(self._running) + len(self._reserved) >= self.config.max_num_seqs:
            return None
        bm = self.block_manager
        computed, num_cached = bm.get_computed_blocks(request)
        if not bm.allocate_slots(request, request.num_prompt_tokens - num_cached, computed, num_cached):
            return None
        request.num_cached_tokens = max(request.num_cached_tokens, num_cached)
        self._reserved[request.request_id] = request
        return len(computed)

    def start_imported(self, request_id: str) -> Request:
        """The reserved request's prompt KV is in its blocks: it decodes from the next step on."""
        request = self._reserved.pop(request_id)
        request.num_computed_tokens = request.num_prompt_tokens
        request.status = RequestStatus.RUNNING
        self._running.append(request)
        self._track(request)
        self.block_manager.cache_full_blocks(request)
        return request

    def cancel_reserved(self, request_id: str) -> Request | None:
        request = self._reserved.pop(request_id, None)
        if request is not None:
            self.block_manager.free(request)
            request.status = RequestStatus.FINISHED_ABORTED
        return request

    def abort(self, request_id: str) -> Request | None:
        """Finish the request as aborted and free its blocks now; None if it is not queued."""
        return self._finish_early(request_id, RequestStatus.FINISHED_ABORTED, None)

    def finish_with_error(self, request_id: str, message: str) -> Request | None:
        """Fail one request (its error is `message`) without touching the others."""
        return self._finish_early(request_id, RequestStatus.FINISHED_ERROR, message)

    def _finish_early(self, request_id: str, status: RequestStatus, error: str | None) -> Request | None:
        request = self._requests.get(request_id)
        if request is None:
            return None
        self._untrack(request)
        if request.status == RequestStatus.RUNNING:
            self._running.remove(request)
        else:
            self._waiting.remove(request)
        self.block_manager.free(request)
        request.status = status
        request.error = error
        return request

    def get(self, request_id: str) -> Request | None:
        return self._requests.get(request_id)

    def has_unfinished(self) -> bool:
        return bool(self._requests)

    def running_requests(self) -> list[Request]:
        return list(self._running)

    def waiting_requests(self) -> list[Request]:
        return list(self._waiting)

    @property
    def all_plain(self) -> bool:
        """Every unfinished request is Request.plain (greedy, no logprobs or logits processors)."""
        return not self._num_not_plain

    @property
    def num_running(self) -> int:
        return len(self._running)

    @property
    def num_waiting(self) -> int:
        return len(self._waiting)

    # ------------------------------------------------------------------ one step

    def schedule(self) -> BatchPlan:
        """Plan the next step. It may be planned while the previous step is still in flight:
        tokens scheduled there count as computed, and a token it is sampling is fed to this
        step straight from the device (`pending_input`)."""
        plan = BatchPlan()
        budget = self.config.max_num_batched_tokens
        bm = self.block_manager
        max_model_len = self.config.max_model_len

        # Running requests first, in admission order. When blocks run out, the latest admitted
        # request is preempted (recomputed later) until the current one fits.
        index = 0
        block_size = bm.block_size
        scheduled = plan.scheduled
        micro = self.config.micro_batches
        # A micro-batch takes its share of the running set; requests in a step still in flight wait.
        cap = -(-len(self._running) // micro) if micro > 1 else len(self._running)
        running = self._running
        append = scheduled.append
        # Running prompts' next chunks go after the decodes: a step's one-token rows then lead
        # (AttentionMetadata.decode_rows), and one decode-attention launch takes them all.
        chunks: list[ScheduledRequest] = []
        prefill_left = self.config.prefill_budget
        while index < len(running) and budget > 0 and len(scheduled) + len(chunks) < cap:
            request = running[index]
            pending = request.num_pending_tokens
            if micro > 1 and pending:
                index += 1
                continue
            start = request.num_computed_tokens + request.num_inflight_tokens
            known = len(request.all_token_ids)
            total = known + pending
            if pending and (total >= request.token_limit or total >= max_model_len or request.handoff):
                index += 1  # the token in flight is its last: nothing more to compute
                continue
            if start + 1 == total and start < len(request.block_ids) * block_size:
                # A decode whose slot is already in its last block: the common case, kept cheap.
                append(ScheduledRequest(request, 1, start, True, start == known))
                request.num_inflight_tokens += 1
                request.num_pending_tokens = pending + 1
                budget -= 1
                index += 1
                continue
            num_new = min(total - start, budget, self.config.max_tokens_per_request_step)
            if request.draft_len and num_new < total - start:
                drop_draft(request)  # a draft is checked whole in one step, or not at all
                total -= known - len(request.all_token_ids)
                num_new = min(total - start, budget, self.config.max_tokens_per_request_step)
            prompt_chunk = total - start > 1 + request.draft_len  # a prompt's (or a recompute's) tokens
            if prompt_chunk:
                num_new = min(num_new, prefill_left)
                if num_new == 0:
                    index += 1  # this step's prompt tokens are spent; it goes on next step
                    continue
            while not bm.allocate_slots(request, request.num_inflight_tokens + num_new):
                victim = running.pop()
                self._preempt(victim)
                plan.preempted.append(victim)
                if victim is request:
                    break
            else:
                budget -= num_new
                prefill_left -= num_new if prompt_chunk else 0
                self._add_to_plan(scheduled if num_new == 1 else chunks, request, start, num_new)
                index += 1
        scheduled += chunks

        # Then waiting requests, first come first served, unless this step had to preempt: a
        # request that does not fit blocks those behind it, so long prompts are not starved.
        plan.num_batched_tokens = self.config.max_num_batched_tokens - budget
        if plan.preempted:
            return self._sealed(plan)
        while self._waiting and budget > 0 and len(self._running) < self.config.max_num_seqs:
            request = self._waiting[0]
            if request.num_pending_tokens:
                break  # preempted while its last token was in flight; resumes once it is back
            computed_blocks, num_cached = bm.get_computed_blocks(request)
            num_new = min(request.num_tokens - num_cached, budget, self.config.max_tokens_per_request_step)
            if num_new > 1:
                num_new = min(num_new, prefill_left)
            if num_new == 0 or not bm.allocate_slots(request, num_new, computed_blocks, num_cached):
                break
            self._waiting.popleft()
            if request.status == RequestStatus.WAITING:  # first admission, not a resumption
                request.num_cached_tokens = num_cached
            request.num_computed_tokens = num_cached
            request.status = RequestStatus.RUNNING
            self._running.append(request)
            budget -= num_new
            prefill_left -= num_new if num_new > 1 else 0
            self._add_to_plan(scheduled, request, num_cached, num_new)
        plan.num_batched_tokens = self.config.max_num_batched_tokens - budget
        return self._sealed(plan)

    def _sealed(self, plan: BatchPlan) -> BatchPlan:
        plan.sampling = [s.request for s in plan.scheduled if s.samples]
        plan.plain = self.all_plain
        plan.handoffs = self._num_handoff > 0
        if self.num_drafting and any(r.draft_len for r in plan.sampling):
            plan.draft_rows = [(r, j) for r in plan.sampling for j in range(1 + r.draft_len)]
        return plan

    @staticmethod
    def _add_to_plan(scheduled: list[ScheduledRequest], request: Request, start: int, num_new: int) -> None:
        known = len(request.all_token_ids)
        samples = start + num_new == known + request.num_pending_tokens
        scheduled.append(ScheduledRequest(request, num_new, start, samples, start == known,
                                          (1 + request.draft_len) if samples else 0))
        request.num_inflight_tokens += num_new
        if samples:
            request.num_pending_tokens += 1

    def _preempt(self, request: Request) -> None:
        """Drop the request's KV and put it back at the head of the queue, to be recomputed
        (its own blocks are likely still cached then, so recompute is often a prefix hit)."""
        self.block_manager.free(request)
        drop_draft(request)
        # A drafting model's KV goes with the blocks (and an EAGLE-3 head's inputs are computed again).
        request.draft_kv_len, request.draft_kv_tail, request.draft_inputs = 0, [], []
        request.num_computed_tokens = 0
        request.num_inflight_tokens = 0  # a token in flight still arrives: num_pending_tokens stays
        request.status = RequestStatus.PREEMPTED
        request.num_preemptions += 1
        self.num_preemptions_total += 1
        self._waiting.appendleft(request)

    # ------------------------------------------------------------------ after the step

    def update_from_output(self, plan: BatchPlan, sampled: list[int] | dict[str, int]) -> list[Request]:
        """Advance every scheduled request by its chunk, append the sampled tokens (one per
        plan.sampling row, in order; or by request id), and return the requests that finished
        this step (their blocks are already freed). Steps are updated in the order they were
        scheduled."""
        if isinstance(sampled, dict):
            sampled = [sampled.get(r.request_id) for r in plan.sampling]
        finished: list[Request] = []
        block_size = self.block_manager.block_size
        cache_full_blocks = self.block_manager.cache_full_blocks
        running, preempted = RequestStatus.RUNNING, RequestStatus.PREEMPTED
        max_model_len = self.config.max_model_len
        next_token = iter(sampled).__next__
        for item in plan.scheduled:
            request = item.request
            status = request.status
            samples = item.samples
            token = next_token() if samples else None
            if status is running:
                n = item.num_new_tokens
                request.num_inflight_tokens -= n
                before = request.num_computed_tokens
                request.num_computed_tokens = after = before + n
            elif not (status is preempted and samples):
                continue  # aborted, failed, or finished by the token of an earlier step
            if samples:
                request.num_pending_tokens -= 1
                new_tokens = (token,)
                if type(token) is list:
                    # Jump-forward: the draft's tokens the draws confirmed, then the first draw that
                    # differed (or the one after the whole draft). Only the KV of the confirmed ones
                    # stands; the others' is rewritten by later steps. (A request preempted since
                    # the launch has dropped its draft and recomputes all of it.)
                    if request.draft_len and status is running:
                        request.num_computed_tokens = after = after - (request.draft_len - (len(token) - 1))
                    drop_draft(request)
                    new_tokens = token
                elif request.draft_len:  # no token for it: the draft goes too
                    if status is running:
                        request.num_computed_tokens = after = after - request.draft_len
                    drop_draft(request)
                if token is None:
                    request.status = RequestStatus.FINISHED_ERROR
                    request.error = "the engine returned no sampled token for this request"
                else:
                    tokens = request.all_token_ids
                    for i, token in enumerate(new_tokens):
                        tokens.append(token)
                        known = len(tokens)
                        if token in request.stop_ids and (
                                known - request.num_prompt_tokens >= request.sampling_params.min_tokens
                                or request.matcher is not None):  # a grammar's end is the answer's
                            request.status = RequestStatus.FINISHED_STOPPED
                        elif known >= request.token_limit or known >= max_model_len:
                            request.status = RequestStatus.FINISHED_LENGTH
                        elif request.handoff:
                            request.status = RequestStatus.HANDED_OFF
                        if request.status is not status:
                            if type(new_tokens) is list:  # what the step emits: up to the end
                                del new_tokens[i + 1:]
                            break
            if status is running and after // block_size != before // block_size:
                cache_full_blocks(request)  # a block filled up: make it findable
            if request.status is not status:  # it finished just now
                finished.append(request)
                if status is preempted:  # preempted after its step was launched
                    self._waiting.remove(request)

        if finished:
            self._running = [r for r in self._running if r.status is running]
            for request in finished:
                self.block_manager.free(request)
                self._untrack(request)
        return finished
