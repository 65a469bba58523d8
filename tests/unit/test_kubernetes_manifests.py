"""deploy/kubernetes against the Kubernetes schemas, against each other, and against the CLI and docs it uses."""

from __future__ import annotations

import importlib
import re
import shlex
import textwrap
from pathlib import Path
from urllib.parse import urlsplit

import kubernetes_validate
import pytest
import yaml

ROOT = Path(__file__).resolve().parents[2]
MANIFESTS = ROOT / "deploy" / "kubernetes"
GUIDE = ROOT / "docs" / "kubernetes.md"
CONFIGURATION = (ROOT / "docs" / "configuration.md").read_text()
KUBERNETES_VERSION = "1.30"  # the schemas kubernetes-validate ships (its package data: no network)
NAMESPACE = "inferno"
# Custom resources: not in the Kubernetes schemas, checked by hand below (test_service_monitors).
CRDS = {("monitoring.coreos.com/v1", "ServiceMonitor")}
CLUSTER_SCOPED = {"Namespace"}
APART = {"servicemonitor.yaml"}  # needs the Prometheus Operator's CRDs: applied on its own, not by kustomize
ENTRY_POINTS = {"gateway": "services.gateway.main", "scheduler": "services.scheduler.main",
                "worker": "services.worker.main", "kvstore": "services.kvstore.main"}
WORKER_ROLES = ("mixed", "prefill", "decode")


def load_documents() -> list[tuple[str, dict]]:
    docs = []
    for path in sorted(MANIFESTS.glob("*.yaml")):
        if path.name != "kustomization.yaml":
            docs += [(path.name, doc) for doc in yaml.safe_load_all(path.read_text()) if doc]
    return docs


DOCUMENTS = load_documents()


def doc_id(entry: tuple[str, dict]) -> str:
    name, doc = entry
    return f"{name}:{doc['kind']}/{doc['metadata']['name']}"


def of_kind(*kinds: str) -> list[dict]:
    return [doc for _, doc in DOCUMENTS if doc["kind"] in kinds]


def named(kind: str, name: str) -> dict:
    found = [doc for doc in of_kind(kind) if doc["metadata"]["name"] == name]
    assert len(found) == 1, f"{kind}/{name}: {len(found)} in the set"
    return found[0]


WORKLOADS = of_kind("Deployment", "StatefulSet")


def pod_spec(workload: dict) -> dict:
    return workload["spec"]["template"]["spec"]


def pod_labels(workload: dict) -> dict:
    return workload["spec"]["template"]["metadata"]["labels"]


def matches(selector: dict, labels: dict) -> bool:
    return bool(selector) and all(labels.get(k) == v for k, v in selector.items())


def selected_workloads(selector: dict) -> list[dict]:
    return [w for w in WORKLOADS if matches(selector, pod_labels(w))]


def inferno_containers() -> list[tuple[dict, dict]]:
    """(workload, container) for every container that runs the inferno image."""
    return [(w, c) for w in WORKLOADS for c in pod_spec(w)["containers"] if c["image"].startswith("inferno:")]


def container_ports(container: dict) -> tuple[set, set]:
    ports = container.get("ports", [])
    return {p["name"] for p in ports if "name" in p}, {p["containerPort"] for p in ports}


def expanded_args(container: dict) -> list[str]:
    """The args as the kubelet runs them: $(VAR) filled from the container's env (ConfigMap keys read)."""
    config = named("ConfigMap", "inferno")["data"]
    env = {}
    for var in container.get("env", []):
        source = var.get("valueFrom", {})
        if "value" in var:
            env[var["name"]] = var["value"]
        elif "configMapKeyRef" in source:
            env[var["name"]] = config[source["configMapKeyRef"]["key"]]
        elif "fieldRef" in source:
            env[var["name"]] = {"status.podIP": "10.0.0.7", "metadata.name": "pod-0"}[source["fieldRef"]["fieldPath"]]
    return [re.sub(r"\$\((\w+)\)", lambda m: env[m.group(1)], a) for a in container.get("args", [])]


def test_kustomization_lists_every_manifest():
    kustomization = yaml.safe_load((MANIFESTS / "kustomization.yaml").read_text())
    files = {p.name for p in MANIFESTS.glob("*.yaml")} - {"kustomization.yaml"}
    assert sorted(kustomization["resources"]) == sorted(files - APART)
    assert all((MANIFESTS / name).is_file() for name in APART)


@pytest.mark.parametrize("entry", [e for e in DOCUMENTS if (e[1]["apiVersion"], e[1]["kind"]) not in CRDS],
                         ids=doc_id)
