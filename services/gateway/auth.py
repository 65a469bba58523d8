"""API-key authentication: a Bearer token checked in constant time against every configured key,
answered with the key's tenant."""

from __future__ import annotations

import hmac

from services.gateway.errors import ApiError
from services.gateway.tenants import DEFAULT_TENANT, Tenant, TenantsFile


def key_matches(presented: str, keys: tuple[bytes, ...]) -> bool:
    """Compare with every key, without stopping at the first match: the time taken does not say
    which key (or how much of one) matched."""
    p = presented.encode(errors="surrogateescape")
    found = False
    for key in keys:
        found |= hmac.compare_digest(p, key)
    return found


class ApiKeys:
    """The accepted keys and their tenants; none configured means no authentication (every request
    is the default tenant's). Both transports check with it."""

    def __init__(self, keys: tuple[str, ...], tenants: TenantsFile | None = None):
        self.default = Tenant(DEFAULT_TENANT)
        self.tenants: dict[str, Tenant] = {DEFAULT_TENANT: self.default}
        self.from_file = tenants is not None
        owners = {k: DEFAULT_TENANT for k in keys}
        if tenants is not None:
            self.tenants.update(tenants.tenants)
            owners.update(tenants.keys)
        self._keys = tuple((k.encode(), self.tenants[t]) for k, t in owners.items())

    def __bool__(self) -> bool:
        return bool(self._keys)

    def check(self, authorization: str | None) -> Tenant:
        """The tenant of "Bearer <an accepted key>" (the default one when no key is configured); else a 401."""
        if not self._keys:
            return self.default
        scheme, _, token = (authorization or "").partition(" ")
        if scheme.lower() != "bearer" or not token:
            raise ApiError(401, "Missing API key: send it as 'Authorization: Bearer <key>'.", code="invalid_api_key")
        p = token.strip().encode(errors="surrogateescape")
        found: Tenant | None = None
        for key, tenant in self._keys:  # every key is compared, whichever matches
            if hmac.compare_digest(p, key):
                found = tenant
        if found is None:
            raise ApiError(401, "Incorrect API key provided.", code="invalid_api_key")
        return found


def check_bearer(authorization: str | None, token: str) -> None:
    """A 401 unless the header is "Bearer <token>" (compared in constant time)."""
    scheme, _, given = (authorization or "").partition(" ")
    if scheme.lower() != "bearer" or not hmac.compare_digest(given.strip().encode(errors="surrogateescape"),
                                                             token.encode()):
        raise ApiError(401, "This endpoint needs its token: send it as 'Authorization: Bearer <token>'.",
                       code="invalid_api_key")
