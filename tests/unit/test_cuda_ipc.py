"""Hand-off pages over CUDA IPC: descriptors checked before anything is mapped, a receiver that
cannot map refuses so the sender sends the bytes instead (real UCXX over loopback), and on a GPU
machine a second process copies a slot out of an exported buffer."""

from __future__ import annotations

import asyncio
import dataclasses
import json
import subprocess
import sys
import time
from types import SimpleNamespace

import pytest
import torch

from services.worker.engine.cuda_ipc import REFUSED, IpcError, IpcExporter, IpcImporter, _fields, host_id
from services.worker.engine.kv_export import Handoff
from services.worker.handoff import HandoffSender
from services.worker.handoff_receiver import PUSH_GRACE, HandoffReceiver
from services.worker.step_loop import ImportCommand
from shared.handoff_messages import KvHandoffOffer, KvHandoffReady
from shared.kv_transfer import TransferClient, TransferServer
from shared.messages import GenerateRequest, WireSamplingParams, pack_ids
from shared.sampling_params import SamplingParams
from shared.wire import encode

STORAGE = [b"h" * 64, 1 << 20, 0, b"/torch_ref", 0, None, False]  # torch's sharing fields
GOOD = {"storage": STORAGE, "offset": 4096, "nbytes": 16}


@pytest.mark.parametrize("bad", [
    None, [], {**GOOD, "storage": STORAGE[:6]}, {**GOOD, "storage": ["h" * 64, *STORAGE[1:]]},
    {**GOOD, "storage": [b"", *STORAGE[1:]]}, {**GOOD, "storage": [*STORAGE[:6], "no"]},
    {**GOOD, "storage": [STORAGE[0], -1, *STORAGE[2:]]}, {**GOOD, "offset": -1},
    {**GOOD, "nbytes": 1.5}, {**GOOD, "nbytes": True}, {k: v for k, v in GOOD.items() if k != "offset"},
])
def test_malformed_descriptors_are_refused_before_anything_is_mapped(bad):
    with pytest.raises(IpcError):
        _fields(bad)
    assert _fields(GOOD) == (STORAGE, 4096, 16)


def test_the_host_id_names_this_host_and_boot():
    assert host_id() == host_id() and "/" in host_id()


class StepLoopRecorder:
    def __init__(self):
        self.commands = []

    def submit(self, command):
        self.commands.append(command)


class DescribeAnything:
    """Stands in for the CUDA export on a CPU machine: any pages get a (bogus) descriptor."""

    def describe(self, pages):
        return {"storage": STORAGE, "offset": 0, "nbytes": pages.numel() * pages.element_size()}


def test_a_receiver_without_cuda_ipc_refuses_descriptors_and_the_bytes_come_instead():
    pages = torch.arange(2 * 3 * 8, dtype=torch.float32).reshape(2, 3, 8)

    async def run():
        step_loop = StepLoopRecorder()
        receiver = HandoffReceiver(step_loop, "layout", 96, "", ttl=5.0, ipc=None, host_id="h")
        assert receiver.host_id == ""  # it does not announce IPC it cannot take
        server = TransferServer(receiver.on_frame, receiver.allocate).start()
        refused = await receiver._copy_in({"ipc": GOOD}, SimpleNamespace(buffer=torch.empty(4), allocated=None))
        assert isinstance(refused, str) and refused.startswith(REFUSED)

        offer = SimpleNamespace(request=SimpleNamespace(request_id="r1", reply_to="inbox"), first_token=5, seed=7,
                                num_cached_tokens=0)
        buffer = torch.zeros_like(pages)
        expiry = asyncio.get_running_loop().call_later(5.0, lambda: None)
        receiver.waiting["t1"] = (offer, SimpleNamespace(buffer=buffer), expiry)

        transfer = TransferClient()
        sender = HandoffSender(None, "", "prefill-0", "layout", 96, transfer, timeout=5.0,
                               ipc=DescribeAnything(), host_id="h")
        handoff = Handoff(pages, seed=7, num_cached_tokens=0, release=lambda: None)
        assert handoff.in_buffer
        try:
            reply, via_ipc = await sender._deliver(server.address, {"op": "kv_handoff", "transfer_id": "t1"},
                                                   handoff, 0, "h")
            assert not via_ipc
        finally:
            await transfer.close()
            await server.close()
        return reply, sender, step_loop, buffer, receiver

    reply, sender, step_loop, buffer, receiver = asyncio.run(run())
    assert reply == {"ok": True, "nbytes": 0}
    assert torch.equal(buffer, pages)  # the fallback pushed the bytes into the reservation
    assert sender._no_ipc and sender.stats["ipc"] == 0  # and it will not offer this worker a descriptor again
    assert not receiver.waiting and receiver.stats["imports"] == 1 and receiver.stats["ipc"] == 0
    (command,) = step_loop.commands
    assert isinstance(command, ImportCommand) and command.first_token == 5


