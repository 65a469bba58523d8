"""What the gateway does per tenant on every request: its rate limits, its prefix-cache salt and its
metric labels (tenants come from the keys file only, so the label set stays bounded)."""

from __future__ import annotations

import time
from typing import Callable

from prometheus_client import CollectorRegistry, Counter

from services.gateway.auth import ApiKeys
from services.gateway.errors import ApiError
from services.gateway.rate_limit import TenantLimiter, TenantLimits
from services.gateway.tenants import Tenant


class Tenancy:
    def __init__(self, keys: ApiKeys, share_prefix_cache: bool, registry: CollectorRegistry,
                 clock: Callable[[], float] = time.monotonic):
        # Without a keys file there is one tenant and nobody to isolate from: salts stay as sent,
        # so the prefix cache of a plain --api-key deployment is keyed as before.
        self.salted = keys.from_file
        self.isolate = keys.from_file and not share_prefix_cache
        self.limiters = {t.name: TenantLimiter(t.limits, clock) for t in keys.tenants.values()
                         if t.limits != TenantLimits()}
        self.requests = Counter("inferno:tenant_requests", "Generation requests answered, by tenant and status.",
                                ["tenant", "status"], registry=registry)
        self.tokens = Counter("inferno:tenant_tokens", "Tokens of served requests, by tenant and kind.",
                              ["tenant", "kind"], registry=registry)
        for name in keys.tenants:
            self.requests.labels(tenant=name, status="200")  # present from the first scrape
            self.requests.labels(tenant=name, status="429")

    def cache_salt(self, tenant: Tenant, salt: str) -> str:
        return tenant.cache_salt(salt, self.isolate) if self.salted else salt

    def admit(self, tenant: Tenant, num_tokens: int) -> TenantLimiter | None:
        """Take the request against the tenant's limits (the limiter to release when it ends), or
        raise the 429 with OpenAI's x-ratelimit-* headers."""
        limiter = self.limiters.get(tenant.name)
        if limiter is None:
            return None
        verdict = limiter.acquire(num_tokens)
        if not verdict.admitted:
            raise ApiError(429, verdict.reason, type="requests", code="rate_limit_exceeded",
                           retry_after=verdict.retry_after, headers=verdict.headers)
        return limiter

    def count(self, tenant: Tenant, status: int, prompt_tokens: int = 0, completion_tokens: int = 0) -> None:
        self.requests.labels(tenant=tenant.name, status=str(status)).inc()
        if prompt_tokens:
            self.tokens.labels(tenant=tenant.name, kind="prompt").inc(prompt_tokens)
        if completion_tokens:
            self.tokens.labels(tenant=tenant.name, kind="completion").inc(completion_tokens)
