"""TLS on the bus against real nats-servers started with shared/nats_certs.py's certificates: the services'
connection with the CA round-trips a request, one without it (or without TLS) is refused, mutual TLS
refuses a client without a certificate, and a cluster's routes run over TLS."""

from __future__ import annotations

import asyncio
import time
from pathlib import Path

import pytest

from services.launcher import free_port
from shared.config import NatsConfig
from shared.errors import ServiceUnavailable
from shared.messages import AbortRequest, RouteReply
from shared.nats_certs import CertificateAuthority, write_private, write_server_files
from shared.nats_client import NatsConnection, connect_nats
from shared.nats_tls import ServerTlsFiles, server_tls_config

HANDSHAKE_ERROR = "TLS handshake error"


@pytest.fixture(scope="module")
def ca() -> CertificateAuthority:
    return CertificateAuthority.generate()


@pytest.fixture
def tls_files(ca, tmp_path) -> ServerTlsFiles:
    return write_server_files(tmp_path / "tls", ca, ca.issue_server())


def tls_server(factory, tmp_path: Path, files: ServerTlsFiles, **config):
    conf = tmp_path / f"nats-{free_port()}.conf"
    conf.write_text(server_tls_config(files, **config))
    return factory(extra_args=("-c", str(conf)))


def tls_config(port: int, files: ServerTlsFiles, scheme: str = "tls", **kwargs) -> NatsConfig:
    return NatsConfig(url=f"{scheme}://127.0.0.1:{port}", tls_ca=files.ca_file, connect_timeout=1.0, **kwargs)


async def probe_logged(server) -> int:
    """The server's handshake errors once the fixture's own probe is logged: it reads the INFO line
    that comes after the handshake-first wait and hangs up."""
    deadline = time.monotonic() + 5
    while (count := server.log_tail(1000).count(HANDSHAKE_ERROR)) == 0 and time.monotonic() < deadline:
        await asyncio.sleep(0.05)
    return count


async def round_trip(a: NatsConnection, b: NatsConnection, subject: str = "tls.echo") -> RouteReply:
    await a.subscribe(subject, AbortRequest, lambda req: RouteReply.accepted(req.request_ids[0]))
    return await b.request(subject, AbortRequest(request_ids=["over-tls"]), RouteReply, timeout=2.0)


async def test_a_client_with_the_ca_round_trips_a_request(nats_server_factory, tls_files, tmp_path):
    server = tls_server(nats_server_factory, tmp_path, tls_files)
    errors_at_start = await probe_logged(server)
    a = await connect_nats(tls_config(server.port, tls_files), "tls-a", wait=5.0)
    # A nats:// URL with the CA is TLS as well: the server requires it.
    b = await connect_nats(tls_config(server.port, tls_files, scheme="nats"), "tls-b", wait=5.0)
    try:
        assert await round_trip(a, b) == RouteReply.accepted("over-tls")
        assert a.client._server_info["tls_required"] is True
    finally:
        await a.close()
        await b.close()
    # The services handshake first, their pre-check too: the server has no half-open connection to log.
    assert server.log_tail(1000).count(HANDSHAKE_ERROR) == errors_at_start


async def test_a_client_without_the_ca_or_tls_is_refused(nats_server_factory, tls_files, tmp_path):
    server = tls_server(nats_server_factory, tmp_path, tls_files)
    other_ca = CertificateAuthority.generate()
    other = write_server_files(tmp_path / "other", other_ca, other_ca.issue_server())
    for cfg in (NatsConfig(url=f"tls://127.0.0.1:{server.port}", connect_timeout=0.5),  # the system's CAs
                tls_config(server.port, other)):  # another stack's CA
        with pytest.raises(ServiceUnavailable, match="CERTIFICATE_VERIFY_FAILED"):
            await connect_nats(cfg, "wrong-ca", wait=0.6)
    with pytest.raises(ServiceUnavailable, match="CERTIFICATE_VERIFY_FAILED"):  # waits for INFO, then the same
        await connect_nats(NatsConfig(url=f"nats://127.0.0.1:{server.port}", connect_timeout=0.5), "plain", wait=0.6)
    # A client that never starts TLS gets the INFO line (after the handshake-first wait) and no further.
    reader, writer = await asyncio.open_connection("127.0.0.1", server.port)
    try:
        info = await asyncio.wait_for(reader.readline(), 5.0)
        assert b'"tls_required":true' in info
        writer.write(b'CONNECT {"verbose":false}\r\nPING\r\n')
        await writer.drain()
        assert b"PONG" not in await asyncio.wait_for(reader.read(4096), 5.0)
    finally:
        writer.close()


