"""The public NATS API's contract, shared by the gateway and its clients: headers, the terminal
message, keep-alive timing, and the request-id lists of the cancel and keep-alive subjects.

A request is one message on {p}.api.v1.chat.completions, {p}.api.v1.completions or
{p}.api.v1.models (shared/subjects.py) with a reply subject and the JSON body of the HTTP route.
Its headers, all optional:

    Authorization: Bearer <key>     the HTTP API's keys
    x-request-id: <id>              the caller's id for the request (1-256 characters), which names it
                                    in cancel and keep-alive messages; echoed on the terminal message
    x-session-affinity: <session>   as over HTTP
    x-timeout: <seconds>            the request's deadline (the server's own deadline caps it)
    x-keepalive: 1                  the caller promises keep-alives: the gateway cancels the request
                                    when none came for KEEPALIVE_TIMEOUT seconds

The replies, on the reply subject:
- not streamed: one message, the JSON body the HTTP route answers with;
- streamed: one message per chunk (the JSON of one SSE event, no headers), then the terminal message.
The last message of every request is the only one with the header x-status (the HTTP status,
"200" on success); its body is the answer (not streamed), the usage chunk or nothing (a stream that
ended well), or an OpenAI-shaped error {"error": {...}} (a failure, before or after chunks).
Retry-After comes with 429 and 503.

{p}.api.v1.cancel and {p}.api.v1.keepalive take a JSON list of request ids (with Authorization
when the gateway has keys). A cancelled request ends with x-status 499; a cancel that arrives
before its request is kept for a few seconds, and the request is refused when it comes.
"""

from __future__ import annotations

import json
from typing import Iterable

AUTHORIZATION = "Authorization"
REQUEST_ID = "x-request-id"
SESSION_AFFINITY = "x-session-affinity"
TIMEOUT = "x-timeout"
KEEPALIVE = "x-keepalive"
# Not "Status": nats-py reads a reply's Status header as the server's own status (503 = no responders).
STATUS = "x-status"
RETRY_AFTER = "Retry-After"

KEEPALIVE_INTERVAL = 0.25  # seconds between a client's keep-alives; at most 0.5 keeps within the timeout
KEEPALIVE_TIMEOUT = 0.7  # a request not kept alive for this long is cancelled (noticed within 0.75 s)
CANCELLED = 499  # x-status of a request its caller cancelled (nginx's "client closed request")

MAX_REQUEST_ID_CHARS = 256
MAX_IDS_PER_MESSAGE = 4096


def encode_ids(ids: Iterable[str]) -> bytes:
    """The body of a cancel or keep-alive message."""
    return json.dumps(list(ids)).encode()


def decode_ids(data: bytes) -> list[str]:
    """The request ids of a cancel or keep-alive message; ValueError when it is not one."""
    try:
        ids = json.loads(data)
    except (ValueError, RecursionError):
        raise ValueError("not JSON") from None
    if not isinstance(ids, list) or len(ids) > MAX_IDS_PER_MESSAGE:
        raise ValueError(f"not a list of at most {MAX_IDS_PER_MESSAGE} request ids")
    if not all(isinstance(i, str) and 0 < len(i) <= MAX_REQUEST_ID_CHARS for i in ids):
        raise ValueError(f"request ids are strings of 1-{MAX_REQUEST_ID_CHARS} characters")
    return ids
