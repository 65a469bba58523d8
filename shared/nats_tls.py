"""TLS on the bus, with nats-server's own TLS: the servers' `tls` blocks and a client's ssl.SSLContext
(the certificates themselves: shared/nats_certs.py).

Once the bus leaves one host, the users' passwords (shared/nats_auth.py) and every message would
cross the network in clear. The services start TLS before the server's first line (nats-server's
handshake_first): nats-py otherwise reads that line in clear and follows it, so whoever sits on the
path could leave out "tls_required" and read the password that comes next.
"""

from __future__ import annotations

import ssl
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from shared.config import NatsConfig

# The servers wait this long for a client's handshake before they send the INFO line in clear, so
# a client that waits for that line (nats-py's default, other languages' clients) still connects.
HANDSHAKE_FIRST_FALLBACK = "300ms"
CA_FILE, CERT_FILE, KEY_FILE = "ca.crt", "server.crt", "server.key"


@dataclass(frozen=True, slots=True)
class ServerTlsFiles:
    """Where a nats-server reads its CA, certificate and key."""

    ca_file: str
    cert_file: str
    key_file: str

    @classmethod
    def in_dir(cls, directory: str | Path) -> ServerTlsFiles:
        d = Path(directory)
        return cls(str(d / CA_FILE), str(d / CERT_FILE), str(d / KEY_FILE))


def tls_block(files: ServerTlsFiles, *, clients: bool = True, verify_clients: bool = False) -> str:
    """nats-server's `tls { ... }` block. `clients`: the client port's (handshake first, with the
    fallback); else a cluster's, whose routes nats-server always verifies both ways. `verify_clients`:
    clients must show a certificate the CA signed (mutual TLS)."""
    lines = [f'cert_file: "{files.cert_file}"', f'key_file: "{files.key_file}"', f'ca_file: "{files.ca_file}"',
             "timeout: 2"]
    if clients:
        lines.append(f'handshake_first: "{HANDSHAKE_FIRST_FALLBACK}"')
        if verify_clients:
            lines.append("verify: true")
    return "tls {\n" + "".join(f"  {line}\n" for line in lines) + "}\n"


def server_tls_config(files: ServerTlsFiles, *, cluster: bool = False, verify_clients: bool = False) -> str:
    """The client port's TLS and, with `cluster`, the routes' (a `cluster` block holding only `tls`:
    the cluster's name, port and routes may come as flags, which nats-server merges with it; without
    a port it opens no route listener)."""
    text = tls_block(files, verify_clients=verify_clients)
    if cluster:
        text += "cluster {\n" + "".join(f"  {line}\n" for line in tls_block(files, clients=False).splitlines()) + "}\n"
    return text


def client_context(ca_file: str = "", cert_file: str = "", key_file: str = "") -> ssl.SSLContext:
    """A client's TLS context: it trusts `ca_file` (else the system's CAs) and checks the server's name;
    with `cert_file` and `key_file` it shows that certificate to servers that verify clients."""
    context = ssl.create_default_context(ssl.Purpose.SERVER_AUTH, cafile=ca_file or None)
    if cert_file:
        context.load_cert_chain(cert_file, key_file or None)
    return context


def nats_options(cfg: NatsConfig) -> dict[str, Any]:
    """nats-py's TLS arguments for `cfg` ({} without TLS)."""
    return tls_options(cfg.tls_ca, cfg.tls_cert, cfg.tls_key, first=cfg.tls_first) if cfg.tls else {}


def tls_options(ca_file: str = "", cert_file: str = "", key_file: str = "", *, first: bool = True) -> dict[str, Any]:
    """nats-py's `tls` and `tls_handshake_first` arguments. A server it discovers by IP address (a
    cluster's INFO) is checked against the name of the server first dialled: nats-py keeps that name."""
    return dict(tls=client_context(ca_file, cert_file, key_file), tls_handshake_first=first)