def test_valid_against_the_kubernetes_schema(entry):
    # strict: the schemas that reject unknown fields, so a misspelt key fails here and not at apply time.
    kubernetes_validate.validate(entry[1], KUBERNETES_VERSION, strict=True)


def guide_objects() -> list[dict]:
    """The whole objects docs/kubernetes.md shows: yaml blocks and here-documents with a kind."""
    text = GUIDE.read_text()
    blocks = re.findall(r"^```yaml\n(.*?)^```", text, re.M | re.S)
    blocks += re.findall(r"<<'EOF'\n(.*?)^EOF", text, re.M | re.S)
    return [doc for block in blocks for doc in yaml.safe_load_all(block) if isinstance(doc, dict) and "kind" in doc]


def test_the_guide_shows_valid_objects():
    objects = guide_objects()
    assert sorted(o["kind"] for o in objects) == ["HorizontalPodAutoscaler", "Pod"]
    for obj in objects:
        kubernetes_validate.validate(obj, KUBERNETES_VERSION, strict=True)
        assert obj["metadata"]["namespace"] == NAMESPACE
    hpa = next(o for o in objects if o["kind"] == "HorizontalPodAutoscaler")
    named(hpa["spec"]["scaleTargetRef"]["kind"], hpa["spec"]["scaleTargetRef"]["name"])
    pod = next(o for o in objects if o["kind"] == "Pod")
    assert pod["spec"]["volumes"][0]["persistentVolumeClaim"]["claimName"] == "models"


def test_only_the_listed_crds_lack_a_schema():
    # Every other kind validates above (an unknown one raises SchemaNotFoundError there).
    for name, doc in DOCUMENTS:
        if (doc["apiVersion"], doc["kind"]) in CRDS:
            with pytest.raises(kubernetes_validate.SchemaNotFoundError):
                kubernetes_validate.validate(doc, KUBERNETES_VERSION, strict=True)


def test_the_guide_sections_the_manifests_point_at_exist():
    headings = re.findall(r"^#+ (.+)$", GUIDE.read_text(), re.M)
    slugs = {re.sub(r"[^\w\- ]", "", h.lower()).replace(" ", "-") for h in headings}
    for path in MANIFESTS.glob("*.yaml"):
        for anchor in re.findall(r"docs/kubernetes\.md#([\w-]+)", path.read_text()):
            assert anchor in slugs, f"{path.name}: #{anchor}"


def test_everything_is_in_the_namespace():
    assert named("Namespace", NAMESPACE)
    for name, doc in DOCUMENTS:
        if doc["kind"] not in CLUSTER_SCOPED:
            assert doc["metadata"].get("namespace") == NAMESPACE, doc_id((name, doc))


def test_workload_selectors_match_their_pods():
    for w in WORKLOADS:
        assert matches(w["spec"]["selector"]["matchLabels"], pod_labels(w)), w["metadata"]["name"]
    # Two workloads whose pods one selector takes would fight over them.
    for w in WORKLOADS:
        assert selected_workloads(w["spec"]["selector"]["matchLabels"]) == [w], w["metadata"]["name"]


def test_services_select_pods_and_target_their_ports():
    for service in of_kind("Service"):
        targets = selected_workloads(service["spec"]["selector"])
        assert targets, f"Service/{service['metadata']['name']} selects no pods"
        for port in service["spec"]["ports"]:
            target = port.get("targetPort", port["port"])
            for w in targets:
                names, numbers = set(), set()
                for c in pod_spec(w)["containers"]:
                    n, p = container_ports(c)
                    names |= n
                    numbers |= p
                assert target in (names if isinstance(target, str) else numbers), \
                    f"Service/{service['metadata']['name']} → {w['metadata']['name']}: no port {target}"


def test_disruption_budgets_and_autoscaler_name_workloads():
    for pdb in of_kind("PodDisruptionBudget"):
        assert selected_workloads(pdb["spec"]["selector"]["matchLabels"]), pdb["metadata"]["name"]
    assert {p["metadata"]["name"] for p in of_kind("PodDisruptionBudget")} >= {"gateway", "scheduler", "nats"}
    hpa = named("HorizontalPodAutoscaler", "gateway")
    ref = hpa["spec"]["scaleTargetRef"]
    gateway = named(ref["kind"], ref["name"])
    assert "replicas" not in gateway["spec"]  # the autoscaler owns the count
    assert hpa["spec"]["metrics"][0]["resource"]["name"] == "cpu"
    assert all("cpu" in c["resources"]["requests"] for c in pod_spec(gateway)["containers"])  # Utilization needs it


