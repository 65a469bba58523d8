"""Speculation's `eagle3` method: an EAGLE-3 head (eagle3.py) drafts from the target's own hidden
states, so it needs no second model, one decoder layer of its own.

The target keeps the residual stream at the input of three of its layers (DecoderLM.aux_layers) for
every token it computes; after each launch the rows of speculating requests are kept on the request
(`draft_inputs`, device tensors by first position). The head's input at position p is the target's
state there, fused by its `fc`, with the token drawn after p; its output draws the token after that.
So after a check that confirmed a tokens, the head first computes the a + 1 positions the target has
just computed (catch-up, from their kept states), which draws the first draft token, then feeds its
own output state forward for each further token.

The head's KV holds the positions it computed from the target's states; those it computed from its
own (the draft) are written again after the check. Kept states of positions a check did not confirm
are dropped when the target computes those positions again.
"""

from __future__ import annotations

from itertools import chain

import numpy as np
import torch
from torch import nn

from services.worker.engine.model_drafter import DraftModel, confirmed_kv_len, device_rows
from services.worker.engine.request import Request


class Eagle3Drafter(DraftModel):
    method = "eagle3"
    shift = 1  # the head's input at p is token p + 1

    def __init__(self, head, kv_cache, block_manager, device: torch.device, max_tokens: int, target_vocab: int):
        super().__init__(head, kv_cache, block_manager, device, max_tokens, target_vocab)
        self._state: dict[int, torch.Tensor] = {}  # item -> the head's output state at its last position

    def after_launch(self, scheduled, model) -> None:
        """Keep the target's states of the speculating requests' tokens: one gather on the device per
        step, a view of it per request (positions from the step's start)."""
        aux = model.aux_hidden
        if aux is None:
            return
        counts = np.fromiter((s.num_new_tokens for s in scheduled), dtype=np.int64, count=len(scheduled))
        offsets = np.cumsum(counts) - counts
        keep = [i for i, s in enumerate(scheduled) if s.request.speculates]
        if not keep:
            return
        rows = np.concatenate([np.arange(offsets[i], offsets[i] + counts[i]) for i in keep])
        kept = aux.index_select(0, device_rows(rows, aux.device))
        at = 0
        for i in keep:
            s, n = scheduled[i], int(counts[i])
            r = s.request
            # States from this step's start on are new: those kept from an earlier step are stale there.
            inputs = [(p, t[:s.start - p]) for p, t in r.draft_inputs if p < s.start]
            inputs.append((s.start, kept[at:at + n]))
            r.draft_inputs = inputs
            at += n

    def _first_position(self, r: Request) -> int | None:
        last = len(r.all_token_ids) - 2  # the last position the target computed
        covered = last + 1  # kept states cover [covered, last]
        for p, t in reversed(r.draft_inputs):
            if p + len(t) < covered:
                break
            covered = min(covered, p)
        if covered > last:
            return None  # no state of the last position: no draft this step
        return max(min(confirmed_kv_len(r), last), covered)

    def _drafted(self, r: Request, n: int, draft: list[int]) -> None:
        r.draft_kv_len, r.draft_kv_tail = n - 1, []  # the positions computed from the target's states
        r.draft_inputs = []
        self._state.clear()

    def _aux_rows(self, r: Request, start: int, num: int) -> torch.Tensor:
        parts = []
        for p, t in r.draft_inputs:
            lo, hi = max(start, p), min(start + num, p + len(t))
            if lo < hi:
                parts.append(t[lo - p:hi - p])
        return parts[0] if len(parts) == 1 else torch.cat(parts)

    def _step(self, scheduled, owners: list[int], first: bool, last_ids=None, last_rows=None) -> torch.Tensor:
        head = self.model
        if first:  # the catch-up: the target's states, the tokens drawn after them (known)
            hidden = head.fuse(torch.cat([self._aux_rows(s.request, s.start, s.num_new_tokens) for s in scheduled]))
            tokens = list(chain.from_iterable(
                s.request.all_token_ids[s.start + 1:s.start + 1 + s.num_new_tokens] for s in scheduled))
        else:  # a draft step: the head's own state, the token it drew (fed on the device)
            hidden, tokens = torch.cat([self._state[i] for i in owners]), None
        graph = self._graph_step(scheduled, last_rows)
        if graph is not None:  # the draw is in the graph too (HeadGraphStep): its ids are the side output
            staged, rows = graph
            if tokens is not None:
                staged.stage.tokens[:staged.n] = tokens
            self.graphs.model.hidden_in[:staged.n].copy_(hidden)
            prenorm, _ = self.graphs.launch(staged, last_ids)
            ids = self.graphs.model.aux_hidden[rows]
        else:
            inputs = self._eager_inputs(scheduled, last_ids, last_rows, tokens)
            normed, prenorm = head(inputs.input_ids, hidden, inputs.positions, self.kv_cache.layers[0], inputs.meta)
            rows = inputs.logits_indices
            ids = head.to_target(head.compute_logits(normed[rows]).argmax(dim=-1))
        out = prenorm[rows]
        for j, i in enumerate(owners):
            self._state[i] = out[j:j + 1]
        return ids


class HeadGraphStep(nn.Module):
    """The head as the decode graphs call a model, (tokens, positions, KV layers, metadata), its hidden
    input in a static buffer the drafter fills before each replay; returns its output state (prenorm),
    and draws inside the graph: every row's draft id (the target's) is the runner's side output,
    `aux_hidden` (eager, the draw was four launches from Python a step)."""

    def __init__(self, head, max_rows: int):
        super().__init__()
        self.head = head
        self.hidden_in = torch.zeros(max_rows, head.config.hidden_size, dtype=head.norm.dtype,
                                     device=head.norm.device)
        self.aux_hidden = None

    def forward(self, input_ids, positions, kv_layers, meta):
        head = self.head
        normed, prenorm = head(input_ids, self.hidden_in[:input_ids.shape[0]], positions, kv_layers[0], meta)
        self.aux_hidden = head.to_target(head.compute_logits(normed).argmax(dim=-1))
        return prenorm
