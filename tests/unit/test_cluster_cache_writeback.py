"""The worker's write-back bound: copies waiting for the kvstore never exceed their byte budget, and
write-back can be off."""

from __future__ import annotations

from services.worker.cluster_cache import QUEUE_BYTES_GPU, ClusterCache


def cache(on_gpu=True, write_back="on") -> ClusterCache:
    return ClusterCache(client=None, namespace="ns", page_bytes=1 << 20, block_size=16, model="m",
                        write_back=write_back, on_gpu=on_gpu)


def hashes(n: int) -> list[bytes]:
    return [i.to_bytes(16, "little") for i in range(n)]


def test_gpu_copies_are_bounded_by_bytes():
    c = cache()
    assert c.max_queue_bytes == QUEUE_BYTES_GPU == 256 << 20
    assert c.skip(hashes(300)) == 300  # 300 MiB would not fit: nothing is copied
    assert c.stats["dropped_pages"] == 300
    assert c.skip(hashes(10)) == 0
    c.queued_bytes = 250 << 20
    assert c.skip(hashes(10)) == 10


def test_known_pages_are_skipped_and_write_back_can_be_off():
    c = cache(on_gpu=False)
    c._remember(hashes(4))
    assert c.skip(hashes(6)) == 4
    assert cache(write_back="off").skip(hashes(6)) == 6
