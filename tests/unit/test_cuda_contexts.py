"""No process of `inferno up` makes a CUDA context on a GPU it does not compute on (on two GPUs a
decode worker and the kvstore each held a 518 MiB context on GPU 0): a worker sees only its own GPUs
(as cuda:0 on), the control plane none, and the kvstore runs UCX without ucxx's progress thread,
which makes GPU 0's context current as it starts."""

from __future__ import annotations

import asyncio
import subprocess
import sys
from pathlib import Path

import pytest

from services import gpu_placement, launcher

ROOT = Path(__file__).resolve().parents[2]


class FakePopen:
    """Records what the launcher starts; nothing runs."""

    started: list[FakePopen] = []

    def __init__(self, argv, env=None, **kwargs):
        self.argv, self.env, self.pid = argv, env, 1000 + len(FakePopen.started)
        FakePopen.started.append(self)

    def poll(self):
        return None


@pytest.fixture
def popen(monkeypatch):
    FakePopen.started = []
    monkeypatch.setattr(launcher.subprocess, "Popen", FakePopen)
    monkeypatch.delenv("CUDA_VISIBLE_DEVICES", raising=False)  # the launcher's own: all GPUs
    return FakePopen.started


def started(tmp_path, monkeypatch, gpus, device="cuda", workers=0, prefill=0, decode=0, tp=1, pp=1):
    """A stack's children started as `inferno up` starts them, on a machine with these GPUs."""
    monkeypatch.setattr(launcher, "visible_gpus", lambda: list(gpus))
    cfg = launcher.StackConfig(model_dir=tmp_path, run_dir=tmp_path / "run", device=device, workers=workers,
                               prefill_workers=prefill, decode_workers=decode, kvstore_capacity_gb=1.0,
                               tensor_parallel_size=tp, pipeline_parallel_size=pp, log_format="json")
    stack = launcher.Stack(cfg)
    stack.start_nats()
    stack.start_scheduler()
    stack.start_kvstore()
    for i in range(workers):
        stack.start_worker(i)
    for i in range(prefill):
        stack.start_worker(i, "prefill")
    for i in range(decode):
        stack.start_worker(i, "decode")
    stack.start_gateways()
    return stack


def children(tmp_path, monkeypatch, gpus, **stack) -> dict[str, tuple[str | None, str | None]]:
    """{name: (its --device or None, its CUDA_VISIBLE_DEVICES)} of every child."""
    out = {}
    for c in started(tmp_path, monkeypatch, gpus, **stack).children:
        device = c.argv[c.argv.index("--device") + 1] if "--device" in c.argv else None
        out[c.name] = (device, c.proc.env.get("CUDA_VISIBLE_DEVICES"))
    return out


def test_prefill_and_decode_workers_each_see_their_own_gpu_and_services_none(tmp_path, popen, monkeypatch):
    got = children(tmp_path, monkeypatch, ["0", "1"], prefill=1, decode=1)
    assert got == {"nats": (None, ""), "scheduler-0": (None, ""), "gateway": (None, ""),
                   "prefill-0": ("cuda:0", "0"), "decode-0": ("cuda:0", "1"),
                   "kvstore": (None, None)}  # the launcher's view: UCX moves GPU pages only where CUDA is
    env = popen[-1].env  # the launcher's own environment still reaches every child
    assert env["PYTHONUNBUFFERED"] == "1" and env["PATH"]


def test_a_parallel_group_sees_its_gpus_and_the_next_worker_the_next_ones(tmp_path, popen, monkeypatch):
    got = children(tmp_path, monkeypatch, ["0", "1", "2", "3", "4"], workers=3, tp=2)
    assert {k: v for k, v in got.items() if k.startswith("worker")} == {
        "worker-0": ("cuda:0", "0,1"), "worker-1": ("cuda:0", "2,3"), "worker-2": ("cuda:0", "0,1")}
    got = children(tmp_path, monkeypatch, ["0", "1", "2", "3"], workers=1, tp=2, pp=2)
    assert got["worker-0"] == ("cuda:0", "0,1,2,3")


