"""`inferno up --nats-tls`: the whole stack on a bus with TLS (shared/nats_tls.py), started as a person
starts it. Its servers refuse a client without the stack's CA; the services, the start-up table, the
NATS API client and `inferno top` all reach it with the CA; a completion goes through HTTP."""

from __future__ import annotations

import json
import stat
import subprocess
import sys

import nats
import openai
import pytest

import inferno.client
from shared.nats_tls import ServerTlsFiles, server_tls_config
from tests.e2e.conftest import MODEL_NAME, inferno_up


@pytest.fixture(scope="module")
def tls_stack(tiny_model, tmp_path_factory):
    """`inferno up --nats-tls` in a subprocess: (its run directory, what it printed until it served)."""
    run_dir = tmp_path_factory.mktemp("tls") / "run"
    with inferno_up(tiny_model, run_dir, "--nats-tls") as text:
        assert "inferno: serving" in text, text + "".join(f"\n{p.name}:\n{p.read_text()[-2000:]}"
                                                          for p in run_dir.glob("*.log"))
        yield run_dir, text


def test_the_run_directory_holds_the_bus_tls(tls_stack):
    run_dir, _ = tls_stack
    stack = json.loads((run_dir / "stack.json").read_text())
    files = ServerTlsFiles.in_dir((run_dir / "nats-tls").resolve())
    assert stack["nats"].startswith("tls://") and stack["nats_tls_ca"] == files.ca_file
    assert (run_dir / "nats-api-api.url").read_text().startswith("tls://api:")
    assert stat.S_IMODE((run_dir / "nats-tls" / "server.key").stat().st_mode) == 0o600
    assert not list((run_dir / "nats-tls").glob("ca.key"))  # the CA's key is never written
    assert (run_dir / "nats.conf").read_text() == "include ./nats-users.conf\n" + server_tls_config(files)
    # Every service connected over TLS, and so did `inferno up` for its table (the worker's row comes
    # from its heartbeat on the bus).
    for name in ("gateway", "scheduler-0", "worker-0"):
        log = (run_dir / f"{name}.log").read_text()
        assert '"url": "tls://127.0.0.1:' in log or "url=tls://127.0.0.1:" in log, name


def test_the_start_up_table_read_the_workers_heartbeats_over_tls(tls_stack):
    _, printed = tls_stack
    row = next(line for line in printed.splitlines() if "worker-0" in line)
    assert "mixed" in row and "cpu" in row and "float32" in row


def test_a_completion_through_http(tls_stack):
    run_dir, _ = tls_stack
    url = json.loads((run_dir / "stack.json").read_text())["url"]
    client = openai.OpenAI(base_url=url + "/v1", api_key="unused", max_retries=0, timeout=60)
    r = client.completions.create(model=MODEL_NAME, prompt="Hello", max_tokens=4, temperature=0,
                                  extra_body={"ignore_eos": True})
    assert r.usage.completion_tokens == 4


async def test_the_nats_api_with_the_ca_and_without(tls_stack):
    run_dir, _ = tls_stack
    api_url = (run_dir / "nats-api-api.url").read_text().strip()
    ca = json.loads((run_dir / "stack.json").read_text())["nats_tls_ca"]
    async with await inferno.client.connect(api_url, tls_ca=ca) as client:
        r = await client.completions.create(model=MODEL_NAME, prompt="Hello", max_tokens=3, temperature=0,
                                            extra_body={"ignore_eos": True})
        assert r.usage.completion_tokens == 3
    with pytest.raises(inferno.client.APIConnectionError, match="CERTIFICATE_VERIFY_FAILED"):
        await inferno.client.connect(api_url, allow_reconnect=False, connect_timeout=2)  # no CA: not trusted
    with pytest.raises(Exception):
        await nats.connect(api_url.replace("tls://", "nats://"), allow_reconnect=False, connect_timeout=2,
                           max_reconnect_attempts=0)


def test_top_finds_the_ca_in_the_run_directory(tls_stack):
    run_dir, _ = tls_stack
    out = subprocess.run([sys.executable, "-m", "services.cli", "top", "--run-dir", str(run_dir), "--once"],
                         capture_output=True, text=True, timeout=30)
    assert out.returncode == 0 and "worker-0" in out.stdout, out.stdout + out.stderr
