"""Service configuration: defaults, validation that names the field, env helpers for entry points."""

from __future__ import annotations

import dataclasses

import pytest

from shared.config import (GatewayConfig, NatsConfig, RouterConfig, WorkerServiceConfig, env_default, parse_bool,
                           parse_csv)


def test_defaults():
    n = NatsConfig()
    assert (n.url, n.subject_prefix, n.connect_timeout, n.request_timeout) == \
        ("nats://127.0.0.1:4222", "inferno", 2.0, 5.0)
    assert NatsConfig(url="nats://a:4222, nats://b:4223").servers == ["nats://a:4222", "nats://b:4223"]
    r = RouterConfig()
    assert (r.heartbeat_ttl, r.overload_kv_usage, r.affinity_bucket, r.affinity_ttl) == \
        (3.0, 0.95, "inferno_affinity", 3600.0)
    g = GatewayConfig(model_name="m", model_dir="/models/m")
    assert g.port == 8000 and g.api_keys == () and g.max_body_bytes == 4 << 20 and g.gateway_id.startswith("gw-")
    assert GatewayConfig(model_name="m", model_dir="d").gateway_id != g.gateway_id
    w = WorkerServiceConfig(model_dir="/models/m")
    assert (w.role, w.block_size, w.heartbeat_interval, w.drain_timeout, w.emit_only) == \
        ("mixed", 16, 1.0, 30.0, False)
    assert WorkerServiceConfig(emit_only=True).model_dir == ""
    assert WorkerServiceConfig().model_dir == ""  # no model until told over the admin subject


def test_configs_are_frozen():
    with pytest.raises(dataclasses.FrozenInstanceError):
        NatsConfig().url = "nats://elsewhere:4222"  # type: ignore[misc]


@pytest.mark.parametrize("make, field", [
    (lambda: NatsConfig(url=""), "url"),
    (lambda: NatsConfig(url="127.0.0.1:4222"), "url"),
    (lambda: NatsConfig(subject_prefix="a b"), "subject_prefix"),
    (lambda: NatsConfig(connect_timeout=0), "connect_timeout"),
    (lambda: NatsConfig(request_timeout=float("nan")), "request_timeout"),
    (lambda: NatsConfig(reconnect_jitter=-1), "reconnect_jitter"),
    (lambda: GatewayConfig(model_name="", model_dir="d"), "model_name"),
    (lambda: GatewayConfig(model_name="m", model_dir="d", port=70000), "port"),
    (lambda: GatewayConfig(model_name="m", model_dir="d", port=True), "port"),
    (lambda: GatewayConfig(model_name="m", model_dir="d", api_keys=["k"]), "api_keys"),
    (lambda: GatewayConfig(model_name="m", model_dir="d", api_keys=("",)), "api_keys"),
    (lambda: GatewayConfig(model_name="m", model_dir="d", max_n=17), "max_n"),
    (lambda: GatewayConfig(model_name="m", model_dir="d", max_tokens_default=0), "max_tokens_default"),
    (lambda: GatewayConfig(model_name="m", model_dir="d", gateway_id="gw.1"), "gateway_id"),
    (lambda: GatewayConfig(model_name="m", model_dir="d", more_models=(("m", "e"),)), "more_models"),
    (lambda: GatewayConfig(model_name="m", model_dir="d", more_models=(("n", ""),)), "more_models"),
    (lambda: RouterConfig(heartbeat_ttl=0), "heartbeat_ttl"),
    (lambda: RouterConfig(overload_kv_usage=1.5), "overload_kv_usage"),
    (lambda: RouterConfig(max_waiting=2.5), "max_waiting"),
    (lambda: RouterConfig(affinity_bucket="a.b"), "affinity_bucket"),
    (lambda: WorkerServiceConfig(model_dir="d", role="boss"), "role"),
    (lambda: WorkerServiceConfig(model_dir="d", worker_id="w 1"), "worker_id"),
    (lambda: WorkerServiceConfig(model_dir="d", device="tpu"), "device"),
    (lambda: WorkerServiceConfig(model_dir="d", dtype="int4"), "dtype"),
    (lambda: WorkerServiceConfig(model_dir="d", block_size=0), "block_size"),
    (lambda: WorkerServiceConfig(model_dir="d", num_blocks=-5), "num_blocks"),
    (lambda: WorkerServiceConfig(model_dir="d", gpu_memory_utilization=0.0), "gpu_memory_utilization"),
])
def test_validation_names_the_field(make, field):
    with pytest.raises(ValueError, match=rf"\.{field}: "):
        make()


def test_env_default(monkeypatch):
    monkeypatch.delenv("INFERNO_TEST_X", raising=False)
    assert env_default("INFERNO_TEST_X", 8000) == 8000
    monkeypatch.setenv("INFERNO_TEST_X", "9000")
    assert env_default("INFERNO_TEST_X", 8000) == 9000
    assert env_default("INFERNO_TEST_X", 1.5) == 9000.0
    assert env_default("INFERNO_TEST_X", None) == "9000"
    monkeypatch.setenv("INFERNO_TEST_X", "yes")
    assert env_default("INFERNO_TEST_X", False) is True
    monkeypatch.setenv("INFERNO_TEST_X", "k1, k2,,")
    assert env_default("INFERNO_TEST_X", ()) == ("k1", "k2")
    assert env_default("INFERNO_TEST_X", "", cast=str.upper) == "K1, K2,,"
    monkeypatch.setenv("INFERNO_TEST_X", "many")
    with pytest.raises(ValueError, match="INFERNO_TEST_X"):
        env_default("INFERNO_TEST_X", 8000)


def test_parsers():
    assert [parse_bool(t) for t in ("1", "TRUE", " on ", "0", "no", "")] == [True, True, True, False, False, False]
    with pytest.raises(ValueError):
        parse_bool("maybe")
    assert parse_csv(" a ,b,, c ") == ("a", "b", "c")
    assert parse_csv("") == ()