def test_volumes_and_config_references_exist():
    claims = {c["metadata"]["name"] for c in of_kind("PersistentVolumeClaim")}
    config_maps = {c["metadata"]["name"]: c["data"] for c in of_kind("ConfigMap")}
    for w in WORKLOADS:
        spec = pod_spec(w)
        templates = {t["metadata"]["name"] for t in w["spec"].get("volumeClaimTemplates", [])}
        volumes = {v["name"]: v for v in spec.get("volumes", [])}
        for volume in volumes.values():
            if "persistentVolumeClaim" in volume:
                assert volume["persistentVolumeClaim"]["claimName"] in claims
            if "configMap" in volume:
                assert volume["configMap"]["name"] in config_maps
        for c in spec["containers"]:
            for mount in c.get("volumeMounts", []):
                assert mount["name"] in volumes or mount["name"] in templates, f"{c['name']}: {mount['name']}"
            for var in c.get("env", []):
                ref = var.get("valueFrom", {}).get("configMapKeyRef")
                if ref:
                    assert ref["key"] in config_maps[ref["name"]], f"{c['name']}: {ref}"


def test_probes_point_at_ports_that_exist():
    for w in WORKLOADS:
        for c in pod_spec(w)["containers"]:
            names, numbers = container_ports(c)
            for kind in ("startupProbe", "readinessProbe", "livenessProbe"):
                probe = c.get(kind, {})
                for action in ("httpGet", "tcpSocket"):
                    if action in probe:
                        port = probe[action]["port"]
                        assert port in (names if isinstance(port, str) else numbers), f"{c['name']} {kind}: {port}"


def test_gateway_probes():
    (c,) = pod_spec(named("Deployment", "gateway"))["containers"]
    assert c["readinessProbe"]["httpGet"]["path"] == "/ready"
    assert c["livenessProbe"]["httpGet"]["path"] == "/health"
    assert c["startupProbe"]["httpGet"]["path"] == "/health"
    args = expanded_args(c)
    assert c["ports"][0]["containerPort"] == int(args[args.index("--port") + 1])
    assert args[args.index("--host") + 1] == "0.0.0.0"


def test_the_scheduler_probe_watches_the_nats_port():
    url = named("ConfigMap", "inferno")["data"]["INFERNO_NATS_URL"]
    host, port = re.fullmatch(r"tls://([\w-]+):(\d+)", url).groups()
    assert any(p["port"] == int(port) for p in named("Service", host)["spec"]["ports"])
    (c,) = pod_spec(named("Deployment", "scheduler"))["containers"]
    assert f":{int(port):04X} 01 " in c["readinessProbe"]["exec"]["command"][-1]
    assert named("Deployment", "scheduler")["spec"]["replicas"] == 2


@pytest.mark.parametrize("role", WORKER_ROLES)
def test_workers(role):
    w = named("Deployment", f"worker-{role}")
    (c,) = pod_spec(w)["containers"]
    args = expanded_args(c)
    assert args[args.index("--role") + 1] == role
    assert c["resources"]["limits"]["nvidia.com/gpu"] == c["resources"]["requests"]["nvidia.com/gpu"] == 1
    assert w["spec"]["replicas"] == (1 if role == "mixed" else 0)  # prefill and decode are opt-in
    mounts = {m["mountPath"]: m for m in c["volumeMounts"]}
    assert mounts["/models"]["readOnly"] is True
    volumes = {v["name"]: v for v in pod_spec(w)["volumes"]}
    assert volumes[mounts["/dev/shm"]["name"]]["emptyDir"]["medium"] == "Memory"
    assert "/cache/triton" in mounts  # the image's TRITON_CACHE_DIR
    assert "TRITON_CACHE_DIR=/cache/triton" in (ROOT / "Dockerfile").read_text()
    env = {v["name"]: v for v in c["env"]}
    assert env["INFERNO_WORKER_ID"]["valueFrom"]["fieldRef"]["fieldPath"] == "metadata.name"
    assert "INFERNO_WORKER_ID" in c["readinessProbe"]["exec"]["command"][-1]  # worker-status asks by id
    assert env["INFERNO_GPU_MEMORY_UTILIZATION"]["value"] == "0.92"
    assert ("INFERNO_KV_TRANSFER_HOST" in env) == (role == "decode")


