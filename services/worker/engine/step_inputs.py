"""Builds a step's model inputs on the host with numpy, then moves them in one copy."""

from __future__ import annotations

from dataclasses import dataclass
from itertools import chain

import numpy as np
import torch

from services.worker.engine.attention_metadata import AttentionMetadata
from services.worker.engine.block_tables import BlockTables
from services.worker.kernels.extend_attention import query_tiles


@dataclass(slots=True)
class StepInputs:
    input_ids: torch.Tensor  # [T]
    positions: torch.Tensor  # [T]
    meta: AttentionMetadata
    logits_indices: torch.Tensor  # [S] rows of the hidden states to sample from
    num_tokens: int
    num_seqs: int
    # input_ids[feed_dst] are the previous step's sampled ids[feed_src], still on the device
    feed_dst: torch.Tensor | None = None
    feed_src: torch.Tensor | None = None


def align_up(n: int, k: int) -> int:
    """n rounded up to a multiple of k."""
    return -(-n // k) * k


@dataclass(slots=True)
class HostStep:
    """A step's inputs on the host: every part back to back in one int64 array. Other ranks of a
    parallel group receive exactly this and upload it as the driver does."""

    flat: np.ndarray
    lens: tuple[int, ...]  # tokens, positions, slots, seq_lens, qsl, logits rows, tables, feed dst, feed src, tiles
    n_seq: int
    max_blocks: int
    max_query_len: int
    max_seq_len: int

    def offsets(self) -> np.ndarray:
        """Where each part starts in `flat`: on a 16-byte boundary (odd parts are padded), so a
        kernel handed a view sees the same pointer alignment every step. Triton specialises on
        it, and a new alignment would compile a kernel variant in the middle of serving."""
        return np.cumsum((0, *(align_up(n, 2) for n in self.lens)))

    def parts(self, buf=None) -> list:
        """The parts as views of `buf` (default: flat), in the order of `lens`."""
        buf = self.flat if buf is None else buf
        offs = self.offsets()
        return [buf[offs[i]:offs[i] + n] for i, n in enumerate(self.lens)]

    def fields(self) -> list[int]:
        return [self.n_seq, self.max_blocks, self.max_query_len, self.max_seq_len, *self.lens]

    @classmethod
    def from_fields(cls, fields, flat: np.ndarray) -> "HostStep":
        n_seq, max_blocks, max_query_len, max_seq_len, *lens = (int(x) for x in fields[:4 + NUM_PARTS])
        return cls(flat, tuple(lens), n_seq, max_blocks, max_query_len, max_seq_len)


NUM_PARTS = 10
NUM_FIELDS = 4 + NUM_PARTS


def build_step_inputs(scheduled, block_size: int, device: torch.device, pin: bool,
                      last_rows: dict[str, int] | None = None,
                      block_tables: BlockTables | None = None) -> StepInputs:
    return upload_step_inputs(pack_step_inputs(scheduled, block_size, last_rows, block_tables), device, pin)


def pack_step_inputs(scheduled, block_size: int, last_rows: dict[str, int] | None = None,
                     block_tables: BlockTables | None = None, drafts: bool = False) -> HostStep:
    """`scheduled`: ScheduledRequest items (request, start, num_new_tokens, samples,
    pending_input, num_logits). `drafts`: some item checks a jump-forward draft. `last_rows`: the previous step's sampled row of each request, for the
    inputs that are still on the device. `block_tables`: the block manager's mirror of the requests'
    block ids, whose rows make the block table in one gather (without it, the lists are read).

    One Python pass gathers each row's ints and lists; numpy does the per-token work (a mixed
    step carries ~1,000 decode rows beside its prefill chunks: per-row numpy calls cost ~10 ms)."""
    n_seq = len(scheduled)
    reqs = [s.request for s in scheduled]
    counts = np.fromiter((s.num_new_tokens for s in scheduled), dtype=np.int64, count=n_seq)
    starts = np.fromiter((s.start for s in scheduled), dtype=np.int64, count=n_seq)
    T = int(counts.sum())
    qsl = np.zeros(n_seq + 1, dtype=np.int64)
    np.cumsum(counts, out=qsl[1:])
    seq_lens = starts + counts
    row_of = np.repeat(np.arange(n_seq), counts)  # the row of each token
    positions = np.arange(T, dtype=np.int64) + np.repeat(starts - qsl[:-1], counts)

    # Inputs still on the device are written as 0 and fed on the device (runner.py).
    pending = [i for i, s in enumerate(scheduled) if s.pending_input]
    tokens = np.fromiter(chain.from_iterable(
        (0,) if s.pending_input else s.request.all_token_ids[s.start:s.start + s.num_new_tokens]
        for s in scheduled), dtype=np.int64, count=T)
    feed_dst = qsl[pending]
    feed_src = np.fromiter((last_rows[reqs[i].request_id] for i in pending), dtype=np.int64,
                           count=len(pending)) if pending else np.zeros(0, dtype=np.int64)

    n_blocks = np.fromiter((len(r.block_ids) for r in reqs), dtype=np.int64, count=n_seq)
    max_blocks = max(1, int(n_blocks.max())) if n_seq else 1
    rows = block_tables.rows(reqs) if block_tables is not None else None
    if rows is not None and (n_seq == 0 or rows.min() >= 0):
        tables = block_tables.ids[rows, :max_blocks]  # zero after each row's blocks (BlockTables' invariant)
    else:
        tables = np.zeros((n_seq, max_blocks), dtype=np.int64)
        flat_blocks = np.fromiter(chain.from_iterable(r.block_ids for r in reqs), dtype=np.int64,
                                  count=int(n_blocks.sum()))
        block_rows = np.repeat(np.arange(n_seq), n_blocks)
        tables[block_rows, np.arange(len(flat_blocks)) - np.repeat(np.cumsum(n_blocks) - n_blocks, n_blocks)] = \
            flat_blocks
    slots = tables[row_of, positions // block_size] * block_size + positions % block_size

    if drafts:  # jump-forward: a row for each token of a draft, and one after it
        n_logits = np.fromiter((s.num_logits if s.samples else 0 for s in scheduled), dtype=np.int64, count=n_seq)
        ends = np.cumsum(n_logits)
        logits_idx = np.repeat(qsl[1:] - n_logits, n_logits) + np.arange(int(ends[-1]) if n_seq else 0) \
            - np.repeat(ends - n_logits, n_logits)
    else:
        samples = np.fromiter((s.samples for s in scheduled), dtype=bool, count=n_seq)
        logits_idx = qsl[1:][samples] - 1
    tiles = query_tiles(counts).reshape(-1)
    parts = [tokens, positions, slots, seq_lens, qsl, logits_idx, tables.reshape(-1), feed_dst, feed_src, tiles]
    pad = np.zeros(1, dtype=np.int64)
    padded = [q for p in parts for q in ((p, pad) if len(p) & 1 else (p,))]
    return HostStep(np.concatenate(padded), tuple(len(p) for p in parts), n_seq, max_blocks,
                    int(counts.max()) if n_seq else 0, int(seq_lens.max()) if n_seq else 0)


def upload_step_inputs(step: HostStep, device: torch.device, pin: bool) -> StepInputs:
    """One host buffer, one transfer; the views below slice it on the device."""
    host = torch.from_numpy(step.flat)
    if device.type == "cuda":
        host = host.pin_memory() if pin else host
        dev = host.to(device, non_blocking=True)
    else:
        dev = host
    view = step.parts(dev)
    n_seq = step.n_seq
    not_one = np.flatnonzero(np.diff(step.parts()[4]) != 1)  # sequences with other than one new token
    decode_rows = int(not_one[0]) if len(not_one) else 0
    meta = AttentionMetadata(
        slot_mapping=view[2],
        block_tables=view[6].view(n_seq, step.max_blocks).to(torch.int32),
        seq_lens=view[3].to(torch.int32),
        query_start_loc=view[4].to(torch.int32),
        max_query_len=step.max_query_len,
        max_seq_len=step.max_seq_len,
        tiles=view[9].view(2, -1).to(torch.int32),
        decode_rows=decode_rows,
    )
    fed = (view[7], view[8]) if step.lens[7] else (None, None)
    return StepInputs(view[0], view[1], meta, view[5], int(step.lens[0]), n_seq, *fed)
