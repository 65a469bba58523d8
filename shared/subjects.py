"""NATS subject names of every service, under a configurable prefix, with their id rules.

| subject                         | message         | from → to                     | pattern       |
|---------------------------------|-----------------|-------------------------------|---------------|
| {p}.generate                    | GenerateRequest | gateway → scheduler           | request/reply |
| {p}.worker.{worker_id}.generate | GenerateRequest | scheduler → worker            | publish       |
| {p}.worker.{worker_id}.abort    | AbortRequest    | gateway → worker              | publish       |
| {p}.worker.{worker_id}.handoff  | KvHandoffOffer  | prefill worker → decode worker | request/reply |
| {p}.worker.{worker_id}.prepare  | GenerateRequest | scheduler → decode worker     | publish       |
| {p}.worker.{worker_id}.handoff_ready | KvHandoffReady | decode worker → prefill worker | publish  |
| {p}.heartbeat                   | WorkerHeartbeat | worker → schedulers, gateways | publish       |
| {p}.kv_events                   | KvEvents        | worker → schedulers           | publish       |
| {p}.gateway.{gateway_id}.tokens | TokenBatch      | worker → gateway              | publish       |

A worker's admin (MessagePack, shared/admin_messages.py; the reply to a load comes once the model serves):

| subject                              | request → reply                         | from → to         | pattern       |
|--------------------------------------|-----------------------------------------|-------------------|---------------|
| {p}.worker.{worker_id}.admin.load    | LoadModelRequest → WorkerAdminReply     | operator → worker | request/reply |
| {p}.worker.{worker_id}.admin.unload  | UnloadModelRequest → WorkerAdminReply   | operator → worker | request/reply |
| {p}.worker.{worker_id}.admin.status  | WorkerStatusRequest → WorkerAdminReply  | operator → worker | request/reply |

The kvstore's control (MessagePack, shared/kvstore_messages.py; one kvstore per prefix; the page
data itself moves over UCXX, shared/kv_transfer.py):

| subject             | request → reply                   | from → to        | pattern       |
|---------------------|-----------------------------------|------------------|---------------|
| {p}.kvstore.lookup  | KvLookupRequest → KvLookupReply   | worker → kvstore | request/reply |
| {p}.kvstore.put     | KvPutRequest → KvPutReply         | worker → kvstore | request/reply |
| {p}.kvstore.commit  | KvCommitRequest → KvCommitReply   | worker → kvstore | request/reply |
| {p}.kvstore.get     | KvGetRequest → KvGetReply         | worker → kvstore | request/reply |
| {p}.kvstore.release | KvReleaseRequest → KvReleaseReply | worker → kvstore | request/reply |
| {p}.kvstore.stats   | KvStatsRequest → KvStatsReply     | anyone → kvstore | request/reply |

The public NATS API (JSON bodies and headers, not MessagePack: its contract is shared/nats_api.py):

| subject                         | body                      | from → to              | pattern         |
|---------------------------------|---------------------------|------------------------|-----------------|
| {p}.api.v1.chat.completions     | OpenAI chat request       | client → one gateway   | request/replies |
| {p}.api.v1.completions          | OpenAI completion request | client → one gateway   | request/replies |
| {p}.api.v1.models               | (empty)                   | client → one gateway   | request/reply   |
| {p}.api.v1.cancel               | JSON list of request ids  | client → every gateway | publish         |
| {p}.api.v1.keepalive            | JSON list of request ids  | client → every gateway | publish         |

The generate request/reply is answered with a RouteReply by one scheduler replica: they all
subscribe in the queue group SCHEDULER_QUEUE. The API requests are taken by one gateway replica
(queue group GATEWAY_QUEUE); cancel and keep-alive messages reach every gateway, and the one that
holds the request acts on them.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

DEFAULT_PREFIX = "inferno"
STORE_ID = "kvstore"  # the kvstore's name in KvEvents (its pages are fetchable by every worker)
SCHEDULER_QUEUE = "schedulers"  # queue group: each GenerateRequest reaches one scheduler replica
GATEWAY_QUEUE = "gateways"  # queue group: each API request reaches one gateway replica
API_VERSION = "v1"

_TOKEN = re.compile(r"[A-Za-z0-9_-]{1,128}")


def check_id(kind: str, value: str) -> str:
    """Return `value` if it can be one token of a subject (letters, digits, '_' and '-'), else raise ValueError.

    Dots, spaces and the wildcards '*' and '>' would change which subscribers a subject reaches.
    """
    if not isinstance(value, str) or _TOKEN.fullmatch(value) is None:
        raise ValueError(f"{kind} {value!r} must be 1-128 characters of letters, digits, '_' or '-'")
    return value


def check_prefix(prefix: str) -> str:
    """A prefix is one or more valid tokens joined by dots, e.g. "inferno" or "prod.inferno"."""
    if not isinstance(prefix, str) or not prefix or not all(_TOKEN.fullmatch(t) for t in prefix.split(".")):
        raise ValueError(f"subject prefix {prefix!r} must be dot-separated tokens of letters, digits, '_' or '-'")
    return prefix


def generate_subject(prefix: str = DEFAULT_PREFIX) -> str:
    return f"{check_prefix(prefix)}.generate"


def worker_generate(prefix: str, worker_id: str) -> str:
    return f"{check_prefix(prefix)}.worker.{check_id('worker_id', worker_id)}.generate"


def worker_abort(prefix: str, worker_id: str) -> str:
    return f"{check_prefix(prefix)}.worker.{check_id('worker_id', worker_id)}.abort"


def worker_handoff(prefix: str, worker_id: str) -> str:
    return f"{check_prefix(prefix)}.worker.{check_id('worker_id', worker_id)}.handoff"


def worker_handoff_ready(prefix: str, worker_id: str) -> str:
    """A prefill worker learns here that a decode worker's blocks for one of its requests wait."""
    return f"{check_prefix(prefix)}.worker.{check_id('worker_id', worker_id)}.handoff_ready"


