"""The bus's certificates: a private CA, made in memory, and the certificates it signs (nats-server's
and, for mutual TLS, clients'), written with their keys readable by their owner only.

The CA's key is never written: it signs a stack's certificates once, at `inferno up --nats-tls` or
`inferno nats-certs`, and a new set comes from running that again, so no file on any host can sign
a certificate the bus would trust. (The services themselves need none of this: shared/nats_tls.py.)
"""

from __future__ import annotations

import datetime
import ipaddress
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Iterable

from cryptography import x509
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.x509.oid import ExtendedKeyUsageOID, NameOID

from shared.nats_tls import ServerTlsFiles

# Every server certificate names these: the services of one host dial the bus on loopback.
LOOPBACK_HOSTS = ("127.0.0.1", "localhost")
DEFAULT_DAYS = 825
# Clock skew between the host that signs and the hosts that check.
_BACKDATE = datetime.timedelta(hours=1)


@dataclass(frozen=True, slots=True)
class Issued:
    """A certificate and its private key, PEM-encoded."""

    cert_pem: bytes
    key_pem: bytes


class CertificateAuthority:
    """A private CA held in memory; it signs the bus's certificates (P-256 keys: quick to make, and
    read by Go's crypto/tls in nats-server and OpenSSL in the clients alike)."""

    def __init__(self, key: ec.EllipticCurvePrivateKey, cert: x509.Certificate):
        self._key = key
        self.cert = cert

    @classmethod
    def generate(cls, name: str = "Inferno NATS CA", days: int = DEFAULT_DAYS) -> CertificateAuthority:
        key = ec.generate_private_key(ec.SECP256R1())
        subject = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, name)])
        now = _now()
        cert = (x509.CertificateBuilder().subject_name(subject).issuer_name(subject).public_key(key.public_key())
                .serial_number(x509.random_serial_number())
                .not_valid_before(now - _BACKDATE).not_valid_after(now + datetime.timedelta(days=days))
                .add_extension(x509.BasicConstraints(ca=True, path_length=0), critical=True)
                .add_extension(_key_usage(key_cert_sign=True, crl_sign=True), critical=True)
                .add_extension(x509.SubjectKeyIdentifier.from_public_key(key.public_key()), critical=False)
                .sign(key, hashes.SHA256()))
        return cls(key, cert)

    @property
    def cert_pem(self) -> bytes:
        return self.cert.public_bytes(serialization.Encoding.PEM)

    def issue_server(self, hosts: Iterable[str] = (), days: int = DEFAULT_DAYS) -> Issued:
        """A nats-server's certificate for LOOPBACK_HOSTS and `hosts` (names, wildcards such as
        *.nats-headless, or IP addresses). It serves clients and routes, and nats-server checks a
        route's certificate at both its ends, so it is a client certificate as well."""
        names = list(dict.fromkeys([*LOOPBACK_HOSTS, *hosts]))
        return self._issue("nats", days, names, [ExtendedKeyUsageOID.SERVER_AUTH, ExtendedKeyUsageOID.CLIENT_AUTH])

    def issue_client(self, name: str, days: int = DEFAULT_DAYS) -> Issued:
        """A client's certificate, for servers that verify their clients (mutual TLS)."""
        return self._issue(name, days, [], [ExtendedKeyUsageOID.CLIENT_AUTH])

    def _issue(self, common_name: str, days: int, hosts: list[str], usages: list[x509.ObjectIdentifier]) -> Issued:
        key = ec.generate_private_key(ec.SECP256R1())
        now = _now()
        builder = (x509.CertificateBuilder()
                   .subject_name(x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, common_name)]))
                   .issuer_name(self.cert.subject).public_key(key.public_key())
                   .serial_number(x509.random_serial_number())
                   .not_valid_before(now - _BACKDATE).not_valid_after(now + datetime.timedelta(days=days))
                   .add_extension(x509.BasicConstraints(ca=False, path_length=None), critical=True)
                   .add_extension(_key_usage(digital_signature=True), critical=True)
                   .add_extension(x509.ExtendedKeyUsage(usages), critical=False)
                   .add_extension(x509.AuthorityKeyIdentifier.from_issuer_public_key(self._key.public_key()),
                                  critical=False))
        if hosts:
            builder = builder.add_extension(x509.SubjectAlternativeName([_general_name(h) for h in hosts]),
                                            critical=False)
        cert = builder.sign(self._key, hashes.SHA256())
        key_pem = key.private_bytes(serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8,
                                    serialization.NoEncryption())
        return Issued(cert.public_bytes(serialization.Encoding.PEM), key_pem)


def _now() -> datetime.datetime:
    return datetime.datetime.now(datetime.timezone.utc)


def _key_usage(digital_signature: bool = False, key_cert_sign: bool = False, crl_sign: bool = False) -> x509.KeyUsage:
    return x509.KeyUsage(digital_signature=digital_signature, content_commitment=False, key_encipherment=False,
                         data_encipherment=False, key_agreement=False, key_cert_sign=key_cert_sign,
                         crl_sign=crl_sign, encipher_only=False, decipher_only=False)


def _general_name(host: str) -> x509.GeneralName:
    try:
        return x509.IPAddress(ipaddress.ip_address(host))
    except ValueError:
        if not host or any(c.isspace() or c in "/:@" for c in host):
            raise ValueError(f"{host!r} is neither a host name nor an IP address") from None
        return x509.DNSName(host)


def write_server_files(directory: Path, ca: CertificateAuthority, server: Issued) -> ServerTlsFiles:
    """ca.crt, server.crt and server.key (mode 0600) in `directory`, which is made if missing."""
    directory.mkdir(parents=True, exist_ok=True)
    files = ServerTlsFiles.in_dir(directory)
    Path(files.ca_file).write_bytes(ca.cert_pem)
    Path(files.cert_file).write_bytes(server.cert_pem)
    write_private(Path(files.key_file), server.key_pem)
    return files


def write_private(path: Path, data: bytes) -> None:
    """Write `data` to a file only this user may read, not readable by others even for a moment."""
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    with os.fdopen(fd, "wb") as f:
        os.fchmod(f.fileno(), 0o600)  # a file that was there keeps its mode through O_CREAT
        f.write(data)
