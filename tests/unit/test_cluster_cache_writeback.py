"""The worker's write-back bound: copies waiting for the kvstore never exceed their byte budget, and
"auto" writes back only blocks a fetch would pay for."""

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


def test_auto_writes_back_only_what_pays_for_its_put():
    c = cache(on_gpu=False, write_back="auto")
    c.fetch_bps.value, c.prefill_tps.value = 1e9, 5e3  # a 1 MiB page in 1 ms, its 16 tokens in 3.2 ms
    assert c.skip(hashes(6)) == 0 and c.pays(6) and not c.pays(0)
    c.prefill_tps.value = 1e5  # recomputing a block (0.16 ms) beats fetching it
    assert c.skip(hashes(6)) == 6 and not c.pays(6)
    assert cache(on_gpu=False, write_back="on").skip(hashes(6)) == 0  # "on" writes back regardless
    c.prefill_tps.value = 5e3
    c.put_block_s.add(0.5e-3)  # half a millisecond to store a block that saves 2.2 ms of prefill ...
    assert c.skip(hashes(6)) == 0
    c.reuse = 0.1  # ... but one in ten of the store's pages is ever read again
    assert c.skip(hashes(6)) == 6
