"""Who may publish and subscribe to what on the bus: one NATS user per service role, API users and an
admin, as nats-server's own authorization config (users with permissions; no scheme of our own).

Once the bus leaves one host, any client that reaches NATS could otherwise publish straight to a
worker and pass by the gateway's keys, quotas and validation. Each role is allowed its subjects of
shared/subjects.py only; an API user may publish to {prefix}.api.> and read only its own inboxes
(_INBOX.<user>.>, the inbox prefix its client sets: api_inbox_prefix), so it reads no other client's
replies; the workers' admin subjects take the admin user.
"""

from __future__ import annotations

import json
import re
import secrets
from dataclasses import dataclass

from shared.subjects import check_id, check_prefix

SERVICE_ROLES = ("gateway", "scheduler", "worker", "kvstore")
ADMIN = "admin"
# Request/reply inboxes of the services, and JetStream's API and KV subjects (the buckets of session
# affinity, heartbeats' snapshots and prefix locations; a KV watcher's deliveries come to an inbox).
# ($JS.> also holds the flow-control and ack replies of those consumers.)
_SERVICE_PUB = ["_INBOX.>", "$JS.>", "$KV.>"]
_SERVICE_SUB = ["_INBOX.>"]


def role_permissions(prefix: str) -> dict[str, dict[str, list[str]]]:
    """Each service role's publish and subscribe allow lists (nats-server permissions)."""
    p = check_prefix(prefix)
    worker = f"{p}.worker.*"
    return {
        # API requests in (one gateway of the queue group), routing asked of the schedulers, tokens
        # back from the workers, aborts and its heartbeats out; replies to API clients go to their inboxes.
        "gateway": {"publish": [f"{p}.generate", f"{worker}.abort", f"{p}.gateway_heartbeat", *_SERVICE_PUB],
                    "subscribe": [f"{p}.api.>", f"{p}.gateway.*.tokens", f"{p}.heartbeat", *_SERVICE_SUB]},
        # (and aborts a request at a worker that did not acknowledge it in time)
        "scheduler": {"publish": [f"{worker}.generate", f"{worker}.prepare", f"{worker}.abort", *_SERVICE_PUB],
                      "subscribe": [f"{p}.generate", f"{p}.heartbeat", f"{p}.kv_events", *_SERVICE_SUB]},
        # A worker serves its own subjects (generate, abort, hand-offs, admin), streams tokens to the
        # gateways, offers hand-offs to other workers (and aborts there what it handed over) and asks
        # the kvstore; it hears the gateways' beats (a silent one's requests end).
        "worker": {"publish": [f"{p}.heartbeat", f"{p}.kv_events", f"{p}.gateway.*.tokens", f"{worker}.handoff",
                               f"{worker}.handoff_ready", f"{worker}.abort", f"{p}.kvstore.>", *_SERVICE_PUB],
                   "subscribe": [f"{worker}.>", f"{p}.gateway_heartbeat", *_SERVICE_SUB]},
        "kvstore": {"publish": [f"{p}.kv_events", *_SERVICE_PUB],
                    "subscribe": [f"{p}.kvstore.>", *_SERVICE_SUB]},
    }


def api_inbox_prefix(user: str) -> str:
    """The inbox prefix an API user's client must set (nats-py's inbox_prefix): its replies come there."""
    return f"_INBOX.{check_id('api user', user)}"


def api_permissions(prefix: str, user: str) -> dict[str, list[str]]:
    return {"publish": [f"{check_prefix(prefix)}.api.>"], "subscribe": [f"{api_inbox_prefix(user)}.>"]}


@dataclass(frozen=True, slots=True)
class NatsCredentials:
    """A stack's users and their passwords (random, made by `inferno up`; kept in its run directory)."""

    passwords: dict[str, str]  # user → password: the service roles, the admin, the API users
    api_users: tuple[str, ...]

    @classmethod
    def generate(cls, api_users: tuple[str, ...] = ("api",)) -> "NatsCredentials":
        users = (*SERVICE_ROLES, ADMIN, *api_users)
        return cls({user: secrets.token_urlsafe(24) for user in users}, tuple(api_users))

    def server_config(self, prefix: str) -> str:
        """nats-server's `authorization` block with these passwords."""
        return server_config(prefix, self.passwords, self.api_users)

    def url(self, servers: str, user: str) -> str:
        """`servers` (comma-separated nats:// URLs) with this user's credentials in each."""
        password = self.passwords[user]
        return ",".join(part.replace("://", f"://{user}:{password}@", 1) for part in servers.split(","))

    def env_file(self) -> str:
        """Every password as a variable of password_variable's name, one a line (a compose .env file;
        `kubectl create secret generic --from-env-file`)."""
        return "".join(f"{password_variable(user)}={password}\n" for user, password in self.passwords.items())

    def env(self, user: str) -> dict[str, str]:
        """What a service's environment carries (not its argv, which `ps` shows): NatsConfig reads it."""
        return {"INFERNO_NATS_USER": user, "INFERNO_NATS_PASSWORD": self.passwords[user]}


def password_variable(user: str) -> str:
    """The environment variable that holds `user`'s password where nats-server's config reads it
    ($VAR references: deploy/nats/users.conf) and where compose and Kubernetes hand it to a service."""
    return f"INFERNO_NATS_{user.upper().replace('-', '_')}_PASSWORD"


def server_config(prefix: str, passwords: dict[str, str] | None = None, api_users: tuple[str, ...] = ("api",)) -> str:
    """nats-server's `authorization` block (its config syntax takes JSON values): each user with its
    password, or with None a reference to its password_variable, which nats-server reads from its
    environment (the deployments' template: their passwords live in Secrets, not in files)."""
    roles = role_permissions(prefix)

    def password(user: str) -> str:
        return passwords[user] if passwords else f"${password_variable(user)}"

    users = [{"user": role, "password": password(role), "permissions": roles[role]} for role in SERVICE_ROLES]
    users.append({"user": ADMIN, "password": password(ADMIN)})  # everything: operators' tools
    users += [{"user": user, "password": password(user), "permissions": api_permissions(prefix, user)}
              for user in api_users]
    text = json.dumps(users, indent=2)
    if not passwords:  # a variable reference is written bare: "$X" in quotes would be the literal text
        text = re.sub(r'"(\$INFERNO_NATS_[A-Z0-9_]+_PASSWORD)"', r"\1", text)
    return f"authorization {{\n  users: {text}\n}}\n"
