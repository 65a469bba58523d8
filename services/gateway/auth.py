"""API-key authentication: a Bearer token checked in constant time against every configured key."""

from __future__ import annotations

import hmac

from services.gateway.errors import ApiError


def key_matches(presented: str, keys: tuple[bytes, ...]) -> bool:
    """Compare with every key, without stopping at the first match: the time taken does not say
    which key (or how much of one) matched."""
    p = presented.encode(errors="surrogateescape")
    found = False
    for key in keys:
        found |= hmac.compare_digest(p, key)
    return found


class ApiKeys:
    """The accepted keys; none configured means no authentication. Both transports check with it."""

    def __init__(self, keys: tuple[str, ...]):
        self._keys = tuple(k.encode() for k in keys)

    def __bool__(self) -> bool:
        return bool(self._keys)

    def check(self, authorization: str | None) -> None:
        """Raise a 401 unless `authorization` is "Bearer <an accepted key>" (or no key is configured)."""
        if not self._keys:
            return
        scheme, _, token = (authorization or "").partition(" ")
        if scheme.lower() != "bearer" or not token:
            raise ApiError(401, "Missing API key: send it as 'Authorization: Bearer <key>'.", code="invalid_api_key")
        if not key_matches(token.strip(), self._keys):
            raise ApiError(401, "Incorrect API key provided.", code="invalid_api_key")
