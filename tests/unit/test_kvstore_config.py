"""The kvstore's settings and flags: validation, the TTL a request is granted, refusals before anything starts."""

from __future__ import annotations

import pytest

from services.kvstore.config import GIB, KvStoreConfig
from services.kvstore.main import main, parse_args


def test_defaults_and_ttl_grant():
    cfg = KvStoreConfig(lease_ttl=5.0, max_lease_ttl=20.0)
    assert cfg.capacity_bytes == 4 * GIB and cfg.http_port == 0 and cfg.pin_memory is None
    assert (cfg.ttl(0.0), cfg.ttl(1.5), cfg.ttl(1e9)) == (5.0, 1.5, 20.0)


@pytest.mark.parametrize("kwargs", [
    dict(capacity_bytes=0), dict(capacity_bytes=1.5), dict(lease_ttl=0), dict(lease_ttl=float("nan")),
    dict(lease_ttl=200.0), dict(ucx_port=70000), dict(http_port=-1), dict(ucx_host=""), dict(max_leases=True),
    dict(pin_memory="yes"),
])
def test_bad_settings_are_refused(kwargs):
    with pytest.raises(ValueError):
        KvStoreConfig(**kwargs)


def test_flags():
    args = parse_args(["--capacity-gb", "0.5", "--lease-ttl", "3", "--ucx-port", "13337", "--http-port", "9400",
                       "--pin-memory", "off"])
    assert (args.capacity_gb, args.lease_ttl, args.ucx_port, args.http_port, args.pin_memory) == (
        0.5, 3.0, 13337, 9400, "off")
    assert main(["--capacity-gb", "0"]) == 2
    assert main(["--lease-ttl", "500"]) == 2  # above --max-lease-ttl