def test_kvstore_ports_match_its_flags():
    (c,) = pod_spec(named("Deployment", "kvstore"))["containers"]
    args = expanded_args(c)
    ports = {p["name"]: p["containerPort"] for p in c["ports"]}
    assert ports == {"ucx": int(args[args.index("--ucx-port") + 1]), "http": int(args[args.index("--http-port") + 1])}
    assert {p["name"] for p in named("Service", "kvstore")["spec"]["ports"]} == {"ucx", "http"}
    assert c["livenessProbe"]["httpGet"]["path"] == "/health"


def test_nats_cluster():
    sts = named("StatefulSet", "nats")
    assert sts["spec"]["replicas"] == 3
    (c,) = pod_spec(sts)["containers"]
    assert c["image"] == "nats:2.10"
    conf = named("ConfigMap", "nats-config")["data"]["nats.conf"]
    headless = named("Service", sts["spec"]["serviceName"])
    assert headless["spec"]["clusterIP"] == "None"
    # Every pod by its stable name under the headless Service (a route to itself a server ignores).
    routes = re.findall(r"nats://([\w.-]+):6222", conf)
    assert routes == [f"nats-{i}.{headless['metadata']['name']}" for i in range(sts["spec"]["replicas"])]
    assert "no_advertise" not in conf  # the services size their KV buckets from the advertised URLs
    assert re.search(r"jetstream\s*{[^}]*store_dir:\s*/data", conf) and "http_port: 8222" in conf
    (template,) = sts["spec"]["volumeClaimTemplates"]
    assert {m["name"]: m["mountPath"] for m in c["volumeMounts"]}[template["metadata"]["name"]] == "/data"


def test_the_bus_has_users():
    """Every server includes the users that shared/nats_auth.py makes, their passwords from the Secret the
    kustomization generates; every service connects as its role with its password from that Secret."""
    from shared.nats_auth import password_variable, server_config

    config = named("ConfigMap", "nats-config")["data"]
    assert "include ./users.conf" in config["nats.conf"] and config["users.conf"] == server_config("inferno")
    kustomization = yaml.safe_load((MANIFESTS / "kustomization.yaml").read_text())
    secret = next(g for g in kustomization["secretGenerator"] if g["name"] == "inferno-nats-users")
    assert kustomization["generatorOptions"]["disableNameSuffixHash"]
    (c,) = pod_spec(named("StatefulSet", "nats"))["containers"]
    assert c["envFrom"] == [{"secretRef": {"name": secret["name"]}}]
    for w in WORKLOADS:
        for c in pod_spec(w)["containers"]:
            if c["image"] != "inferno:latest":
                continue
            env = {v["name"]: v for v in c["env"]}
            role = c["args"][0]
            assert env["INFERNO_NATS_USER"]["value"] == role, w["metadata"]["name"]
            assert env["INFERNO_NATS_PASSWORD"]["valueFrom"]["secretKeyRef"] == {
                "name": secret["name"], "key": password_variable(role)}, w["metadata"]["name"]


def go_names(pattern: str, host: str) -> bool:
    """Whether a certificate's name `pattern` names `host` by Go's crypto/x509 (nats-server checks its routes
    with it): a leading '*' label stands for one label."""
    want, have = pattern.lower().split("."), host.lower().split(".")
    return len(want) == len(have) and all(a == b or (i == 0 and a == "*") for i, (a, b) in enumerate(zip(want, have)))


