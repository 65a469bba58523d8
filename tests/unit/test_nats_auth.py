"""The bus's users: each role's allow lists name that role's subjects (shared/subjects.py), the URLs and
environment carry the right user, and the config is what nats-server reads."""

from __future__ import annotations

import json
import re

from shared import subjects
from shared.nats_auth import ADMIN, SERVICE_ROLES, NatsCredentials, api_permissions, role_permissions


def _allows(patterns: list[str], subject: str) -> bool:
    """NATS subject matching: * one token, > the rest."""
    for pattern in patterns:
        p, s = pattern.split("."), subject.split(".")
        if (p[-1] == ">" and len(s) >= len(p) and all(a in ("*", b) for a, b in zip(p[:-1], s))) or (
                len(p) == len(s) and all(a in ("*", b) for a, b in zip(p, s))):
            return True
    return False


def test_each_role_publishes_and_reads_its_own_subjects_only():
    roles, p = role_permissions("inferno"), "inferno"
    worker_in = [subjects.worker_generate(p, "w1"), subjects.worker_abort(p, "w1"),
                 subjects.worker_handoff(p, "w1"), subjects.worker_admin(p, "w1", "load")]
    assert all(_allows(roles["worker"]["subscribe"], s) for s in worker_in)
    assert _allows(roles["scheduler"]["publish"], subjects.worker_generate(p, "w1"))
    assert _allows(roles["gateway"]["publish"], subjects.generate_subject(p))
    assert _allows(roles["gateway"]["subscribe"], subjects.api(p, "chat.completions"))
    assert _allows(roles["worker"]["publish"], subjects.gateway_inbox(p, "g1"))
    assert _allows(roles["kvstore"]["subscribe"], subjects.kvstore(p, "get"))
    # Nobody but the admin sends a worker's admin verbs; a gateway does not feed workers directly.
    for role in SERVICE_ROLES:
        assert not _allows(roles[role]["publish"], subjects.worker_admin(p, "w1", "unload")), role
    assert not _allows(roles["gateway"]["publish"], subjects.worker_generate(p, "w1"))
    api = api_permissions(p, "alice")
    assert _allows(api["publish"], subjects.api(p, "completions"))
    assert not _allows(api["publish"], subjects.worker_generate(p, "w1"))
    assert _allows(api["subscribe"], "_INBOX.alice.abc.1") and not _allows(api["subscribe"], "_INBOX.bob.abc")


def test_credentials_reach_the_config_the_urls_and_the_environment():
    creds = NatsCredentials.generate(("api", "bob"))
    assert set(creds.passwords) == {*SERVICE_ROLES, ADMIN, "api", "bob"}
    assert len(set(creds.passwords.values())) == len(creds.passwords)  # each its own random password
    users = json.loads(re.search(r"users: (\[.*\])", creds.server_config("inferno"), re.S).group(1))
    assert {u["user"] for u in users} == set(creds.passwords)
    assert all("permissions" in u for u in users if u["user"] != ADMIN)
    url = creds.url("nats://a:1,nats://b:2", "bob")
    assert url == f"nats://bob:{creds.passwords['bob']}@a:1,nats://bob:{creds.passwords['bob']}@b:2"
    assert creds.env("worker") == {"INFERNO_NATS_USER": "worker", "INFERNO_NATS_PASSWORD": creds.passwords["worker"]}
