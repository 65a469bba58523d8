"""The kvstore's control messages on NATS: one request and one reply class per verb (codec: shared/wire.py).

Page data never travels here (it moves over UCXX, shared/kv_transfer.py); these messages carry
block hashes, lease ids and the data server's address. Hashes are packed: 16-byte digests
(shared/block_hash.py) concatenated, in order. Every reply has `code` and `error`: empty on
success, else a short label (ERROR_CODES) and a sentence.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Annotated, Iterable

from shared.errors import MessageError
from shared.wire import ByteLen, Message, register

HASH_BYTES = 16
PackedHashes = Annotated[bytes, ByteLen(multiple=HASH_BYTES)]
MAX_HASHES = 16384  # per request: 256k tokens at 16 per block
MAX_REQUEST_BYTES = MAX_HASHES * HASH_BYTES + 4096
MAX_NAMESPACE_CHARS = 256
MAX_LEASE_ID_CHARS = 64
# Namespaces of cost probes (a worker's one page, put once and read back now and then to time a
# round trip): the store keeps them out of its reuse figure and out of its KV events.
PROBE_PREFIX = "_probe:"

# Reply codes. "bad_request": malformed, oversized or invalid; "no_space": the put does not fit
# even after eviction; "unknown_lease": expired, released or never issued; "not_filled": commit
# before the pages arrived; "page_size": the namespace holds pages of another size.
ERROR_CODES = ("bad_request", "no_space", "unknown_lease", "not_filled", "page_size", "too_many_leases",
               "unavailable", "internal")


def pack_hashes(hashes: Iterable[bytes]) -> bytes:
    hashes = list(hashes)
    if any(len(h) != HASH_BYTES for h in hashes):
        raise ValueError(f"block hashes must be {HASH_BYTES} bytes each")
    return b"".join(hashes)


def unpack_hashes(data: bytes) -> list[bytes]:
    if len(data) % HASH_BYTES:
        raise MessageError(f"packed hashes: {len(data)} bytes is not a multiple of {HASH_BYTES}")
    return [data[i:i + HASH_BYTES] for i in range(0, len(data), HASH_BYTES)]


def _require(ok: bool, message: str) -> None:
    if not ok:
        raise MessageError(message)


def _check_namespace(namespace: str) -> None:
    _require(0 < len(namespace) <= MAX_NAMESPACE_CHARS, f"namespace must be 1-{MAX_NAMESPACE_CHARS} characters")


def _check_hashes(hashes: bytes) -> None:
    _require(len(hashes) <= MAX_HASHES * HASH_BYTES, f"at most {MAX_HASHES} hashes per request")


def _check_ttl(ttl: float) -> None:
    _require(math.isfinite(ttl) and ttl >= 0.0, "ttl must be a finite number of seconds >= 0 (0: the default)")


def _check_lease_id(lease_id: str) -> None:
    _require(0 < len(lease_id) <= MAX_LEASE_ID_CHARS, f"lease_id must be 1-{MAX_LEASE_ID_CHARS} characters")


@dataclass(slots=True, frozen=True, kw_only=True)
class KvReply(Message):
    """What every kvstore reply carries (not a message of its own)."""

    code: str = ""
    error: str = ""

    @property
    def ok(self) -> bool:
        return not self.code


@register
@dataclass(slots=True, frozen=True, kw_only=True)
class KvLookupRequest(Message):
    """How many leading `hashes` does the store hold? (the longest cached prefix)"""

    TYPE = "kv_lookup_request"
    VERSION = 1
    MAX_BYTES = MAX_REQUEST_BYTES

    namespace: str  # layout fingerprint: model, dtype, block size, layers, kv heads, head dim
    block_size: int  # tokens per page, for the hit/miss token counters
    hashes: PackedHashes

    def _check(self) -> None:
        _check_namespace(self.namespace)
        _require(self.block_size > 0, "block_size must be positive")
        _check_hashes(self.hashes)


@register
@dataclass(slots=True, frozen=True, kw_only=True)
class KvLookupReply(KvReply):
    TYPE = "kv_lookup_reply"
    VERSION = 1

    hits: int = 0
    address: str = ""  # the UCXX data server, "host:port"


@register
@dataclass(slots=True, frozen=True, kw_only=True)
class KvPutRequest(Message):
    """Reserve room for pages; the reply says which hashes to send (those not stored already)."""

    TYPE = "kv_put_request"
    VERSION = 1
    MAX_BYTES = MAX_REQUEST_BYTES

    namespace: str
    page_bytes: int  # fixed per namespace
    hashes: PackedHashes
    ttl: float = 0.0  # seconds the reservation lives without a commit; 0: the store's default

    def _check(self) -> None:
        _check_namespace(self.namespace)
        _require(self.page_bytes > 0, "page_bytes must be positive")
        _check_hashes(self.hashes)
        _check_ttl(self.ttl)


@register
@dataclass(slots=True, frozen=True, kw_only=True)
class KvPutReply(KvReply):
    TYPE = "kv_put_reply"
    VERSION = 1

    lease_id: str = ""  # "" when nothing needs sending
    accepted: PackedHashes = b""  # send these pages, concatenated in this order, in one UCXX "put"
    address: str = ""
    # Pages leased to readers per page stored, over the store's life (from 1.0, as a prior, while it
    # has stored little): what a page written now is worth, for a writer that weighs its cost.
    reuse: float = 1.0


@register
@dataclass(slots=True, frozen=True, kw_only=True)
class KvCommitRequest(Message):
    """The put's pages arrived (the UCXX call returned): make them visible."""

    TYPE = "kv_commit_request"
    VERSION = 1

    lease_id: str

    def _check(self) -> None:
        _check_lease_id(self.lease_id)


