"""Hand-off pages through host memory where UCX would move GPU memory over TCP: when, and the buffers."""

from __future__ import annotations

import torch

from services.worker.host_staging import ROUND, HostStaging, copy_pages, flat_bytes, should_stage


def test_auto_stages_where_ucx_has_no_gpu_path():
    same, other = "h1/boot", "h2/boot"
    assert should_stage("auto", same, same, ucx_tls="tcp,cuda_copy,self")  # UCX's own staging over TCP
    assert should_stage("auto", same, same, ucx_tls="tcp,sm,cuda_copy")
    for tls in ("", "tcp,cuda_copy,cuda_ipc", "rc,cuda_copy", "dc_x,tcp", "cuda,tcp", "^cuda_ipc", "all"):
        assert not should_stage("auto", same, same, ucx_tls=tls), tls
    assert should_stage("auto", same, other, ucx_tls="", rdma=False)  # another host, no RDMA: TCP
    assert not should_stage("auto", same, other, ucx_tls="", rdma=True)  # GPUDirect RDMA moves GPU memory
    assert not should_stage("auto", same, "", ucx_tls="", rdma=False)  # a peer that names no host: as UCX sees fit
    assert should_stage("host", same, same) and not should_stage("off", same, other, ucx_tls="tcp")


def test_buffers_are_reused_rounded_up_and_bounded():
    staging = HostStaging(keep_bytes=3 * ROUND)
    a = staging.take(1000)
    assert a.numel() == 1000 and a._base.numel() == ROUND and staging.made == 1
    staging.give(a)
    b = staging.take(ROUND)  # the kept buffer fits: no new one
    assert staging.made == 1 and b.numel() == ROUND
    c = staging.take(ROUND + 1)  # two rounds
    assert staging.made == 2 and c._base.numel() == 2 * ROUND
    staging.give(b)
    staging.give(c)
    d = staging.take(10)  # the smallest that fits
    assert d._base.numel() == ROUND
    staging.give(d)
    staging.give(staging.take(3 * ROUND))  # 1 + 2 + 3 rounds kept would pass the bound: the smallest go
    assert sorted(x.numel() // ROUND for x in staging._free) == [3]


def test_pages_round_trip_through_a_staging_buffer_bit_exact():
    pages = torch.randn(5, 2, 16, 8, dtype=torch.bfloat16)
    staging = HostStaging()
    staged = staging.take(pages.numel() * pages.element_size())
    copy_pages(staged, flat_bytes(pages))
    out = torch.empty_like(pages)
    copy_pages(flat_bytes(out), staged)
    assert torch.equal(out.view(torch.int16), pages.view(torch.int16))
    try:
        flat_bytes(pages.transpose(0, 1))  # never a silent copy of a strided view
    except RuntimeError:
        pass
    else:
        raise AssertionError("flat_bytes copied a strided tensor")


def test_staged_frames_to_one_decode_worker_take_turns_and_share_one_buffer():
    """Frames waiting for one decode worker's endpoint hold no host buffer: one is made and reused
    (pinning a new one costs ~1 s a GB), and each frame carries its own pages."""
    import asyncio
    from types import SimpleNamespace

    from services.worker.handoff import HandoffSender

    sent = []

    class Endpoint:  # the transfer client's contract: one frame, one reply header
        async def call(self, address, header, payload, timeout):
            sent.append((header["staged"], bytes(payload.numpy())))
            await asyncio.sleep(0.01)
            return {"ok": True}, None

    staging = HostStaging()
    sender = HandoffSender(None, "p", "w", "layout", 64, Endpoint(), staging=staging, staging_mode="host")
    pages = [torch.full((2, 8), float(i)) for i in range(5)]

    async def main():
        return await asyncio.gather(*(sender._deliver("decode:1", {"op": "kv_handoff"},
                                                      SimpleNamespace(pages=p, in_buffer=False), 0, "")
                                      for p in pages))

    replies = asyncio.run(main())
    assert all(r == ({"ok": True}, False) for r in replies)
    assert staging.made == 1 and sender.stats["staged"] == 5
    assert sorted(payload for _, payload in sent) == sorted(bytes(flat_bytes(p).numpy()) for p in pages)
