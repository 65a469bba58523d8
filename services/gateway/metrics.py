"""Prometheus metrics of one gateway, on its own CollectorRegistry, with vLLM-style `inferno:` names.

Definitions (all latencies in seconds, measured at the gateway):
- time_to_first_token: HTTP request received → first output token of the request arrives.
- inter_token_latency: between consecutive token arrivals of one choice (one sample per arrival).
- e2e_request_latency: HTTP request received → the last choice finished.
- request_queue_time: HTTP request received → the scheduler accepted every choice (validation,
  tokenization and admission; the time queued inside a worker is part of TTFT, not of this).
- num_requests_running / num_requests_waiting / prefix_cache_*: summed over the live workers'
  latest heartbeats. The prefix-cache counters are each worker's cumulative count, so the sum can
  step down when a worker leaves.
- kv_handoffs / kv_handoff_seconds_p50: the prefill workers' hand-offs and the slowest one's median time.
- kv_cache_usage_perc: KV blocks in use over all blocks of the live workers (0..1); the plain mean
  of their kv_usage when they do not report block counts.
"""

from __future__ import annotations

from bisect import bisect_left
from typing import Iterator

from prometheus_client import CollectorRegistry, Counter, Gauge, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, HistogramMetricFamily, Metric
from prometheus_client.exposition import CONTENT_TYPE_LATEST

from services.gateway.worker_health import WorkerHealth

_LATENCY_BUCKETS = (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5,
                    10.0, 20.0, 40.0, 80.0)
_ITL_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.015, 0.02, 0.025, 0.03, 0.04, 0.05, 0.075, 0.1, 0.15, 0.2,
                0.3, 0.4, 0.5, 0.75, 1.0, 2.5)
_E2E_BUCKETS = (0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 40.0, 50.0, 60.0, 120.0,
                240.0, 480.0, 960.0)


class LatencyHistogram:
    """A Prometheus histogram for code on the event loop's thread: no lock, one bisect per sample
    (a fifth of prometheus_client's Histogram.observe, which matters once per token)."""

    __slots__ = ("name", "doc", "bounds", "counts", "sum")

    def __init__(self, name: str, doc: str, buckets: tuple[float, ...]):
        self.name = name
        self.doc = doc
        self.bounds = tuple(sorted(buckets))
        self.counts = [0] * (len(self.bounds) + 1)  # the last one is +Inf
        self.sum = 0.0

    def observe(self, value: float) -> None:
        self.counts[bisect_left(self.bounds, value)] += 1  # a bucket's bound is inclusive (le)
        self.sum += value

    @property
    def count(self) -> int:
        return sum(self.counts)

    def family(self) -> HistogramMetricFamily:
        buckets = []
        total = 0
        for bound, n in zip((*map(str, self.bounds), "+Inf"), self.counts):
            total += n
            buckets.append((bound, total))
        return HistogramMetricFamily(self.name, self.doc, buckets=buckets, sum_value=self.sum)


class HistogramCollector:
    def __init__(self, histograms: list[LatencyHistogram]):
        self.histograms = histograms

    def describe(self) -> list[Metric]:
        return [h.family() for h in self.histograms]

    def collect(self) -> Iterator[Metric]:
        for h in self.histograms:
            yield h.family()