@register
@dataclass(slots=True, frozen=True, kw_only=True)
class KvCommitReply(KvReply):
    TYPE = "kv_commit_reply"
    VERSION = 1

    pages: int = 0


@register
@dataclass(slots=True, frozen=True, kw_only=True)
class KvGetRequest(Message):
    """Lease the leading pages of `hashes` that the store holds, for one UCXX "get"."""

    TYPE = "kv_get_request"
    VERSION = 1
    MAX_BYTES = MAX_REQUEST_BYTES

    namespace: str
    hashes: PackedHashes
    ttl: float = 0.0  # seconds the pages stay pinned without a release; 0: the store's default

    def _check(self) -> None:
        _check_namespace(self.namespace)
        _check_hashes(self.hashes)
        _check_ttl(self.ttl)


@register
@dataclass(slots=True, frozen=True, kw_only=True)
class KvGetReply(KvReply):
    TYPE = "kv_get_reply"
    VERSION = 1

    lease_id: str = ""  # "" when count is 0
    count: int = 0  # leading pages found and pinned
    page_bytes: int = 0
    address: str = ""


@register
@dataclass(slots=True, frozen=True, kw_only=True)
class KvReleaseRequest(Message):
    """End a lease: a get's pins are dropped, an uncommitted put's reservation is abandoned."""

    TYPE = "kv_release_request"
    VERSION = 1

    lease_id: str

    def _check(self) -> None:
        _check_lease_id(self.lease_id)


@register
@dataclass(slots=True, frozen=True, kw_only=True)
class KvReleaseReply(KvReply):
    TYPE = "kv_release_reply"
    VERSION = 1


@register
@dataclass(slots=True, frozen=True, kw_only=True)
class KvStatsRequest(Message):
    TYPE = "kv_stats_request"
    VERSION = 1


@register
@dataclass(slots=True, frozen=True, kw_only=True)
class KvStatsReply(KvReply):
    """The store's gauges and cumulative counters (the same figures as its Prometheus metrics)."""

    TYPE = "kv_stats_reply"
    VERSION = 1

    pages: int = 0
    reserved_pages: int = 0
    bytes_used: int = 0
    capacity_bytes: int = 0
    leases: int = 0
    hit_pages: int = 0
    miss_pages: int = 0
    hit_tokens: int = 0
    miss_tokens: int = 0
    leased_pages: int = 0
    stored_pages: int = 0
    evictions: int = 0
    lease_expiries: int = 0
    no_space: int = 0
    bad_messages: int = 0
    transfer_bytes_in: int = 0
    transfer_bytes_out: int = 0
    address: str = ""
