"""Drafts made by a model on the engine's device: speculation's `draft_model` method, a smaller model
of the same tokenizer, and the base of `eagle3` (eagle3_drafter.py).

The drafting model keeps KV of its own shape in a pool of its own, indexed by the target's block
ids: a request's pages hold both models' KV of the same positions, so the block manager allocates,
shares and frees them once, and a preempted request loses both. Before drafting k tokens after a
request's L known ones, the engine's blocks are grown to the L + k the check will need (the
batcher would allocate them next step anyway); without free blocks the request does not draft.

A draft is greedy: its model's argmax at each place. The check keeps what the target would have
drawn (drafts.py), so the draft's quality costs speed, never the answer.
"""

from __future__ import annotations

import numpy as np
import torch

from services.worker.engine.batcher import ScheduledRequest
from services.worker.engine.request import Request
from services.worker.engine.step_inputs import pack_step_inputs, upload_step_inputs


def confirmed_kv_len(r: Request) -> int:
    """Positions of the drafting model's KV that still hold the request's tokens: those computed
    before its last draft, then as many of the drafted ones as the draws confirmed."""
    tail = r.draft_kv_tail
    base = r.draft_kv_len - len(tail)
    known = r.all_token_ids
    m = 0
    while m < len(tail) and base + m < len(known) and known[base + m] == tail[m]:
        m += 1
    return min(base + m, len(known) - 1)  # the last known token is always computed again


def device_rows(rows: np.ndarray, device: torch.device) -> torch.Tensor:
    """Row indices on the device through pinned memory: a copy from pageable memory waits for the
    device's queue to drain first, and a drafter queues its steps ahead of the device."""
    host = torch.from_numpy(rows)
    if device.type != "cuda":
        return host
    return host.pin_memory().to(device, non_blocking=True)


def grow_blocks(block_manager, r: Request, k: int) -> bool:
    """The request's blocks cover the check of a k-token draft: its known tokens and k more."""
    return block_manager.allocate_slots(r, r.num_inflight_tokens + len(r.all_token_ids) - r.num_computed_tokens + k)


