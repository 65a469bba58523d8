"""What 1 prefill + 1 decode workers run with by default, so that P/D pays under load at launcher
defaults: the decode worker's own prefills in small steps, and a prefill worker's queue reported often."""

from __future__ import annotations

from services.worker.model_build import chunked_prefill_size
from services.worker.heartbeat import heartbeat_period
from shared.config import RouterConfig, WorkerServiceConfig


def test_a_decode_worker_prefills_512_tokens_a_step_unless_told():
    role = lambda r, **kw: WorkerServiceConfig(model_dir="d", role=r, **kw)  # noqa: E731
    assert chunked_prefill_size(role("decode")) == 512
    assert chunked_prefill_size(role("mixed")) == chunked_prefill_size(role("prefill")) == 0  # the step budget
    assert chunked_prefill_size(role("decode", chunked_prefill_size=0)) == 0
    assert chunked_prefill_size(role("mixed", chunked_prefill_size=256)) == 256


def test_a_prefill_worker_beats_often_enough_for_the_queue_bound():
    assert heartbeat_period(WorkerServiceConfig(model_dir="d", role="prefill")) == 0.1
    assert heartbeat_period(WorkerServiceConfig(model_dir="d", role="prefill", heartbeat_interval=0.05)) == 0.05
    assert heartbeat_period(WorkerServiceConfig(model_dir="d", role="decode")) == 1.0
    assert RouterConfig().disagg_max_prefill_queue_tokens == 4096
