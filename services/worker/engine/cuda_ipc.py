"""GPU memory of one process mapped by another of the same host (CUDA IPC), with torch's own
sharing fields: the one-shot all-reduce's peer buffers, and the prefill → decode hand-off.

The hand-off, both ways round. Pull: the prefill worker cuts every hand-off from one long-lived
buffer (page_arena.py) and shares that buffer once; the decode worker maps it once and copies each
hand-off's slot into its receive buffer on its own stream, a peer copy over NVLink. Push (when the
decode worker announced a receive slot of its own long-lived buffer): the prefill worker maps that
buffer once and writes the slot itself, so the decode worker's handler copies nothing. Only the
sharing fields, an offset and a length cross the wire. Why: UCXX through Python moved a
3,000-token prompt's 375 MiB at ~100 GB/s (3.7 ms p50, four H100s, 2026-11-27) where a peer copy
runs at ~390 GB/s, and a warm buffer on the prefill side did not change that. Where IPC is not
possible (another host or container, a CPU worker) the receiver refuses the descriptor and the
pages go over UCXX as before.

A mapping is opened on the *caller's* device, so CUDA enables peer access from it to the owner's
and the tensor reads as local to it: copies from it are plain device copies on our streams.
"""

from __future__ import annotations

import functools
import socket
import threading
from collections import OrderedDict
from typing import TYPE_CHECKING

if TYPE_CHECKING:  # torch loads with the engine, not with the worker's service code
    import torch

REFUSED = "cuda ipc refused"  # a receiver's error starting with this: send the bytes instead


class IpcError(RuntimeError):
    pass


def share(t: torch.Tensor) -> list:
    """What another process needs to map t's storage (torch.multiprocessing's own fields). Each
    call wraps the storage in a new reference count: share a long-lived storage once."""
    _device, handle, size, offset, ref_handle, ref_offset, event_handle, event_sync = t.untyped_storage()._share_cuda_()
    return [handle, size, offset, ref_handle, ref_offset, event_handle, event_sync]


def open_shared(fields: list, device: torch.device) -> torch.Tensor:
    """Map a peer's storage into this process on `device` (ours), as a flat uint8 tensor."""
    import torch

    handle, size, offset, ref_handle, ref_offset, event_handle, event_sync = fields
    storage = torch.UntypedStorage._new_shared_cuda(device.index, handle, size, offset, ref_handle, ref_offset,
                                                    event_handle, event_sync)
    return torch.empty(0, dtype=torch.uint8, device=device).set_(storage, 0, (size,), (1,))


@functools.cache
def host_id() -> str:
    """Which host (and boot) this process runs on: IPC is tried only between equal ids."""
    try:
        with open("/proc/sys/kernel/random/boot_id") as f:
            boot = f.read().strip()
    except OSError:
        boot = ""
    return f"{socket.gethostname()}/{boot}"


class IpcExporter:
    """Descriptors of CUDA tensors (the prefill side's hand-off slots to pull, the decode side's
    receive slots to push into); each storage is shared once (cached). The
    cache holds the storages it shared: one freed while cached could give its address to a new
    allocation, whose pages would then go out under the old storage's handle."""

    def __init__(self):
        self._shared: dict[int, tuple[object, list]] = {}  # storage pointer → (storage, sharing fields)
        self._lock = threading.Lock()

    def describe(self, tensor: torch.Tensor) -> dict:
        """{"storage", "offset", "nbytes"}: the tensor's storage and where its bytes lie in it."""
        if not tensor.is_cuda or not tensor.is_contiguous():
            raise IpcError("only contiguous CUDA tensors can be shared")
        storage = tensor.untyped_storage()
        with self._lock:
            entry = self._shared.get(storage.data_ptr())
            if entry is None:
                try:
                    entry = self._shared[storage.data_ptr()] = (storage, share(tensor))
                except RuntimeError as e:
                    raise IpcError(f"cannot share this memory: {e}") from e
            fields = entry[1]
        return {"storage": fields, "offset": tensor.storage_offset() * tensor.element_size(),
                "nbytes": tensor.numel() * tensor.element_size()}


