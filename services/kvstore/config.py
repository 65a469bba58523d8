"""The kvstore's settings: a frozen dataclass, validated on construction (flags are read in main.py)."""

from __future__ import annotations

import math
from dataclasses import dataclass

GIB = 1 << 30


def _fail(name: str, message: str) -> None:
    raise ValueError(f"KvStoreConfig.{name}: {message}")


def _positive(cfg: object, *names: str) -> None:
    for name in names:
        v = getattr(cfg, name)
        if isinstance(v, bool) or not isinstance(v, (int, float)) or not math.isfinite(v) or v <= 0:
            _fail(name, f"must be a positive number, got {v!r}")


def _port(cfg: object, name: str) -> None:
    v = getattr(cfg, name)
    if isinstance(v, bool) or not isinstance(v, int) or not 0 <= v <= 65535:
        _fail(name, f"must be an int in [0, 65535], got {v!r}")


@dataclass(frozen=True, slots=True, kw_only=True)
class KvStoreConfig:
    capacity_bytes: int = 4 * GIB  # host memory for pages, reservations included
    lease_ttl: float = 10.0  # seconds a put's reservation or a get's pins live without commit/release
    max_lease_ttl: float = 120.0  # the most a client may ask for
    max_leases: int = 65536  # beyond it new puts and gets are refused, so clients cannot grow the index
    ucx_host: str = "127.0.0.1"  # the address workers dial (the listener takes every interface)
    ucx_port: int = 0  # 0: any free port (the address is in every lookup, put and get reply)
    http_host: str = "127.0.0.1"
    http_port: int = 0  # /health and /metrics; 0: no HTTP server
    sweep_interval: float = 0.5  # seconds between sweeps of expired leases (each request sweeps too)
    pin_memory: bool | None = None  # None: pinned when a CUDA device is present

    def __post_init__(self) -> None:
        if isinstance(self.capacity_bytes, bool) or not isinstance(self.capacity_bytes, int):
            _fail("capacity_bytes", f"must be an int, got {self.capacity_bytes!r}")
        if isinstance(self.max_leases, bool) or not isinstance(self.max_leases, int):
            _fail("max_leases", f"must be an int, got {self.max_leases!r}")
        _positive(self, "capacity_bytes", "lease_ttl", "max_lease_ttl", "max_leases", "sweep_interval")
        if self.lease_ttl > self.max_lease_ttl:
            _fail("lease_ttl", f"{self.lease_ttl} is above max_lease_ttl {self.max_lease_ttl}")
        for name in ("ucx_host", "http_host"):
            if not isinstance(getattr(self, name), str) or not getattr(self, name):
                _fail(name, "must not be empty")
        _port(self, "ucx_port")
        _port(self, "http_port")
        if self.pin_memory not in (None, True, False):
            _fail("pin_memory", f"must be None, True or False, got {self.pin_memory!r}")

    def ttl(self, asked: float) -> float:
        """The lease TTL to grant for a request's `ttl` (0: the default; capped at max_lease_ttl)."""
        return self.lease_ttl if asked <= 0 else min(asked, self.max_lease_ttl)
