"""deploy/grafana/inferno.json: a dashboard Grafana can import anywhere, whose every PromQL series and
grouping label is one that a running stack's /metrics serves (the gateway's and the kvstore's)."""

from __future__ import annotations

import json
import re
import time
import urllib.request
from pathlib import Path

import openai
import pytest

from tests.e2e.conftest import MODEL_NAME, start_stack

DASHBOARD = Path(__file__).resolve().parents[2] / "deploy" / "grafana" / "inferno.json"
DATASOURCE = {"type": "prometheus", "uid": "${DS_PROMETHEUS}"}
# N-gram drafts on repetitive prompts, so that the speculation panels' counters have a method label.
SPEC = {"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_min": 1, "prompt_lookup_max": 2}

# Words of PromQL that stand where a series name could: set operators, modifiers, vector matching
# (group_left may come without its label list) and the float literals.
_KEYWORDS = {"and", "or", "unless", "bool", "offset", "by", "without", "on", "ignoring", "group_left",
             "group_right", "inf", "nan"}
_LABEL_LIST = re.compile(r"\b(by|without|on|ignoring|group_left|group_right)\s*\(([^)]*)\)")


def series_names(expr: str) -> set[str]:
    """The series a PromQL expression selects, named as Prometheus stores them: suffixes such as
    _bucket and _total stay, so the names compare with /metrics' sample names as they are."""
    expr = re.sub(r'"(?:[^"\\]|\\.)*"|\'(?:[^\'\\]|\\.)*\'|`[^`]*`', " ", expr)  # strings: label values
    expr = re.sub(r"\{[^}]*\}", " ", expr)  # label matchers
    expr = re.sub(r"\[[^\]]*\]", " ", expr)  # ranges and subqueries, with their $__rate_interval
    expr = _LABEL_LIST.sub(" ", expr)  # by (le), on (instance), ...: label names, not series
    names = set()
    # Not after a word character, a dot or a $: so no piece of 0.99, 1e3, 5m or a Grafana $variable.
    for m in re.finditer(r"(?<![\w.$:])[A-Za-z_:][\w:]*", expr):
        called = re.match(r"\s*\(", expr[m.end():])  # sum(, rate(, histogram_quantile(
        if not called and m.group().lower() not in _KEYWORDS:
            names.add(m.group())
    return names


def grouping_labels(expr: str) -> set[str]:
    """The labels that `by (...)` clauses group on."""
    return {label.strip() for kind, labels in _LABEL_LIST.findall(expr) if kind == "by"
            for label in labels.split(",") if label.strip()}


@pytest.mark.parametrize("expr, names", [
    ("histogram_quantile(0.99, sum by (le) (rate(a:b_seconds_bucket{job=~\"x|y\"}[$__rate_interval])))",
     {"a:b_seconds_bucket"}),
    ("sum(rate(x_total[5m] offset 1h)) by (method) / on (method) group_left sum(y_total{k='v'}) > bool 1e3",
     {"x_total", "y_total"}),
    ("1 + max(up) or vector(0) unless absent(z) and Inf > NaN", {"up", "z"}),
    ('topk($n, rate(q:r_total{tenant="$tenant", status!~"2.."}[1m:10s]))', {"q:r_total"}),
])
def test_the_extractor_reads_promql(expr, names):
    assert series_names(expr) == names


@pytest.fixture(scope="module")
def dashboard():
    return json.loads(DASHBOARD.read_text())


def graphs(dashboard: dict) -> list[dict]:
    return [p for p in dashboard["panels"] if p["type"] != "row"]


def exprs(dashboard: dict) -> list[str]:
    return [t["expr"] for p in graphs(dashboard) for t in p["targets"]]


def test_a_dashboard_that_imports_anywhere(dashboard):
    assert dashboard["schemaVersion"] >= 39 and dashboard["uid"] == "inferno" and dashboard["id"] is None
    # The data source is a variable, not an import-time input: the same file serves Grafana's
    # Import and file provisioning (which leaves a `__inputs` placeholder unresolved).
    [variable] = dashboard["templating"]["list"]
    assert (variable["name"], variable["type"], variable["query"]) == ("DS_PROMETHEUS", "datasource", "prometheus")
    assert "__inputs" not in dashboard
    ids = [p["id"] for p in dashboard["panels"]]
    assert len(ids) == len(set(ids)) and all(isinstance(i, int) for i in ids)
    for p in dashboard["panels"]:
        assert p["gridPos"]["x"] + p["gridPos"]["w"] <= 24, p["title"]
    for p in graphs(dashboard):
        assert p["datasource"] == DATASOURCE and p["targets"], p["title"]
        assert len({t["refId"] for t in p["targets"]}) == len(p["targets"]), p["title"]
        for t in p["targets"]:
            assert t["datasource"] == DATASOURCE and series_names(t["expr"]), (p["title"], t["expr"])


def test_counters_and_buckets_are_read_as_rates(dashboard):
    # A counter plotted raw only ever climbs; a bucket only means something as a rate.
    for expr in exprs(dashboard):
        for name in series_names(expr):
            if name.endswith(("_total", "_bucket")):
                selections = re.findall(rf"{re.escape(name)}\b", expr)
                rates = re.findall(rf"\b(?:rate|irate|increase)\(\s*{re.escape(name)}(?:\{{[^}}]*\}})?\[", expr)
                assert len(rates) == len(selections), (name, expr)


def scrape(url: str) -> dict[str, set[str]]:
    """Sample name → the label names it carries, from one /metrics."""
    with urllib.request.urlopen(url, timeout=5) as r:
        text = r.read().decode()
    out: dict[str, set[str]] = {}
    for m in re.finditer(r"^([A-Za-z_:][\w:]*)(?:\{([^}]*)\})? ", text, re.M):
        out.setdefault(m.group(1), set()).update(re.findall(r"(\w+)=", m.group(2) or ""))
    return out


def test_every_series_is_served_by_a_running_stack(dashboard, tiny_model, tmp_path):
    # The stack's default kvstore serves the inferno_kvstore: series on a port of its own.
    stack = start_stack(tmp_path, tiny_model, worker_args=("--speculative-config", json.dumps(SPEC)))
    try:
        [kvstore] = [c for c in stack.children if c.name == "kvstore"]
        kvstore_port = kvstore.argv[kvstore.argv.index("--http-port") + 1]
        urls = [stack.url + "/metrics", f"http://127.0.0.1:{kvstore_port}/metrics"]
        client = openai.OpenAI(base_url=stack.url + "/v1", api_key="unused", max_retries=0, timeout=60)
        for prompt in ("a b c a b c a b c", "1 2 1 2 1 2 1 2"):
            client.completions.create(model=MODEL_NAME, prompt=prompt, max_tokens=16, temperature=0.0,
                                      extra_body={"ignore_eos": True})
        used = {name for expr in exprs(dashboard) for name in series_names(expr)}
        deadline = time.monotonic() + 5  # the drafts' counts come with the worker's next heartbeats
        while True:
            served: dict[str, set[str]] = {}
            for url in urls:
                served.update(scrape(url))
            if used <= set(served) or time.monotonic() > deadline:
                break
            time.sleep(0.25)
    finally:
        stack.stop()
    assert sorted(used - set(served)) == []
    for expr in exprs(dashboard):
        labels = set().union(*(served[name] for name in series_names(expr)))
        assert grouping_labels(expr) <= labels, expr
