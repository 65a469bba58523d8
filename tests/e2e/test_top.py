"""`inferno top` against a real stack (issue 41): `--once` prints the worker's row with its live rates
while answers stream, and the live view draws the same under tmux (started with send-keys, read with
capture-pane). Also `inferno up`'s table of what it started."""

from __future__ import annotations

import shutil
import subprocess
import sys
import threading
import time
import uuid

import openai
import pytest

from tests.e2e.conftest import MODEL_NAME, inferno_up, start_stack


@pytest.fixture(scope="module")
def busy_stack(tiny_model, tmp_path_factory):
    """A stack kept generating while the tests look at it."""
    stack = start_stack(tmp_path_factory.mktemp("top"), tiny_model)
    stop = threading.Event()

    def load():
        c = openai.OpenAI(base_url=stack.url + "/v1", api_key="unused", max_retries=0, timeout=60)
        while not stop.is_set():
            c.completions.create(model=MODEL_NAME, prompt="Tell me a story", max_tokens=200,
                                 extra_body={"ignore_eos": True})
    threads = [threading.Thread(target=load, daemon=True) for _ in range(2)]
    for t in threads:
        t.start()
    yield stack
    stop.set()
    for t in threads:
        t.join(timeout=30)
    stack.stop()


def top_argv(stack) -> list[str]:
    return [sys.executable, "-m", "services.cli", "top", "--url", stack.url, "--nats", stack.admin_nats_url]


def worker_row(text: str) -> list[str]:
    row = next(line for line in text.splitlines() if "worker-0" in line)
    return [cell.strip() for cell in row.strip("│┃ ").split("│")]


def out_tok_s(screen: str) -> float:
    try:
        return float(worker_row(screen)[9].replace(",", ""))
    except (StopIteration, IndexError, ValueError):
        return 0.0


def test_once_prints_the_workers_row_with_its_rates(busy_stack):
    out = subprocess.run(top_argv(busy_stack) + ["--once"], capture_output=True, text=True, timeout=30)
    assert out.returncode == 0, out.stderr
    cells = worker_row(out.stdout)
    worker, role, device, model, state, running, waiting, kv, tok_in, tok_out, step_ms, handoffs, p50 = cells
    assert (worker, role, device, model, state) == ("worker-0", "mixed", "cpu", MODEL_NAME, "ready")
    assert int(running) >= 0 and float(tok_out.replace(",", "")) > 0 and float(step_ms) > 0  # (a beat may fall between answers)
    assert "gateway:" in out.stdout and "workers ready 1/1" in out.stdout


@pytest.mark.skipif(shutil.which("tmux") is None, reason="tmux is not installed (.ci/run installs it)")
def test_the_live_view_under_tmux(busy_stack):
    session = f"inferno-top-{uuid.uuid4().hex[:8]}"
    subprocess.run(["tmux", "new-session", "-d", "-s", session, "-x", "200", "-y", "40"], check=True)
    try:
        subprocess.run(["tmux", "send-keys", "-t", session, " ".join(top_argv(busy_stack)), "Enter"], check=True)
        deadline, screen = time.monotonic() + 20, ""
        while time.monotonic() < deadline:
            time.sleep(0.5)
            screen = subprocess.run(["tmux", "capture-pane", "-p", "-t", session], capture_output=True,
                                    text=True).stdout
            if "worker-0" in screen and screen.count("requests/s") == 1 and out_tok_s(screen) > 0:
                break  # one frame (redrawn in place), with the live rates
        assert "worker-0" in screen and "out tok/s" in screen, screen
        assert screen.count("requests/s") == 1 and out_tok_s(screen) > 0, screen
        subprocess.run(["tmux", "send-keys", "-t", session, "C-c"], check=True)
    finally:
        subprocess.run(["tmux", "kill-session", "-t", session], capture_output=True)


def test_up_prints_what_it_started_and_top_finds_the_stack(tiny_model, tmp_path):
    """`inferno up` says what it started once ready (a table: the workers' device, dtype, KV tokens) and
    leaves its URLs in the run directory, where `inferno top` finds them."""
    import json

    run_dir = tmp_path / "run"
    with inferno_up(tiny_model, run_dir) as text:
        assert "inferno: started" in text, text
        row = next(line for line in text.splitlines() if "worker-0" in line)
        assert "mixed" in row and "cpu" in row and "float32" in row and "16,384" in row  # 1,024 blocks of 16
        urls = json.loads((run_dir / "stack.json").read_text())
        assert urls["url"].startswith("http://") and urls["nats"].startswith("nats://")
        out = subprocess.run([sys.executable, "-m", "services.cli", "top", "--run-dir", str(run_dir), "--once"],
                             capture_output=True, text=True, timeout=30)
        assert out.returncode == 0 and worker_row(out.stdout)[0] == "worker-0", out.stdout + out.stderr
