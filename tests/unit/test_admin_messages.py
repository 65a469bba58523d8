"""A worker's admin messages and model state: wire round trips, the checks that refuse bad ones,
the subjects, and what the scheduler makes of a worker with no model or one loading."""

from __future__ import annotations

import time

import msgpack
import pytest

from services.scheduler.admission import Rejection, admit
from services.scheduler.kv_index import KvIndex
from services.scheduler.registry import WorkerState
from shared import subjects
from shared.admin_messages import (LoadBreakdown, LoadModelRequest, UnloadModelRequest, WorkerAdminReply,
                                   WorkerStatusRequest)
from shared.errors import MessageError
from shared.messages import WorkerHeartbeat
from shared.wire import decode, encode


@pytest.mark.parametrize("msg", [
    LoadModelRequest(model_dir="/models/a"),
    LoadModelRequest(model_dir="/models/b.gguf", model_name="b", dtype="bfloat16", max_model_len=4096,
                     load_format="dummy", mode="abort", drain_timeout=0.0),
    UnloadModelRequest(),
    UnloadModelRequest(mode="abort", drain_timeout=5.0),
    WorkerStatusRequest(),
    WorkerAdminReply(ok=True, worker_id="w-1", state="no_model", warm=True),
    WorkerAdminReply(ok=True, worker_id="w-1", state="ready", model="a", model_dir="/models/a",
                     load=LoadBreakdown(weights_s=0.9, weights_gb=16.06, kv_s=0.02, kv_reused=True, graphs_s=0.3,
                                        graphs_deferred=36, ready_s=1.4)),
    WorkerAdminReply(ok=False, worker_id="w-1", state="ready", model="a", code="bad_request",
                     error="/nope: no such model directory or .gguf file"),
])
def test_round_trip(msg):
    assert decode(type(msg), encode(msg)) == msg


@pytest.mark.parametrize("cls, fields", [
    (LoadModelRequest, {"model_dir": ""}),
    (LoadModelRequest, {"model_dir": "/m", "mode": "later"}),
    (LoadModelRequest, {"model_dir": "/m", "drain_timeout": -1.0}),
    (LoadModelRequest, {"model_dir": "/m", "drain_timeout": float("inf")}),
    (LoadModelRequest, {"model_dir": "/m", "dtype": "int4"}),
    (LoadModelRequest, {"model_dir": "/m", "max_model_len": -5}),
    (UnloadModelRequest, {"mode": "now"}),
    (WorkerAdminReply, {"ok": True, "worker_id": "w", "state": "asleep"}),
    (WorkerAdminReply, {"ok": True, "worker_id": "w", "state": "ready", "code": "busy"}),
    (WorkerAdminReply, {"ok": False, "worker_id": "w", "state": "ready", "code": "oops"}),
])
def test_checks_refuse(cls, fields):
    raw = msgpack.packb({"t": cls.TYPE, "v": cls.VERSION, **fields})
    with pytest.raises(MessageError):
        decode(cls, raw)


def test_admin_subjects():
    assert subjects.worker_admin("inferno", "worker-0", "load") == "inferno.worker.worker-0.admin.load"
    assert subjects.Subjects("p.q").worker_admin("w", "status") == "p.q.worker.w.admin.status"
    with pytest.raises(ValueError):
        subjects.worker_admin("inferno", "worker-0", "reboot")
    with pytest.raises(ValueError):
        subjects.worker_admin("inferno", "w.*", "load")


def heartbeat(**fields) -> WorkerHeartbeat:
    base = dict(worker_id="w-1", role="mixed", model="m", ready=True, draining=False, generate_subject="g",
                abort_subject="a", timestamp=time.time(), seq=1, max_model_len=4096)
    return WorkerHeartbeat(**{**base, **fields})


def test_heartbeat_state():
    assert heartbeat().state == "ready"  # a worker that says nothing of it (older) serves its model
    raw = encode(heartbeat())
    assert decode(WorkerHeartbeat, raw).state == "ready"
    for state in ("no_model", "loading", "unloading"):
        hb = heartbeat(state=state, ready=False, model="" if state == "no_model" else "m")
        assert decode(WorkerHeartbeat, encode(hb)) == hb
    with pytest.raises(MessageError):  # ready means serving
        decode(WorkerHeartbeat, encode(heartbeat(state="loading", ready=True)))
    with pytest.raises(MessageError):
        decode(WorkerHeartbeat, encode(heartbeat(state="sleeping", ready=False)))


def worker(**fields) -> WorkerState:
    return WorkerState(heartbeat=heartbeat(**fields), last_seen=0.0, kv=KvIndex())


def test_admission_counts_a_worker_with_no_model_as_none():
    empty = worker(worker_id="w-empty", model="", state="no_model", ready=False)
    refused = admit([empty], "m", 10, 100, 1.0)
    assert refused == Rejection(503, "service_unavailable", "no worker is available", 1.0)
    # Beside a serving worker of another model, the model is unknown (404), as without the empty one.
    other = worker(worker_id="w-other", model="other")
    assert admit([empty, other], "m", 10, 100, 1.0).status == 404


def test_admission_waits_for_a_worker_loading_the_model():
    loading = worker(worker_id="w-1", state="loading", ready=False)
    assert admit([loading], "m", 10, 100, 1.0).status == 503
    unloading = worker(worker_id="w-2", state="unloading", ready=False)
    assert admit([unloading], "m", 10, 100, 1.0).status == 503
    ready = worker(worker_id="w-3")
    assert admit([loading, unloading, ready], "m", 10, 100, 1.0) == [ready]
