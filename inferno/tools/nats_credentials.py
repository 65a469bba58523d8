"""`inferno nats-credentials`: random passwords for the bus's users, as the deployments take them."""

from __future__ import annotations

import argparse
import sys

from shared.nats_auth import NatsCredentials


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(
        prog="inferno nats-credentials",
        description="Print a random password for each NATS user (the service roles, the admin, the API users) "
                    "as VARIABLE=password lines: docker compose's .env (`inferno nats-credentials > .env`), or "
                    "`kubectl -n inferno create secret generic inferno-nats-users --from-env-file=FILE`. "
                    "deploy/nats/users.conf reads them from nats-server's environment.")
    ap.add_argument("--api-user", action="append", default=None, metavar="NAME",
                    help="an API user (repeatable; default one, 'api'); a new one also needs its entry in "
                         "deploy/nats/users.conf (shared/nats_auth.server_config)")
    args = ap.parse_args(argv)
    sys.stdout.write(NatsCredentials.generate(tuple(args.api_user or ("api",))).env_file())
    return 0
