"""API-key authentication: a Bearer token checked in constant time against every configured key."""

from __future__ import annotations

import hmac
from typing import Awaitable, Callable

from aiohttp import web

from services.gateway.errors import ApiError

OPEN_PATHS = frozenset({"/health"})  # liveness probes carry no credentials


def key_matches(presented: str, keys: tuple[bytes, ...]) -> bool:
    """Compare with every key, without stopping at the first match: the time taken does not say
    which key (or how much of one) matched."""
    p = presented.encode()
    found = False
    for key in keys:
        found |= hmac.compare_digest(p, key)
    return found


def auth_middleware(api_keys: tuple[str, ...]) -> Callable:
    keys = tuple(k.encode() for k in api_keys)

    @web.middleware
    async def authenticate(request: web.Request, handler: Callable[[web.Request], Awaitable[web.StreamResponse]]):
        if keys and request.path not in OPEN_PATHS:
            header = request.headers.get("Authorization", "")
            scheme, _, token = header.partition(" ")
            if scheme.lower() != "bearer" or not token:
                raise ApiError(401, "Missing API key: send it as 'Authorization: Bearer <key>'.",
                               code="invalid_api_key")
            if not key_matches(token.strip(), keys):
                raise ApiError(401, "Incorrect API key provided.", code="invalid_api_key")
        return await handler(request)

    return authenticate