def worker_handoff_prepare(prefix: str, worker_id: str) -> str:
    """A decode worker paired with a prefill worker reserves the request's blocks on this."""
    return f"{check_prefix(prefix)}.worker.{check_id('worker_id', worker_id)}.prepare"


ADMIN_VERBS = ("load", "unload", "status")


def worker_admin(prefix: str, worker_id: str, verb: str) -> str:
    """A worker's admin subject (shared/admin_messages.py): load, replace or unload its model, or its status."""
    if verb not in ADMIN_VERBS:
        raise ValueError(f"admin verb {verb!r} must be one of {ADMIN_VERBS}")
    return f"{check_prefix(prefix)}.worker.{check_id('worker_id', worker_id)}.admin.{verb}"


def heartbeat(prefix: str = DEFAULT_PREFIX) -> str:
    return f"{check_prefix(prefix)}.heartbeat"


def gateway_heartbeat(prefix: str = DEFAULT_PREFIX) -> str:
    """Gateways' beats (GatewayHeartbeat): a worker ends the requests of a gateway gone silent."""
    return f"{check_prefix(prefix)}.gateway_heartbeat"


def kv_events(prefix: str = DEFAULT_PREFIX) -> str:
    return f"{check_prefix(prefix)}.kv_events"


def kv_snapshot_bucket(prefix: str = DEFAULT_PREFIX) -> str:
    """The JetStream KV bucket of the workers' prefix-cache snapshots (KvSnapshot): one per prefix,
    its dots made underscores (a bucket name is one token)."""
    return f"{check_prefix(prefix).replace('.', '_')}_kv_snapshots"


def gateway_inbox(prefix: str, gateway_id: str) -> str:
    return f"{check_prefix(prefix)}.gateway.{check_id('gateway_id', gateway_id)}.tokens"


def api(prefix: str, name: str) -> str:
    """A subject of the public NATS API: "chat.completions", "completions", "models", "cancel", "keepalive"."""
    return f"{check_prefix(prefix)}.api.{API_VERSION}.{name}"


KVSTORE_VERBS = ("lookup", "put", "commit", "get", "release", "stats")


def kvstore(prefix: str, verb: str) -> str:
    """A subject of the kvstore's control: one of KVSTORE_VERBS."""
    if verb not in KVSTORE_VERBS:
        raise ValueError(f"kvstore verb {verb!r} must be one of {KVSTORE_VERBS}")
    return f"{check_prefix(prefix)}.kvstore.{verb}"


@dataclass(frozen=True, slots=True)
class Subjects:
    """The subjects under one prefix, for code that passes a single object around."""

    prefix: str = DEFAULT_PREFIX

    def __post_init__(self) -> None:
        check_prefix(self.prefix)

    @property
    def generate(self) -> str:
        return generate_subject(self.prefix)

    @property
    def heartbeat(self) -> str:
        return heartbeat(self.prefix)

    @property
    def gateway_heartbeat(self) -> str:
        return gateway_heartbeat(self.prefix)

    @property
    def kv_events(self) -> str:
        return kv_events(self.prefix)

    def worker_generate(self, worker_id: str) -> str:
        return worker_generate(self.prefix, worker_id)

    def worker_abort(self, worker_id: str) -> str:
        return worker_abort(self.prefix, worker_id)

    def worker_handoff_prepare(self, worker_id: str) -> str:
        return worker_handoff_prepare(self.prefix, worker_id)

    def worker_admin(self, worker_id: str, verb: str) -> str:
        return worker_admin(self.prefix, worker_id, verb)

    def gateway_inbox(self, gateway_id: str) -> str:
        return gateway_inbox(self.prefix, gateway_id)

    @property
    def api_chat_completions(self) -> str:
        return api(self.prefix, "chat.completions")

    @property
    def api_completions(self) -> str:
        return api(self.prefix, "completions")

    @property
    def api_models(self) -> str:
        return api(self.prefix, "models")

    @property
    def api_cancel(self) -> str:
        return api(self.prefix, "cancel")

    @property
    def api_keepalive(self) -> str:
        return api(self.prefix, "keepalive")

    def kvstore(self, verb: str) -> str:
        return kvstore(self.prefix, verb)