class IpcImporter:
    """Peer storages mapped once, one per owner (the decode side maps prefill workers' buffers to
    pull, the prefill side decode workers' to push) and the last `keep` owners, and copies out of
    or into them on a stream of its own. A mapping keeps the peer's
    memory allocated even after its owner freed it (CUDA IPC), so an owner's new storage (a
    restart, a model reload) replaces its old mapping at once. One copy at a time: in chunks on
    2-8 streams (several copy engines) a 362 MiB pull was no faster (four H100s, 2026-11-27:
    1.00 ms on one, 1.01-1.05 ms on more; bench/ipc_copy_probe.py at db19122)."""

    def __init__(self, keep: int = 8):
        self.keep = keep
        self._stream = None
        self._mapped: OrderedDict[str, tuple[bytes, torch.Tensor]] = OrderedDict()  # owner → (handle, mapping)
        self._lock = threading.Lock()

    def copy_into(self, dst: torch.Tensor, desc, after=None, timing: bool = False, owner: str = ""):
        """Pull: enqueue a copy of the described bytes (shared by `owner`) into the contiguous CUDA
        tensor `dst`, behind the CUDA event `after`; returns (start, end) CUDA events (start None
        unless `timing`). IpcError when the descriptor is malformed, out of bounds or cannot be mapped."""
        import torch

        peer = self._peer_bytes(desc, dst, owner)
        return self._enqueue(dst, lambda: dst.view(-1).view(torch.uint8).copy_(peer, non_blocking=True),
                             after, timing)

    def copy_to(self, src: torch.Tensor, desc, after=None, timing: bool = False, owner: str = ""):
        """Push: enqueue a copy of the contiguous CUDA tensor `src` into the described bytes (shared
        by `owner`), behind `after`; returns (start, end) as copy_into. NVLink writes: the prefill
        worker's copy engine fills the decode worker's receive slot, so neither side's SMs move the
        bytes, and the decode worker's handler has nothing left to copy."""
        import torch

        peer = self._peer_bytes(desc, src, owner)
        return self._enqueue(src, lambda: peer.copy_(src.view(-1).view(torch.uint8), non_blocking=True),
                             after, timing)

    def _peer_bytes(self, desc, local: torch.Tensor, owner: str) -> torch.Tensor:
        """The described bytes of a peer's storage, mapped on `local`'s device, checked against it."""
        fields, offset, nbytes = _fields(desc)
        if nbytes != local.numel() * local.element_size() or not local.is_contiguous():
            raise IpcError(f"{nbytes} bytes described, the local buffer holds {local.numel() * local.element_size()}")
        peer = self._map(fields, local.device, owner)
        if offset + nbytes > peer.numel():
            raise IpcError(f"bytes {offset}..{offset + nbytes} lie outside the shared {peer.numel()} bytes")
        return peer[offset:offset + nbytes]

    def _enqueue(self, local: torch.Tensor, copy, after, timing: bool):
        import torch

        if self._stream is None:
            self._stream = torch.cuda.Stream(local.device)
        stream = self._stream
        start = torch.cuda.Event(enable_timing=True) if timing else None
        if after is not None:
            stream.wait_event(after)
        if start is not None:
            start.record(stream)
        with torch.cuda.stream(stream):
            copy()
        local.record_stream(stream)  # the local buffer is not reused before its copy ends
        end = torch.cuda.Event(enable_timing=timing)
        end.record(stream)
        return start, end

    def _map(self, fields: list, device: torch.device, owner: str) -> torch.Tensor:
        handle = fields[0]
        with self._lock:
            entry = self._mapped.get(owner)
            if entry is not None and entry[0] == handle:
                self._mapped.move_to_end(owner)
                return entry[1]
            self._mapped.pop(owner, None)  # that owner's previous storage: let its memory go
            try:
                peer = open_shared(fields, device)
            except RuntimeError as e:
                raise IpcError(f"cannot map the peer's memory: {e}") from e
            self._mapped[owner] = (handle, peer)
            while len(self._mapped) > self.keep:
                self._mapped.popitem(last=False)
            return peer

    @property
    def owners(self) -> list[str]:
        with self._lock:
            return list(self._mapped)

    def close(self) -> None:
        with self._lock:
            self._mapped.clear()


def _fields(desc) -> tuple[list, int, int]:
    """A descriptor from the wire, checked: a foreign frame must not make us map or read garbage."""
    if not isinstance(desc, dict):
        raise IpcError("the descriptor is not a map")
    fields, offset, nbytes = desc.get("storage"), desc.get("offset"), desc.get("nbytes")
    if not isinstance(fields, list) or len(fields) != 7:
        raise IpcError("the storage must be torch's 7 sharing fields")
    handle, size, base, ref_handle, ref_offset, event_handle, event_sync = fields
    if not (isinstance(handle, bytes) and handle and isinstance(ref_handle, bytes)
            and (event_handle is None or isinstance(event_handle, bytes)) and isinstance(event_sync, bool)):
        raise IpcError("the storage's handles must be bytes")
    for name, value in (("offset", offset), ("nbytes", nbytes), ("size", size), ("base", base),
                        ("ref_offset", ref_offset)):
        if not isinstance(value, int) or isinstance(value, bool) or value < 0:
            raise IpcError(f"{name} must be a non-negative integer")
    return fields, offset, nbytes
