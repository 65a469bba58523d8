"""`inferno nats-certs`: a private CA and the certificates of the bus's TLS, as the deployments take them."""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from shared.nats_certs import DEFAULT_DAYS, LOOPBACK_HOSTS, CertificateAuthority, write_private, write_server_files
from shared.subjects import check_id

# The compose file's variable for the directory (docker-compose.yml mounts it into the nats-servers
# and its ca.crt into every service; it refuses to start without it).
DIR_VARIABLE = "INFERNO_NATS_TLS_DIR"


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(
        prog="inferno nats-certs",
        description="Make a new CA and, signed by it, the NATS servers' certificate (and clients' for mutual TLS) "
                    "in OUT_DIR: ca.crt, server.crt, server.key (mode 0600), NAME.crt and NAME.key. The CA's key "
                    "is not kept: run it again for a new set. Prints INFERNO_NATS_TLS_DIR=OUT_DIR for docker "
                    "compose's .env (`inferno nats-certs deploy/nats/tls --host nats ... >> .env`); Kubernetes: "
                    "the kustomization makes the Secret inferno-nats-tls from deploy/kubernetes/nats-tls/.")
    ap.add_argument("out_dir", type=Path, metavar="OUT_DIR")
    ap.add_argument("--host", action="append", default=[],
                    help=f"a name or address the services dial the servers by, or a wildcard such as *.nats-headless "
                         f"(repeatable; {' and '.join(LOOPBACK_HOSTS)} are always in)")
    ap.add_argument("--client", action="append", default=[], metavar="NAME",
                    help="also a client certificate NAME.crt and its key NAME.key, for servers that verify clients "
                         "(repeatable)")
    ap.add_argument("--days", type=int, default=DEFAULT_DAYS, help="how long the certificates are valid")
    args = ap.parse_args(argv)
    if args.days < 1:
        ap.error("--days must be at least 1")
    ca = CertificateAuthority.generate(days=args.days)
    try:
        server = ca.issue_server(args.host, days=args.days)
        for name in args.client:  # a file name: no path of its own
            check_id("client", name)
    except ValueError as e:
        ap.error(str(e))
    files = write_server_files(args.out_dir, ca, server)
    for name in args.client:
        client = ca.issue_client(name, days=args.days)
        (args.out_dir / f"{name}.crt").write_bytes(client.cert_pem)
        write_private(args.out_dir / f"{name}.key", client.key_pem)
    print(f"inferno nats-certs: {files.ca_file}, {files.cert_file} ({', '.join([*LOOPBACK_HOSTS, *args.host])}), "
          f"{files.key_file}", file=sys.stderr)
    print(f"{DIR_VARIABLE}={args.out_dir.resolve()}")
    return 0