class WorkerStatsCollector:
    """Reads the heartbeat table at scrape time (nothing to update per heartbeat)."""

    def __init__(self, health: WorkerHealth):
        self.health = health

    def describe(self) -> list[Metric]:
        return []  # unchecked: the families are built at scrape time

    def collect(self) -> Iterator[Metric]:
        live = self.health.live()
        running = sum(hb.num_running for hb in live)
        waiting = sum(hb.num_waiting for hb in live)
        total_blocks = sum(hb.num_total_blocks for hb in live)
        if total_blocks:
            used = sum(hb.num_total_blocks - hb.num_free_blocks for hb in live)
            usage = used / total_blocks
        else:
            usage = sum(hb.kv_usage for hb in live) / len(live) if live else 0.0
        yield GaugeMetricFamily("inferno:num_requests_running", "Requests running on the live workers.", running)
        yield GaugeMetricFamily("inferno:num_requests_waiting", "Requests waiting on the live workers.", waiting)
        yield GaugeMetricFamily("inferno:kv_cache_usage_perc", "KV cache usage of the live workers (1 = full).",
                                usage)
        yield GaugeMetricFamily("inferno:num_workers_live", "Workers heard from within the heartbeat TTL.",
                                len(live))
        yield GaugeMetricFamily("inferno:num_workers_ready", "Live workers serving a model and taking requests "
                                "(not loading, unloading or draining).", sum(hb.ready and not hb.draining for hb in live))
        yield CounterMetricFamily("inferno:prefix_cache_hits", "Prompt tokens found in the prefix caches.",
                                  sum(hb.prefix_cache_hits for hb in live))
        yield CounterMetricFamily("inferno:prefix_cache_queries", "Prompt tokens looked up in the prefix caches.",
                                  sum(hb.prefix_cache_queries for hb in live))
        # Prefill/decode hand-offs: how many the prefill workers made, and the slowest one's median time
        # over its latest (up to 256; 0 with no prefill worker).
        prefill = [hb for hb in live if hb.role == "prefill"]
        yield CounterMetricFamily("inferno:kv_handoffs", "Requests handed from prefill to decode workers.",
                                  sum(hb.kv_handoffs for hb in prefill))
        yield CounterMetricFamily("inferno:kv_handoffs_recomputed", "Failed hand-offs whose requests the "
                                  "decode workers computed from the prompt and first token instead.",
                                  sum(hb.kv_handoffs_recomputed for hb in prefill))
        yield GaugeMetricFamily("inferno:kv_handoff_seconds_p50", "The median hand-off time of the prefill "
                                "worker slowest at it (its latest 256).",
                                max((hb.kv_handoff_p50_ms for hb in prefill), default=0.0) / 1e3)
        yield self._expert_tokens(live)
        # Speculative decoding and jump-forward (vLLM's names), by method: accepted / draft tokens is
        # the acceptance rate, and 1 + accepted / drafts the tokens a request makes in a step that
        # checks its draft.
        by_method: dict[str, list[int]] = {}
        for hb in live:
            for method, counts in hb.spec_by_method.items():
                total = by_method.setdefault(method, [0, 0, 0])
                for i, c in enumerate(counts[:3]):
                    total[i] += c
        for i, (name, doc) in enumerate((
                ("inferno:spec_decode_num_drafts", "Drafts checked (a request's in a step)."),
                ("inferno:spec_decode_num_draft_tokens", "Tokens drafted (speculation, jump-forward)."),
                ("inferno:spec_decode_num_accepted_tokens", "Drafted tokens the model's draws confirmed."))):
            family = CounterMetricFamily(name, doc, labels=["method"])
            for method, counts in sorted(by_method.items()):
                family.add_metric([method], counts[i])
            yield family

    @staticmethod
    def _expert_tokens(live) -> CounterMetricFamily:
        """An MoE model's router load per worker, expert and the GPU holding it (always 0 without
        expert parallelism): the first thing to look at when one GPU of an EP group is the slow one."""
        family = CounterMetricFamily("inferno:moe_expert_tokens", "Tokens routed to each expert (summed over the "
                                     "MoE layers).", labels=["worker", "expert", "gpu"])
        for hb in live:
            experts = len(hb.expert_tokens)
            for e, count in enumerate(hb.expert_tokens):
                family.add_metric([hb.worker_id, str(e), str(e * hb.expert_ranks // experts)], count)
        return family


class GatewayMetrics:
    def __init__(self, health: WorkerHealth):
        self.registry = CollectorRegistry()
        r = self.registry
        self.time_to_first_token = LatencyHistogram("inferno:time_to_first_token_seconds", "Time to first token.",
                                                    _LATENCY_BUCKETS)
        self.inter_token_latency = LatencyHistogram("inferno:inter_token_latency_seconds", "Inter-token latency.",
                                                    _ITL_BUCKETS)
        self.e2e_request_latency = LatencyHistogram("inferno:e2e_request_latency_seconds",
                                                    "End-to-end request latency.", _E2E_BUCKETS)
        self.request_queue_time = LatencyHistogram("inferno:request_queue_time_seconds",
                                                   "Gateway receipt to acceptance by the scheduler.", _LATENCY_BUCKETS)
        r.register(HistogramCollector([self.time_to_first_token, self.inter_token_latency,
                                       self.e2e_request_latency, self.request_queue_time]))
        self.request_success = Counter("inferno:request_success", "Choices finished, by finish reason.",
                                       ["finished_reason"], registry=r)
        self.request_errors = Counter("inferno:request_errors", "Requests answered with an error, by status.",
                                      ["status"], registry=r)
        self.prompt_tokens = Counter("inferno:prompt_tokens", "Prompt tokens of served requests.", registry=r)
        self.generation_tokens = Counter("inferno:generation_tokens", "Tokens generated.", registry=r)
        self.request_migrations = Counter("inferno:request_migrations", "Choices sent to another worker after "
                                          "theirs went silent before the first token.", registry=r)
        self.requests_in_flight = Gauge("inferno:gateway_requests_in_flight",
                                        "HTTP generation requests in progress at this gateway.", registry=r)
        for reason in ("stop", "length"):
            self.request_success.labels(finished_reason=reason)  # present from the first scrape
        r.register(WorkerStatsCollector(health))

    def render(self) -> tuple[bytes, str]:
        return generate_latest(self.registry), CONTENT_TYPE_LATEST