def test_the_sender_describes_only_pages_in_the_buffer_for_a_worker_of_its_host():
    sender = HandoffSender(None, "", "p", "layout", 96, None, ipc=DescribeAnything(), host_id="h")
    pages = torch.zeros(2, 4)
    in_buffer = Handoff(pages, 0, 0, release=lambda: None)
    assert sender._describe(pages, in_buffer, "a:1", "h") is not None
    assert sender._describe(pages, in_buffer, "a:1", "other") is None  # another host
    assert sender._describe(pages, in_buffer, "a:1", "") is None  # a CPU decode worker announces none
    assert sender._describe(pages, Handoff(pages, 0, 0), "a:1", "h") is None  # a fresh allocation
    assert sender._describe(pages[:0], in_buffer, "a:1", "h") is None  # nothing to send
    sender._no_ipc.add("a:1")
    assert sender._describe(pages, in_buffer, "a:1", "h") is None


class Done:
    def query(self):
        return True


class WriteInto:
    """Stands in for the CUDA IPC push on a CPU machine: the "mapped" slot is the receiver's own tensor."""

    def __init__(self, slot: torch.Tensor):
        self.slot, self.writes = slot, 0

    def copy_to(self, src, desc, after=None, timing=False, owner=""):
        assert desc["nbytes"] == src.numel() * src.element_size() and owner == "decode-0"
        self.slot.copy_(src)
        self.writes += 1
        return None, Done()


def reservation(buffer, release=lambda: None):
    return SimpleNamespace(buffer=buffer, skip_blocks=0, release=release, hold_until=0.0, allocated=None)


def prepared(receiver, rid, res):
    done = asyncio.get_running_loop().create_future()
    done.set_result(res)
    receiver.prepared[rid] = (done, asyncio.get_running_loop().call_later(5.0, lambda: None))


def offer_of(rid, num_pages):
    request = GenerateRequest(request_id=rid, model="m", prompt_ids=pack_ids([1, 2, 3]), reply_to="inbox",
                              sampling=WireSamplingParams.from_params(SamplingParams(max_tokens=4)),
                              worker_id="prefill-0", decode_worker_id="decode-0")
    return KvHandoffOffer(request=request, first_token=5, seed=7, num_cached_tokens=0, layout="layout",
                          page_bytes=96, num_pages=num_pages, prefill_worker_id="prefill-0", transfer_id="t")


def test_the_decode_worker_announces_only_hand_off_buffer_slots_and_holds_them_past_the_window():
    async def run():
        receiver = HandoffReceiver(StepLoopRecorder(), "layout", 96, "a:1", ttl=5.0, ipc=object(), host_id="h",
                                   slots=DescribeAnything())
        fresh = reservation(torch.zeros(2, 3, 8), release=None)  # allocated, not cut from the buffer
        assert receiver._push_target(fresh) is None and fresh.hold_until == 0.0
        slot = reservation(torch.zeros(2, 3, 8))
        t0 = time.time()
        target = receiver._push_target(slot)
        assert target is not None and target.nbytes == 2 * 3 * 8 * 4
        assert t0 + 5.0 <= target.until <= time.time() + 5.0  # the write window: the prepare's TTL
        assert slot.hold_until >= time.monotonic() + 5.0 + PUSH_GRACE - 1  # the slot outlives it
        assert target.descriptor() == DescribeAnything().describe(slot.buffer)
        # a worker without IPC (a CPU worker) or with pushes turned off announces none
        for no_push in (HandoffReceiver(StepLoopRecorder(), "layout", 96, "a:1", ipc=None, slots=DescribeAnything()),
                        HandoffReceiver(StepLoopRecorder(), "layout", 96, "a:1", ipc=object(), slots=None)):
            assert no_push._push_target(reservation(torch.zeros(2, 3, 8))) is None

    asyncio.run(run())