def test_the_bus_has_tls(tmp_path):
    """Every server's client port and routes take the TLS blocks of shared/nats_tls.py, with the files of the
    Secret the kustomization makes from `inferno nats-certs`'s directory; every service dials tls:// and mounts
    that Secret's CA alone; the certificate the guide's command makes names the Service and every route."""
    from cryptography import x509

    from inferno.tools import nats_certs
    from shared.nats_tls import CA_FILE, CERT_FILE, KEY_FILE, ServerTlsFiles, tls_block

    conf = named("ConfigMap", "nats-config")["data"]["nats.conf"]
    sts = named("StatefulSet", "nats")
    (c,) = pod_spec(sts)["containers"]
    tls_mount = next(m for m in c["volumeMounts"] if m["name"] == "tls")
    files = ServerTlsFiles.in_dir(tls_mount["mountPath"])
    assert "\n" + tls_block(files) in conf
    cluster = re.search(r"^cluster {\n(.*?)^}\n", conf, re.M | re.S).group(1)
    assert cluster.endswith(textwrap.indent(tls_block(files, clients=False), " " * 2))
    kustomization = yaml.safe_load((MANIFESTS / "kustomization.yaml").read_text())
    secret = next(g for g in kustomization["secretGenerator"] if g["name"] == "inferno-nats-tls")
    certs_dir = "nats-tls"
    assert secret["files"] == [f"{certs_dir}/{name}" for name in (CA_FILE, CERT_FILE, KEY_FILE)]
    tls_volume = next(v for v in pod_spec(sts)["volumes"] if v["name"] == "tls")
    assert tls_volume["secret"] == {"secretName": secret["name"], "defaultMode": 0o400}
    config = named("ConfigMap", "inferno")["data"]
    url, ca_file = urlsplit(config["INFERNO_NATS_URL"]), config["INFERNO_NATS_TLS_CA"]
    assert url.scheme == "tls"
    for w, c in inferno_containers():
        env = {v["name"]: v for v in c["env"]}
        assert env["INFERNO_NATS_TLS_CA"]["valueFrom"]["configMapKeyRef"] == {"name": "inferno",
                                                                            "key": "INFERNO_NATS_TLS_CA"}
        mount = next(m for m in c["volumeMounts"] if m["mountPath"] == str(Path(ca_file).parent))
        volume = next(v for v in pod_spec(w)["volumes"] if v["name"] == mount["name"])
        assert mount["readOnly"] and volume["secret"] == {  # the CA, not the servers' key
            "secretName": secret["name"], "items": [{"key": CA_FILE, "path": Path(ca_file).name}]}
    # The guide's command, run: its certificate names what the services and the routes dial.
    line = re.search(r"^inferno nats-certs .*$", GUIDE.read_text().replace("\\\n", " "), re.M).group(0)
    out_dir, *args = shlex.split(line, comments=True)[2:]
    assert out_dir == f"deploy/kubernetes/{certs_dir}"
    assert nats_certs.main([str(tmp_path), *args]) == 0
    cert = x509.load_pem_x509_certificate((tmp_path / CERT_FILE).read_bytes())
    names = cert.extensions.get_extension_for_class(x509.SubjectAlternativeName).value
    names = names.get_values_for_type(x509.DNSName)
    dialled = [url.hostname, *re.findall(r"nats://([\w.-]+):6222", conf)]
    for host in dialled:
        assert any(go_names(name, host) for name in names), host
    said = (MANIFESTS / "kustomization.yaml").read_text().replace("\\\n#", " ")  # the kustomization says the same
    assert shlex.split(re.search(r"^#\s+(inferno nats-certs .*)$", said, re.M).group(1))[2:] == [out_dir, *args]


def test_service_monitors():
    """ServiceMonitor is a CRD: checked for its shape and against the Services it scrapes."""
    for monitor in of_kind("ServiceMonitor"):
        assert set(monitor) == {"apiVersion", "kind", "metadata", "spec"}
        assert set(monitor["spec"]) == {"selector", "endpoints"}
        services = [s for s in of_kind("Service") if matches(monitor["spec"]["selector"]["matchLabels"],
                                                               s["metadata"]["labels"])]
        assert len(services) == 1, monitor["metadata"]["name"]
        port_names = {p["name"] for p in services[0]["spec"]["ports"]}
        for endpoint in monitor["spec"]["endpoints"]:
            assert set(endpoint) <= {"port", "path", "interval", "authorization"}
            assert endpoint["port"] in port_names and endpoint["path"] == "/metrics"
    assert {m["metadata"]["name"] for m in of_kind("ServiceMonitor")} == {"inferno-gateway", "inferno-kvstore"}


@pytest.mark.parametrize("entry", inferno_containers(),
                         ids=lambda e: f"{e[0]['metadata']['name']}/{e[1]['name']}")
def test_commands_parse_with_the_cli_and_are_documented(entry):
    _, c = entry
    args = expanded_args(c)
    module = importlib.import_module(ENTRY_POINTS[args[0]])
    module.parse_args(args[1:])  # raises SystemExit on an unknown flag
    for flag in (a for a in args if a.startswith("--")):
        assert f"`{flag}`" in CONFIGURATION, f"{flag} is not in docs/configuration.md"
    source = Path(module.__file__).read_text() + (ROOT / "shared" / "config.py").read_text()  # + NatsConfig's
    for var in (v["name"] for v in c["env"] if v["name"].startswith("INFERNO_")):
        assert var in CONFIGURATION, f"{var} is not in docs/configuration.md"
        # Read by the service, or handed to it as a flag through $(VAR).
        assert var in source or f"$({var})" in " ".join(c["args"]), f"{c['name']}: {var} is read by nothing"
