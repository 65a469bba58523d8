"""Schema-driven fuzzing against the whole stack: schemathesis generates requests, valid and
invalid, from the gateway's own /openapi.json (bench/fuzz_api.py; run it for 10,000+ cases), and
not one of 500 may get a server error (1,000 here found none either, in twice the time)."""

from __future__ import annotations

import time

import pytest

from bench.fuzz_api import fuzz
from tests.e2e.conftest import metrics


@pytest.mark.timeout(900)
def test_no_server_error_in_500_schema_driven_cases(stack):
    report = fuzz(stack.url, 500, seed=20261123, max_tokens=4, workers=4)
    print(report.summary())
    assert report.cases >= 500
    assert report.server_errors == [] and report.transport_errors == []
    assert report.by_status[200] >= 150 and report.by_status[400] >= 150  # valid and invalid bodies both
    for operation in ("POST /v1/chat/completions", "POST /v1/completions", "POST /tokenize", "POST /detokenize"):
        assert report.by_operation[operation] >= 100, operation
    assert report.by_operation["GET /v1/models"] >= 10
    deadline = time.monotonic() + 10  # and the stack is left as it was found
    while (m := metrics(stack))["inferno:num_requests_running"] or m["inferno:kv_cache_usage_perc"]:
        assert time.monotonic() < deadline
        time.sleep(0.1)
    assert m["inferno:gateway_requests_in_flight"] == 0
