"""Subject names and the id rules that keep them from reaching the wrong subscribers."""

from __future__ import annotations

import pytest

from shared import subjects
from shared.subjects import Subjects


def test_subject_names():
    assert subjects.generate_subject() == "inferno.generate"
    assert subjects.generate_subject("prod.inferno") == "prod.inferno.generate"
    assert subjects.worker_generate("inferno", "worker-0") == "inferno.worker.worker-0.generate"
    assert subjects.worker_abort("inferno", "worker_0") == "inferno.worker.worker_0.abort"
    assert subjects.heartbeat("x") == "x.heartbeat"
    assert subjects.kv_events("x") == "x.kv_events"
    assert subjects.gateway_inbox("inferno", "gw-1a2b") == "inferno.gateway.gw-1a2b.tokens"
    assert subjects.SCHEDULER_QUEUE == "schedulers"


def test_bound_subjects_match_functions():
    s = Subjects("p")
    assert (s.generate, s.heartbeat, s.kv_events) == ("p.generate", "p.heartbeat", "p.kv_events")
    assert s.worker_generate("w") == "p.worker.w.generate"
    assert s.worker_abort("w") == "p.worker.w.abort"
    assert s.gateway_inbox("g") == "p.gateway.g.tokens"


@pytest.mark.parametrize("bad", ["", "a.b", "a b", "*", ">", "w*", "a>", "tab\t", "x" * 129, "é"])
def test_ids_that_would_change_routing_are_refused(bad):
    with pytest.raises(ValueError, match="worker_id"):
        subjects.worker_generate("inferno", bad)
    with pytest.raises(ValueError, match="gateway_id"):
        subjects.gateway_inbox("inferno", bad)


@pytest.mark.parametrize("bad", ["", ".", "a.", ".a", "a..b", "a.*", "a.>", "a b"])
def test_bad_prefixes_are_refused(bad):
    with pytest.raises(ValueError, match="prefix"):
        subjects.heartbeat(bad)
    with pytest.raises(ValueError):
        Subjects(bad)
