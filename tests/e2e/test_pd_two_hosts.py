"""P/D across hosts: the prefill worker on one "host", everything else on another, two network
namespaces joined by a veth pair (made here, removed after). The KV pages cross over UCX's TCP
transport; the answers equal the engine's own."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys

import pytest

from tests.e2e.conftest import MODEL_NAME, assert_greedy_as_one_engine, heartbeats, start_stack, wait_workers

pytest.importorskip("ucxx", reason="UCXX (ucxx-cu12) moves the KV pages")

# A /30 of its own: the stack's side and the other host's.
HERE, THERE = "10.213.77.1", "10.213.77.2"
PROMPTS = [[1000, 17, 230, 44, 9, 512], list(range(40, 140, 3))] + [[5 + (i * 13 + j) % 1000 for j in range(600)]
                                                                    for i in range(6)]
MAX_TOKENS = 16
UCX_ENV = {"UCX_TLS": "tcp"}  # the network transport a host-to-host hand-off takes (no shared memory)


def _ip(*args: str) -> None:
    subprocess.run(["ip", *args], check=True, capture_output=True)


@pytest.fixture(scope="module")
def other_host():
    """A network namespace with a veth pair to this one: THERE reaches HERE and nothing else."""
    if shutil.which("ip") is None:
        pytest.fail("making two hosts needs iproute2's `ip` (.ci/run installs it)")
    tag = f"ipd{os.getpid() % 100000}"
    ns, here, there = f"inferno-{tag}", f"{tag}a", f"{tag}b"
    made = subprocess.run(["ip", "netns", "add", ns], capture_output=True, text=True)
    if made.returncode and ("permi" in made.stderr.lower() or os.geteuid() != 0):  # no CAP_SYS_ADMIN here
        pytest.skip(f"network namespaces are not allowed here: {made.stderr.strip()}")
    assert made.returncode == 0, made.stderr
    try:
        _ip("link", "add", here, "type", "veth", "peer", "name", there)
        _ip("link", "set", there, "netns", ns)
        _ip("addr", "add", f"{HERE}/30", "dev", here)
        _ip("link", "set", here, "up")
        _ip("netns", "exec", ns, "ip", "addr", "add", f"{THERE}/30", "dev", there)
        _ip("netns", "exec", ns, "ip", "link", "set", there, "up")
        _ip("netns", "exec", ns, "ip", "link", "set", "lo", "up")
        yield ns
    finally:
        subprocess.run(["ip", "netns", "del", ns], capture_output=True)  # takes its end of the pair, and so both
        subprocess.run(["ip", "link", "del", here], capture_output=True)


@pytest.fixture(scope="module")
def split_stack(tiny_model, other_host, tmp_path_factory):
    # This host: NATS (on the link's address), the scheduler, the gateway and the decode worker, whose
    # UCXX listener the prefill worker reaches over the link. The other host: the prefill worker.
    stack = start_stack(tmp_path_factory.mktemp("two-hosts"), tiny_model, workers=0, decode_workers=1,
                        nats_host=HERE, kvstore_capacity_gb=0, env=UCX_ENV,
                        decode_worker_args=("--kv-transfer-host", HERE),
                        scheduler_args=("--disagg-min-prefill-tokens", "1", "--no-disagg-by-time", "--heartbeat-ttl", "10"),
                        gateway_args=("--heartbeat-ttl", "10"))
    try:
        stack.start_process("prefill-0", [
            "ip", "netns", "exec", other_host, sys.executable, "-m", "services.worker", "--nats-url", stack.nats_url,
            "--log-format", "json", "--worker-id", "prefill-0", "--role", "prefill", "--model-dir", str(tiny_model),
            "--model-name", MODEL_NAME, "--device", "cpu", "--num-blocks", "256", "--heartbeat-interval", "0.5",
            "--kv-transfer-host", THERE], env=UCX_ENV)
        wait_workers(stack, 2)
        yield stack
    finally:
        stack.stop()


def test_prompts_prefilled_on_the_other_host_answer_as_one_engine(tiny_model, split_stack):
    assert_greedy_as_one_engine(split_stack, tiny_model, PROMPTS, MAX_TOKENS)
    prefill = heartbeats(split_stack)["prefill-0"]
    assert prefill.kv_handoffs >= len(PROMPTS) and prefill.kv_handoff_bytes > 0
    assert prefill.kv_handoffs_ipc == 0  # over the link, not shared memory
    per = prefill.kv_handoff_bytes / prefill.kv_handoffs
    print(f"hand-offs over the veth link: {prefill.kv_handoffs}, {per / 1e6:.2f} MB each, "
          f"p50 {prefill.kv_handoff_p50_ms:.2f} ms ({per / max(prefill.kv_handoff_p50_ms, 1e-9) / 1e6:.3f} GB/s)")
