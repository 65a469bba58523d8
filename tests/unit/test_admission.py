"""The scheduler's queueing-time estimate and the 429 it sheds with: exact figures on a fake clock."""

from __future__ import annotations

import pytest

from services.scheduler.admission import QueueWait, Rejection, within_wait
from services.scheduler.registry import Registry
from services.scheduler.router import Router
from shared.config import RouterConfig
from shared.messages import GenerateRequest, WireSamplingParams, WorkerHeartbeat
from shared.sampling_params import SamplingParams
from shared.wire import pack_ids


def hb(worker_id: str, seq: int, queued: int = 0, timestamp: float = 0.0, **load) -> WorkerHeartbeat:
    return WorkerHeartbeat(worker_id=worker_id, role="mixed", model="m", ready=True, draining=False,
                           generate_subject=f"g.{worker_id}", abort_subject=f"a.{worker_id}", timestamp=timestamp,
                           seq=seq, queued_prefill_tokens=queued, **load)


def test_wait_is_queued_plus_routed_tokens_over_the_rate():
    reg = Registry(heartbeat_ttl=3.0)
    wait = QueueWait(1000.0)
    w = reg.on_heartbeat(hb("w1", 1, queued=1500), 0.0)
    assert wait.seconds(w) == 1.5
    w.note_routed(500)
    assert wait.seconds(w) == 2.0
    assert wait.seconds(w, 500) == 2.5  # its own prompt, until its first token


def test_the_rate_is_learnt_only_while_the_queue_stays_busy():
    reg = Registry(heartbeat_ttl=3.0)
    wait = QueueWait(1000.0)

    def beat(seq: int, queued: int, at: float, routed: int = 0) -> None:
        """A heartbeat stamped `at` by the worker, after `routed` tokens were sent to it."""
        before = reg.workers.get("w1")
        if before is not None and routed:
            before.note_routed(routed)
        wait.observe(before, hb("w1", seq, queued, timestamp=at), 0.0)  # receipt time plays no part
        reg.on_heartbeat(hb("w1", seq, queued, timestamp=at), 0.0)

    beat(1, 0, 0.0)
    beat(2, 800, 1.0, routed=900)  # the queue was empty at the start: nothing learnt
    assert wait.rate("w1") == 1000.0
    beat(3, 700, 1.2, routed=100)  # 0.2 s: too short a window, kept open
    beat(4, 400, 2.0, routed=100)  # 800 + 200 - 400 = 600 tokens left the queue in 1 s
    assert (wait.rates["w1"], wait.deviations["w1"]) == (600.0, 300.0)  # a first sample: half of it as the margin
    assert wait.rate("w1") == 300.0
    beat(5, 100, 3.0)  # 300 tokens/s: the mean and the deviation move 30% of the way
    assert wait.rates["w1"] == pytest.approx(510.0) and wait.deviations["w1"] == pytest.approx(300.0)
    assert wait.rate("w1") == pytest.approx(210.0)
    beat(6, 90, 4.0, routed=500)  # 510 tokens/s again: the deviation shrinks
    assert wait.rates["w1"] == pytest.approx(510.0) and wait.deviations["w1"] == pytest.approx(210.0)
    assert wait.rate("w1") == pytest.approx(300.0)
    beat(7, 0, 5.0)  # emptied: says nothing about capacity
    beat(8, 500, 6.0, routed=600)
    assert wait.rates["w1"] == pytest.approx(510.0)
    beat(1, 700, 7.0)  # a restarted worker (seq went back): no sample across the restart
    assert wait.rates["w1"] == pytest.approx(510.0)


def test_within_wait_keeps_the_workers_under_the_bound_or_sheds():
    reg = Registry(heartbeat_ttl=3.0)
    wait = QueueWait(1000.0)
    a = reg.on_heartbeat(hb("a", 1, queued=3000), 0.0)
    b = reg.on_heartbeat(hb("b", 1, queued=1000), 0.0)
    assert within_wait([a, b], wait, 2.0, 1.0) == [b]
    assert within_wait([a, b], wait, 0.0, 1.0) == [a, b]  # no bound
    b.note_routed(1500)  # 2.5 s now
    r = within_wait([a, b], wait, 2.0, 1.0)
    assert isinstance(r, Rejection) and (r.status, r.error_type) == (429, "rate_limit_exceeded")
    assert r.retry_after == 1.0 and "(2.5 s) exceeds the server's bound of 2 s" in r.message
    a.heartbeat = hb("a", 2, queued=9000)
    b.heartbeat = hb("b", 2, queued=9000)
    b.routed_tokens = 0
    assert within_wait([a, b], wait, 2.0, 1.0).retry_after == 7.0  # until the least loaded drains to the bound


def test_router_sheds_with_the_configured_bound():
    cfg = RouterConfig(max_queue_seconds=1.0, admission_tokens_per_second=100.0)
    reg = Registry(heartbeat_ttl=3.0)
    router = Router(cfg, reg)
    reg.on_heartbeat(hb("w1", 1, queued=150, max_model_len=1000), 0.0)
    req = GenerateRequest(request_id="r", model="m", prompt_ids=pack_ids([1] * 20),
                          sampling=WireSamplingParams.from_params(SamplingParams(max_tokens=4)), reply_to="x",
                          gateway_id="gw")
    r = router.admit(req, 0.1)
    assert isinstance(r, Rejection) and r.status == 429
    reg.on_heartbeat(hb("w1", 2, queued=60, max_model_len=1000), 0.2)
    assert [w.worker_id for w in router.admit(req, 0.3)] == ["w1"]


@pytest.mark.parametrize("kw", [{"max_queue_seconds": -1.0}, {"admission_tokens_per_second": 0.0}])
def test_config_is_validated(kw):
    with pytest.raises(ValueError):
        RouterConfig(**kw)
