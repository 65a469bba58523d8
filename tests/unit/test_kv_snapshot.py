"""A worker's mirror of its announced prefix-cache blocks: the reports applied as a scheduler applies
them, the snapshot parts, and when it is put again."""

from __future__ import annotations

from services.scheduler.kv_index import KvIndex
from services.worker import kv_snapshot
from shared.messages import KvEvents, KvSnapshot
from shared.wire import decode, encode


def block(i: int) -> bytes:
    return i.to_bytes(16, "little")


def test_the_mirror_is_what_a_following_scheduler_holds(monkeypatch):
    mirror, index = kv_snapshot.KvMirror(), KvIndex()
    reports = [(1, [block(i) for i in range(10)], [], True), (2, [block(10)], [block(3)], False),
               (3, [], [block(0)], False)]
    for seq, stored, removed, cleared in reports:
        mirror.apply(seq, stored, removed, cleared)
        index.apply(KvEvents(worker_id="w", seq=seq, stored=stored, removed=removed, cleared=cleared), 0.0)
    assert mirror.blocks == index.blocks and mirror.seq == 3
    monkeypatch.setattr(kv_snapshot, "PART_BLOCKS", 4)
    parts = [decode(KvSnapshot, encode(s)) for s in mirror.snapshots("w")]
    assert [(p.part, p.parts, p.seq) for p in parts] == [(0, 3, 3), (1, 3, 3), (2, 3, 3)]
    late = KvIndex()
    joined = b"".join(p.blocks for p in parts)
    assert late.load(3, {joined[i:i + 16] for i in range(0, len(joined), 16)}, 0.0)
    assert late.blocks == index.blocks and late.complete
    assert not late.load(2, set(), 0.0)  # an older snapshot never replaces a newer view


def test_puts_while_changing_and_at_half_the_ttl_otherwise():
    mirror = kv_snapshot.KvMirror()
    assert mirror.due(0.0)  # never put
    mirror.put_seq, mirror.put_at = mirror.seq, 100.0
    assert not mirror.due(100.0 + kv_snapshot.SNAPSHOT_INTERVAL)
    assert mirror.due(100.0 + kv_snapshot.SNAPSHOT_TTL / 2)
    mirror.apply(1, [block(1)], [], False)
    assert not mirror.due(100.0 + kv_snapshot.SNAPSHOT_INTERVAL / 2)
    assert mirror.due(100.0 + kv_snapshot.SNAPSHOT_INTERVAL)