def test_the_prefill_worker_writes_the_announced_slot_and_the_frame_only_says_so():
    """Over real UCXX: the pages go into the decode worker's slot before the frame, which carries
    no bytes; the decode worker imports without copying. Where the slot cannot be written (another
    host, its window passed, a pusher that CUDA refuses), the frame carries the bytes as before."""
    pages = torch.arange(2 * 3 * 8, dtype=torch.float32).reshape(2, 3, 8)

    async def run():
        step_loop = StepLoopRecorder()
        receiver = HandoffReceiver(step_loop, "layout", 96, "", ttl=5.0, ipc=object(), host_id="h",
                                   slots=DescribeAnything())
        server = TransferServer(receiver.on_frame, receiver.allocate).start()
        transfer = TransferClient()
        results = {}
        try:
            for case in ("push", "other host", "late", "refused"):
                rid = f"r-{case}"
                res = reservation(torch.zeros_like(pages))
                prepared(receiver, rid, res)
                target = receiver._push_target(res)
                if case == "late":
                    target = dataclasses.replace(target, until=time.time() - 1)
                ready = KvHandoffReady(request_id=rid, decode_worker_id="decode-0", skip_pages=0, num_pages=2,
                                       address=server.address, layout="layout", page_bytes=96,
                                       host_id="elsewhere" if case == "other host" else "h", push=target)
                pusher = WriteInto(res.buffer)
                if case == "refused":
                    pusher.copy_to = lambda *a, **k: (_ for _ in ()).throw(IpcError("no peer access"))
                sender = HandoffSender(None, "", "prefill-0", "layout", 96, transfer, timeout=5.0, host_id="h",
                                       pusher=pusher)
                handoff = Handoff(pages, seed=7, num_cached_tokens=0)
                delivered, via_ipc, copy_s = await sender._push_direct(ready, offer_of(rid, 2), handoff)
                results[case] = (delivered, via_ipc, copy_s, pusher.writes, sender.stats["pushed"],
                                 torch.equal(res.buffer, pages), sender.pusher is None)
        finally:
            await transfer.close()
            await server.close()
        return results, receiver, step_loop

    results, receiver, step_loop = asyncio.run(run())
    assert results["push"][:2] == (True, True) and results["push"][3:] == (1, 1, True, False)
    for case in ("other host", "late"):  # the bytes came in the frame, and nothing was written
        assert results[case][:2] == (True, False) and results[case][3:] == (0, 0, True, False)
    assert results["refused"][:2] == (True, False) and results["refused"][4:] == (0, True, True)  # pushes off
    assert receiver.stats["pushed"] == 1 and receiver.stats["imports"] == 4 and receiver.stats["ipc"] == 1
    assert [c.request_id for c in step_loop.commands] == ["r-push", "r-other host", "r-late", "r-refused"]


def test_a_pushed_frame_for_a_slot_never_announced_is_refused():
    async def run():
        receiver = HandoffReceiver(StepLoopRecorder(), "layout", 96, "", ttl=5.0, ipc=object(), host_id="h",
                                   slots=DescribeAnything())
        res = reservation(torch.zeros(2, 3, 8))
        prepared(receiver, "r1", res)  # reserved, but its slot was never announced
        header = {"op": "kv_handoff_direct", "request_id": "r1", "offer": encode(offer_of("r1", 2)),
                  "pushed": 2 * 3 * 8 * 4}
        return await receiver._on_direct(header), receiver

    reply, receiver = asyncio.run(run())
    assert "never announced" in reply["error"] and receiver.stats["imports"] == 0


def test_the_importer_keeps_one_mapping_per_prefill_worker(monkeypatch):
    """A mapping pins the peer's memory even after its owner freed it: an owner's new storage
    (restart, model reload) replaces its old mapping; at most `keep` owners are mapped."""
    import services.worker.engine.cuda_ipc as cuda_ipc

    opened = []

    def fake_open(fields, device):
        opened.append(fields[0])
        return torch.zeros(16, dtype=torch.uint8)

    monkeypatch.setattr(cuda_ipc, "open_shared", fake_open)
    importer = IpcImporter(keep=2)
    first = importer._map([b"a" * 64, *STORAGE[1:]], "cpu", "prefill-0")
    assert importer._map([b"a" * 64, *STORAGE[1:]], "cpu", "prefill-0") is first and len(opened) == 1
    importer._map([b"b" * 64, *STORAGE[1:]], "cpu", "prefill-0")  # prefill-0 restarted: a new buffer
    assert importer.owners == ["prefill-0"] and len(opened) == 2
    importer._map([b"c" * 64, *STORAGE[1:]], "cpu", "prefill-1")
    importer._map([b"d" * 64, *STORAGE[1:]], "cpu", "prefill-2")
    assert importer.owners == ["prefill-1", "prefill-2"]  # the least recently used owner went
    importer.close()
    assert importer.owners == []


