"""docker-compose.yml against the official Compose schema and against the CLI it calls."""

from __future__ import annotations

import importlib
import json
import re
from pathlib import Path
from urllib.parse import urlsplit

import pytest
import yaml

ROOT = Path(__file__).resolve().parents[2]
SCHEMA = ROOT.parent / "shared" / "data" / "compose-spec.json"
ENTRY_POINTS = {"gateway": "services.gateway.main", "scheduler": "services.scheduler.main",
                "worker": "services.worker.main", "kvstore": "services.kvstore.main"}


def interpolate(value: str) -> str:
    """Compose's ${VAR:-default} with the defaults (what an empty environment gives)."""
    return re.sub(r"\$\{[A-Z_]+:-([^}]*)\}", r"\1", value)


@pytest.fixture(scope="module")
def compose():
    return yaml.safe_load((ROOT / "docker-compose.yml").read_text())


def test_schema_valid(compose):
    if not SCHEMA.is_file():
        pytest.skip(f"the Compose schema is not beside the checkout ({SCHEMA})")
    import jsonschema

    jsonschema.validate(compose, json.loads(SCHEMA.read_text()))


def test_services_and_roles(compose):
    services = compose["services"]
    assert set(services) >= {"nats", "scheduler", "gateway", "worker", "worker-cpu", "kvstore", "prefill-worker",
                             "decode-worker"}
    assert "-js" in services["nats"]["command"]
    gpu = services["worker"]["deploy"]["resources"]["reservations"]["devices"][0]
    assert gpu["driver"] == "nvidia" and "gpu" in gpu["capabilities"]
    assert any(v.endswith(":/models:ro") for v in services["worker"]["volumes"])
    assert services["worker"]["profiles"] == ["gpu"] and services["worker-cpu"]["profiles"] == ["cpu"]
    for name in ("scheduler", "gateway", "worker", "worker-cpu", "kvstore", "prefill-worker", "decode-worker"):
        assert services[name]["environment"]["INFERNO_NATS_URL"] == "${INFERNO_NATS_URL:-tls://nats:4222}"
    # The three-node cluster profile: each node routes to all three and keeps its own store.
    nodes = [services[f"nats-{n}"] for n in "abc"]
    assert all(node["profiles"] == ["nats-cluster"] and "-js" in node["command"] for node in nodes)
    routes = {node["command"][node["command"].index("--routes") + 1] for node in nodes}
    assert routes == {"nats://nats-a:6222,nats://nats-b:6222,nats://nats-c:6222"}
    assert len({node["volumes"][0] for node in nodes}) == 3
    # The disaggregated pair: one GPU each, the decode worker reachable for the KV pages.
    pair = [services[n] for n in ("prefill-worker", "decode-worker")]
    assert [s["deploy"]["resources"]["reservations"]["devices"][0]["device_ids"] for s in pair] == [["0"], ["1"]]
    assert all(s["profiles"] == ["disagg"] for s in pair)
    assert "--kv-transfer-host" in services["decode-worker"]["command"]


@pytest.mark.parametrize("name", ["scheduler", "gateway", "worker", "worker-cpu", "kvstore", "prefill-worker",
                                  "decode-worker", "worker-tp2"])
def test_commands_parse_with_the_cli(compose, name):
    command = [interpolate(str(part)) for part in compose["services"][name]["command"]]
    module = importlib.import_module(ENTRY_POINTS[command[0]])
    args = module.parse_args(command[1:])  # raises SystemExit on an unknown flag
    if command[0] == "worker":
        assert args.model_dir == ["/models/demo"]


def test_environment_is_read_by_the_entry_points(compose):
    # Every service's NATS user and password are NatsConfig's (shared/config.py).
    common = (ROOT / "shared" / "config.py").read_text()
    sources = {name: Path(importlib.import_module(mod).__file__).read_text() + common
               for name, mod in ENTRY_POINTS.items()}
    for name, service in compose["services"].items():
        if service.get("image") != "inferno:latest":
            continue  # nats, prometheus, grafana: their own images
        entry = service["command"][0]
        for var in service["environment"]:
            if var.startswith("NCCL_"):
                continue  # read by NCCL itself in the worker's ranks
            assert var in sources[entry], f"{name}: {var} is not read by {ENTRY_POINTS[entry]}"


