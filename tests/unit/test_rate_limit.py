"""Per-tenant limits: token buckets, concurrency and the x-ratelimit-* headers, on a fake clock."""

from __future__ import annotations

import json

import pytest

from services.gateway.auth import ApiKeys
from services.gateway.errors import ApiError
from services.gateway.rate_limit import TenantLimiter, TenantLimits, duration
from services.gateway.tenants import DEFAULT_TENANT, Tenant, TenantsFile


class Clock:
    def __init__(self) -> None:
        self.t = 100.0

    def __call__(self) -> float:
        return self.t


def test_requests_per_minute_refills_evenly():
    clock = Clock()
    lim = TenantLimiter(TenantLimits(requests_per_minute=2), clock)
    assert lim.acquire(0).admitted and lim.acquire(0).admitted
    v = lim.acquire(0)
    assert not v.admitted and v.retry_after == pytest.approx(30.0)
    assert v.headers == {"x-ratelimit-limit-requests": "2", "x-ratelimit-remaining-requests": "0",
                         "x-ratelimit-reset-requests": "1m0s"}
    assert "requests per minute (limit 2)" in v.reason
    clock.t += 29.999
    assert not lim.acquire(0).admitted
    clock.t += 0.001
    v = lim.acquire(0)
    assert v.admitted and v.headers["x-ratelimit-remaining-requests"] == "0"
    assert v.headers["x-ratelimit-reset-requests"] == "1m0s"
    clock.t += 15
    assert lim.headers()["x-ratelimit-reset-requests"] == "45s"


def test_tokens_per_minute_and_a_refusal_takes_nothing():
    clock = Clock()
    lim = TenantLimiter(TenantLimits(requests_per_minute=10, tokens_per_minute=600), clock)
    assert lim.acquire(500).admitted
    v = lim.acquire(200)  # 100 left: 100 more tokens take 10 s
    assert not v.admitted and v.retry_after == pytest.approx(10.0)
    assert v.headers["x-ratelimit-remaining-tokens"] == "100"
    assert v.headers["x-ratelimit-remaining-requests"] == "9"  # the refused request was not charged
    assert v.headers["x-ratelimit-reset-tokens"] == "50s"
    never = lim.acquire(601)
    assert not never.admitted and "more than the limit of 600" in never.reason and never.retry_after == 60.0
    clock.t += 10
    assert lim.acquire(200).admitted
    assert lim.headers()["x-ratelimit-remaining-tokens"] == "0"


def test_concurrency_is_released():
    lim = TenantLimiter(TenantLimits(max_concurrent=1), Clock())
    assert lim.acquire(10).admitted
    v = lim.acquire(10)
    assert not v.admitted and "concurrent requests (limit 1)" in v.reason and v.headers == {}
    lim.release()
    assert lim.acquire(10).admitted


def test_duration_format():
    assert duration(0) == "0s" and duration(0.0004) == "0.001s" and duration(1.5) == "1.5s"
    assert duration(60) == "1m0s" and duration(361) == "6m1s"


def test_limits_are_validated():
    with pytest.raises(ValueError):
        TenantLimits(requests_per_minute=0)
    with pytest.raises(ValueError):
        TenantLimits(max_concurrent=True)


def test_keys_file_json_and_yaml(tmp_path):
    doc = {"tenants": {"acme": {"requests_per_minute": 5, "max_concurrent": 2},
                       "lab": {"share_prefix_cache": True}},
           "keys": {"sk-a": "acme", "sk-b": "acme", "sk-l": "lab"}}
    (tmp_path / "k.json").write_text(json.dumps(doc))
    (tmp_path / "k.yaml").write_text("tenants:\n  acme: {requests_per_minute: 5, max_concurrent: 2}\n"
                                     "  lab: {share_prefix_cache: true}\n"
                                     "keys: {sk-a: acme, sk-b: acme, sk-l: lab}\n")
    for name in ("k.json", "k.yaml"):
        f = TenantsFile.load(tmp_path / name)
        assert f.keys == {"sk-a": "acme", "sk-b": "acme", "sk-l": "lab"}
        assert f.tenants["acme"] == Tenant("acme", TenantLimits(5, None, 2), False)
        assert f.tenants["lab"].share_prefix_cache


@pytest.mark.parametrize("doc", [
    {"tenants": {"a": {"requests_per_minute": -1}}, "keys": {}},
    {"tenants": {"a": {"rpm": 1}}, "keys": {}},
    {"tenants": {"a b": {}}, "keys": {}},
    {"tenants": {}, "keys": {"k": "nobody"}},
    {"tenants": {"a": {"share_prefix_cache": "yes"}}, "keys": {}},
    {"users": {}},
    [],
])
def test_bad_keys_files_are_refused(doc):
    with pytest.raises(ValueError):
        TenantsFile.parse(doc)


def test_api_keys_name_the_tenant():
    f = TenantsFile.parse({"tenants": {"acme": {}}, "keys": {"sk-a": "acme"}})
    keys = ApiKeys(("legacy",), f)
    assert keys.check("Bearer sk-a").name == "acme"
    assert keys.check("Bearer legacy").name == DEFAULT_TENANT
    with pytest.raises(ApiError) as e:
        keys.check("Bearer sk-b")
    assert e.value.status == 401
    assert ApiKeys(()).check(None).name == DEFAULT_TENANT


def test_cache_salt_isolates_tenants_without_collisions():
    a, ab, shared = Tenant("a"), Tenant("ab"), Tenant("x", share_prefix_cache=True)
    assert a.cache_salt("", True) != Tenant("b").cache_salt("", True)
    # A client cannot forge another tenant's key with a salt of its own.
    assert a.cache_salt("b", True) != ab.cache_salt("", True)
    assert shared.cache_salt("s", True) == a.cache_salt("s", False) == "ss"
    assert a.cache_salt("s", True) == "t1:as"


def test_unparsable_keys_files_are_value_errors(tmp_path):
    (tmp_path / "k.json").write_text("{nope")
    (tmp_path / "k.yaml").write_text("tenants: [unclosed")
    for name in ("k.json", "k.yaml"):
        with pytest.raises(ValueError, match="not valid"):
            TenantsFile.load(tmp_path / name)
