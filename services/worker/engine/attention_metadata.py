"""Per-step tensors that tell attention where each token's KV lives in the paged cache."""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass(slots=True)
class AttentionMetadata:
    """Built once per step by the runner; read by every layer.

    Tokens of the step are laid out request after request: request b owns rows
    query_start_loc[b] : query_start_loc[b+1] and has seq_lens[b] tokens of context
    (cached prefix + the new ones).
    """

    slot_mapping: torch.Tensor  # [T] int64, flat KV slot of each new token
    block_tables: torch.Tensor  # [B, max_blocks] int32
    seq_lens: torch.Tensor  # [B] int32
    query_start_loc: torch.Tensor  # [B + 1] int32
    max_query_len: int
    max_seq_len: int
    # [2, n] int32: the extend kernel's work list (sequence, token tile), built on the host so the
    # launch's grid does not depend on the queries' lengths; None: the kernel sizes its own grid.
    tiles: torch.Tensor | None = None
    # The leading sequences that have one new token each (a mixed step's decodes, which the
    # batcher plans first): attention may give them to the decode kernel, the rest to the extend
    # kernel from tile decode_rows on. 0: the extend kernel takes every sequence.
    decode_rows: int = 0

    @property
    def decode_only(self) -> bool:
        return self.max_query_len == 1