async def test_a_certificate_for_other_hosts_is_refused(nats_server_factory, ca, tmp_path):
    files = write_server_files(tmp_path / "elsewhere", ca, ca.issue_server(["nats.example"]))
    server = tls_server(nats_server_factory, tmp_path, files)
    conn = await connect_nats(tls_config(server.port, files), "loopback", wait=5.0)  # 127.0.0.1 is always named
    await conn.close()
    # ... but another name of this host is not: the name is checked, not only the signature.
    cfg = NatsConfig(url=f"tls://{_hostname()}:{server.port}", tls_ca=files.ca_file, connect_timeout=0.5)
    with pytest.raises(ServiceUnavailable, match="CERTIFICATE_VERIFY_FAILED|Hostname mismatch"):
        await connect_nats(cfg, "other-name", wait=0.6)


def _hostname() -> str:
    """A name of this host that resolves to it and is not in a loopback-only certificate."""
    import socket

    name = socket.gethostname()
    try:
        socket.getaddrinfo(name, None)
    except OSError:
        pytest.skip("this host's name does not resolve")
    return name


async def test_mutual_tls_needs_a_client_certificate(nats_server_factory, ca, tls_files, tmp_path):
    server = tls_server(nats_server_factory, tmp_path, tls_files, verify_clients=True)
    client = ca.issue_client("worker")
    (tmp_path / "worker.crt").write_bytes(client.cert_pem)
    write_private(tmp_path / "worker.key", client.key_pem)
    with pytest.raises(ServiceUnavailable, match="CERTIFICATE_REQUIRED"):
        await connect_nats(tls_config(server.port, tls_files), "no-cert", wait=0.6)
    a = await connect_nats(tls_config(server.port, tls_files, tls_cert=str(tmp_path / "worker.crt"),
                                      tls_key=str(tmp_path / "worker.key")), "with-cert", wait=5.0)
    try:
        assert await round_trip(a, a) == RouteReply.accepted("over-tls")
    finally:
        await a.close()


async def test_a_cluster_routes_over_tls(nats_server_factory, tls_files, tmp_path):
    """Two servers with the `cluster { tls }` block and the cluster's flags: a request on one is answered
    from the other; a server without TLS on its routes cannot join them."""
    routes = [free_port(), free_port()]
    urls = ",".join(f"nats://127.0.0.1:{port}" for port in routes)
    conf = tmp_path / "cluster.conf"
    conf.write_text(server_tls_config(tls_files, cluster=True))
    servers = [nats_server_factory(jetstream=False, extra_args=(
        "-c", str(conf), "--cluster_name", "tls", "--cluster", f"nats://127.0.0.1:{route}", "--routes", urls))
        for route in routes]
    a = await connect_nats(tls_config(servers[0].port, tls_files), "on-a", wait=5.0)
    b = await connect_nats(tls_config(servers[1].port, tls_files), "on-b", wait=5.0)
    try:
        await a.subscribe("tls.routed", AbortRequest, lambda req: RouteReply.accepted("from-a"))
        deadline = time.monotonic() + 10
        while True:  # until the subscription has crossed the route
            try:
                assert await b.request("tls.routed", AbortRequest(request_ids=["x"]), RouteReply,
                                       timeout=0.5) == RouteReply.accepted("from-a")
                break
            except ServiceUnavailable:
                if time.monotonic() > deadline:
                    raise
    finally:
        await a.close()
        await b.close()
    assert "TLS route handshake error" not in servers[0].log_tail(1000)
    plain = nats_server_factory(jetstream=False, extra_args=(
        "--cluster_name", "tls", "--cluster", f"nats://127.0.0.1:{free_port()}", "--routes", urls))
    deadline = time.monotonic() + 10
    while "TLS route handshake error" not in servers[0].log_tail(1000) + plain.log_tail(1000):
        assert time.monotonic() < deadline, "a route without TLS was not refused"
        await asyncio.sleep(0.1)
