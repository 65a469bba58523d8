"""The workers' prefix-cache snapshots in JetStream, read by a scheduler that starts late."""

from __future__ import annotations

import nats.js.errors

from shared.messages import KvSnapshot
from shared.subjects import kv_snapshot_bucket
from shared.wire import DecodeCounter, safe_decode

HASH_BYTES = 16


async def read_snapshots(conn, prefix: str, counter: DecodeCounter) -> dict[str, tuple[int, set[bytes]]]:
    """worker id → (seq, blocks) of each worker whose snapshot parts are all there for one seq (a
    worker mid-put, or with a stale part of an older seq, is left to its live events)."""
    bucket = await conn.kv_bucket(kv_snapshot_bucket(prefix))
    try:
        keys = await bucket.keys()
    except nats.js.errors.NoKeysError:
        return {}
    parts: dict[str, dict[int, KvSnapshot]] = {}
    for key in keys:
        entry = await bucket.get(key)
        snap = safe_decode(KvSnapshot, entry.value, counter, key) if entry.value else None
        if snap is not None:
            parts.setdefault(snap.worker_id, {})[snap.part] = snap
    out = {}
    for worker_id, by_part in parts.items():
        newest = max(s.seq for s in by_part.values())
        current = [s for s in by_part.values() if s.seq == newest]
        if len(current) == current[0].parts:
            blocks = b"".join(s.blocks for s in current)
            out[worker_id] = newest, {blocks[i:i + HASH_BYTES] for i in range(0, len(blocks), HASH_BYTES)}
    return out
