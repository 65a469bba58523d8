"""The prefill → decode hand-off's control messages on NATS (the pages themselves move over UCXX)."""

from __future__ import annotations

from dataclasses import dataclass

from shared.errors import MessageError
from shared.messages import GenerateRequest
from shared.wire import Message, register

MAX_PAGES = 1 << 20


@register
@dataclass(slots=True, frozen=True, kw_only=True)
class KvPushTarget(Message):
    """A decode worker's receive slot that a prefill worker of its host may write over CUDA IPC:
    torch's sharing fields of the slot's long-lived buffer (cuda_ipc.share), where the slot lies in
    it, and until when (wall clock, one host) a write may start. The slot stays held for a grace
    period after `until` even when the request is dropped, so a late write never lands in a slot
    that holds another request's pages."""

    TYPE = "kv_push_target"
    VERSION = 1

    handle: bytes
    size: int
    base: int
    ref_handle: bytes
    ref_offset: int
    event_handle: bytes | None = None
    event_sync: bool = False
    offset: int
    nbytes: int
    until: float

    def _check(self) -> None:
        if not (self.handle and self.nbytes > 0 and min(self.size, self.base, self.ref_offset, self.offset) >= 0):
            raise MessageError("kv_push_target: handle, nbytes > 0, non-negative sizes and offsets")

    @classmethod
    def of(cls, desc: dict, until: float) -> "KvPushTarget":
        """From cuda_ipc's descriptor {"storage": fields, "offset", "nbytes"}."""
        handle, size, base, ref_handle, ref_offset, event_handle, event_sync = desc["storage"]
        return cls(handle=handle, size=size, base=base, ref_handle=ref_handle, ref_offset=ref_offset,
                   event_handle=event_handle, event_sync=event_sync, offset=desc["offset"],
                   nbytes=desc["nbytes"], until=until)

    def descriptor(self) -> dict:
        """cuda_ipc's descriptor form (checked again there before anything is mapped)."""
        return {"storage": [self.handle, self.size, self.base, self.ref_handle, self.ref_offset,
                            self.event_handle, self.event_sync], "offset": self.offset, "nbytes": self.nbytes}


@register
@dataclass(slots=True, frozen=True, kw_only=True)
class KvHandoffOffer(Message):
    """prefill worker → decode worker (request/reply on worker_handoff): take this request, whose
    prompt is prefilled and first token sampled; its KV is `num_pages` pages of `page_bytes`. With
    `recompute`, no pages come (the hand-off failed): the decode worker computes the prompt's KV
    itself and goes on from the first token, which the gateway has already."""

    TYPE = "kv_handoff_offer"
    VERSION = 1

    request: GenerateRequest
    first_token: int
    seed: int  # the resolved sampling seed, so seeded draws go on as on one worker
    num_cached_tokens: int  # prompt tokens the prefill worker found cached (usage reports them)
    layout: str  # kv_pages.page_layout: pages are exchanged only between equal layouts
    page_bytes: int
    num_pages: int
    prefill_worker_id: str
    transfer_id: str
    recompute: bool = False

    def _check(self) -> None:
        if not (0 <= self.first_token and 0 < self.num_pages <= MAX_PAGES and self.page_bytes > 0
                and self.transfer_id and self.layout):
            raise MessageError("kv_handoff_offer: first_token, num_pages, page_bytes, transfer_id, layout")


@register
@dataclass(slots=True, frozen=True, kw_only=True)
class KvHandoffReply(Message):
    """decode worker → prefill worker: accepted (send pages[skip_pages:] to `address` over UCXX
    with the offer's transfer_id), or refused with a reason (no room, another layout, draining)."""

    TYPE = "kv_handoff_reply"
    VERSION = 1

    accepted: bool
    skip_pages: int = 0
    address: str = ""
    reason: str = ""
    host_id: str = ""  # as KvHandoffReady's


@register
@dataclass(slots=True, frozen=True, kw_only=True)
class KvHandoffReady(Message):
    """decode worker → prefill worker (publish on worker_handoff_ready), as soon as the blocks the
    scheduler's prepare asked for are reserved: push pages[skip_pages:] straight to `address` with
    the offer inside the frame's header, without the offer round trip."""

    TYPE = "kv_handoff_ready"
    VERSION = 1

    request_id: str
    decode_worker_id: str
    skip_pages: int
    num_pages: int
    address: str
    layout: str
    page_bytes: int
    host_id: str = ""  # the decode worker's host and boot: equal to the prefill worker's, CUDA IPC is tried
    push: KvPushTarget | None = None  # where to write pages[skip_pages:] over CUDA IPC before the frame

    def _check(self) -> None:
        if not (self.request_id and self.address and self.layout and 0 <= self.skip_pages <= self.num_pages <= MAX_PAGES
                and self.page_bytes > 0):
            raise MessageError("kv_handoff_ready: request_id, address, layout, 0 <= skip_pages <= num_pages")
