"""Tenants: which API key belongs to whom, each tenant's limits, and its prefix-cache salt.

The keys file (--api-keys-file), JSON or YAML:

    tenants:
      acme: {requests_per_minute: 600, tokens_per_minute: 200000, max_concurrent: 32}
      lab:  {share_prefix_cache: true}            # every limit is optional
    keys:
      sk-acme-1: acme
      sk-lab-1: lab

Keys given with --api-key / INFERNO_API_KEYS belong to the tenant "default" (no limits).
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass, field
from pathlib import Path

from services.gateway.rate_limit import TenantLimits

DEFAULT_TENANT = "default"
_NAME = re.compile(r"^[A-Za-z0-9_.-]{1,64}$")  # a metric label value and a log field: kept plain
_TENANT_FIELDS = {"requests_per_minute", "tokens_per_minute", "max_concurrent", "share_prefix_cache"}


@dataclass(frozen=True, slots=True)
class Tenant:
    name: str
    limits: TenantLimits = field(default_factory=TenantLimits)
    share_prefix_cache: bool = False

    def __post_init__(self) -> None:
        if not _NAME.match(self.name):
            raise ValueError(f"tenant name {self.name!r} must be 1-64 characters of A-Z a-z 0-9 _ . -")

    def cache_salt(self, salt: str, isolate: bool) -> str:
        """The request's salt with the tenant folded in, so that tenants never share prefix-cache blocks
        (one could otherwise time another's prompts). The encoding is prefix-free: no salt a client
        sends can make one tenant's key equal another's, nor an isolated key equal a shared one."""
        if isolate and not self.share_prefix_cache:
            return f"t{len(self.name)}:{self.name}{salt}"
        return f"s{salt}"


@dataclass(frozen=True, slots=True)
class TenantsFile:
    """What a keys file says: the tenants and key → tenant name."""

    tenants: dict[str, Tenant]
    keys: dict[str, str]

    @classmethod
    def parse(cls, doc: object, where: str = "the keys file") -> TenantsFile:
        if not isinstance(doc, dict) or set(doc) - {"tenants", "keys"}:
            raise ValueError(f"{where}: expected a mapping with 'tenants' and 'keys'")
        raw_tenants, raw_keys = doc.get("tenants") or {}, doc.get("keys") or {}
        if not isinstance(raw_tenants, dict) or not isinstance(raw_keys, dict):
            raise ValueError(f"{where}: 'tenants' and 'keys' must be mappings")
        tenants: dict[str, Tenant] = {}
        for name, spec in raw_tenants.items():
            spec = spec or {}
            if not isinstance(spec, dict) or set(spec) - _TENANT_FIELDS:
                raise ValueError(f"{where}: tenant {name!r} may only set {sorted(_TENANT_FIELDS)}")
            share = spec.get("share_prefix_cache", False)
            if not isinstance(share, bool):
                raise ValueError(f"{where}: tenant {name!r}: share_prefix_cache must be true or false")
            try:
                limits = TenantLimits(spec.get("requests_per_minute"), spec.get("tokens_per_minute"),
                                      spec.get("max_concurrent"))
                tenants[str(name)] = Tenant(str(name), limits, share)
            except ValueError as e:
                raise ValueError(f"{where}: tenant {name!r}: {e}") from None
        keys: dict[str, str] = {}
        for key, name in raw_keys.items():
            if not isinstance(key, str) or not key:
                raise ValueError(f"{where}: every key must be a non-empty string")
            if name not in tenants:
                raise ValueError(f"{where}: a key names tenant {name!r}, which 'tenants' does not define")
            keys[key] = name
        return cls(tenants, keys)

    @classmethod
    def load(cls, path: str | Path) -> TenantsFile:
        text = Path(path).read_text()
        if str(path).endswith((".yaml", ".yml")):
            try:  # PyYAML is optional (only the test extra installs it): JSON needs nothing
                import yaml
            except ImportError:
                raise ValueError(f"{path}: a YAML keys file needs PyYAML (pip install pyyaml); "
                                 "or write it as JSON") from None
            try:
                doc = yaml.safe_load(text)
            except yaml.YAMLError as e:
                raise ValueError(f"{path}: not valid YAML: {e}") from None
        else:
            try:
                doc = json.loads(text)
            except json.JSONDecodeError as e:
                raise ValueError(f"{path}: not valid JSON: {e}") from None
        return cls.parse(doc, str(path))
