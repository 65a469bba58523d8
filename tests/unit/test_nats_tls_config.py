"""TLS on the bus without a server: the certificates the CA signs (names, usages, key files' modes),
nats-server's `tls` blocks, the clients' settings from flags and environment, `inferno nats-certs`, and
what `inferno up --nats-tls` writes and hands its children."""

from __future__ import annotations

import argparse
import ipaddress
import ssl
import stat
from urllib.parse import urlsplit

import pytest
from cryptography import x509
from cryptography.x509.oid import ExtendedKeyUsageOID

from inferno.tools import nats_certs
from services import launcher
from shared.config import NatsConfig, add_nats_tls_flags, nats_tls_settings
from shared.nats_certs import CertificateAuthority, write_private, write_server_files
from shared.nats_tls import ServerTlsFiles, client_context, nats_options, server_tls_config, tls_block


@pytest.fixture(scope="module")
def ca() -> CertificateAuthority:
    return CertificateAuthority.generate("test CA")


def load(pem: bytes) -> x509.Certificate:
    return x509.load_pem_x509_certificate(pem)


def test_a_server_certificate_names_loopback_and_the_given_hosts(ca):
    cert = load(ca.issue_server(["nats", "*.nats-headless", "10.0.0.7", "nats"]).cert_pem)
    names = cert.extensions.get_extension_for_class(x509.SubjectAlternativeName).value
    assert names.get_values_for_type(x509.DNSName) == ["localhost", "nats", "*.nats-headless"]
    assert names.get_values_for_type(x509.IPAddress) == [ipaddress.ip_address("127.0.0.1"),
                                                         ipaddress.ip_address("10.0.0.7")]
    # Routes check the certificate at both ends: it is a client's too.
    usages = list(cert.extensions.get_extension_for_class(x509.ExtendedKeyUsage).value)
    assert usages == [ExtendedKeyUsageOID.SERVER_AUTH, ExtendedKeyUsageOID.CLIENT_AUTH]
    cert.verify_directly_issued_by(ca.cert)
    assert not cert.extensions.get_extension_for_class(x509.BasicConstraints).value.ca
    assert ca.cert.extensions.get_extension_for_class(x509.BasicConstraints).value.ca


def test_a_client_certificate_is_for_clients_only(ca):
    cert = load(ca.issue_client("worker").cert_pem)
    assert list(cert.extensions.get_extension_for_class(x509.ExtendedKeyUsage).value) == [
        ExtendedKeyUsageOID.CLIENT_AUTH]
    assert cert.subject.rfc4514_string() == "CN=worker"
    with pytest.raises(x509.ExtensionNotFound):
        cert.extensions.get_extension_for_class(x509.SubjectAlternativeName)


@pytest.mark.parametrize("host", ["", "two words", "http://nats", "nats:4222", "a/b"])
def test_a_host_that_is_no_name_is_refused(ca, host):
    with pytest.raises(ValueError, match="neither a host name nor an IP address"):
        ca.issue_server([host])


def test_files_and_their_modes(ca, tmp_path):
    files = write_server_files(tmp_path / "tls", ca, ca.issue_server())
    assert files == ServerTlsFiles.in_dir(tmp_path / "tls")
    assert open(files.ca_file, "rb").read() == ca.cert_pem
    assert stat.S_IMODE((tmp_path / "tls" / "server.key").stat().st_mode) == 0o600
    assert sorted(p.name for p in (tmp_path / "tls").iterdir()) == ["ca.crt", "server.crt", "server.key"]
    # A key written over a file that others could read is not left readable.
    (tmp_path / "old.key").write_text("x")
    (tmp_path / "old.key").chmod(0o644)
    write_private(tmp_path / "old.key", b"secret")
    assert stat.S_IMODE((tmp_path / "old.key").stat().st_mode) == 0o600
    assert (tmp_path / "old.key").read_bytes() == b"secret"


def test_the_server_blocks():
    files = ServerTlsFiles("/t/ca.crt", "/t/server.crt", "/t/server.key")
    assert tls_block(files) == ('tls {\n  cert_file: "/t/server.crt"\n  key_file: "/t/server.key"\n'
                                '  ca_file: "/t/ca.crt"\n  timeout: 2\n  handshake_first: "300ms"\n}\n')
    assert tls_block(files, verify_clients=True).endswith('  handshake_first: "300ms"\n  verify: true\n}\n')
    routes = tls_block(files, clients=False)
    assert "handshake_first" not in routes and "verify" not in routes
    assert server_tls_config(files, cluster=True) == (
        tls_block(files) + "cluster {\n" + "".join(f"  {line}\n" for line in routes.splitlines()) + "}\n")


def test_client_context_and_options(ca, tmp_path):
    files = write_server_files(tmp_path, ca, ca.issue_server())
    client = ca.issue_client("bob")
    (tmp_path / "bob.crt").write_bytes(client.cert_pem)
    write_private(tmp_path / "bob.key", client.key_pem)
    context = client_context(files.ca_file, str(tmp_path / "bob.crt"), str(tmp_path / "bob.key"))
    assert context.verify_mode == ssl.CERT_REQUIRED and context.check_hostname
    assert nats_options(NatsConfig(url="nats://127.0.0.1:4222")) == {}
    for cfg in (NatsConfig(url="tls://127.0.0.1:4222"), NatsConfig(url="nats://h:1", tls_ca=files.ca_file),
                NatsConfig(url="nats://a:1,tls://b:1")):
        options = nats_options(cfg)
        assert cfg.tls and isinstance(options["tls"], ssl.SSLContext) and options["tls_handshake_first"] is True
    assert nats_options(NatsConfig(url="tls://h:1", tls_first=False))["tls_handshake_first"] is False


