"""Where a checkpoint tensor lands in the built model, and which part of it a rank of a group loads."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True, slots=True)
class Placement:
    """Where one checkpoint tensor lands: a parameter, and the first row inside it (a row of its last
    dimension: the experts of a stacked [E, N, K] parameter are E × N rows)."""

    param: str
    row: int
    shape: tuple[int, ...]
    # The checkpoint holds each matrix transposed, [.., cols, rows] for this [.., rows, cols] (Llama 4's
    # stacked experts): its bytes land as stored, and the loader turns each matrix after the load.
    transpose: bool = False

    @property
    def stored_shape(self) -> tuple[int, ...]:
        """The checkpoint tensor's shape when it is all of it."""
        return (*self.shape[:-2], self.shape[-1], self.shape[-2]) if self.transpose else self.shape


@dataclass(frozen=True, slots=True)
class Slice:
    """The part of a checkpoint tensor a rank loads: `length` rows (dim 0) or columns (dim 1)
    from `start`. Rows are one byte range of the file; columns are a strided read."""

    dim: int
    start: int
    length: int


@dataclass(frozen=True, slots=True)
class ShardedTensor:
    """What one rank of a parallel group loads of a checkpoint tensor."""

    full_shape: tuple[int, ...]  # as stored in the checkpoint (checked before loading)
    place: Placement  # where this rank's part lands in its local parameter
    slice: Slice | None = None  # None: the whole tensor (replicated)
