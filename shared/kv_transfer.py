"""Bulk bytes between processes over UCXX (KV pages): one framed request/response call on warm endpoints.

A frame is an 8-byte little-endian header length, a MessagePack map (the header, which says how
many payload bytes follow in "nbytes"), then the payload. A caller sends one frame and reads one
back; the listening side reads the header first and asks its owner where the payload should land
(a pinned host buffer, a GPU tensor: UCX moves it by TCP, shared memory, CUDA IPC or RDMA, as the
transports allow), so pages are received straight into place, never copied through Python bytes.
Endpoints stay open between calls: the first transfer on a new endpoint pays its registration.
Control and indexes go over NATS; only page data travels here.
"""

from __future__ import annotations

import asyncio
import os
import sys
import threading
from collections.abc import Awaitable, Callable
from typing import Any

import msgpack
import numpy as np

MAX_HEADER_BYTES = 1 << 20
DEFAULT_MAX_PAYLOAD = 16 << 30

Buffer = Any  # a contiguous numpy uint8 array, or a torch tensor (CPU or CUDA)
Allocate = Callable[[dict], Buffer]
Handler = Callable[[dict, Buffer | None], Awaitable[tuple[dict, Buffer | None]]]


class TransferError(RuntimeError):
    """A call failed: the peer is gone, answered an error, or the frame was malformed."""


def import_ucxx():
    os.environ.setdefault("UCX_WARN_UNUSED_ENV_VARS", "n")
    # A pending send or recv completes through a Python future that ucxx's notifier thread sets;
    # without it ucxx awaits each one with a loop of asyncio.sleep(0), and the kvstore, whose
    # server keeps a recv pending on every worker's endpoint, spun a whole core while idle (2-core
    # VM, 2026-11-28): the CPU its workers' steps needed (issue 42).
    os.environ.setdefault("UCXPY_ENABLE_PYTHON_FUTURE", "1")
    import ucxx

    global _stop_registered
    if not _stop_registered:
        # That thread is not a daemon: the interpreter would wait for it forever at exit. The hook
        # runs before the interpreter joins its threads (atexit runs after), as concurrent.futures' does.
        threading._register_atexit(stop_ucx)
        _stop_registered = True
    return ucxx


_stop_registered = False


def init_ucx(cuda_context: bool = True) -> None:
    """Start this process's UCX before its first listener or endpoint, progressed by ucxx's own
    thread. That thread makes GPU 0's CUDA context current as it starts (ucxx's _create_context):
    right for a worker, whose GPU 0 is its own (services/gpu_placement.py); a process that computes
    on no GPU (the kvstore) passes cuda_context=False and makes none (UCX still moves GPU pages: it
    takes the context of the memory it is handed). The event loop's "blocking" mode makes none
    either, but spins: ~25 % of a core per kvstore once workers had connected (2-core VM,
    2026-11-28)."""
    ucxx = import_ucxx()
    if not cuda_context:
        from ucxx._lib_async import continuous_ucx_progress

        continuous_ucx_progress._create_context = lambda: None
    ucxx.init(progress_mode="thread", enable_python_future=True)


def stop_ucx() -> None:
    """Stop ucxx's notifier thread, if this process started UCX: while it runs, the interpreter
    does not exit (a kvstore hung 10 s on SIGTERM until killed)."""
    ucxx = sys.modules.get("ucxx")
    if ucxx is not None and ucxx.core._ctx is not None:
        ucxx.core.stop_notifier_thread()


def as_buffer(x: Buffer) -> Buffer:
    """A flat byte view UCXX can send or receive into: numpy for host memory, the tensor itself on a GPU."""
    if isinstance(x, np.ndarray):
        return x.reshape(-1).view(np.uint8)
    import torch

    if not x.is_contiguous():
        raise ValueError("transfer buffers must be contiguous")
    flat = x.reshape(-1).view(torch.uint8)
    return flat if flat.is_cuda else flat.numpy()


def nbytes_of(x: Buffer | None) -> int:
    if x is None:
        return 0
    return int(x.nbytes) if isinstance(x, np.ndarray) else x.numel() * x.element_size()


def _length_prefix(n: int) -> np.ndarray:
    return np.frombuffer(int(n).to_bytes(8, "little"), dtype=np.uint8).copy()


async def send_frame(ep, header: dict, payload: Buffer | None) -> None:
    header = {**header, "nbytes": nbytes_of(payload)}
    raw = np.frombuffer(msgpack.packb(header, use_bin_type=True), dtype=np.uint8)
    await ep.send(_length_prefix(raw.nbytes))
    await ep.send(raw)
    if payload is not None and header["nbytes"]:
        await ep.send(as_buffer(payload))