class DraftModel:
    """`draft_model`: each step, the draft model computes the positions it has not (the accepted
    tokens of the last check; a new request's whole prompt, in chunks of `max_tokens`), draws the
    first draft token from the last, then one decode step per further token (in CUDA graphs where
    `graphs`, a CudaGraphRunner over the draft model and its pool, covers the batch).

    `shift`: a drafter whose input at position p is token p + 1 (EAGLE's: the target's hidden state
    at p with the token drawn from it) computes one position less of each request."""

    method = "draft_model"
    shift = 0

    def __init__(self, model, kv_cache, block_manager, device: torch.device, max_tokens: int, target_vocab: int):
        self.model = model
        self.kv_cache = kv_cache
        self.block_manager = block_manager
        self.device = device
        self.max_tokens = max_tokens
        self.target_vocab = target_vocab
        self.graphs = None  # a CudaGraphRunner over graph_model (drafting.capture_graphs), on a GPU
        self.graph_model = None  # the model as its graphs call it, the draw inside (GreedyStep, HeadGraphStep)
        self._queued = 0  # graph steps queued on the device since the host last waited for it

    @torch.inference_mode()
    def propose(self, items: list[tuple[Request, int]]) -> list[list[int]]:
        """Drafts of up to k tokens for each (request, k); [] for a request without blocks for one.
        The steps queue on the device one after the other, each fed the tokens the step before drew
        there, and the host reads the drafts once at the end."""
        drafts: list[list[int]] = [[] for _ in items]
        todo = []
        for i, (r, k) in enumerate(items):
            start = self._first_position(r) if k > 0 else None
            if start is not None and grow_blocks(self.block_manager, r, k):
                todo.append((i, r, k, len(r.all_token_ids), start))
        if not todo:
            return drafts
        drawn: list[tuple[torch.Tensor, list[int]]] = []  # each step's drawn ids (on the device), its rows' items
        # Catch up to the last known token, whose logits give the first draft token.
        behind = {i: start for i, _, _, _, start in todo}
        end = {i: n - self.shift for i, _, _, n, _ in todo}
        while behind:
            budget, scheduled, owners = self.max_tokens, [], []
            for i, r, k, n, _ in todo:
                start = behind.get(i)
                if start is None or budget <= 0:
                    continue
                num = min(end[i] - start, budget)
                budget -= num
                last = start + num == end[i]
                scheduled.append(ScheduledRequest(r, num, start, last))
                if last:
                    owners.append(i)
                    del behind[i]
                else:
                    behind[i] = start + num
            drawn.append((self._step(scheduled, owners, True), owners))
        last_ids = drawn[0][0] if len(drawn) == 1 else torch.cat([ids for ids, _ in drawn])
        row = {i: j for j, i in enumerate(i for _, owners in drawn for i in owners)}
        # Then one token at a time, its input the token drawn before it, still on the device.
        for j in range(1, max(k for _, _, k, _, _ in todo)):
            rows = [(i, r, n) for i, r, k, n, _ in todo if k > j]
            scheduled = [ScheduledRequest(r, 1, n - 1 - self.shift + j, True, True) for _, r, n in rows]
            owners = [i for i, _, _ in rows]
            last_ids = self._step(scheduled, owners, False, last_ids, {r.request_id: row[i] for i, r, _ in rows})
            row = {i: j for j, i in enumerate(owners)}
            drawn.append((last_ids, owners))
        tokens = torch.cat([ids for ids, _ in drawn]).tolist()  # the one wait for the device
        self._queued = 0
        at = 0
        for _, owners in drawn:
            for i in owners:
                drafts[i].append(tokens[at])
                at += 1
        for i, r, k, n, _ in todo:
            self._drafted(r, n, drafts[i])
        return drafts

    def _first_position(self, r: Request) -> int | None:
        """Where the request's catch-up starts; None: it cannot draft now."""
        return confirmed_kv_len(r)

    def _drafted(self, r: Request, n: int, draft: list[int]) -> None:
        r.draft_kv_len = n + len(draft) - 1  # the last draft token was drawn, never computed
        r.draft_kv_tail = draft[:-1]

    def after_launch(self, scheduled, model) -> None:
        """Called after each target step is launched (a drafter that reads the target's states)."""

    def _step(self, scheduled: list[ScheduledRequest], owners: list[int], first: bool,
              last_ids: torch.Tensor | None = None, last_rows: dict[str, int] | None = None) -> torch.Tensor:
        """One forward of the draft model over `scheduled`; the greedy token of each sampling row, on
        the device. `owners`: the items of the sampling rows; `first`: the catch-up, before the first
        draft token; `last_ids`/`last_rows`: the inputs still on the device (the rows' previous draws)."""
        graph = self._graph_step(scheduled, last_rows)
        if graph is not None:  # the draw is in the graph too (GreedyStep): its ids are the side output
            staged, rows = graph
            self.graphs.launch(staged, last_ids)
            return self.graphs.model.aux_hidden[rows]
        inputs = self._eager_inputs(scheduled, last_ids, last_rows)
        hidden = self.model(inputs.input_ids, inputs.positions, self.kv_cache.layers, inputs.meta)
        return greedy(self.model.compute_logits(hidden[inputs.logits_indices]), self.target_vocab)

    def _eager_inputs(self, scheduled, last_ids, last_rows, tokens: list[int] | None = None):
        """A step's inputs built and moved as the target's eager steps' are (`tokens`: other inputs)."""
        step = pack_step_inputs(scheduled, self.kv_cache.block_size, last_rows, self.block_manager.tables)
        if tokens is not None:
            step.parts()[0][:] = tokens
        inputs = upload_step_inputs(step, self.device, self.device.type == "cuda")
        if inputs.feed_dst is not None:
            inputs.input_ids.index_copy_(0, inputs.feed_dst, last_ids.index_select(0, inputs.feed_src))
        return inputs

    def _graph_step(self, scheduled: list[ScheduledRequest], last_rows: dict[str, int] | None = None):
        """The step staged in the drafter's decode graphs, a row per token (as a target's draft check:
        CudaGraphRunner._stage_checks), and the rows of the sampling requests' last tokens; None when
        the graphs do not cover it (a new request's whole prompt). Eager, a drafter's step is ~20
        launches from Python: more than the GPU's time for a 1B model's or a head's step."""
        graphs = self.graphs
        if graphs is None:
            return None
        if self._queued >= len(graphs.stages) - 1:  # a host stage's copy may still be queued: let it go
            if graphs.cuda:
                torch.cuda.current_stream(self.device).synchronize()
            self._queued = 0
        self._queued += 1
        counts = np.fromiter((s.num_new_tokens for s in scheduled), dtype=np.int64, count=len(scheduled))
        n = int(counts.sum())
        if not graphs.covers(scheduled, n if n != len(scheduled) else None):
            return None
        staged = graphs.stage(scheduled, last_rows, self.block_manager.tables)
        if n == len(scheduled) and all(s.samples for s in scheduled):
            return staged, graphs.rows[:n]  # a row each: all of them (a device tensor kept by the graphs)
        last = np.cumsum(counts) - 1
        return staged, device_rows(last[[s.samples for s in scheduled]], self.device)


def greedy(logits: torch.Tensor, target_vocab: int) -> torch.Tensor:
    if logits.shape[-1] > target_vocab:  # a draft vocabulary padded past the target's
        logits = logits[:, :target_vocab]
    return logits.argmax(dim=-1)


class GreedyStep(torch.nn.Module):
    """A draft model as the decode graphs call a model, with its draw inside: the LM head and the
    argmax of every row join the captured step (eager, they were four launches from Python a step).
    The drawn ids are the graph runner's side output (`aux_hidden`, as a target's kept states)."""

    def __init__(self, model, target_vocab: int):
        super().__init__()
        self.model, self.target_vocab = model, target_vocab
        self.aux_hidden = None

    def forward(self, input_ids, positions, kv_layers, meta):
        hidden = self.model(input_ids, positions, kv_layers, meta)
        self.aux_hidden = greedy(self.model.compute_logits(hidden), self.target_vocab)
        return hidden
