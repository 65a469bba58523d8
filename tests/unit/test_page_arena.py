"""The hand-off buffer: page slots cut from one allocation (first fit, merged on release), and the
gather of a request's scattered blocks straight into a slot."""

import threading

import pytest
import torch

from services.worker.engine.kv_cache import KVCache
from services.worker.engine.kv_pages import gather_pages
from services.worker.engine.model_config import ModelConfig
from services.worker.engine.page_arena import PageArena

DEVICES = ["cpu"] + (["cuda"] if torch.cuda.is_available() else [])


def pool(num_blocks=12, layers=3, block_size=4, heads=2, dim=8, dtype=torch.float32, device="cpu"):
    return torch.empty((layers, 2, num_blocks, block_size, heads, dim), dtype=dtype, device=device)


def test_runs_are_first_fit_and_views_of_one_buffer():
    arena = PageArena(pool(), 10)
    a, free_a = arena.take(3)
    b, free_b = arena.take(4)
    assert a.shape == (3, 3, 2, 4, 2, 8) and b.shape[0] == 4
    assert a.data_ptr() == arena.buffer.data_ptr()
    assert b.data_ptr() == arena.buffer[3].data_ptr()
    assert arena.take(4) is None  # 3 left
    c, free_c = arena.take(3)
    assert c.data_ptr() == arena.buffer[7].data_ptr() and arena.free_pages == 0
    free_a()
    d, free_d = arena.take(2)  # the first free run: where a was
    assert d.data_ptr() == arena.buffer[0].data_ptr()
    assert arena.free_pages == 1


def test_release_merges_neighbours_and_is_idempotent():
    arena = PageArena(pool(), 10)
    slots = [arena.take(2) for _ in range(5)]
    assert arena.take(1) is None
    for i in (1, 3, 2):  # the middle three, out of order: they merge into one run of 6
        slots[i][1]()
    slots[2][1]()  # twice: no double free
    assert arena.free_pages == 6
    big, _ = arena.take(6)
    assert big.data_ptr() == arena.buffer[2].data_ptr()
    slots[0][1]()
    slots[4][1]()
    assert arena.free_pages == 4 and arena.take(3) is None  # two runs of 2, not one of 4


def test_take_and_release_from_two_threads():
    arena = PageArena(pool(), 64)

    def churn(seed):
        for i in range(500):
            got = arena.take(1 + (seed + i) % 5)
            if got is not None:
                got[1]()
    threads = [threading.Thread(target=churn, args=(s,)) for s in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert arena.free_pages == 64
    whole, _ = arena.take(64)  # everything merged back into one run
    assert whole.shape[0] == 64


def test_a_run_of_no_pages_is_refused():
    with pytest.raises(ValueError):
        PageArena(pool(), 4).take(0)


CFG = ModelConfig(architecture="LlamaForCausalLM", vocab_size=64, hidden_size=32, intermediate_size=64,
                  num_hidden_layers=3, num_attention_heads=4, num_key_value_heads=2, head_dim=8,
                  rms_norm_eps=1e-5, rope_theta=10000.0, max_position_embeddings=256, tie_word_embeddings=False)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float8_e4m3fn])
def test_gather_into_a_slot_equals_gather_pages(device, dtype):
    kv = KVCache(CFG, 12, 4, dtype, torch.device(device))
    raw = kv.pool.view(torch.uint8)  # any bytes; 0..119 are finite in every dtype here
    raw.copy_(torch.randint(0, 120, raw.shape, dtype=torch.uint8, device=device))
    blocks = [9, 2, 7, 3, 11]
    arena = PageArena(kv.pool, 8)
    arena.take(2)  # the slot starts at page 2 of the buffer, not at its base
    slot, release = arena.take(len(blocks))
    out = gather_pages(kv, blocks, slot)
    assert out.data_ptr() == slot.data_ptr()
    assert torch.equal(slot.view(torch.uint8), gather_pages(kv, blocks).view(torch.uint8))
    with pytest.raises(ValueError):
        gather_pages(kv, blocks[:3], slot)
    release()


class Event:
    """A CUDA event's query(), set by the test."""

    def __init__(self):
        self.done = False

    def query(self):
        return self.done


def test_a_retired_receive_slot_waits_for_its_reads_and_for_late_writes():
    """A decode worker's receive slot goes back only once the import's scatter has read it (its
    event) and the window in which a prefill worker may still write it (hold_until) has passed."""
    import time

    from services.worker.engine.kv_export import PageExporter

    kv = KVCache(CFG, num_blocks=8, block_size=4, dtype=torch.float32, device="cpu")
    exporter = PageExporter(kv, torch.device("cpu"), buffer_blocks=4)
    slot, release = exporter.receive_slot(3)
    assert slot.shape[0] == 3 and exporter.receive_slot(2) is None
    read = Event()
    exporter.retire(release, read)
    assert exporter.receive_slot(2) is None  # the scatter may still read it
    read.done = True
    slot, release = exporter.receive_slot(4)  # reaped: the whole buffer is free again
    exporter.retire(release, None, hold_until=time.monotonic() + 60)  # announced to a prefill worker
    assert exporter.receive_slot(1) is None
    exporter._retired = [(r, e, 0.0) for r, e, _ in exporter._retired]  # ... and its window has passed
    assert exporter.receive_slot(4) is not None
