"""The prefix-cache blocks a worker has announced, put in JetStream for schedulers that start late."""

from __future__ import annotations

import math

from shared.messages import KvSnapshot
from shared.wire import encode

PART_BLOCKS = 32768  # 512 KiB of hashes a value: under NATS's 1 MB message limit
SNAPSHOT_INTERVAL = 5.0  # seconds between puts while the cache changes
SNAPSHOT_TTL = 60.0  # a worker gone this long leaves no snapshot behind; a live one puts again at half


class KvMirror:
    """The blocks the worker's KvEvents have announced so far, and when they were last put.

    A scheduler that was running follows the events; one that starts later (a replica, a restart)
    reads the snapshots first and follows the events from their seq on (services/scheduler)."""

    def __init__(self) -> None:
        self.blocks: set[bytes] = set()
        self.seq = 0
        self.put_seq = -1
        self.put_at = float("-inf")

    def apply(self, seq: int, stored, removed, cleared: bool) -> None:
        """One KvEvents report, as a scheduler applies it (a clear first)."""
        if cleared:
            self.blocks.clear()
        self.blocks.update(stored)
        self.blocks.difference_update(removed)
        self.seq = seq

    def due(self, now: float) -> bool:
        return now - self.put_at >= (SNAPSHOT_INTERVAL if self.seq != self.put_seq else SNAPSHOT_TTL / 2)

    def snapshots(self, worker_id: str) -> list[KvSnapshot]:
        blocks = list(self.blocks)
        parts = max(1, math.ceil(len(blocks) / PART_BLOCKS))
        return [KvSnapshot(worker_id=worker_id, seq=self.seq, part=i, parts=parts,
                           blocks=b"".join(blocks[i * PART_BLOCKS:(i + 1) * PART_BLOCKS])) for i in range(parts)]

    async def put(self, bucket, worker_id: str, now: float) -> None:
        """Every part under `{worker_id}.{part}` (a stale higher part of an older seq is ignored, and expires)."""
        seq = self.seq
        for snap in self.snapshots(worker_id):
            await bucket.put(f"{worker_id}.{snap.part}", encode(snap))
        self.put_seq, self.put_at = seq, now