async def recv_frame(ep, allocate: Allocate | None, max_payload: int) -> tuple[dict, Buffer | None]:
    size = np.empty(8, dtype=np.uint8)
    await ep.recv(size)
    n = int.from_bytes(size.tobytes(), "little")
    if not 0 < n <= MAX_HEADER_BYTES:
        raise TransferError(f"frame header of {n} bytes (limit {MAX_HEADER_BYTES})")
    raw = np.empty(n, dtype=np.uint8)
    await ep.recv(raw)
    try:
        header = msgpack.unpackb(raw.tobytes(), raw=False, strict_map_key=True)
    except (ValueError, msgpack.UnpackException) as e:
        raise TransferError(f"frame header is not MessagePack: {e}") from e
    nbytes = header.get("nbytes") if isinstance(header, dict) else None
    if not isinstance(nbytes, int) or isinstance(nbytes, bool) or not 0 <= nbytes <= max_payload:
        raise TransferError(f"frame header needs 'nbytes' in [0, {max_payload}], got {nbytes!r}")
    if nbytes == 0:
        return header, None
    # The payload must be drained even when its owner refuses it, or the stream loses its framing.
    dest = allocate(header) if allocate is not None else None
    if dest is None or nbytes_of(dest) != nbytes:
        dest = np.empty(nbytes, dtype=np.uint8)
        header = {**header, "_discarded": True}
    await ep.recv(as_buffer(dest))
    return header, dest


class TransferServer:
    """Listens for frames; `handler(header, payload)` answers each with (header, payload or None)."""

    def __init__(self, handler: Handler, allocate: Allocate, host: str = "127.0.0.1", port: int = 0,
                 max_payload: int = DEFAULT_MAX_PAYLOAD, on_error: Callable[[str], None] | None = None):
        self.handler, self.allocate = handler, allocate
        self.host, self.max_payload = host, max_payload
        self._port = port
        self._listener = None
        self._tasks: set[asyncio.Task] = set()
        self.on_error = on_error or (lambda reason: None)

    def start(self) -> "TransferServer":
        self._listener = import_ucxx().create_listener(self._serve, port=self._port)
        return self

    @property
    def port(self) -> int:
        return self._listener.port

    @property
    def address(self) -> str:
        return f"{self.host}:{self.port}"

    async def _serve(self, ep) -> None:
        self._tasks.add(asyncio.current_task())
        try:
            while not ep.closed:
                try:
                    header, payload = await recv_frame(ep, self.allocate, self.max_payload)
                except TransferError as e:
                    self.on_error(str(e))
                    return  # the stream's framing is lost: drop this endpoint; the client reconnects
                if header.get("_discarded"):
                    reply, out = {"error": "payload refused"}, None
                else:
                    try:
                        reply, out = await self.handler(header, payload)
                    except Exception as e:  # one bad call must not end the connection
                        self.on_error(f"handler failed: {e}")
                        reply, out = {"error": str(e)}, None
                await send_frame(ep, reply, out)
        except Exception:  # the peer went away (ucxx raises its own connection errors)
            return
        finally:
            self._tasks.discard(asyncio.current_task())
            if not ep.closed:
                await ep.close()

    async def close(self) -> None:
        if self._listener is not None:
            self._listener.close()
        tasks = list(self._tasks)
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)  # each closes its endpoint as it ends


class TransferClient:
    """Calls TransferServers by address ("host:port"), one warm endpoint per address, calls on an
    endpoint one at a time (the stream is ordered)."""

    def __init__(self, max_payload: int = DEFAULT_MAX_PAYLOAD):
        self.max_payload = max_payload
        self._endpoints: dict[str, tuple[Any, asyncio.Lock]] = {}

    async def _endpoint(self, address: str):
        if address not in self._endpoints or self._endpoints[address][0].closed:
            host, _, port = address.rpartition(":")
            ep = await import_ucxx().create_endpoint(host, int(port))
            self._endpoints[address] = (ep, asyncio.Lock())
        return self._endpoints[address]

    async def connect(self, address: str, timeout: float = 30.0) -> None:
        """Open the endpoint to `address` now, so the first call does not wait for it."""
        try:
            await asyncio.wait_for(self._endpoint(address), timeout)
        except Exception as e:
            raise TransferError(f"connect to {address} failed: {type(e).__name__}: {e}") from e

    async def call(self, address: str, header: dict, payload: Buffer | None = None,
                   allocate: Allocate | None = None, timeout: float = 30.0) -> tuple[dict, Buffer | None]:
        """Send one frame and return the reply frame; allocate(reply_header) places its payload."""
        try:
            ep, lock = await asyncio.wait_for(self._endpoint(address), timeout)
            async with lock:
                await asyncio.wait_for(send_frame(ep, header, payload), timeout)
                reply, data = await asyncio.wait_for(recv_frame(ep, allocate, self.max_payload), timeout)
        except (TransferError, asyncio.CancelledError):  # cancelled: a caller's deadline passed
            await self.drop(address)
            raise
        except Exception as e:  # timeouts and ucxx's own connection errors alike
            await self.drop(address)  # a half-done call leaves the stream out of step
            raise TransferError(f"transfer to {address} failed: {type(e).__name__}: {e}") from e
        if reply.get("error"):
            raise TransferError(f"{address}: {reply['error']}")
        return reply, data

    async def drop(self, address: str) -> None:
        entry = self._endpoints.pop(address, None)
        if entry is not None and not entry[0].closed:
            try:
                await entry[0].close()
            except Exception:
                pass

    async def close(self) -> None:
        for address in list(self._endpoints):
            await self.drop(address)