def test_the_gpus_are_those_the_launcher_was_given(tmp_path, popen, monkeypatch):
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "4, 6,GPU-7f3a")
    gpus = gpu_placement.visible_gpus()
    assert gpus == ["4", "6", "GPU-7f3a"]
    got = children(tmp_path, monkeypatch, gpus, workers=3)
    assert [got[f"worker-{i}"] for i in range(3)] == [("cuda:0", "4"), ("cuda:0", "6"), ("cuda:0", "GPU-7f3a")]
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "")
    assert gpu_placement.visible_gpus() == []


def test_one_named_gpu_holds_every_worker_and_the_cpu_none(tmp_path, popen, monkeypatch):
    got = children(tmp_path, monkeypatch, ["0", "1", "2"], device="cuda:2", workers=2)
    assert got["worker-0"] == got["worker-1"] == ("cuda:0", "2")
    got = children(tmp_path, monkeypatch, ["0"], device="cuda", workers=2)
    assert got["worker-0"] == got["worker-1"] == ("cuda:0", "0")
    got = children(tmp_path, monkeypatch, ["0", "1"], device="cpu", workers=1)
    assert got["worker-0"] == ("cpu", "")
    got = children(tmp_path, monkeypatch, ["0"], device="cuda:3", workers=1)  # beyond those found: as asked
    assert got["worker-0"] == ("cuda:3", None)


def test_a_restart_keeps_the_childs_gpus(tmp_path, popen, monkeypatch):
    stack = started(tmp_path, monkeypatch, ["0", "1"], prefill=1, decode=1)
    decode = stack.child("decode-0")
    decode.proc.poll = lambda: 1  # it died
    stack.restart(decode)
    assert popen[-1].argv == decode.argv and popen[-1].env["CUDA_VISIBLE_DEVICES"] == "1"


def test_the_control_plane_and_the_kvstore_import_no_torch_and_no_ucx():
    """They compute on no GPU: importing them (and the kvstore's page store) loads neither torch nor
    UCX, which could make a CUDA context."""
    code = ("import sys\n"
            "import services.gateway.main, services.gateway.app, services.scheduler.main, services.scheduler.service\n"
            "import services.kvstore.main, services.kvstore.service\n"
            "from services.kvstore.page_store import PageStore\n"
            "PageStore(pinned=False).allocate(0, 4096)\n"
            "print(sorted(m for m in ('torch', 'ucxx', 'triton') if m in sys.modules))\n")
    out = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "[]"


LISTEN = """
import asyncio, sys
import ucxx._cuda_context
made = []  # the devices ucxx's progress thread makes a CUDA context current on as it starts
ucxx._cuda_context.ensure_cuda_context = lambda device_id=0: made.append(device_id)
from shared.kv_transfer import TransferServer, init_ucx

async def listen():
    # In the running loop, as the kvstore does: begun before asyncio.run, ucxx's first progress
    # thread belongs to a loop that never runs and never calls its start callback.
    if sys.argv[1] != "default":
        init_ucx(cuda_context=sys.argv[1] == "context")
    server = TransferServer(lambda header, payload: None, lambda header: None).start()
    await asyncio.sleep(0.3)
    await server.close()

asyncio.run(listen())
print(made)
"""


@pytest.mark.parametrize("mode, made", [("no-context", "[]"), ("context", "[0]"), ("default", "[0]")])
def test_ucx_without_a_cuda_context_makes_none(mode, made):
    """ucxx's progress thread makes a context on GPU 0 as it starts, unless told not to."""
    out = subprocess.run([sys.executable, "-c", LISTEN, mode], cwd=ROOT, capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip().splitlines()[-1] == made


def test_the_kvstore_starts_ucx_without_a_cuda_context_and_pins_no_pages(monkeypatch):
    from services.kvstore import main as kvstore_main
    from services.kvstore.config import KvStoreConfig
    from shared.config import NatsConfig

    started = []

    async def run_service(nats_cfg, name, make):
        started.append(name)
        return 0

    monkeypatch.setattr(kvstore_main, "init_ucx", lambda cuda_context=True: started.append(cuda_context))
    monkeypatch.setattr(kvstore_main, "run_service", run_service)
    assert asyncio.run(kvstore_main.serve(KvStoreConfig(), NatsConfig())) == 0
    assert started == [False, "kvstore"]  # UCX first, before any listener, with no context
    assert kvstore_main.PIN_CHOICES[kvstore_main.parse_args([]).pin_memory] is False  # pinning needs a context