def test_monitoring_is_a_profile_over_the_services_that_serve_metrics(compose):
    services = compose["services"]
    # `docker compose up` without a profile starts what it did before monitoring came.
    assert {n for n, s in services.items() if "profiles" not in s} == {"nats", "scheduler", "gateway", "kvstore"}
    assert services["prometheus"]["profiles"] == services["grafana"]["profiles"] == ["monitoring"]
    for name in ("prometheus", "grafana"):
        for volume in services[name]["volumes"]:
            source = volume.split(":")[0]
            assert not source.startswith("./") or (ROOT / source).exists(), f"{name}: {source} is missing"
    prometheus = yaml.safe_load((ROOT / "deploy" / "prometheus" / "prometheus.yml").read_text())
    targets = {t for job in prometheus["scrape_configs"] for c in job["static_configs"] for t in c["targets"]}
    gateway_port = services["gateway"]["ports"][0].split(":")[-1]
    kvstore = services["kvstore"]["command"]
    assert targets == {f"gateway:{gateway_port}", f"kvstore:{kvstore[kvstore.index('--http-port') + 1]}"}
    assert services["grafana"]["environment"]["GF_AUTH_ANONYMOUS_ORG_ROLE"] == "Viewer"


def test_the_bus_has_users(compose):
    """Each service connects as its role with its password from .env; every nats-server reads the users
    of deploy/nats/users.conf (through nats.conf), which is what shared/nats_auth.py makes."""
    from shared.nats_auth import password_variable, server_config

    services = compose["services"]
    users = (ROOT / "deploy" / "nats" / "users.conf").read_text()
    assert users.endswith(server_config("inferno")), "regenerate deploy/nats/users.conf from shared/nats_auth.py"
    assert "\ninclude ./users.conf\n" in (ROOT / "deploy" / "nats" / "nats.conf").read_text()
    for name, service in services.items():
        if name.startswith("nats"):
            assert service["command"][:2] == ["-c", "/etc/nats/nats.conf"], name
            assert {"./deploy/nats/nats.conf:/etc/nats/nats.conf:ro",
                    "./deploy/nats/users.conf:/etc/nats/users.conf:ro"} <= set(service["volumes"]), name
            assert set(service["environment"]) == {password_variable(u) for u in
                                                   ("gateway", "scheduler", "worker", "kvstore", "admin", "api")}
        elif service.get("image") == "inferno:latest":
            role = service["command"][0]
            env = service["environment"]
            assert env["INFERNO_NATS_USER"] == role, name
            assert env["INFERNO_NATS_PASSWORD"].startswith("${" + password_variable(role) + ":?"), name


def test_the_bus_has_tls(compose, tmp_path):
    """Every nats-server reads the TLS blocks of shared/nats_tls.py (deploy/nats/nats.conf) with the files
    of the directory `inferno nats-certs` made, which .env names; every service dials tls:// and is given
    that directory's CA alone; the certificate the command makes names every host a service or a route
    dials, and the docs tell that same command."""
    from inferno.tools import nats_certs
    from shared.nats_tls import ServerTlsFiles, server_tls_config

    server_dir, ca_file = "/etc/nats/tls", "/etc/inferno/nats-tls/ca.crt"
    conf = (ROOT / "deploy" / "nats" / "nats.conf").read_text()
    assert conf.endswith(server_tls_config(ServerTlsFiles.in_dir(server_dir), cluster=True))
    certs_dir = compose["x-nats-tls"].removesuffix(f":{server_dir}:ro")
    assert certs_dir.startswith("${" + nats_certs.DIR_VARIABLE + ":?")  # compose refuses to start without it
    assert compose["x-nats-ca"] == f"{certs_dir}/ca.crt:{ca_file}:ro"
    dialled = set()
    for name, service in compose["services"].items():
        if name.startswith("nats"):
            assert compose["x-nats-tls"] in service["volumes"], name
            command = service["command"]
            if "--routes" in command:
                dialled |= {urlsplit(url).hostname for url in command[command.index("--routes") + 1].split(",")}
        elif service.get("image") == "inferno:latest":
            env = service["environment"]
            url = urlsplit(interpolate(env["INFERNO_NATS_URL"]))
            assert url.scheme == "tls", name
            dialled.add(url.hostname)
            assert env["INFERNO_NATS_TLS_CA"] == ca_file and compose["x-nats-ca"] in service["volumes"], name
            assert compose["x-nats-tls"] not in service["volumes"], name  # the servers' key stays with them
    command = re.search(r"run `inferno nats-certs ([^`>]*) >> \.env` first", certs_dir).group(1).split()
    hosts = {command[i + 1] for i, arg in enumerate(command) if arg == "--host"}
    assert dialled == {"nats", "nats-a", "nats-b", "nats-c"} and dialled <= hosts
    assert f"inferno nats-certs {' '.join(command)} >> .env" in (ROOT / "docs" / "operations.md").read_text()
    assert nats_certs.main([str(tmp_path / "tls"), *command[1:]]) == 0  # the command's flags parse