CHILD = r"""
import json, sys, torch
from services.worker.engine.cuda_ipc import IpcExporter
device = torch.device("cuda", int(sys.argv[1]))
torch.cuda.set_device(device)
buf = (torch.arange(1 << 22, dtype=torch.int64, device=device) * 7 % 251).to(torch.uint8)
exporter = IpcExporter()
desc = exporter.describe(buf[4096:4096 + 65536])
assert exporter.describe(buf[8192:8200])["storage"] is desc["storage"]  # shared once
torch.cuda.synchronize()
wire = [f.hex() if isinstance(f, bytes) else f for f in desc["storage"]]
print(json.dumps({**desc, "storage": wire}), flush=True)
sys.stdin.readline()
"""


@pytest.mark.skipif(not torch.cuda.is_available(), reason="CUDA IPC needs a GPU")
def test_a_second_process_copies_a_slot_out_of_the_exported_buffer():
    src = 1 if torch.cuda.device_count() > 1 else 0  # a peer GPU where there is one
    child = subprocess.Popen([sys.executable, "-c", CHILD, str(src)], stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                             text=True)
    try:
        desc = json.loads(child.stdout.readline())
        desc["storage"] = [bytes.fromhex(f) if i in (0, 3, 5) and f is not None else f
                           for i, f in enumerate(desc["storage"])]
        assert desc["offset"] == 4096 and desc["nbytes"] == 65536
        dst = torch.empty(65536, dtype=torch.uint8, device="cuda:0")
        expected = (torch.arange(4096, 4096 + 65536, dtype=torch.int64) * 7 % 251).to(torch.uint8)
        importer = IpcImporter()
        start, end = importer.copy_into(dst, desc, timing=True)
        end.synchronize()
        assert torch.equal(dst.cpu(), expected) and start.elapsed_time(end) >= 0
        with pytest.raises(IpcError):  # beyond the shared storage
            importer.copy_into(torch.empty(1 << 23, dtype=torch.uint8, device="cuda:0"), {**desc, "nbytes": 1 << 23})
        _, end = importer.copy_into(dst[:8], {**desc, "offset": 8192, "nbytes": 8})  # mapped once, reused
        end.synchronize()
        assert torch.equal(dst[:8].cpu(), expected[4096:4104])
        importer.close()
    finally:
        child.stdin.write("done\n")
        child.stdin.flush()
        child.wait(timeout=30)


PUSH_CHILD = r"""
import json, sys, torch
from services.worker.engine.cuda_ipc import IpcExporter
device = torch.device("cuda", int(sys.argv[1]))
torch.cuda.set_device(device)
buf = torch.zeros(1 << 20, dtype=torch.uint8, device=device)  # a receive buffer: slots are cut from it
desc = IpcExporter().describe(buf[8192:8192 + 65536])
torch.cuda.synchronize()
wire = [f.hex() if isinstance(f, bytes) else f for f in desc["storage"]]
print(json.dumps({**desc, "storage": wire}), flush=True)
sys.stdin.readline()  # the peer has written the slot
expected = (torch.arange(65536, device=device) * 13 % 256).to(torch.uint8)
print(json.dumps({"slot": bool(torch.equal(buf[8192:8192 + 65536], expected)),
                  "rest": int(buf[:8192].count_nonzero() + buf[8192 + 65536:].count_nonzero())}), flush=True)
sys.stdin.readline()
"""


@pytest.mark.skipif(not torch.cuda.is_available(), reason="CUDA IPC needs a GPU")
def test_a_second_process_writes_a_slot_of_the_exported_buffer():
    """The push: the prefill side writes the decode side's announced slot, and nothing around it."""
    dst = 1 if torch.cuda.device_count() > 1 else 0
    child = subprocess.Popen([sys.executable, "-c", PUSH_CHILD, str(dst)], stdin=subprocess.PIPE,
                             stdout=subprocess.PIPE, text=True)
    try:
        desc = json.loads(child.stdout.readline())
        desc["storage"] = [bytes.fromhex(f) if i in (0, 3, 5) and f is not None else f
                           for i, f in enumerate(desc["storage"])]
        src = (torch.arange(65536, device="cuda:0") * 13 % 256).to(torch.uint8)
        importer = IpcImporter()
        start, end = importer.copy_to(src, desc, timing=True, owner="decode-0")
        end.synchronize()
        assert start.elapsed_time(end) >= 0
        with pytest.raises(IpcError):  # a source of another size than the slot
            importer.copy_to(src[:100], desc, owner="decode-0")
        child.stdin.write("written\n")
        child.stdin.flush()
        assert json.loads(child.stdout.readline()) == {"slot": True, "rest": 0}
        importer.close()
    finally:
        child.stdin.write("done\n")
        child.stdin.flush()
        child.wait(timeout=30)