@pytest.mark.parametrize("settings, field", [
    ({"tls_cert": "{crt}"}, "tls_cert"),  # a certificate without its key
    ({"tls_key": "{crt}"}, "tls_cert"),
    ({"tls_ca": "{missing}"}, "tls_ca"),
])
def test_bad_tls_settings(tmp_path, settings, field):
    (tmp_path / "c.crt").write_text("x")
    paths = {"crt": str(tmp_path / "c.crt"), "missing": str(tmp_path / "none.crt")}
    with pytest.raises(ValueError, match=f"NatsConfig.{field}"):
        NatsConfig(**{k: v.format(**paths) for k, v in settings.items()})


def test_flags_default_to_the_environment(monkeypatch, tmp_path):
    ap = argparse.ArgumentParser()
    add_nats_tls_flags(ap)
    assert nats_tls_settings(ap.parse_args([])) == dict(tls_ca="", tls_cert="", tls_key="", tls_first=True)
    monkeypatch.setenv("INFERNO_NATS_TLS_CA", "/env/ca.crt")
    monkeypatch.setenv("INFERNO_NATS_TLS_FIRST", "0")
    ap = argparse.ArgumentParser()
    add_nats_tls_flags(ap)
    assert nats_tls_settings(ap.parse_args([])) == dict(tls_ca="/env/ca.crt", tls_cert="", tls_key="", tls_first=False)
    args = ap.parse_args(["--nats-tls-ca", "/flag/ca.crt", "--nats-tls-first", "--nats-tls-cert", "c", "--nats-tls-key",
                          "k"])
    assert nats_tls_settings(args) == dict(tls_ca="/flag/ca.crt", tls_cert="c", tls_key="k", tls_first=True)


def test_nats_certs_writes_the_set_and_the_compose_line(tmp_path, capsys):
    out = tmp_path / "tls"
    assert nats_certs.main([str(out), "--host", "nats", "--client", "bob", "--days", "30"]) == 0
    assert capsys.readouterr().out == f"{nats_certs.DIR_VARIABLE}={out.resolve()}\n"
    assert sorted(p.name for p in out.iterdir()) == ["bob.crt", "bob.key", "ca.crt", "server.crt", "server.key"]
    assert {p.name for p in out.iterdir() if stat.S_IMODE(p.stat().st_mode) == 0o600} == {"bob.key", "server.key"}
    ca = load((out / "ca.crt").read_bytes())
    server = load((out / "server.crt").read_bytes())
    server.verify_directly_issued_by(ca)
    load((out / "bob.crt").read_bytes()).verify_directly_issued_by(ca)
    assert (server.not_valid_after_utc - server.not_valid_before_utc).days == 30  # (and the hour of skew)
    for bad in (["--client", "../escape"], ["--host", "a b"], ["--days", "0"]):
        with pytest.raises(SystemExit) as exit_:
            nats_certs.main([str(tmp_path / "other"), *bad])
        assert exit_.value.code == 2
    assert not (tmp_path / "escape.crt").exists()


def test_up_with_tls_writes_its_config_and_gives_every_service_the_ca(tmp_path):
    cfg = launcher.StackConfig(model_dir=tmp_path, run_dir=tmp_path / "run", nats_tls=True, nats_cluster=2)
    stack = launcher.Stack(cfg)
    assert [urlsplit(u).scheme for u in stack.nats_url.split(",")] == ["tls", "tls"]
    assert stack.nats_url_of("api").startswith("tls://api:")
    argv = stack.bus.config_argv()
    files = stack.nats_tls
    assert argv == ["-c", str(tmp_path / "run" / "nats.conf")]
    assert (tmp_path / "run" / "nats.conf").read_text() == ("include ./nats-users.conf\n" +
                                                            server_tls_config(files, cluster=True))
    assert files.ca_file == str((tmp_path / "run" / "nats-tls" / "ca.crt").resolve())
    load(open(files.cert_file, "rb").read()).verify_directly_issued_by(load(open(files.ca_file, "rb").read()))
    assert stack.bus.env_for("worker-0")["INFERNO_NATS_TLS_CA"] == files.ca_file
    assert stack.bus.env_for("gateway")["INFERNO_NATS_USER"] == "gateway"
    assert stack.bus.env_for("nats-1") == {}
    assert isinstance(stack.nats_tls_options()["tls"], ssl.SSLContext)


def test_up_without_tls_or_users_writes_no_config(tmp_path):
    stack = launcher.Stack(launcher.StackConfig(model_dir=tmp_path, run_dir=tmp_path / "run", nats_auth=False))
    assert stack.nats_url.startswith("nats://") and stack.bus.config_argv() == []
    assert stack.bus.env_for("worker-0") == {} and stack.nats_tls_options() == {}
    assert launcher.parse_args(["--nats-tls"]).nats_tls and not launcher.parse_args([]).nats_tls

