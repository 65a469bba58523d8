"""Hand-off pages over CUDA IPC: descriptors checked before anything is mapped, a receiver that
cannot map refuses so the sender sends the bytes instead (real UCXX over loopback), and on a GPU
machine a second process copies a slot out of an exported buffer."""

from __future__ import annotations

import asyncio
import json
import subprocess
import sys
from types import SimpleNamespace

import pytest
import torch

from services.worker.engine.cuda_ipc import REFUSED, IpcError, IpcImporter, _fields, host_id
from services.worker.engine.kv_export import Handoff
from services.worker.handoff import HandoffReceiver, HandoffSender
from services.worker.step_loop import ImportCommand
from shared.kv_transfer import TransferClient, TransferServer

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
